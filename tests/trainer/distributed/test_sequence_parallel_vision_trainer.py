"""Ulysses sequence parallelism on a vision-language model in the real trainer: the built-in tiny Qwen2-VL on prompts
with images (verl's geo3k layout), `python -m torch.distributed.run --nproc-per-node 2 -m trainer` with the actor's
and the critic's `ulysses_sequence_parallel_size: 2` (2 CPU ranks over gloo, one sp group) against the same run on
one rank.

The runs are greedy, as test_ranks.py's, so both sample the same responses. The prompts differ in length (left
padding) and their images in size (4 and 8 vision tokens), so an image's tokens fall on both sides of the ranks'
split in some rows. Each run's log says which models run on sequence shards, so a silent fall-back to whole sequences
cannot pass for Ulysses.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.trainer.distributed.test_ranks import (
    TOLERANCE,
    actor_weights,
    largest_difference,
    launch,
    metrics,
)
from tests.trainer.distributed.test_sequence_parallel_trainer import assert_same_metrics, ran_on_sequence_shards


def noise_png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_images_data(path: Path, rows: int = 8) -> Path:
    """verl's geo3k layout: chat prompts with an <image> after 0 to 2 words, images of 56 x 56 or 112 x 56."""
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "arithmetic",
         "prompt": [{"role": "user", "content": "1 " * (index % 3) + "<image> : ="}],
         "images": [{"bytes": noise_png(56 * (1 + index % 2), 56, seed=index)}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(index)}, "extra_info": {"index": index}}
        for index in range(rows)]), path)
    return path


def vision_run(data: Path) -> list[str]:
    """PPO with a critic and a KL loss against the reference, so that the actor, the reference and the critic all
    run on the vision-language model."""
    return ["actor_rollout_ref.model.path=builtin:tiny-qwen2-vl",
            "actor_rollout_ref.model.override_config={num_hidden_layers: 2}", f"data.train_files=[{data}]",
            "data.image_key=images", "data.max_prompt_length=16", "algorithm.adv_estimator=gae",
            "actor_rollout_ref.rollout.n=1", "critic.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.1", "trainer.total_training_steps=2", "trainer.save_freq=1"]


def vision_tower(weights: dict) -> dict:
    return {name: weight for name, weight in weights.items() if ".visual." in f".{name}"}


@pytest.mark.slow
def test_ppo_with_a_reference_on_two_sequence_parallel_ranks_trains_a_vision_language_model_as_one_rank(tmp_path):
    """The actor's log-probs and update, the reference's log-probs and the critic's values and update run on
    sequence shards of the prompts with their images; the actor's and the critic's parameters are one rank's on the
    same global batch, and so are the metrics. verl's Ulysses configs set use_remove_padding too: a vision-language
    model's forwards are padded whatever it says, on one rank as on two. The split run keeps the policy's embedding
    and head shards on the CPU (sequence_parallel_offload) and recomputes its layers in backward (gradient
    checkpointing: the recomputed layers' inputs carry the group too)."""
    run = vision_run(write_images_data(tmp_path / "train.parquet"))
    one = launch(1, tmp_path, "one", *run)
    assert one.returncode == 0, one.stderr[-4000:]
    two = launch(2, tmp_path, "sp", *run, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                 "critic.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
                 "critic.model.use_remove_padding=true", "actor_rollout_ref.actor.sequence_parallel_offload=true",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    assert two.returncode == 0, two.stderr[-4000:]
    for role in ("actor", "ref", "critic"):
        assert ran_on_sequence_shards(two, role), role
    for role in ("actor", "critic"):
        one_weights, two_weights = (actor_weights(run_dir / "checkpoints" / "global_step_2", role)
                                    for run_dir in (tmp_path / "one", tmp_path / "sp"))
        assert largest_difference(one_weights, two_weights) < TOLERANCE, role
        # The comparison can fail: the second step moved the vision tower by far more than the tolerance.
        step_1 = actor_weights(tmp_path / "one" / "checkpoints" / "global_step_1", role)
        assert largest_difference(vision_tower(one_weights), vision_tower(step_1)) > 100 * TOLERANCE, role
    assert_same_metrics(metrics(tmp_path / "one"), metrics(tmp_path / "sp"))
    assert metrics(tmp_path / "one")[-1]["actor/kl_loss"] > 0  # the reference's log-probs took part
