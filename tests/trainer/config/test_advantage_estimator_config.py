"""algorithm.adv_estimator takes every one of verl's names, and the keys of verl's optimal token baseline load."""

from __future__ import annotations

import typing

import pytest

from trainer.config import ConfigError, load_config
from trainer.config.schema import AdvantageEstimatorName

N2 = ["actor_rollout_ref.rollout.n=2"]


@pytest.mark.parametrize("name", typing.get_args(AdvantageEstimatorName))
def test_every_verl_estimator_loads_and_only_gae_builds_a_critic(name):
    config = load_config(None, [f"algorithm.adv_estimator={name}", *N2])
    assert config.algorithm.adv_estimator == name
    assert config.use_critic == (name == "gae")
    assert config.algorithm.reads_sum_pi_squared == (name in ("optimal_token_baseline",
                                                              "tir_optimal_token_baseline"))


def test_grpo_passk_with_one_response_per_prompt_is_refused_as_verl_refuses_it():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"])
    assert [str(problem) for problem in error.value.problems] == [
        "actor_rollout_ref.rollout.n: got 1, but algorithm.adv_estimator=grpo_passk gives each prompt's best response "
        "its margin over the second best (verl refuses a group of one); allowed: n >= 2"]


@pytest.mark.parametrize("name", ["rloo", "rloo_vectorized", "opo", "gpg", "optimal_token_baseline"])
def test_group_estimators_with_one_response_per_prompt_load_as_in_verl(name):
    """verl runs them with n=1 (the trainer warns at start what the advantages become)."""
    assert load_config(None, [f"algorithm.adv_estimator={name}"]).actor_rollout_ref.rollout.n == 1


def test_verl_otb_keys_load():
    """verl's examples/otb_trainer settings; sum_pi_squared_checkpointing is accepted either way (nothing to
    recompute here)."""
    for checkpointing in ("True", "False"):
        config = load_config(None, ["algorithm.adv_estimator=optimal_token_baseline", *N2,
                                    "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                                    f"actor_rollout_ref.actor.sum_pi_squared_checkpointing={checkpointing}"])
        assert config.actor_rollout_ref.actor.calculate_sum_pi_squared is True
    assert load_config(None, []).actor_rollout_ref.actor.calculate_sum_pi_squared is False
