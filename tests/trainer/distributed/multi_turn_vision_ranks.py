"""One rank of the 2-rank multi-turn check with images, run by torch.distributed.run (2 CPU ranks over gloo) from
test_multi_turn_vision_ranks.py.

Each rank trains the built-in tiny Qwen2-VL for a GRPO step of verl's geo3k multi-turn config (its Geo3kTool). The
tiny model's word-level vocabulary cannot write <tool_call>, so its turns are read as calls: on rank 0 every turn
calls the tool (up to max_assistant_turns), on rank 1 none does, so that rank 1's conversations end after one turn
while rank 0's go on (each turn is cut after 2 tokens, as a stop would cut it). Each rank writes what it saw, and
what each turn's sampling was given, to OUT/rank<r>.json:

    python -m torch.distributed.run --standalone --nproc-per-node 2 multi_turn_vision_ranks.py OUT DATA TOOLS RUNS
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from trainer.config import load_config_with_notes
from trainer.distributed.ranks import Ranks
from trainer.loop import Trainer
from trainer.rollout import multi_turn
from trainer.rollout.tool_calls import ToolCall


def main(out: Path, data: str, tools: str, runs_dir: str) -> None:
    ranks = Ranks.from_environment("cpu")

    def rank_0_calls_every_turn(text: str) -> tuple[str, list[ToolCall]]:
        return text, [ToolCall("calc_geo3k_reward", {"answer": text})] if ranks.rank == 0 else []

    multi_turn.parse_tool_calls = rank_0_calls_every_turn  # the rollout looks it up at each turn
    config = load_config_with_notes(None, [
        "actor_rollout_ref.model.path=builtin:tiny-qwen2-vl", f"data.train_files=[{data}]",
        "data.train_batch_size=4", "data.max_prompt_length=24", "data.max_response_length=12",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", "trainer.total_training_steps=1",
        "actor_rollout_ref.model.custom_chat_template=null",  # Qwen2.5-VL's, which the word-level tokenizer cannot read
        "trainer.save_freq=-1", f"trainer.runs_dir={runs_dir}", "trainer.experiment_name=multi_turn_vision_ranks"],
        "geo3k_multiturn_grpo").config
    trainer = Trainer(config, log=lambda *_: None, ranks=ranks)
    rollout, turns = trainer.generation.rollout, []
    sample = rollout.sample

    def short_turns(ids, mask, *args, **kwargs):  # each turn cut after 2 tokens, as a stop would cut it
        turns.append({"rows": len(ids), "images": sum(bool(row) for row in kwargs.get("multi_modal", ())),
                      "synced": rollout.synced})
        sampled = sample(ids, mask, *args, **kwargs)
        sampled.response_mask[:, 2:] = 0
        return sampled

    rollout.sample = short_turns
    batches = []
    generate = trainer.generation.generate
    trainer.generation.generate = lambda *a, **k: batches.append(generate(*a, **k)) or batches[-1]
    try:
        trainer.fit()
    finally:
        ranks.close()
    [batch] = batches
    image_token = trainer.actor.model.config.image_token_id
    report: dict = {"rows": len(batch.records), "turns": turns,
                    "images": len(batch.multi_modal_inputs or []),
                    "prompt_image_tokens": (batch.prompt_ids == image_token).sum(dim=1).tolist(),
                    "tool_tokens": (batch.response_real_mask - batch.response_mask).sum(dim=1).tolist(),
                    "num_turns": [record.extra_info["num_turns"] for record in batch.records]}
    if ranks.rank == 0:
        rows = trainer.metrics_log.read()
        report["metrics"] = [{key: value for key, value in row.items() if isinstance(value, int | float)}
                             for row in rows]
        report["finite"] = all(math.isfinite(value) for row in report["metrics"] for value in row.values())
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
