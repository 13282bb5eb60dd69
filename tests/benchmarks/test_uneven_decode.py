"""benchmarks/uneven_decode.py (issue 40's rollout measure) on the CPU with the tiny model: rows end at their drawn
lengths in every variant, and the refilled decode runs fewer steps than a static batch."""

import torch

from benchmarks import uneven_decode
from trainer.models import load_policy, load_tokenizer


def test_every_variant_ends_each_row_at_its_drawn_length_and_refills_run_fewer_steps():
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=3,
                         override_config={"num_hidden_layers": 2}).eval()
    plan = uneven_decode.QUICK_UNEVEN
    lines: list[str] = []
    result = uneven_decode.measure(policy, plan, torch.device("cpu"), hbm_bytes_per_s=1e11, log=lines.append)
    variants = result["variants"]
    assert all(run["lengths_as_drawn"] for run in variants.values()), variants
    assert variants["static"]["refilled"] == 0 and variants["refill"]["refilled"] == plan.rows - plan.slots
    # A static batch runs each piece to its longest row; refills keep the slots busy.
    assert variants["refill"]["steps"] < variants["static"]["steps"]
    assert variants["static"]["useful_speedup"] == 1.0 and result["useful_speedup"] > 0
    assert result["useful_tokens"] == int(uneven_decode.long_tailed_lengths(
        plan.rows, plan.new_tokens, median_tokens=plan.median_tokens, sigma=plan.sigma, seed=plan.seed).sum())
    assert result["step"]["rows"] == plan.slots and result["step"]["step_floor_ms"] > 0
    assert any(line.startswith("| refill |") for line in lines)


def test_lengths_are_long_tailed_and_within_the_limit():
    lengths = uneven_decode.long_tailed_lengths(4096, 1024, median_tokens=160, sigma=1.0, seed=0)
    assert int(lengths.min()) >= 2 and int(lengths.max()) == 1024
    assert 140 <= float(lengths.median()) <= 180  # the median drawn
    assert float(lengths.double().mean()) > 1.4 * float(lengths.median())  # the tail pulls the mean up
    assert 0.01 < float((lengths == 1024).double().mean()) < 0.06  # about 3% reach the limit


def test_the_useful_floor_reads_the_weights_each_step_and_each_tokens_prefix():
    # Rows of 2 and 4 tokens after 3-token prompts, one slot: 6 steps (the tokens over the slots), 600 bytes of
    # weights; prefixes 2*3 + 1 and 4*3 + 6 tokens, 25 in all, 250 bytes of keys and values; at 10 bytes a second.
    floor = uneven_decode.useful_floor_s(torch.tensor([2, 4]), prompt_tokens=3, slots=1, weight_bytes=100,
                                         kv_bytes_per_token=10, bytes_per_s=10)
    assert floor == 85.0
    # Two slots: the longest row's 4 steps.
    assert uneven_decode.useful_floor_s(torch.tensor([2, 4]), prompt_tokens=3, slots=2, weight_bytes=100,
                                        kv_bytes_per_token=10, bytes_per_s=10) == 65.0
