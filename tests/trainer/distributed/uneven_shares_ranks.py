"""One rank of the check of use_dynamic_bsz on a step whose sequences do not divide among the ranks, run by
torch.distributed.run (2 CPU ranks over gloo) from test_uneven_shares.py.

The trainer (UNEVEN: one prompt x 3 responses, GRPO, token-budget micro-batches of one sequence each) runs one step:
rank 0 takes 2 of the sequences, rank 1 one, and rank 1 runs a filler micro-batch to match rank 0's two. Each rank
saves the batch its actor update got (OUT/batch<r>.pt) and the step's run-wide metrics (no rank holds the whole
weights: every forward, the rollout's too, is a collective); rank 0 the whole weights after
the step (OUT/weights.pt), for the test to compare with one process's update over the whole batch.

    python -m torch.distributed.run --standalone --nproc-per-node 2 uneven_shares_ranks.py OUT RUNS_DIR REWARD ...

The overrides after REWARD are added to the run's (PPO: with a critic, whose weights rank 0 saves to OUT/critic.pt).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer.config import load_config
from trainer.distributed import sharding
from trainer.distributed.ranks import Ranks
from trainer.loop import Trainer

PROMPT, RESPONSE = 8, 6


PPO = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-2", f"critic.ppo_max_token_len_per_gpu={PROMPT + RESPONSE}",
       f"critic.forward_max_token_len_per_gpu={PROMPT + RESPONSE}"]
"""With a critic (PPO), its values and its update in token-budget micro-batches of one sequence too."""


def uneven(ranks: int, runs_dir: str, reward: str, *more: str) -> list[str]:
    """The run's overrides on `ranks` ranks: 3 sequences, so 2 and 1 on two ranks."""
    return [
        "actor_rollout_ref.model.path=builtin:tiny-qwen2",
        "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
        "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        # One sequence per micro-batch (each has PROMPT + RESPONSE tokens at most): rank 0 runs 2, rank 1 one.
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={PROMPT + RESPONSE}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.temperature=2.0", "algorithm.adv_estimator=grpo",
        f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}", "trainer.device=cpu",
        f"trainer.n_gpus_per_node={ranks}", "trainer.total_training_steps=1", "trainer.save_freq=-1",
        f"custom_reward_function.path={reward}", f"trainer.runs_dir={runs_dir}", "trainer.experiment_name=uneven",
        *more]


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach().clone()
            for name, parameter in model.named_parameters()}


def main(out: Path, runs_dir: str, reward: str, *more: str) -> None:
    ranks = Ranks.from_environment("cpu")
    # No rank holds the whole weights: every forward gathers the shards (a collective), the rollout's synced too,
    # so a rank that ran one forward fewer than the other would leave it waiting.
    sharding.WHOLE_WEIGHTS_SHARE = 0.0
    try:
        trainer = Trainer(load_config(None, uneven(2, runs_dir, reward, *more)), log=lambda *_: None, ranks=ranks)
        update = trainer.actor.update

        def recorded(batch):
            torch.save(batch, out / f"batch{ranks.rank}.pt")
            return update(batch)

        trainer.actor.update = recorded
        seen: dict = {}

        class Metrics:
            def on_step(self, step, metrics):
                seen.update({key: value for key, value in metrics.items() if isinstance(value, float)})

        trainer.observers.append(Metrics())
        trainer.fit()
        weights = whole_weights(trainer.actor.model)
        critic = whole_weights(trainer.critic.model) if trainer.critic is not None else None
        if ranks.rank == 0:
            torch.save(weights, out / "weights.pt")
            if critic is not None:
                torch.save(critic, out / "critic.pt")
        (out / f"rank{ranks.rank}.json").write_text(json.dumps({"metrics": seen}))
    finally:
        ranks.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], *sys.argv[4:])
