"""The batch sizes of a run of several ranks: verl's rules, no stricter. verl splits a step's sequences (prompts x
rollout.n) among the GPUs, so the prompts need not divide among the ranks; it refuses a batch whose sequences do not
(utils/config.py's real_train_batch_size), a mini-batch that leaves a rank no sequence, and one whose per-rank
share a micro-batch does not divide (fsdp_workers.py's normalized ppo_mini_batch_size)."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config

BASE = ["trainer.device=cpu", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


def problems(*overrides: str) -> list[tuple[str, str]]:
    try:
        load_config(None, [*BASE, *overrides])
    except ConfigError as error:
        return [(problem.path, problem.message) for problem in error.problems]
    return []


@pytest.mark.parametrize("overrides", [
    # verl's grpo_trainer/run_qwen2_5_7b_grpo_*_prof_npu.sh: 2 prompts a mini-batch on 8 GPUs, 1 sequence each.
    ["trainer.n_gpus_per_node=8", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
     "actor_rollout_ref.rollout.n=4"],
    # One prompt, its 4 responses on 2 ranks.
    ["trainer.n_gpus_per_node=2", "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
     "actor_rollout_ref.rollout.n=4"],
    # 3 x 2 = 6 sequences a mini-batch on 4 ranks: verl rounds the share down, to 1.
    ["trainer.n_gpus_per_node=4", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
     "actor_rollout_ref.rollout.n=2"],
    # A critic's mini-batch of one prompt on 2 ranks, 2 responses each.
    ["trainer.n_gpus_per_node=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
     "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=1"],
], ids=["verl-npu-profiling-script", "one-prompt-two-ranks", "rounded-down-share", "critic-one-prompt"])
def test_what_verl_accepts_loads(overrides):
    assert problems(*overrides) == []


def test_a_batch_whose_sequences_do_not_divide_among_the_gpus_is_refused_as_verl_refuses_it():
    assert problems("trainer.n_gpus_per_node=4", "data.train_batch_size=3",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=2") == [
        ("data.train_batch_size", "got 3, whose 6 sequences (x rollout.n 2) do not divide among the run's 4 ranks "
         "(trainer.nnodes x trainer.n_gpus_per_node); verl requires train_batch_size x rollout.n to be a multiple of "
         "the GPUs; allowed: a multiple of 2")]


def test_a_mini_batch_that_leaves_a_rank_no_sequence_is_refused_for_the_actor_and_the_critic():
    found = problems("trainer.n_gpus_per_node=4", "data.train_batch_size=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=2",
                     "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=1")
    says = ("got 1, which leaves no sequence per rank: 1 x rollout.n 2 // 4 ranks is 0, and verl requires at least "
            "one; allowed: at least 2")
    assert found == [("actor_rollout_ref.actor.ppo_mini_batch_size", says), ("critic.ppo_mini_batch_size", says)]


def test_a_micro_batch_that_does_not_divide_a_ranks_rounded_down_share_is_refused():
    # 3 prompts x 2 = 6 sequences on 4 ranks: 1 each (verl's //), which a micro-batch of 2 does not divide.
    [(key, message)] = problems("trainer.n_gpus_per_node=4", "data.train_batch_size=6",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=2",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert key == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    assert "the mini-batch of 1 sequences (ppo_mini_batch_size 3 x rollout.n 2 // 4 ranks)" in message


def test_token_budgets_skip_verls_sequence_check_and_the_ranks_take_uneven_shares():
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "trainer.n_gpus_per_node=4",
               "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=3"]
    assert problems(*dynamic, "data.train_batch_size=4") == []
    assert problems(*dynamic, "data.train_batch_size=2") == []  # 6 sequences on 4 ranks: 2, 2, 1 and 1
    # A critic's mini-batches of another size would cut the uneven shares otherwise on each rank: one line.
    (key, message), *_ = problems(*dynamic, "data.train_batch_size=2", "algorithm.adv_estimator=gae",
                                  "critic.ppo_mini_batch_size=1")
    assert key == "critic.ppo_mini_batch_size" and "dealt by the actor's mini-batches of 2" in message


def test_a_reward_model_on_uneven_shares_is_one_line_rather_than_a_hang():
    """Its micro-batches' forwards gather the shards: a rank with a shorter share would run fewer and the other
    rank would wait for good."""
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "trainer.n_gpus_per_node=4",
               "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=3",
               "reward_model.enable=true", "reward_model.model.path=builtin:tiny-qwen2"]
    found = problems(*dynamic, "data.train_batch_size=2")  # 6 sequences on 4 ranks: 2, 2, 1 and 1
    assert [key for key, _ in found] == ["reward_model.enable"], found
    assert "allowed: data.train_batch_size a multiple of 4" in found[0][1]
    assert problems(*dynamic, "data.train_batch_size=4") == []  # 12 on 4: even shares
