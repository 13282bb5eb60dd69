"""The value model: values for GAE and the clipped value update."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from trainer.algorithms import compute_value_loss
from trainer.config import KEYS, CriticConfig
from trainer.distributed.ranks import Ranks
from trainer.rollout.batch import RolloutBatch
from trainer.workers.merging import MicroBatchMerging
from trainer.workers.optimization import (
    build_optimizer,
    build_scheduler,
    publish_pending,
    rank_mini_batch_size,
    response_logits,
    restore_schedule,
    update_worker,
)
from trainer.workers.packing import check_packable, plan_micro_batches
from trainer.workers.recovery import WorkerMemory, run_pieces
from trainer.workers.sequence_split import SequenceSplit


class Critic:
    """Owns the critic's weights, optimizer and schedule."""

    def __init__(self, model: PreTrainedModel, config: CriticConfig, *, rollout_n: int,
                 forward_micro_batch_size: int, total_steps: int, memory: WorkerMemory | None = None,
                 ranks: Ranks | None = None, sequence_split: SequenceSplit | None = None):
        self.model = model
        self.ranks = ranks  # several: the model is sharded and the batches are this rank's share
        self.sequence_split = sequence_split  # Ulysses: every forward on this rank's slice of the sequences
        # The memory manager's side for this model: its optimizer, dynamic offload between
        # micro-batches and relief after an out-of-memory error. None: plain AdamW, errors propagate.
        self.memory = memory
        self.config = config
        self.rollout_n = rollout_n
        self.forward_micro_batch_size = forward_micro_batch_size
        # Sharded with optimizer_offload: the host's AdamW arithmetic of the critic's last step runs in a thread
        # of its own beside the actor's update, as one rank's engine runs it in its worker, and the next read of
        # the critic applies it first (compute_values, its next update, a checkpoint): exact, nothing reads the
        # critic between its step and those.
        self.optimizer = (memory.build_optimizer(model, config.optim) if memory is not None
                          else build_optimizer(model, config.optim, fsdp_config=config.fsdp_config, background=True))
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        # Fewer, larger micro-batches while the update streams layers (issue 14).
        self.merging = MicroBatchMerging(config.fsdp_config.merge_micro_batches)
        if config.model.use_remove_padding:
            check_packable(model, KEYS.critic.model.use_remove_padding)

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        # The head's output at the position before each response token is that state's value.
        if self.sequence_split is not None:
            return self.sequence_split.values(self.model, batch).float() * batch.response_mask
        outputs = response_logits(self.model, batch, remove_padding=self.config.model.use_remove_padding)
        return outputs.squeeze(-1).float() * batch.response_mask

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, R] values of the states before each response token (micro-batches by token budget with
        critic.use_dynamic_bsz: critic.forward_max_token_len_per_gpu)."""
        publish_pending(self.optimizer)  # HostAdamW's update from the last step, computed in the background
        plan = plan_micro_batches(batch, self.forward_micro_batch_size,
                                  self.config.forward_max_token_len_per_gpu if self.config.use_dynamic_bsz else None,
                                  agree=self.ranks.count_agreement if self.ranks is not None else None)
        arranged = plan.arrange(batch)
        was_training = self.model.training
        self.model.eval()
        try:
            parts = run_pieces(lambda first, count: self._values(arranged.select(torch.arange(first, first + count))),
                               plan.pieces, memory=self.memory)
            return plan.restore(torch.cat(parts))
        finally:
            self.model.train(was_training)

    @property
    def mini_batch_size(self) -> int:
        return rank_mini_batch_size(self.config.ppo_mini_batch_size, self.rollout_n, self.ranks)

    def update_micro_batches(self, size: int) -> int:
        """Micro-batches an update of `size` sequences runs in per epoch while its layers stream."""
        return self.merging.micro_batches(size, self.mini_batch_size, self.config.ppo_micro_batch_size_per_gpu)

    def update(self, batch: RolloutBatch) -> dict[str, list[float]]:
        metrics = update_worker(self, batch, self._loss, None)
        metrics = {f"critic/{key}": values for key, values in metrics.items()}
        metrics["critic/lr"] = [self.scheduler.get_last_lr()[0]]
        self.scheduler.step()
        return metrics

    def _loss(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        predictions = self._values(batch)
        mask = batch.training_mask  # less the tokens rollout correction rejected, as verl's critic reads them
        loss, clipfrac = compute_value_loss(predictions, batch.values, batch.returns, mask,
                                            cliprange_value=self.config.cliprange_value,
                                            loss_agg_mode=self.config.loss_agg_mode)
        mean_prediction = (predictions * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"vf_loss": loss.item(), "vf_clipfrac": clipfrac.item(), "vpred_mean": mean_prediction.item()}

    def state_dict(self) -> dict:
        """Its optimizer's states (None when sharded: the checkpoint's DCP shards hold them) and schedule."""
        sharded = self.ranks is not None and self.ranks.distributed
        return {"optimizer": None if sharded else self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        restore_schedule(self.scheduler, self.optimizer, state["scheduler"])
