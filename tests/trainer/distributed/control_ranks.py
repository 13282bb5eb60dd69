"""One rank of the control checks, run by torch.distributed.run (2 CPU ranks over gloo) from test_ranks.py.

Each rank trains the tiny model with a stand-in daemon link (every rank has one, as under the verl daemon).
Rank 0's link hands the trainer a live setting and a checkpoint-now after step 1; rank 1 is asked to stop
after step 3, as a SIGTERM to that rank alone would. Each rank writes what it saw to OUT/rank<r>.json:

    python -m torch.distributed.run --standalone --nproc-per-node 2 control_ranks.py OUT RUNS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.checkpoint import list_checkpoints
from trainer.config import load_config
from trainer.config.live import LiveSettings
from trainer.config.messages import CheckpointNowMessage, DownMessage, SettingsAckMessage, SettingsMessage, UpMessage
from trainer.distributed.ranks import Ranks
from trainer.loop import Trainer

TINY = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=8", "data.max_response_length=4",
    "trainer.device=cpu", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=6", "trainer.save_freq=-1",
]


class Link:
    """Records what the trainer sends; hands it what is queued."""

    def __init__(self) -> None:
        self.sent: list[UpMessage] = []
        self.inbox: list[DownMessage] = []

    def send(self, message: UpMessage) -> None:
        self.sent.append(message)

    def poll(self) -> list[DownMessage]:
        messages, self.inbox = self.inbox, []
        return messages


def main(out: Path, runs_dir: str) -> None:
    config = load_config(None, [*TINY, f"trainer.runs_dir={runs_dir}", "trainer.experiment_name=control"])
    ranks = Ranks.from_environment("cpu")
    link = Link()
    trainer = Trainer(config, log=lambda *_: None, telemetry=link, ranks=ranks)
    applied_at: list[int] = []
    trainer.settings.subscribe(lambda settings: applied_at.append(trainer.step))

    class Commands:
        def on_step(self, step, metrics):
            if step == 1 and ranks.rank == 0:
                values = {**trainer.settings.current.public(), "dynamic_offload.gpu_memory_threshold": 0.6}
                link.inbox += [SettingsMessage(version=4, values=LiveSettings.model_validate(values)),
                               CheckpointNowMessage()]
            if step == 3 and ranks.rank == 1:
                trainer.control.request_stop()

    trainer.observers.append(Commands())
    try:
        trainer.fit()
    finally:
        ranks.close()
    acks = [message for message in link.sent if isinstance(message, SettingsAckMessage)]
    (out / f"rank{ranks.rank}.json").write_text(json.dumps({
        "applied_at": applied_at, "threshold": trainer.settings.current.gpu_memory_threshold,
        "acks": [[ack.version, ack.step] for ack in acks], "final_step": trainer.step,
        "checkpoints": [step for step, _ in list_checkpoints(trainer.checkpointer.directory)]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
