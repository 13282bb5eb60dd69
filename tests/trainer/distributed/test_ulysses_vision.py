"""Ulysses sequence parallelism on a vision-language model (the built-in tiny Qwen2-VL, and a tiny Qwen2.5-VL): 2 CPU
ranks over gloo against one process without Ulysses, the actor's log-probs and entropies, the critic's values, and
the gradients of a loss over them (the vision tower's included); and the one line that refuses a vision-language
model it cannot split.

The two-rank checks run once, in one torch.distributed.run launch of ulysses_vision_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

from tests.trainer.distributed.test_ranks import rank_script_reports
from trainer.errors import RunSetupError
from trainer.models.loading import load_policy, load_tokenizer
from trainer.workers.sequence_split import SequenceSplit

TOLERANCE = 1e-5  # fp32, relative to the largest magnitude of the expected tensor


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict[str, float]]:
    """What each of the 2 ranks measured (ulysses_vision_ranks.py), one dict per rank."""
    return rank_script_reports("ulysses_vision_ranks.py", tmp_path_factory.mktemp("ulysses_vision"))


@pytest.mark.parametrize("case", ["images", "images/checkpointing", "text_only", "qwen2_5_vl/images"])
def test_the_actor_s_log_probs_and_gradients_split_over_two_ranks_are_one_process_s(reports, case):
    """Prompts with images of two sizes and one without, left-padded: each rank's decoder ran on half of the
    (padded) positions, and the responses' log-probs, entropies and the gradients of a loss over them are one
    process's; the vision tower's gradients too (each rank's come from the image tokens of its own positions)."""
    name = f"actor/{case}"
    for report in reports:
        for measured in ("log_probs", "entropy", "grads", *(("vision_grads",) if case != "text_only" else ())):
            assert report[f"{name}/{measured}"] < TOLERANCE, (name, measured, report[f"{name}/{measured}"])
        assert report[f"{name}/decoder_length"] == -(-report[f"{name}/sequence_length"] // 2)
        if case != "text_only":
            assert report[f"{name}/vision_grad_size"] > 1e-3
            # The check can fail: another image in a row gives other log-probs.
            assert report[f"{name}/another_image_control"] > 100 * TOLERANCE


def test_the_critic_s_values_and_gradients_split_over_two_ranks_are_one_process_s(reports):
    for report in reports:
        for measured in ("values", "grads", "vision_grads"):
            assert report[f"critic/{measured}"] < TOLERANCE, (measured, report[f"critic/{measured}"])
        assert report["critic/vision_grad_size"] > 1e-3


def tiny_llava() -> LlavaForConditionalGeneration:
    """A vision-language model whose positions are plain text ones (no get_rope_index): Llava."""
    text = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=31))


def test_a_vision_language_model_without_get_rope_index_is_refused_in_one_line_naming_the_key():
    key = "critic.ulysses_sequence_parallel_size"
    with pytest.raises(RunSetupError) as caught:
        SequenceSplit.check_splittable(tiny_llava(), key, 2)
    assert str(caught.value) == (
        f"{key}: 2, but LlavaForConditionalGeneration is a vision-language model without a get_rope_index and a "
        "language_model to split its sequences at (Ulysses splits Qwen2-VL's and Qwen2.5-VL's); allowed: 1 for "
        "this model")
    # Qwen2-VL passes, and so does a text model.
    tokenizer = load_tokenizer("builtin:tiny-qwen2-vl")
    SequenceSplit.check_splittable(load_policy("builtin:tiny-qwen2-vl", tokenizer, dtype=torch.float32, seed=0),
                                   key, 2)
    SequenceSplit.check_splittable(load_policy("builtin:tiny-qwen2", load_tokenizer("builtin:tiny-qwen2"),
                                               dtype=torch.float32, seed=0), key, 2)
