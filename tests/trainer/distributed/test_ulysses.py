"""Ulysses sequence parallelism: 2 CPU ranks over gloo against the same work on one rank, and the config checks.

The two-rank checks run once, in one torch.distributed.run launch of ulysses_ranks.py (starting ranks costs
seconds here); each test below asserts on what both ranks reported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support import REPO
from tests.trainer.distributed.test_ranks import rank_script_reports
from trainer.config.sequence_parallel import (
    ACTOR_FSDP_KEY,
    ACTOR_KEY,
    AttentionHeads,
    allowed_sizes,
    attention_heads,
    sequence_parallel_problems,
)

RANKS = 2
TOLERANCE = 1e-5  # fp32, relative to the largest magnitude of the expected tensor


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict[str, float]]:
    """What each of the 2 ranks measured (ulysses_ranks.py), one dict per rank."""
    return rank_script_reports("ulysses_ranks.py", tmp_path_factory.mktemp("ulysses"), ranks=RANKS)


@pytest.mark.parametrize("key_value_heads", [2, 1], ids=["kv2", "kv1-repeated"])
@pytest.mark.parametrize("mask", ["causal", "padded"])
def test_attention_forward_and_backward_equal_full_attention(reports, key_value_heads, mask):
    name = f"attention/kv{key_value_heads}/{mask}"
    for report in reports:
        for measured in ("output", "grad_query", "grad_key", "grad_value"):
            assert report[f"{name}/{measured}"] < TOLERANCE, (name, measured, report[f"{name}/{measured}"])
        assert report[f"{name}/refuses_sliding_window"] == 1.0
    # The check can fail: attention over the second rank's own positions alone is far from the answer.
    assert reports[1][f"{name}/unsharded_control"] > 0.1


@pytest.mark.parametrize("case", ["qwen2/kv2", "llama/kv1", "qwen2/kv2/checkpointing"])
def test_training_step_with_two_ranks_equals_one(reports, case):
    for report in reports:
        for measured in ("log_probs", "grads", "parameters_after_step"):
            value = report[f"step/{case}/{measured}"]
            assert value < TOLERANCE, (case, measured, value)


@pytest.mark.parametrize("case", ["qwen2/kv2", "llama/kv1"])
def test_the_padding_free_row_split_over_two_ranks_gives_one_ranks_padding_free_forward(reports, case):
    """use_remove_padding with Ulysses (what every verl Ulysses config sets): the packed row of real tokens is split
    along the sequence, and the responses' log-probs, entropies and gradients are one rank's padding-free ones."""
    for report in reports:
        for measured in ("log_probs", "entropy", "against_padded", "grads", "sum_pi_squared",
                         "sum_pi_squared_log_probs"):
            value = report[f"padding_free/{case}/{measured}"]
            assert value < TOLERANCE, (case, measured, value)
        assert report[f"padding_free/{case}/padding_zero"] == 0.0


# ------------------------------------------------------------------------ one process, no group


def test_without_sequence_parallel_inputs_the_model_is_plain_sdpa():
    """Rollout and scoring call the same model without shards: the registered wrapper must change nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.distributed.ulysses import SequenceParallel, use_ulysses_attention

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).eval()
    input_ids = torch.randint(1, 32, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    expected = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    assert use_ulysses_attention(model) == "ulysses_sdpa"
    assert model.config._attn_implementation == "ulysses_sdpa"
    shard = SequenceParallel().shard(model, input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids)
    logits = model(**shard.model_inputs()).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert shard.gather(logits) is logits
    assert shard.log_probs(logits).shape == (2, 7)


def test_ulysses_needs_sdpa():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.distributed.ulysses import register_ulysses_attention, use_ulysses_attention

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         attn_implementation="eager"))
    with pytest.raises(ValueError, match="needs attn_implementation sdpa.*'eager'"):
        use_ulysses_attention(model)
    with pytest.raises(ValueError, match="wraps one of sdpa; got 'flex_attention'"):
        register_ulysses_attention("flex_attention")
    # In the trainer: one line naming the setting (a model directory may ask for eager, where no override did).
    from trainer.errors import RunSetupError
    from trainer.workers.sequence_split import SequenceSplit

    with pytest.raises(RunSetupError, match="ulysses_sequence_parallel_size: .*'eager'; set "
                                            "override_config.attn_implementation=sdpa"):
        SequenceSplit.prepare(model)
    with pytest.raises(RunSetupError, match="^critic.ulysses_sequence_parallel_size: "):
        SequenceSplit.prepare(model, "critic.ulysses_sequence_parallel_size")


def test_mesh_degree_must_divide_the_ranks():
    from trainer.distributed.ulysses import sequence_parallel_mesh

    with pytest.raises(ValueError, match="got 3; it must divide the 4 ranks"):
        sequence_parallel_mesh("cpu", 4, 3)


# ------------------------------------------------------------------------------- config checks

QWEN2_7B = AttentionHeads(attention=28, key_value=4)


def messages(size, world_size, heads, key=ACTOR_KEY):
    return [str(problem) for problem in sequence_parallel_problems(size, world_size=world_size, heads=heads, key=key)]


def test_sizes_that_split_the_heads_and_the_ranks_pass():
    assert messages(1, 1, QWEN2_7B) == []
    assert messages(4, 8, QWEN2_7B) == []        # 4 key-value heads split over 4 ranks
    assert messages(2, 2, AttentionHeads(4, 1)) == []  # 1 key-value head repeated on 2 ranks
    assert allowed_sizes(8, QWEN2_7B) == [1, 2, 4]


def test_attention_heads_not_divisible():
    assert messages(8, 8, QWEN2_7B) == [
        f"{ACTOR_KEY}: got 8, but the model's 28 attention heads do not divide by it; allowed: 1, 2, 4"]


def test_key_value_heads_neither_split_nor_repeated():
    assert messages(4, 4, AttentionHeads(attention=12, key_value=6)) == [
        f"{ACTOR_KEY}: got 4, but the model's 6 key-value heads neither divide by it nor divide it (so they can "
        "be neither split nor repeated evenly); allowed: 1, 2"]


def test_degree_against_the_world_size():
    assert messages(4, 2, QWEN2_7B) == [
        f"{ACTOR_KEY}: got 4, more than the run's 2 rank(s) (trainer.nnodes x trainer.n_gpus_per_node); "
        "allowed: 1, 2"]
    assert messages(2, 6, QWEN2_7B, key=ACTOR_FSDP_KEY) == [] and messages(4, 6, QWEN2_7B, key=ACTOR_FSDP_KEY) == [
        f"{ACTOR_FSDP_KEY}: got 4, which does not divide the run's 6 ranks (trainer.nnodes x "
        "trainer.n_gpus_per_node) into data-parallel groups; allowed: 1, 2"]


def test_every_problem_is_reported_at_once():
    assert len(messages(3, 4, QWEN2_7B)) == 2  # does not divide the ranks, nor the 28 heads


def test_head_counts_from_config_json():
    assert attention_heads({"num_attention_heads": 28, "num_key_value_heads": 4}) == QWEN2_7B
    assert attention_heads({"num_attention_heads": 12}) == AttentionHeads(12, 12)  # no GQA: one per head
    assert attention_heads({"text_config": {"num_attention_heads": 16, "num_key_value_heads": 8}}) == \
        AttentionHeads(16, 8)


def test_constraints_import_no_torch():
    """The config layer (torch-free) calls these checks."""
    code = "import sys, trainer.config.sequence_parallel; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
