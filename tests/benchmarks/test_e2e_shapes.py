"""e2e_bench.py's realistic shapes (issue 40) scaled down to the tiny actor on the CPU: each variant's config loads,
and one variant of each shape trains two steps in this process, with its rows ending at the drawn lengths."""

import argparse
import os

import pytest
import torch

from benchmarks import e2e_bench, uneven_decode
from trainer.config import load_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
NEW_SHAPES = ("gsm8k7b", "long3b", "lora14b")


@pytest.mark.parametrize("shape", NEW_SHAPES)
@pytest.mark.parametrize("variant", ["all_gpu", "offload", "offload_delayed"])
def test_each_variant_of_each_realistic_shape_is_a_valid_run(tmp_path, shape, variant):
    (tmp_path / "models" / "policy").mkdir(parents=True)  # where save_models puts the shape's model
    (tmp_path / "models" / "policy" / "config.json").write_text("{}")
    for name in (shape, f"{shape}_tiny"):
        config = load_config(None, e2e_bench.overrides(name, variant, "cuda", tmp_path, tmp_path / "models", 4))
        spec = e2e_bench.SHAPES[name]
        assert config.data.max_response_length == spec["response_length"]
        assert config.actor_rollout_ref.rollout.n == spec["n"]
        assert (config.actor_rollout_ref.model.lora_rank > 0) == spec["lora"]
        assert config.critic.enable == (spec["algorithm"] == "gae")
        assert config.critic.model.enable_gradient_checkpointing == config.critic.enable  # as the actor's: long3b's OOM
        assert config.actor_rollout_ref.actor.fsdp_config.delayed_update == (variant == "offload_delayed")
        assert config.actor_rollout_ref.actor.fsdp_config.optimizer_offload == (variant != "all_gpu")
        if spec["lengths"] is not None:  # ended at drawn lengths in the static decode
            assert config.actor_rollout_ref.rollout.decode == "static"
        # The long-response shapes compute their log-probs fused (both sides of a comparison: a setting of the shape).
        assert config.actor_rollout_ref.model.use_fused_kernels == (shape in ("gsm8k7b", "long3b"))
    assert e2e_bench.SHAPES["gsm8k7b"]["prompts"] * e2e_bench.SHAPES["gsm8k7b"]["n"] == 512
    assert e2e_bench._actor_shape("lora14b")["num_hidden_layers"] == 48


@pytest.mark.parametrize("shape", NEW_SHAPES)
def test_each_realistic_shape_trains_at_the_tiny_size(tmp_path, shape):
    name = f"{shape}_tiny"
    e2e_bench.save_models(tmp_path / "models", name, "cpu")
    args = argparse.Namespace(device="cpu", shape=name, variant="offload_delayed", scratch=tmp_path, steps=2,
                              warmup=1, models=tmp_path / "models", decode="auto", set=[], profile=False)
    result = e2e_bench.run_variant(args)
    assert result["steps"] == 2 and result["phases_s"]["step"] > 0
    assert 0.1 < result["peak_host_gib"] < 64  # this process's largest resident size, in GiB
    spec = e2e_bench.SHAPES[name]
    if spec["lengths"] is not None:
        # Each step's rollout: one generate of prompts x n rows, their lengths drawn with seeds 0, 1, ...
        for seed, step in enumerate(result["per_step"]):
            drawn = uneven_decode.long_tailed_lengths(spec["prompts"] * spec["n"], spec["response_length"],
                                                      **spec["lengths"], seed=seed)
            assert step["response_length/mean"] == pytest.approx(float(drawn.double().mean()))
            assert step["response_length/max"] == float(drawn.max())


def test_a_result_goes_into_an_existing_directory_named_by_shape_and_card():
    assert e2e_bench.gpu_tag("cpu") == "cpu"
    if torch.cuda.is_available():
        assert e2e_bench.gpu_tag("cuda").startswith(("h", "a", "b", "l"))
