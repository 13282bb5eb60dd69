"""verl's keys of rewards, validation and kernels as its scripts write them: each read where this project acts on
it, accepted where either value runs the same, or accepted with a NOTE where it has no effect here."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config, load_config_with_notes

ARO = "actor_rollout_ref"


@pytest.mark.parametrize("line", [
    f"{ARO}.model.use_liger=True", f"{ARO}.model.fused_kernel_options.impl_backend=triton",
    f"{ARO}.actor.fsdp_config.use_torch_compile=False",
    f"{ARO}.ref.use_torch_compile=False", "reward_model.launch_reward_fn_async=True",
])
def test_a_kernel_or_async_switch_with_no_effect_here_is_accepted_with_a_note(line: str) -> None:
    [note] = load_config_with_notes(None, [line]).notes
    assert line.split("=")[0].startswith(note.key), "the key (or its section) is named"


@pytest.mark.parametrize("line", [
    f"{ARO}.actor.entropy_checkpointing=True", f"{ARO}.actor.entropy_from_logits_with_chunking=True",
    f"{ARO}.actor.fsdp_config.entropy_checkpointing=True", f"{ARO}.ref.entropy_checkpointing=False",
    f"{ARO}.actor.calculate_entropy=True", "reward_model.use_reward_loop=False", "reward_model.use_reward_loop=True",
])
def test_a_switch_whose_both_values_run_the_same_here_is_accepted_silently(line: str) -> None:
    assert load_config_with_notes(None, [line]).notes == []


def test_the_fused_kernels_switch_is_read_and_no_longer_noted_as_not_built() -> None:
    assert load_config(None, []).actor_rollout_ref.model.use_fused_kernels is False, "verl's default"
    loaded = load_config_with_notes(None, [f"{ARO}.model.use_fused_kernels=True"])
    assert loaded.config.actor_rollout_ref.model.use_fused_kernels is True and loaded.notes == []
    # verl's actor repeats the model's key: accepted where it does, refused where it does not.
    mirrored = load_config_with_notes(None, [f"{ARO}.model.use_fused_kernels=True",
                                             f"{ARO}.actor.use_fused_kernels=True",
                                             "reward_model.model.use_fused_kernels=True"])
    assert mirrored.config.actor_rollout_ref.model.use_fused_kernels is True and mirrored.notes == []
    with pytest.raises(ConfigError, match=rf"{ARO}.actor.use_fused_kernels: got true, but verl's actor repeats "
                                          rf"{ARO}.model.use_fused_kernels"):
        load_config(None, [f"{ARO}.actor.use_fused_kernels=True"])
    # Triton's backend runs the torch implementation, said in the NOTE line; torch's is what runs anyway.
    [note] = load_config_with_notes(None, [f"{ARO}.model.use_fused_kernels=True",
                                           f"{ARO}.model.fused_kernel_options.impl_backend=triton"]).notes
    assert "torch implementation" in note.why and "not built: the log-probs" not in note.why
    assert load_config_with_notes(None, [f"{ARO}.model.fused_kernel_options.impl_backend=torch"]).notes == []


def test_the_actors_torch_compile_switch_is_read() -> None:
    assert load_config(None, []).actor_rollout_ref.actor.use_torch_compile is True, "verl's default"
    off = load_config(None, [f"{ARO}.actor.use_torch_compile=False"])
    assert off.actor_rollout_ref.actor.use_torch_compile is False


def test_validations_sampling_and_logged_generations_are_read() -> None:
    config = load_config(None, [f"{ARO}.rollout.val_kwargs.do_sample=True", f"{ARO}.rollout.val_kwargs.temperature=0.6",
                                f"{ARO}.rollout.val_kwargs.top_p=0.95", f"{ARO}.rollout.val_kwargs.n=8",
                                "trainer.log_val_generations=10"])
    sampling = config.actor_rollout_ref.rollout.val_kwargs
    assert (sampling.do_sample, sampling.temperature, sampling.top_p, sampling.n, sampling.samples) == (
        True, 0.6, 0.95, 8, True)
    assert config.trainer.log_val_generations == 10
    with pytest.raises(ConfigError, match=r"rollout.val_kwargs.n: got 0, out of range"):
        load_config(None, [f"{ARO}.rollout.val_kwargs.n=0"])


def test_verls_reward_keys_are_read_where_they_act() -> None:
    config = load_config(None, ["reward_model.reward_manager=prime", "reward_model.model.use_remove_padding=True"])
    assert config.reward_model.reward_manager == "prime" and config.reward_model.model.use_remove_padding is True
