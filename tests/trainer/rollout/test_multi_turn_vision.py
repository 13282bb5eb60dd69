"""verl's geo3k multi-turn example (--config-name=geo3k_multiturn_grpo, its Geo3kTool) through the real trainer with
the built-in tiny Qwen2-VL: the prompt's images go to every turn's generation and to the forwards after the rollout,
the tool answers in text, and the loss reads the model's own turns only; a PPO critic on the same model reads them
too.

The tiny model's word-level vocabulary cannot write <tool_call>: each of its turns is read as a call of the geo3k tool,
and cut after TURN tokens (as a stop would cut it), so that every conversation has two turns of the model's with the
tool's response between them."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from tests.trainer.test_training_vision import dots_png, plain_log_probs
from trainer.config import load_config_with_notes
from trainer.loop import Trainer
from trainer.models.vision_language import TINY_MAX_PIXELS, TINY_MIN_PIXELS
from trainer.rollout import multi_turn
from trainer.rollout.hf_rollout import Sampled
from trainer.rollout.tool_calls import ToolCall

TOOL_CONFIG = Path(__file__).parents[1] / "config" / "assets" / "verl_examples" / "sglang_multiturn_config" \
    / "geo3k_tool_config.yaml"
TURN = 2  # tokens of each of the model's turns


def geo3k_multi_turn_data(path: Path, rows: int = 2) -> Path:
    """verl's geo3k multi-turn layout (examples/data_preprocess/geo3k_multiturn_w_tool.py): a system and a user
    message with <image>, an `images` column of [{'bytes': PNG}], the tool's ground truth in extra_info.tools_kwargs."""
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "hiyouga/geometry3k",
         "prompt": [{"role": "system", "content": ":"}, {"role": "user", "content": "<image> : ="}],
         "images": [{"bytes": dots_png(index + 1, seed=index)}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(index + 1)},
         "extra_info": {"index": index, "need_tools_kwargs": True, "tools_kwargs": {"calc_geo3k_reward": {
             "create_kwargs": {"ground_truth": str(index + 1)}}}}}
        for index in range(rows)]), path)
    return path


@pytest.fixture
def geo3k_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Trainer, list[Sequence[dict]]]:
    return make_geo3k_trainer(tmp_path, monkeypatch)


def make_geo3k_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str
                       ) -> tuple[Trainer, list[Sequence[dict]]]:
    """A trainer of verl's geo3k multi-turn config, and the multi-modal rows each turn's sampling was given."""
    monkeypatch.setattr(multi_turn, "parse_tool_calls",
                        lambda text: (text, [ToolCall("calc_geo3k_reward", {"answer": text})]))
    reward = tmp_path / "reward.py"  # differs between a random model's responses: the step has advantages
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(set(solution_str.split())))\n")
    data = geo3k_multi_turn_data(tmp_path / "train.parquet")
    config = load_config_with_notes(None, [
        "actor_rollout_ref.model.path=builtin:tiny-qwen2-vl", f"data.train_files=[{data}]",
        f"custom_reward_function.path={reward}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.optim.lr=1e-2", "data.max_prompt_length=24", "data.max_response_length=16",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        # The built-in word-level tokenizer cannot read Qwen2.5-VL's template, which the named config sets
        # (test_custom_chat_template.py renders it): its own template joins the messages.
        "actor_rollout_ref.model.custom_chat_template=null",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}", "trainer.device=cpu",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", f"trainer.runs_dir={tmp_path}", *overrides],
        "geo3k_multiturn_grpo").config
    trainer = Trainer(config, log=lambda *_: None)
    turns: list[Sequence[dict]] = []
    sample = trainer.generation.rollout.sample

    def short_turns(ids: torch.Tensor, mask: torch.Tensor, *args: Any, **kwargs: Any) -> Sampled:
        turns.append(kwargs.get("multi_modal", ()))
        sampled = sample(ids, mask, *args, **kwargs)
        sampled.response_mask[:, TURN:] = 0
        return sampled

    monkeypatch.setattr(trainer.generation.rollout, "sample", short_turns)
    return trainer, turns


def test_a_geo3k_multi_turn_grpo_step_trains_on_the_images(geo3k_trainer: tuple[Trainer, list]) -> None:
    trainer, turns = geo3k_trainer
    before = {name: parameter.detach().clone() for name, parameter in trainer.actor.model.named_parameters()}
    trainer.fit()
    [metrics] = trainer.metrics_log.read()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean",
                "response_length/mean"):
        assert math.isfinite(metrics[key]), key
    # Both turns of the 4 conversations sampled with each row's image (a 4 x 4 grid of patches, merged 2 x 2).
    assert [len(rows) for rows in turns] == [4, 4]
    assert all(row["image_grid_thw"].tolist() == [[1, 4, 4]] for rows in turns for row in rows)
    changed = {name.split(".")[1] for name, parameter in trainer.actor.model.named_parameters()
               if not torch.equal(parameter, before[name])}
    assert {"visual", "language_model"} <= changed  # the update's forward saw the images


def test_a_two_turn_conversations_log_probs_are_the_models_with_its_images(
        geo3k_trainer: tuple[Trainer, list]) -> None:
    trainer, _ = geo3k_trainer
    records = trainer.records[:2]
    batch = trainer.generation.generate(records, n=1)
    assert batch.multi_modal_inputs is not None and len(batch.multi_modal_inputs) == 2
    image_token = trainer.actor.model.config.image_token_id
    assert (batch.prompt_ids == image_token).sum(dim=1).tolist() == [4, 4]
    assert not (batch.response_ids == image_token).any()
    tool = batch.response_real_mask - batch.response_mask
    for row in range(2):  # the model's turn, the tool's response (out of the loss), the model's second turn
        own = batch.response_mask[row].nonzero().flatten().tolist()
        assert 2 <= len(own) <= 2 * TURN and tool[row].sum() > 0
        assert tool[row, own[0]:own[-1]].sum() > 0  # the tool's tokens lie between the model's turns
    ours = trainer.actor.compute_log_probs(batch)
    mask = batch.response_mask.bool()
    pngs = [record.images[0]["bytes"] for record in records]
    plain = plain_log_probs(trainer.actor.model, batch.input_ids, batch.attention_mask, pngs,
                            batch.response_ids.shape[1])
    torch.testing.assert_close(ours[mask], plain[mask], atol=1e-5, rtol=1e-4)
    assert trainer.reference is not None  # use_kl_loss: it starts as the actor, and reads the same images
    torch.testing.assert_close(trainer.reference.compute_log_probs(batch)[mask], plain[mask], atol=1e-5, rtol=1e-4)
    swapped = batch.select([0, 1])
    swapped.multi_modal_inputs = batch.multi_modal_inputs[::-1]
    assert (trainer.actor.compute_log_probs(swapped)[mask] - ours[mask]).abs().max() > 1e-4


def plain_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list[bytes],
                 response_length: int) -> torch.Tensor:
    """[B, R] the value head's output at the position before each response token, from one forward of the HF model
    with its images processed here."""
    processor = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS)
    processed = processor(images=[Image.open(io.BytesIO(png)).convert("RGB") for png in images], return_tensors="pt")
    with torch.no_grad():
        values = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=processed["pixel_values"],
                       image_grid_thw=processed["image_grid_thw"],
                       mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits.float()
    return values[:, -response_length - 1:-1, 0]


def test_a_ppo_critic_of_the_vision_language_model_reads_the_images(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, _ = make_geo3k_trainer(tmp_path, monkeypatch, "algorithm.adv_estimator=gae",
                                    "critic.model.path=builtin:tiny-qwen2-vl", "critic.optim.lr=1e-2")
    assert trainer.critic is not None
    before = {name: parameter.detach().clone() for name, parameter in trainer.critic.model.named_parameters()}
    trainer.fit()
    [metrics] = trainer.metrics_log.read()
    for key in ("critic/vf_loss", "critic/values/mean", "actor/pg_loss"):
        assert math.isfinite(metrics[key]), key
    changed = {name.split(".")[1] for name, parameter in trainer.critic.model.named_parameters()
               if not torch.equal(parameter, before[name])}
    assert {"visual", "language_model"} <= changed  # the critic's update read the images too
    records = trainer.records[:2]
    batch = trainer.generation.generate(records, n=1)
    ours = trainer.critic.compute_values(batch)
    mask = batch.response_mask.bool()
    plain = plain_values(trainer.critic.model, batch.input_ids, batch.attention_mask,
                         [record.images[0]["bytes"] for record in records], batch.response_ids.shape[1])
    torch.testing.assert_close(ours[mask], plain[mask], atol=1e-5, rtol=1e-4)
    swapped = batch.select([0, 1])
    swapped.multi_modal_inputs = batch.multi_modal_inputs[::-1]
    assert (trainer.critic.compute_values(swapped)[mask] - ours[mask]).abs().max() > 1e-5
