"""The multi-turn rollout of a vision-language model's conversations against a scripted "model": each turn's sampling
gets the images of exactly the rows still going, in their order, and a rank whose conversations have ended samples
its stand-in with a prompt and its images (so that its forward runs the vision tower as the other ranks' do); a tool's
own images are one NOTE line."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tests.trainer.rollout.test_multi_turn import CALL, GSM8K_TOOL, TOK, ScriptedModel, prompt_of, record, rollout
from tests.trainer.rollout.test_tool_media import PictureTool
from trainer.config.multi_turn import MultiTurnConfig
from trainer.rollout.multi_turn import MultiTurnRollout
from trainer.rollout.tools import load_tools


class ScriptedVisionModel(ScriptedModel):
    """A ScriptedModel that also records the multi-modal rows each turn was given."""

    def __init__(self, turns: dict[str, list[str]]):
        super().__init__(turns)
        self.images: list[list[int]] = []

    def __call__(self, context: torch.Tensor, mask: torch.Tensor,  # type: ignore[override]
                 images: Sequence[dict[str, torch.Tensor]] = ()) -> tuple[torch.Tensor, torch.Tensor, None]:
        assert len(images) == len(context)
        self.images.append([int(row["pixel_values"].item()) if row else -1 for row in images])
        return super().__call__(context, mask)


def image(number: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.tensor([[float(number)]]), "image_grid_thw": torch.tensor([[1, 1, 1]])}


def test_each_turn_samples_the_going_rows_with_their_own_images() -> None:
    model = ScriptedVisionModel({"q1": [CALL, CALL, "7 <eos>"], "q2": ["8 <eos>"]})
    batch = rollout(MultiTurnConfig(enable=True), tools=load_tools(str(GSM8K_TOOL))).run(
        [record("q1"), record("q2", "8")], [prompt_of("q1"), prompt_of("q2")], model,
        multi_modal=[image(1), image(2)])
    # q2 ends after its first turn; q1 goes on to its third, with its own image each time.
    assert model.images == [[1, 2], [1], [1]]
    assert [len(rows) for rows in model.shown] == [2, 1, 1]
    assert batch.response_mask[1].sum() == 2  # q2's "8 <eos>"


def test_a_finished_ranks_stand_in_samples_a_prompt_with_its_images() -> None:
    other_rank_going = iter([1, 1, 1, 0])
    model = ScriptedVisionModel({"q2": ["8 <eos>", "<eos>", "<eos>"]})
    batch = rollout(MultiTurnConfig(enable=True)).run(
        [record("q2", "8")], [prompt_of("q2")], model, agree=lambda going: max(going, next(other_rank_going)),
        multi_modal=[image(2)])
    assert model.images == [[2], [2], [2]]
    assert model.shown[1] == [prompt_of("q2")] == model.shown[2]  # the prompt, its image tokens with it
    assert batch.response_mask[0].tolist() == [1.0] * 2 + [0.0] * 30  # the stand-in's turns are dropped


def test_a_tools_images_are_one_note_for_a_vision_language_model_too() -> None:
    lines: list[str] = []
    echo = '<tool_call> {"name": "echo", "arguments": {"text": "hi"}} </tool_call> <eos>'
    MultiTurnRollout(MultiTurnConfig(enable=True, max_assistant_turns=2), TOK, response_length=40,
                     tools={"echo": PictureTool()}, interactions={}, log=lines.append).run(
        [record("q1")], [prompt_of("q1")], ScriptedVisionModel({"q1": [echo, "<eos>"]}), multi_modal=[image(1)])
    assert lines == ["NOTE: tool 'echo' answered with images or video, which the multi-turn rollout does not pass on "
                     "to a vision-language model (only the prompt's images): only the response's text is passed on"]
