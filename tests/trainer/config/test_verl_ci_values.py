"""Values verl's own CI scripts (tests/special_e2e) pass and verl runs with: lora_alpha 0 (with lora_rank 0, or an
adapter whose output is scaled by 0: a WARNING line) and custom_reward_function.name=null beside a null path
(verl's default name). No torch here."""

from __future__ import annotations

import pytest

from trainer.config import load_config_with_notes

PREFIXES = ["actor_rollout_ref.model", "critic.model"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_lora_alpha_zero_without_an_adapter_loads_with_the_no_adapter_warning(prefix: str) -> None:
    _, _, warnings = load_config_with_notes(None, [f"{prefix}.lora_alpha=0"])
    assert [(warning.path, warning.message.split(":")[0]) for warning in warnings] == [
        (f"{prefix}.lora_alpha", f"got 0, but {prefix}.lora_rank is 0 (no LoRA adapter)")]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_lora_alpha_zero_beside_an_adapter_warns_that_the_adapter_adds_nothing(prefix: str) -> None:
    _, _, warnings = load_config_with_notes(None, [f"{prefix}.lora_alpha=0", f"{prefix}.lora_rank=8"])
    [warning] = warnings
    assert warning.path == f"{prefix}.lora_alpha"
    assert "scaled by lora_alpha / lora_rank = 0: it adds nothing to the layers it wraps" in warning.message


def test_a_null_reward_function_name_beside_a_null_path_is_verls_default_name() -> None:
    config, notes, warnings = load_config_with_notes(None, ["custom_reward_function.path=null",
                                                            "custom_reward_function.name=null"])
    assert config.custom_reward_function.name == "compute_score"
    assert (notes, warnings) == ([], [])



@pytest.mark.parametrize(("written", "read"), [("false", -1), ("true", 1), ("3", 3)])
def test_a_boolean_frequency_is_read_as_verl_compares_it(written: str, read: int) -> None:
    """verl's CI sets trainer.test_freq=false: its `test_freq > 0` never validates (and `true` is every step)."""
    assert load_config_with_notes(None, [f"trainer.save_freq={written}"]).config.trainer.save_freq == read
    assert load_config_with_notes(None, ["trainer.test_freq=false"]).config.trainer.test_freq == -1
