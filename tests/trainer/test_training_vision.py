"""A vision-language model (the built-in tiny Qwen2-VL) trains through the real trainer on prompts with images, in
verl's geo3k layout, and its log-probs are those of the model that sees the images."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from trainer.config import load_config
from trainer.errors import RunSetupError
from trainer.loop import Trainer
from trainer.models.vision_language import TINY_MAX_PIXELS, TINY_MIN_PIXELS

SIDE = 56  # every image 56 x 56: 4 patches of 14, one token after the 2 x 2 merge (-> 4 x 4 grid, 4 tokens)


def dots_png(count: int, seed: int) -> bytes:
    """A SIDE x SIDE PNG of `count` white squares on black at random places (drawn, not downloaded)."""
    rng = np.random.default_rng(seed)
    pixels = np.zeros((SIDE, SIDE, 3), dtype=np.uint8)
    for _ in range(count):
        row, column = rng.integers(0, SIDE - 6, size=2)
        pixels[row:row + 6, column:column + 6] = 255
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_geo3k_layout(path: Path, rows: int = 4) -> Path:
    """verl's geo3k layout (examples/data_preprocess/geo3k.py): chat prompts with <image>, an `images` column of
    [{'bytes': PNG}]; the answer is the number of squares (scored by the last number of the response)."""
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "<image> : ="}],
         "images": [{"bytes": dots_png(index + 1, seed=index)}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(index + 1)}, "extra_info": {"index": index}}
        for index in range(rows)]), path)
    return path


def make_vision_trainer(tmp_path: Path, *overrides: str) -> Trainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_geo3k_layout(tmp_path / "train.parquet")
    # A reward that differs between a random model's responses (the rule's would be 0 for nearly all), so that the
    # step has advantages to train on.
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(set(solution_str.split())))\n")
    config = load_config(None, [f"custom_reward_function.path={reward}",
        "actor_rollout_ref.model.path=builtin:tiny-qwen2-vl", f"data.train_files=[{data}]", "data.image_key=images",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-2",
        "data.max_prompt_length=16", "data.max_response_length=3", "trainer.device=cpu",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", f"trainer.runs_dir={tmp_path}", *overrides])
    return Trainer(config, log=lambda *_: None)


@pytest.fixture
def vision_trainer(tmp_path: Path) -> Trainer:
    return make_vision_trainer(tmp_path)


def plain_log_probs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    images: list[bytes], response_length: int) -> torch.Tensor:
    """[B, R] log-probs of the last R tokens from one forward of the HF model, its images processed here."""
    processor = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS)
    processed = processor(images=[Image.open(io.BytesIO(png)).convert("RGB") for png in images], return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=processed["pixel_values"],
                       image_grid_thw=processed["image_grid_thw"],
                       mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits.float()
    predicted = logits[:, -response_length - 1:-1].log_softmax(dim=-1)
    return predicted.gather(-1, input_ids[:, -response_length:, None]).squeeze(-1)


def test_a_grpo_step_of_a_vision_language_model_trains_on_its_images(vision_trainer: Trainer) -> None:
    before = {name: parameter.detach().clone() for name, parameter in vision_trainer.actor.model.named_parameters()}
    vision_trainer.fit()
    [metrics] = vision_trainer.metrics_log.read()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
        assert math.isfinite(metrics[key]), key
    assert metrics["critic/score/max"] > metrics["critic/score/min"]
    changed = {name.split(".")[1] for name, parameter in vision_trainer.actor.model.named_parameters()
               if not torch.equal(parameter, before[name])}
    # The vision tower trains too: its features entered the update's forward at the image tokens.
    assert {"visual", "language_model"} <= changed

    records = vision_trainer.records[:2]
    batch = vision_trainer.generation.generate(records, n=1)
    assert batch.multi_modal_inputs is not None and len(batch.multi_modal_inputs) == 2
    image_token = vision_trainer.actor.model.config.image_token_id
    assert (batch.prompt_ids == image_token).sum(dim=1).tolist() == [4, 4]  # one <image>: a 4 x 4 grid, merged 2 x 2
    assert not (batch.response_ids == image_token).any()  # the rollout never writes a placeholder of its own
    ours = vision_trainer.actor.compute_log_probs(batch)
    mask = batch.response_mask.bool()
    pngs = [record.images[0]["bytes"] for record in records]
    plain = plain_log_probs(vision_trainer.actor.model, batch.input_ids, batch.attention_mask, pngs,
                            batch.response_ids.shape[1])
    torch.testing.assert_close(ours[mask], plain[mask], atol=1e-5, rtol=1e-4)
    # The images are really used: the same tokens with the two rows' images swapped score otherwise.
    swapped = batch.select([0, 1])
    swapped.multi_modal_inputs = batch.multi_modal_inputs[::-1]
    other = vision_trainer.actor.compute_log_probs(swapped)
    assert (ours[mask] - other[mask]).abs().max() > 1e-4


@pytest.mark.slow
def test_an_offloaded_vision_language_run_is_the_resident_run(tmp_path: Path) -> None:
    """Every group of the language model on the CPU (the engine streams its layers; the vision tower, in no group,
    stays on the compute device): the resident run's metrics, a KL to the reference at step 2 included."""
    keys = ("actor/grad_norm", "actor/kl_loss", "actor/pg_loss", "actor/entropy")
    runs = []
    for name, offload in (("resident", "false"), ("offloaded", "true")):
        trainer = make_vision_trainer(tmp_path / name, "trainer.total_training_steps=2",
                                      f"actor_rollout_ref.actor.fsdp_config.param_offload={offload}",
                                      "actor_rollout_ref.actor.fsdp_config.merge_micro_batches=false")
        trainer.fit()
        runs.append([tuple(row[key] for key in keys) for row in trainer.metrics_log.read()])
    resident, offloaded = runs
    assert [value for step in offloaded for value in step] == pytest.approx(
        [value for step in resident for value in step], rel=1e-6, abs=1e-9)
    assert resident[0][0] > 0 and resident[1][1] > 0


def test_a_truncated_prompt_with_images_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(RunSetupError, match=r"data.truncation: left with a vision-language model"):
        make_vision_trainer(tmp_path, "data.truncation=left")
