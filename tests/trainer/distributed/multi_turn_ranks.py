"""One rank of the 2-rank multi-turn check, run by torch.distributed.run (2 CPU ranks over gloo) from
test_multi_turn_ranks.py.

Each rank trains the tiny model for a GRPO step with verl's gsm8k tool config and the padding-free forward
(use_remove_padding, as verl's multi-turn scripts set it). The tiny model's word-level vocabulary cannot write
<tool_call>, so its turns are read as calls: on rank 0 every turn calls the tool (up to
max_assistant_turns), on rank 1 none does, so that rank 1's conversations end after one turn while rank 0's go on,
and the sharded rollout's forwards still meet. Each rank writes what it saw to OUT/rank<r>.json:

    python -m torch.distributed.run --standalone --nproc-per-node 2 multi_turn_ranks.py OUT DATA TOOLS RUNS_DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from trainer.config import load_config
from trainer.distributed.ranks import Ranks
from trainer.loop import Trainer
from trainer.rollout import multi_turn
from trainer.rollout.tool_calls import ToolCall


def main(out: Path, data: str, tools: str, runs_dir: str) -> None:
    ranks = Ranks.from_environment("cpu")
    calls: list[str] = []

    def rank_0_calls_every_turn(text: str) -> tuple[str, list[ToolCall]]:
        calls.append(text)
        return text, [ToolCall("calc_gsm8k_reward", {"answer": text})] if ranks.rank == 0 else []

    multi_turn.parse_tool_calls = rank_0_calls_every_turn  # the rollout looks it up at each turn
    config = load_config(None, [
        "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
        f"data.train_files=[{data}]", "data.train_batch_size=4", "data.max_prompt_length=8",
        "data.max_response_length=32", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.device=cpu",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", "trainer.total_training_steps=1",
        "trainer.save_freq=-1", "actor_rollout_ref.model.use_remove_padding=true",
        f"trainer.runs_dir={runs_dir}", "trainer.experiment_name=multi_turn_ranks"])
    trainer = Trainer(config, log=lambda *_: None, ranks=ranks)
    batches = []
    generate = trainer.generation.generate
    trainer.generation.generate = lambda *a, **k: batches.append(generate(*a, **k)) or batches[-1]
    try:
        trainer.fit()
    finally:
        ranks.close()
    report: dict = {"calls": len(calls), "steps": []}
    for batch in batches:
        real, own = batch.response_real_mask, batch.response_mask
        tool_tokens = real - own
        report["steps"].append({
            "rows": len(batch.records),
            "tool_tokens": tool_tokens.sum(dim=1).tolist(),
            "own_tokens": own.sum(dim=1).tolist(),
            "own_within_real": bool((own * real == own).all()),
            "advantages_outside_mask_zero": bool((batch.advantages[own == 0] == 0).all()),
            "ref_outside_mask_zero": batch.ref_log_probs is not None
                                     and bool((batch.ref_log_probs[own == 0] == 0).all()),
            "num_turns": [record.extra_info["num_turns"] for record in batch.records],
            "turns_in_mask": [_turns(own_row, real_row) for own_row, real_row in zip(own, real, strict=True)],
        })
    if ranks.rank == 0:
        rows = trainer.metrics_log.read()
        report["metrics"] = [{key: value for key, value in row.items() if isinstance(value, int | float)}
                             for row in rows]
        report["finite"] = all(math.isfinite(value) for row in report["metrics"] for value in row.values())
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))


def _turns(own: torch.Tensor, real: torch.Tensor) -> list[str]:
    """A response's turns as its masks mark them, in order: "model" (a run of loss-mask tokens), "tool" (a run of
    real tokens out of the loss mask)."""
    turns: list[str] = []
    for is_own, is_real in zip(own.tolist(), real.tolist(), strict=True):
        kind = "model" if is_own else "tool" if is_real else None
        if kind is not None and (not turns or turns[-1] != kind):
            turns.append(kind)
    return turns


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
