"""The policy: log-probs for the rollout and reference, and the PPO/GRPO update."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from trainer.algorithms import (
    PolicyLossInputs,
    actor_loss,
    aggregate_loss,
    get_policy_loss,
    kl_penalty,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    off_policy_metrics,
    policy_loss_mode,
    scaled_logits,
    sum_pi_squared_from_logits,
)
from trainer.algorithms.compiled_kernels import compiled_kernels
from trainer.algorithms.functional import EAGER_KERNELS
from trainer.config import KEYS, ActorConfig
from trainer.config.losses import RolloutCorrectionConfig
from trainer.distributed.ranks import Ranks
from trainer.models.fused_head import FusedScoring
from trainer.rollout.batch import RolloutBatch
from trainer.workers.merging import MicroBatchMerging
from trainer.workers.optimization import (
    build_optimizer,
    build_scheduler,
    local_mini_batches,
    one_mini_batch,
    rank_mini_batch_size,
    response_logits,
    restore_schedule,
    update_worker,
)
from trainer.workers.packing import check_packable, plan_micro_batches
from trainer.workers.recovery import WorkerMemory, run_pieces
from trainer.workers.sequence_split import SequenceSplit


class ResponseScores(NamedTuple):
    """What the policy's scoring pass gives at each response position."""

    log_probs: torch.Tensor
    """[B, R] log-probs of the sampled tokens at the sampling temperature."""
    sum_pi_squared: torch.Tensor | None
    """[B, R] the sum over the vocabulary of squared probabilities at that temperature (None: not asked for)."""


@torch.no_grad()
def compute_log_probs(model: PreTrainedModel, batch: RolloutBatch, *, micro_batch_size: int,
                      temperature: float, memory: WorkerMemory | None = None, remove_padding: bool = False,
                      max_token_len: int | None = None, sequence_split: SequenceSplit | None = None,
                      ranks: Ranks | None = None, fused_head: bool = False) -> torch.Tensor:
    """[B, R] log-probs of the sampled responses under `model` at the sampling temperature (`score_responses`)."""
    return score_responses(model, batch, micro_batch_size=micro_batch_size, temperature=temperature, memory=memory,
                           remove_padding=remove_padding, max_token_len=max_token_len, sequence_split=sequence_split,
                           ranks=ranks, fused_head=fused_head).log_probs


@torch.no_grad()
def score_responses(model: PreTrainedModel, batch: RolloutBatch, *, micro_batch_size: int,
                    temperature: float, memory: WorkerMemory | None = None, remove_padding: bool = False,
                    max_token_len: int | None = None, sequence_split: SequenceSplit | None = None,
                    ranks: Ranks | None = None, sum_pi_squared: bool = False,
                    fused_head: bool = False) -> ResponseScores:
    """[B, R] log-probs of the sampled responses under `model` at the sampling temperature, in micro-batches
    of `micro_batch_size` sequences or, with `max_token_len`, of at most that many real tokens (as many on
    every one of several `ranks`); with `remove_padding`, each from a padding-free forward; with
    `sequence_split`, each on this rank's sequence shard (Ulysses). With `memory` (the memory manager's, for
    `model`), a micro-batch that runs out of device memory is retried or split. With `sum_pi_squared`, also each
    position's sum of squared probabilities (verl's calculate_sum_pi_squared), from the same logits, a chunk at a
    time. With `fused_head` (use_fused_kernels; not with `sequence_split`), the log-probs come from the fused head,
    never the logits, unless `sum_pi_squared` asks for what only the logits give."""
    plan = plan_micro_batches(batch, micro_batch_size, max_token_len,
                              agree=ranks.count_agreement if ranks is not None else None)
    arranged = plan.arrange(batch)

    def score(first: int, count: int) -> torch.Tensor:
        """[b, R] log-probs, or [b, R, 2] log-probs and sums of squared probabilities."""
        micro_batch = arranged.select(torch.arange(first, first + count))
        if sequence_split is not None:
            if sum_pi_squared:
                return torch.stack(sequence_split.log_probs_and_sum_pi_squared(model, micro_batch, temperature), -1)
            return sequence_split.log_probs_and_entropy(model, micro_batch, temperature, entropy=False)[0]
        if fused_head and not sum_pi_squared:
            return response_logits(model, micro_batch, remove_padding=remove_padding,
                                   fused=FusedScoring(temperature))[..., 0]
        logits = response_logits(model, micro_batch, remove_padding=remove_padding)
        squares = sum_pi_squared_from_logits(logits, temperature) if sum_pi_squared else None
        # At temperature 1 half-precision logits go as they are: log_probs_from_logits upcasts them a row at a
        # time, instead of one float32 copy of the whole [B, R, V].
        logits = logits if temperature == 1.0 else scaled_logits(logits, temperature)
        log_probs = log_probs_from_logits(logits, micro_batch.response_ids)
        return log_probs if squares is None else torch.stack([log_probs, squares.to(log_probs.dtype)], -1)

    was_training = model.training
    model.eval()
    try:
        parts = run_pieces(score, plan.pieces, memory=memory)
    finally:
        model.train(was_training)
    scores = plan.restore(torch.cat(parts))
    if not sum_pi_squared:
        return ResponseScores(scores * batch.response_mask, None)
    return ResponseScores(scores[..., 0] * batch.response_mask, scores[..., 1] * batch.response_mask)


class Actor:
    """Owns the policy's weights, optimizer and learning-rate schedule."""

    def __init__(self, model: PreTrainedModel, config: ActorConfig, *, temperature: float, rollout_n: int,
                 log_prob_micro_batch_size: int, total_steps: int, seed: int, memory: WorkerMemory | None = None,
                 remove_padding: bool = False, log_prob_max_token_len: int | None = None,
                 ranks: Ranks | None = None, sequence_split: SequenceSplit | None = None,
                 rollout_correction: RolloutCorrectionConfig | None = None, fused_head: bool = False):
        self.model = model
        self.ranks = ranks  # several: the model is sharded and the batches are this rank's share
        self.sequence_split = sequence_split  # Ulysses: every forward on this rank's slice of the sequences
        # The memory manager's side for this model: its optimizer, dynamic offload between
        # micro-batches and relief after an out-of-memory error. None: plain AdamW, errors propagate.
        self.memory = memory
        self.config = config
        # algorithm.rollout_correction: bypass mode's loss corrects for the rollout itself (policy_losses.py).
        self.rollout_correction = rollout_correction or RolloutCorrectionConfig()
        self.policy_loss = get_policy_loss(policy_loss_mode(config, self.rollout_correction))
        self.temperature = temperature
        self.rollout_n = rollout_n
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        # verl's model.use_remove_padding, and rollout.log_prob_max_token_len_per_gpu when
        # rollout.log_prob_use_dynamic_bsz (None: micro-batches of log_prob_micro_batch_size).
        self.remove_padding = remove_padding
        self.log_prob_max_token_len = log_prob_max_token_len
        if remove_padding:
            check_packable(model, KEYS.actor_rollout_ref.model.use_remove_padding)
        self.optimizer = (memory.build_optimizer(model, config.optim) if memory is not None
                          else build_optimizer(model, config.optim, fsdp_config=config.fsdp_config))
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.shuffle_generator = torch.Generator().manual_seed(seed) if config.shuffle else None
        # Fewer, larger micro-batches while the update streams layers (issue 14).
        self.merging = MicroBatchMerging(config.fsdp_config.merge_micro_batches)
        # actor.use_torch_compile: the update's log-prob and entropy chunks compiled on a GPU (verl's default).
        self.kernels = compiled_kernels() if config.use_torch_compile else EAGER_KERNELS
        # model.use_fused_kernels, where the model can (fused_head_blocker): log-probs and entropies from the hidden
        # states and the head's weight, never the [B, R, V] logits.
        self.fused_head = fused_head

    @property
    def _world_size(self) -> int:
        return self.ranks.world_size if self.ranks is not None else 1

    @property
    def mini_batch_size(self) -> int:
        return rank_mini_batch_size(self.config.ppo_mini_batch_size, self.rollout_n, self.ranks)

    def update_micro_batches(self, size: int) -> int:
        """Micro-batches an update of `size` sequences runs in per epoch while its layers stream."""
        return self.merging.micro_batches(size, self.mini_batch_size, self.config.ppo_micro_batch_size_per_gpu)

    def on_policy(self, size: int) -> bool:
        """Whether an update of `size` sequences is one optimizer step (one mini-batch, one epoch): its forwards all
        run on the weights that scored the old log-probs, so the loss takes its own log-probs, detached, as the old
        ones (verl's actor does the same), and the separate scoring pass is not needed."""
        return self.config.ppo_epochs == 1 and one_mini_batch(size, local_mini_batches(
            size, self.config.ppo_mini_batch_size, self.rollout_n, self.ranks))

    def compute_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        return self.score_responses(batch).log_probs

    def score_responses(self, batch: RolloutBatch, *, sum_pi_squared: bool = False) -> ResponseScores:
        """The old log-probs and, with `sum_pi_squared`, the policy's sum of squared probabilities per position."""
        return score_responses(self.model, batch, micro_batch_size=self.log_prob_micro_batch_size,
                               temperature=self.temperature, memory=self.memory,
                               remove_padding=self.remove_padding, max_token_len=self.log_prob_max_token_len,
                               sequence_split=self.sequence_split, ranks=self.ranks, sum_pi_squared=sum_pi_squared,
                               fused_head=self.fused_head)

    def update(self, batch: RolloutBatch) -> dict[str, list[float]]:
        """One PPO update over the batch; returns the micro-batch metrics under verl's actor/ names."""
        metrics = update_worker(self, batch, self._loss, self.shuffle_generator)
        # verl's names: the actor's own under actor/; rollout correction's keep their rollout_corr/.
        metrics = {key if "/" in key else f"actor/{key}": values for key, values in metrics.items()}
        metrics["actor/lr"] = [self.scheduler.get_last_lr()[0]]
        self.scheduler.step()
        return metrics

    def _loss(self, batch: RolloutBatch) -> tuple[torch.Tensor | dict[str, torch.Tensor], dict[str, float]]:
        """The micro-batch's loss by actor.policy_loss.loss_mode (policy_losses.py) with the entropy bonus and KL
        loss, over the tokens rollout correction kept; the policy loss apart where it aggregates its own way."""
        config = self.config
        log_probs, entropies = self._log_probs_and_entropy(batch)
        # No old log-probs: an on-policy update (on_policy), whose weights are the ones that would have scored them.
        old_log_probs = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
        mask = batch.training_mask
        policy = self.policy_loss(PolicyLossInputs(old_log_probs, log_probs, batch.advantages, mask,
                                                   config.loss_agg_mode, rollout_is_weights=batch.rollout_is_weights),
                                  config, self.rollout_correction)
        entropy = aggregate_loss(entropies, mask, config.loss_agg_mode)
        metrics = {"pg_loss": policy.loss, **policy.metrics, "entropy": entropy}
        if batch.rollout_log_probs is not None and not self.rollout_correction.bypass_mode:
            # As verl's actor: how far the policy being trained has moved from the one that sampled.
            drift = off_policy_metrics(log_probs.detach(), batch.rollout_log_probs, mask)
            metrics.update({f"rollout_corr/{key}": value for key, value in drift.items()})
        kl_loss = None
        if config.use_kl_loss:
            kl = kl_penalty(log_probs, batch.ref_log_probs, config.kl_loss_type)
            kl_loss = aggregate_loss(kl, mask, config.loss_agg_mode)
            metrics["kl_loss"] = kl_loss
        # One host read for every metric of the micro-batch.
        values = dict(zip(metrics, torch.stack([value.detach().float() for value in metrics.values()]).tolist(),
                          strict=True))
        if config.use_kl_loss:
            values["kl_coef"] = config.kl_loss_coef
        coefficients = {"entropy_coeff": config.entropy_coeff, "kl_loss_coef": config.kl_loss_coef}
        if policy.aggregation == config.loss_agg_mode:
            return actor_loss(policy.loss, entropy, kl_loss, **coefficients), values
        regularisers = actor_loss(torch.zeros_like(policy.loss), entropy, kl_loss, **coefficients)
        return {policy.aggregation: policy.loss, config.loss_agg_mode: regularisers}, values

    def _log_probs_and_entropy(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] log-probs and entropies of the responses under the policy at the sampling temperature."""
        # Without an entropy bonus the entropy is a metric only: computed without its graph, so its backward
        # computes no entropy gradient; the gradient is the same (it added zeros).
        entropy_graph = self.config.entropy_coeff != 0
        if self.sequence_split is not None:
            log_probs, entropies = self.sequence_split.log_probs_and_entropy(
                self.model, batch, self.temperature, entropy=True, entropy_graph=entropy_graph, kernels=self.kernels)
            assert entropies is not None
            return log_probs, entropies
        if self.fused_head:
            scores = response_logits(self.model, batch, remove_padding=self.remove_padding,
                                     fused=FusedScoring(self.temperature, entropy_graph))
            return scores[..., 0], scores[..., 1] if entropy_graph else scores[..., 1].detach()
        # Chunk by chunk in float32, keeping the logits as the model gave them (a fraction of the composed ops' memory).
        return log_probs_and_entropy_from_logits(response_logits(self.model, batch, remove_padding=self.remove_padding),
                                                 batch.response_ids, self.temperature, entropy_graph=entropy_graph,
                                                 kernels=self.kernels)

    def state_dict(self) -> dict:
        """Its optimizer's states (None when sharded: the checkpoint's DCP shards hold them), schedule and
        mini-batch shuffle."""
        return {"optimizer": None if self._world_size > 1 else self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "shuffle_generator": self.shuffle_generator.get_state() if self.shuffle_generator else None}

    def load_state_dict(self, state: dict) -> None:
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        restore_schedule(self.scheduler, self.optimizer, state["scheduler"])
        if self.shuffle_generator is not None and state["shuffle_generator"] is not None:
            self.shuffle_generator.set_state(state["shuffle_generator"])
