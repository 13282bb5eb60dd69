"""One rank of the checks of groups that span ranks, run by torch.distributed.run (2 CPU ranks over gloo) from
test_whole_groups.py.

1. Every advantage estimator on this rank's rows of one hand-made batch whose groups span the ranks (and whose
   ranks' responses are of different widths), through distributed/whole_groups.py.
2. The trainer with data.train_batch_size=1 and rollout.n=4 (one prompt, its 4 responses split 2 and 2, as verl
   splits them), GRPO, sampled responses scored by a function of their text: one step. The rank records its rows'
   group ids, scores, masks and advantages as the adv phase left them, and the step's metrics.

Everything goes to OUT/rank<r>.json; the test compares it with the one-process computation over the whole batch:

    python -m torch.distributed.run --standalone --nproc-per-node 2 whole_groups_ranks.py OUT RUNS_DIR REWARD
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainer.algorithms import AdvantageInputs, get_advantage_estimator
from trainer.config import AlgorithmConfig, load_config
from trainer.distributed.ranks import Ranks
from trainer.distributed.whole_groups import advantages_over_whole_groups
from trainer.loop import Trainer

ESTIMATORS = ("gae", "grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline",
              "reinforce_plus_plus", "optimal_token_baseline")
ROWS = (6, 6)
"""Each rank's rows of the hand-made batch: groups 0, 1 and 2 of 4 responses each, group 1 on both ranks."""
WIDTHS = (5, 3)
"""Each rank's response width (rank 1's responses are all shorter)."""


def hand_batch() -> dict[str, torch.Tensor]:
    """The whole hand-made batch [12, 5], the same on every rank (one seed), rank 1's rows masked after 3 tokens."""
    generator = torch.Generator().manual_seed(0)
    rows, width = sum(ROWS), max(WIDTHS)
    lengths = torch.randint(1, WIDTHS[1] + 1, (rows,), generator=generator)
    lengths[:ROWS[0]] = torch.randint(1, WIDTHS[0] + 1, (ROWS[0],), generator=generator)
    mask = (torch.arange(width) < lengths[:, None]).float()
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), lengths - 1] = torch.randn(rows, generator=generator)
    return {"token_level_rewards": rewards, "response_mask": mask,
            "group_index": torch.arange(3).repeat_interleave(4),
            "values": torch.randn(rows, width, generator=generator) * mask,
            "old_log_probs": -torch.rand(rows, width, generator=generator) * mask,
            "sum_pi_squared": torch.rand(rows, width, generator=generator) * mask}


def my_rows(whole: dict[str, torch.Tensor], rank: int) -> AdvantageInputs:
    first = sum(ROWS[:rank])
    mine = {name: tensor[first:first + ROWS[rank]] for name, tensor in whole.items()}
    mine = {name: tensor if tensor.dim() == 1 else tensor[:, :WIDTHS[rank]] for name, tensor in mine.items()}
    return AdvantageInputs(**mine)


def estimators_on_my_rows(ranks: Ranks) -> dict[str, list]:
    inputs = my_rows(hand_batch(), ranks.rank)
    algorithm = AlgorithmConfig()
    found = {}
    for name in ESTIMATORS:
        advantages, returns = advantages_over_whole_groups(get_advantage_estimator(name), inputs, algorithm, ranks)
        found[name] = [advantages.tolist(), returns.tolist()]
    return found


def one_grpo_step(ranks: Ranks, runs_dir: str, reward: str) -> dict:
    config = load_config(None, [
        "actor_rollout_ref.model.path=builtin:tiny-qwen2",
        "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
        "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=2.0", "algorithm.adv_estimator=grpo", "data.max_prompt_length=8",
        "data.max_response_length=6", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", f"custom_reward_function.path={reward}",
        f"trainer.runs_dir={runs_dir}", "trainer.experiment_name=whole_groups"])
    trainer = Trainer(config, log=lambda *_: None, ranks=ranks)
    seen: dict = {}
    compute = trainer.advantages.compute_advantages

    def recorded(batch):
        metrics = compute(batch)
        seen.update(group_index=batch.group_index.tolist(), scores=batch.token_level_rewards.sum(-1).tolist(),
                    response_mask=batch.response_mask.tolist(), advantages=batch.advantages.tolist())
        return metrics

    trainer.advantages.compute_advantages = recorded

    class Metrics:
        def on_step(self, step, metrics):
            seen["metrics"] = {key: value for key, value in metrics.items() if isinstance(value, float)}

    trainer.observers.append(Metrics())
    trainer.fit()
    return seen


def main(out: Path, runs_dir: str, reward: str) -> None:
    ranks = Ranks.from_environment("cpu")
    try:
        report = {"estimators": estimators_on_my_rows(ranks), "trainer": one_grpo_step(ranks, runs_dir, reward)}
    finally:
        ranks.close()
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
