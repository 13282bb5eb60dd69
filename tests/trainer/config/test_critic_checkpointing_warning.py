"""A critic that keeps its activations beside an actor that recomputes them is one WARNING line at start: long3b's
critic update ran out of memory so (benchmarks/results/e2e-long3b-h100-2026-12-07T1913.json)."""

from trainer.config.loading import load_config_with_notes

ACTOR = "actor_rollout_ref.model.enable_gradient_checkpointing"
CRITIC = "critic.model.enable_gradient_checkpointing"


def warnings_of(*overrides: str) -> list[str]:
    return [str(warning) for warning in load_config_with_notes(None, list(overrides)).warnings]


def test_an_actor_that_checkpoints_beside_a_critic_that_does_not_is_warned_of():
    warned = [line for line in warnings_of(f"{ACTOR}=true") if line.startswith(CRITIC)]
    assert len(warned) == 1 and f"{ACTOR} is true" in warned[0] and "set it true" in warned[0]
    for overrides in ([f"{ACTOR}=true", f"{CRITIC}=true"], [], [f"{CRITIC}=true"],
                      [f"{ACTOR}=true", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]):
        assert not any(line.startswith(CRITIC) for line in warnings_of(*overrides)), overrides
