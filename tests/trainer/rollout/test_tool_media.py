"""A tool that answers with images (verl's ToolResponse.image) in a text-only model's conversation: its text is
appended, as ever, and the log says once per tool, in one NOTE line, that the images were not passed on."""

from __future__ import annotations

from typing import Any

from tests.trainer.rollout.test_multi_turn import TOK, ScriptedModel, ids, prompt_of, record
from trainer.config.multi_turn import MultiTurnConfig
from trainer.rollout.multi_turn import MultiTurnRollout
from trainer.rollout.tools import Schema

CALL = '<tool_call> {"name": "echo", "arguments": {"text": "hi"}} </tool_call> <eos>'


class PictureTool:
    """Answers with its text and a picture, as verl's image tools answer (a dict as ToolResponse's fields)."""

    def __init__(self) -> None:
        self.name = "echo"
        self.tool_schema = Schema({"type": "function", "function": {"name": "echo"}})

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, None]:
        return "one", None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        return {"text": parameters["text"], "image": [object()]}, 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        pass


def test_a_tools_images_are_one_note_and_its_text_is_appended() -> None:
    lines: list[str] = []
    rollout = MultiTurnRollout(MultiTurnConfig(enable=True, max_assistant_turns=3), TOK, response_length=40,
                               tools={"echo": PictureTool()}, interactions={}, log=lines.append)
    batch = rollout.run([record("q1"), record("q2")], [prompt_of("q1"), prompt_of("q2")],
                        ScriptedModel({"q1": [CALL, CALL, "<eos>"], "q2": [CALL, "<eos>"]}))
    assert lines == ["NOTE: tool 'echo' answered with images or video, which this text-only model cannot read: only "
                     "the response's text is passed on (vision-language models take them)"]
    assert batch.response_ids[0, 8:11].tolist() == ids("tool: hi assistant:")
    assert batch.response_mask[0, 8:11].tolist() == [0.0, 0.0, 0.0]
