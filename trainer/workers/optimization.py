"""What the actor and critic updates share: the forward over responses, AdamW with warm-up,
and the mini-batch / micro-batch loop with gradient accumulation."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from trainer.algorithms import LOSS_AGG_MODES, aggregation_weight
from trainer.config import ActorConfig, CriticConfig, FSDPConfig, OptimConfig
from trainer.data.sampler import rank_mini_batches
from trainer.distributed.host_adamw import HostAdamW
from trainer.distributed.ranks import Ranks
from trainer.models.fused_head import FusedScoring
from trainer.models.vision_language import forward_inputs
from trainer.offload import OffloadEngine
from trainer.offload.groups import find_parts, parameter_groups
from trainer.rollout.batch import RolloutBatch
from trainer.workers.merging import MicroBatchMerging
from trainer.workers.packing import packed_response_outputs, plan_micro_batches, takes_logits_to_keep
from trainer.workers.recovery import Piece, WorkerMemory, retry_out_of_memory

LossFn = Callable[[RolloutBatch], tuple[torch.Tensor | dict[str, torch.Tensor], dict[str, float]]]
"""A micro-batch's loss and metrics. The loss is a mean by the update's loss_agg_mode, or a dict of losses by the
loss_agg_mode each is a mean by (a policy loss that aggregates its own way, beside the entropy and KL terms)."""
MaskOf = Callable[[RolloutBatch], torch.Tensor]
"""The [B, R] tokens a batch's loss reads (what its aggregation divides by)."""


def response_logits(model: PreTrainedModel, batch: RolloutBatch, *, remove_padding: bool = False,
                    fused: FusedScoring | None = None) -> torch.Tensor:
    """[B, R, ...] the model's output at the positions that predict (or value) each response token; with
    `remove_padding`, from one padding-free forward over the real tokens (zeros where responses are padding). With
    `fused` (use_fused_kernels; not for a vision-language model), [B, R, 2]: each response token's log-prob and
    the entropy there, from the fused head (trainer/models/fused_head.py), never the logits."""
    if batch.multi_modal_inputs is not None:
        assert fused is None, "a vision-language model's forward is not fused (fused_head_blocker)"
        return vision_response_logits(model, batch)
    if remove_padding:
        return packed_response_outputs(model, batch, fused=fused)
    response_length = batch.response_ids.shape[1]
    # Only the last response_length + 1 positions go through the head: the prompt's [P, V] logits are never read.
    kept = takes_logits_to_keep(model)
    kept_positions = response_length + 1 if kept else 0
    with fused.around(model, batch.input_ids, kept_positions) if fused else contextlib.nullcontext():
        output = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
            **({"logits_to_keep": response_length + 1} if kept else {}),
        )
    # Position t predicts token t + 1: the last prompt position predicts the first response token.
    first = output.logits.shape[1] - response_length - 1
    return output.logits[:, first: first + response_length]


def vision_response_logits(model: PreTrainedModel, batch: RolloutBatch) -> torch.Tensor:
    """[B, R, V] a vision-language model's logits that predict each response token, from a padded forward with the
    rows' images (a padding-free one would need the multimodal RoPE positions per packed sequence: verl computes
    them itself; here the model does, from the padded rows); the position ids are the model's own."""
    assert batch.multi_modal_inputs is not None
    response_length = batch.response_ids.shape[1]
    input_ids = batch.input_ids
    output = model(input_ids=input_ids, attention_mask=batch.attention_mask, use_cache=False,
                   logits_to_keep=response_length + 1, **forward_inputs(model, input_ids, batch.multi_modal_inputs))
    return output.logits[:, :response_length]


def build_optimizer(model: PreTrainedModel, config: OptimConfig, engine: OffloadEngine | None = None, *,
                    fsdp_config: FSDPConfig | None = None, background: bool = False) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters; `engine`'s when the model has one; for a sharded model whose
    `fsdp_config` asks for optimizer_offload, HostAdamW: its moments and arithmetic on the CPU, the parameters where
    they are (its copies recorded by the model's module groups). With `background` (the critic's) or the config's
    delayed_update, HostAdamW's host arithmetic runs in a thread of its own and `publish` applies it; with
    optimizer_update gpu or both, the update (both: part of it) runs on the device over moments streamed up and back
    (queued on the GPU: no thread needed)."""
    if engine is not None:
        # Per-layer parameter groups, and the update on the CPU when optimizer_offload is set.
        return engine.optimizer(lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if fsdp_config is not None and fsdp_config.optimizer_offload:
        parts = find_parts(model, fsdp_config.wrap_policy.transformer_layer_cls_to_wrap)
        # (delayed_update with the update on the GPU, gpu or both: refused at config load.)
        update = "cpu" if fsdp_config.optimizer_update == "auto" else fsdp_config.optimizer_update
        return HostAdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
                         groups=parameter_groups(parts), delayed=fsdp_config.delayed_update or background,
                         grad_dtype=torch.bfloat16 if fsdp_config.offload_grad_dtype == "bf16" else torch.float32,
                         update=update)
    return torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def publish_pending(optimizer: torch.optim.Optimizer | None) -> None:
    """A sharded model's HostAdamW update still computed in the background (delayed_update, the critic's) applied
    before anything reads the weights as updated; nothing for any other optimizer."""
    if isinstance(optimizer, HostAdamW):
        optimizer.publish()


def rank_mini_batch_size(ppo_mini_batch_size: int, rollout_n: int, ranks: Ranks | None) -> int:
    """Sequences per mini-batch on this rank: verl's global count of prompts, times rollout.n, shared among the
    data-parallel groups (the ranks of a sequence-parallel group hold the same share)."""
    return ppo_mini_batch_size * rollout_n // (ranks.dp_size if ranks is not None else 1)


def local_mini_batches(size: int, ppo_mini_batch_size: int, rollout_n: int, ranks: Ranks | None) -> int | list[int]:
    """This rank's mini-batches of an update of its `size` sequences: `rank_mini_batch_size` each, or where the step's
    sequences do not divide among the data-parallel groups (use_dynamic_bsz), this rank's share of each global
    mini-batch of ppo_mini_batch_size x rollout.n (data.rank_mini_batches, as distributed/run_wide.py dealt them).
    On several ranks a collective (the step's sequences, summed)."""
    even = rank_mini_batch_size(ppo_mini_batch_size, rollout_n, ranks)
    if ranks is None or not ranks.distributed:
        return even
    sequences = round(ranks.reduce_many([float(size)], "sum")[0]) // ranks.sp_size
    if sequences % ranks.dp_size == 0:
        return even
    return rank_mini_batches(sequences, ppo_mini_batch_size * rollout_n, ranks.dp_rank, ranks.dp_size)


def one_mini_batch(size: int, mini_batches: int | list[int]) -> bool:
    """Whether an update of `size` sequences in `mini_batches` (local_mini_batches) is one optimizer step."""
    return len(mini_batches) == 1 if isinstance(mini_batches, list) else size <= mini_batches


def warmup_steps(config: OptimConfig, total_steps: int) -> int:
    if config.lr_warmup_steps >= 0:
        return config.lr_warmup_steps
    # Whole steps of the fraction, as verl; rounding first keeps 0.29 * 100 (28.999999999999996) at 29.
    return math.floor(round(config.lr_warmup_steps_ratio * total_steps, 6))


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int):
    """Linear warm-up, then constant or verl's cosine (num_cycles waves, never below min_lr_ratio); stepped once
    per training step. The ramp is (step + 1) / (warmup + 1), not verl's step / warmup, which spends the
    first update at LR 0."""
    warmup = warmup_steps(config, total_steps)
    schedule = config.schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        # verl's get_cosine_schedule_with_warmup: with num_cycles 0.5 a half cosine from 1 to min_lr_ratio.
        wave = math.cos(math.pi * config.num_cycles * 2.0 * progress)
        return max(config.min_lr_ratio, config.min_lr_ratio + (1.0 - config.min_lr_ratio) * (1.0 + wave) / 2)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer,
                     state: dict) -> None:
    """Load a schedule saved with any number of parameter groups: one rank's offload engine keeps a group per
    layer, a sharded model one group, and every group follows the same schedule from the same learning rate.
    The optimizer's groups take the schedule's current rate."""
    scheduler.load_state_dict(state)
    groups = len(optimizer.param_groups)
    if len(scheduler.base_lrs) != groups:
        scheduler.base_lrs = [scheduler.base_lrs[0]] * groups
        scheduler._last_lr = [scheduler.get_last_lr()[0]] * groups
    for group, rate in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = rate


def run_updates(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    loss_fn: LossFn,
    *,
    mini_batch_size: int | list[int],
    micro_batch_size: int,
    epochs: int,
    grad_clip: float,
    shuffle_generator: torch.Generator | None,
    memory: WorkerMemory | None = None,
    max_token_len: int | None = None,
    loss_agg_mode: str = "token-mean",
    ranks: Ranks | None = None,
    merging: MicroBatchMerging | None = None,
    loss_mask: MaskOf | None = None,
) -> dict[str, list[float]]:
    """PPO's inner loop: `epochs` passes, one optimizer step per mini-batch of `mini_batch_size`
    sequences, gradients accumulated over micro-batches of `micro_batch_size` sequences or, with
    `max_token_len`, of at most that many real tokens (verl's use_dynamic_bsz). `loss_agg_mode`: how
    `loss_fn` aggregates, so that each micro-batch weighs its share. Returns each mini-batch's
    metrics (`mini_batch_metrics`), and "oom_recoveries": the CUDA out-of-memory errors it recovered from.

    With `memory` (the run's memory manager, for this model), a safe point comes before each
    micro-batch (nothing in flight: dynamic offload may move layers) and an out-of-memory error is
    recovered from (`accumulate_gradients`); without it, the error propagates.

    With several `ranks` (a model sharded with FSDP2), each rank's `batch` is its share of the global
    batch, mini-batch by mini-batch, and the gradient and its norm are the global batch's.

    With `merging` (and `memory`), a mini-batch whose update streams layers runs in fewer, larger micro-batches
    (MicroBatchMerging); the gradient is the same.

    `loss_mask`: the tokens `loss_fn` reads of a batch (None: its response_mask), whose counts weigh the micro-batches.

    `mini_batch_size` as a list: this rank's sequences in each mini-batch, where the ranks' shares are uneven
    (local_mini_batches); the micro-batches' metrics are then scaled so that the run's mean over the ranks, which
    weighs each rank by its sequences (metrics.combine_rank_metrics), is still the global mini-batch's value.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    recoveries = 0
    model.train()
    micro_keys: set[str] = set()
    for _ in range(epochs):
        order = (torch.randperm(len(batch), generator=shuffle_generator) if shuffle_generator is not None
                 else torch.arange(len(batch)))
        ordered = batch.select(order)
        mini_batches = (ordered.split(mini_batch_size) if isinstance(mini_batch_size, int)
                        else (ordered.select(range(start, start + size)) for start, size in
                              zip(itertools.accumulate([0, *mini_batch_size]), mini_batch_size, strict=False)))
        for mini_batch in mini_batches:
            publish_pending(optimizer)  # a delayed update lands before the next forward
            optimizer.zero_grad(set_to_none=True)
            size, budget = micro_batch_size, max_token_len
            if merging is not None and memory is not None:
                size, budget = merging.sizes(mini_batch, size, budget, memory.update_streams_layers())
            micro_metrics, recovered, fitting = accumulate_gradients(model, optimizer, mini_batch, loss_fn, size,
                                                                     memory=memory, max_token_len=budget,
                                                                     loss_agg_mode=loss_agg_mode, ranks=ranks,
                                                                     loss_mask=loss_mask)
            if merging is not None and fitting is not None:
                merging.ran_out_of_memory(fitting, budget, micro_batch_size, max_token_len)
            recoveries += recovered
            for key, values in micro_metrics.items():
                metrics[key].extend(values)
                micro_keys.add(key)
            # The offload optimizer clips inside its update (one read of CPU-resident gradients).
            clip = getattr(optimizer, "clip_grad_norm_", None)
            grad_norm = clip(grad_clip) if clip is not None else torch.nn.utils.clip_grad_norm_(
                model.parameters(), grad_clip)
            if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over every rank's shards
                grad_norm = grad_norm.full_tensor()
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                # A non-finite gradient would poison the weights and every later step.
                metrics["skipped_steps"].append(1.0)
            metrics["grad_norm"].append(grad_norm.item())
    optimizer.zero_grad(set_to_none=True)
    if isinstance(mini_batch_size, list) and ranks is not None and ranks.distributed:
        # Each rank's values are its micro-batches' shares of the global loss times the world size, whose plain mean
        # over the ranks is the global value; the run weighs rank r by its sequences s_r: S / (world x s_r) undoes it.
        sequences = ranks.reduce_many([float(len(batch))], "sum")[0]
        scale = sequences / (ranks.world_size * len(batch))
        for key in micro_keys:
            metrics[key] = [value * scale for value in metrics[key]]
    metrics["oom_recoveries"] = [float(recoveries)]
    return metrics


class UpdatedWorker(Protocol):
    """What `update_worker` reads of an actor or critic: its model and optimizer, its config's update keys (verl's
    ppo_* keys, which the two share) and where it runs."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    config: ActorConfig | CriticConfig
    rollout_n: int
    ranks: Ranks | None
    memory: WorkerMemory | None
    merging: MicroBatchMerging


def update_worker(worker: UpdatedWorker, batch: RolloutBatch, loss_fn: LossFn,
                  shuffle_generator: torch.Generator | None) -> dict[str, list[float]]:
    """`run_updates` by the worker's ppo_* keys (the actor's and the critic's are the same keys), its out-of-memory
    recoveries counted on its memory: the micro-batch metrics, unnamed."""
    config = worker.config
    metrics = run_updates(
        worker.model, worker.optimizer, batch, loss_fn,
        mini_batch_size=local_mini_batches(len(batch), config.ppo_mini_batch_size, worker.rollout_n, worker.ranks),
        micro_batch_size=config.ppo_micro_batch_size_per_gpu,
        epochs=config.ppo_epochs,
        grad_clip=config.grad_clip,
        shuffle_generator=shuffle_generator,
        memory=worker.memory,
        max_token_len=config.ppo_max_token_len_per_gpu if config.use_dynamic_bsz else None,
        loss_agg_mode=config.loss_agg_mode,
        ranks=worker.ranks,
        merging=worker.merging,
        loss_mask=lambda batch: batch.training_mask,
    )
    recovered = metrics.pop("oom_recoveries")
    if worker.memory is not None:
        worker.memory.count_recoveries(int(sum(recovered)))
    return metrics


def accumulate_gradients(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    mini_batch: RolloutBatch,
    loss_fn: LossFn,
    micro_batch_size: int,
    *,
    memory: WorkerMemory | None = None,
    max_token_len: int | None = None,
    loss_agg_mode: str = "token-mean",
    ranks: Ranks | None = None,
    loss_mask: MaskOf | None = None,
) -> tuple[dict[str, list[float]], int, int | None]:
    """The gradient of the mini-batch's loss, summed over micro-batches (of `micro_batch_size` sequences,
    or by token budget with `max_token_len`); its metrics (`mini_batch_metrics`), the out-of-memory errors
    recovered from, and the most sequences a micro-batch held after one was split (None: none was).

    Each micro-batch's loss weighs its share of what the mini-batch's loss is averaged over (its tokens
    for token-mean, its sequences for the seq-mean modes: `aggregation_weight`), so the gradient is the
    mini-batch's whole loss's, whatever the micro-batches.

    A CUDA out-of-memory error in a micro-batch does not end the run (recovery.retry_out_of_memory).
    A backward that failed half-way has already added to some gradients, so the whole mini-batch's
    are dropped and it is redone: with the same micro-batches once memory was relieved (the same
    result), otherwise with the failed micro-batch split in two (the same result, by the weighting above,
    metrics too: `mini_batch_metrics`). One sequence that does not fit with
    nothing left to free raises recovery.SequenceOutOfMemory, with its tokens.

    With several `ranks`, `mini_batch` is this rank's share: the weight it is divided by is the whole
    mini-batch's, all ranks' (verl's global token count), and FSDP2's average of the ranks' gradients is
    undone (times the world size), so that the sum of the ranks' gradients is one rank's on the whole.
    With Ulysses the S ranks of a sequence-parallel group hold the same share, so the weight summed over all
    ranks counts it S times; each rank's loss is the whole sequences' too, and the gathers' backward sums the
    group's S copies of its gradient onto each rank's positions: the two factors of S cancel, and the average
    is still the global batch's gradient (test_sequence_parallel_trainer.py checks it against one rank).

    A loss given as a dict of losses by their loss_agg_mode weighs each by its own mode's share (a policy loss that
    averages per sequence beside a token-mean entropy term); the metrics weigh by `loss_agg_mode`'s.
    """
    plan = plan_micro_batches(mini_batch, micro_batch_size, max_token_len,
                              agree=ranks.count_agreement if ranks is not None else None)
    arranged = plan.arrange(mini_batch)
    mask_of = loss_mask or (lambda batch: batch.response_mask)
    whole = _aggregation_weights(mask_of(mini_batch)).clamp(min=1)
    if ranks is not None and ranks.distributed:
        whole = ranks.sum_tensor(_aggregation_weights(mask_of(mini_batch))).clamp(min=1) / ranks.world_size

    def backward(piece: Piece) -> tuple[dict[str, float], float]:
        if memory is not None:
            memory.safe_point()
        micro_batch = arranged.select(torch.arange(piece.first, piece.first + piece.count))
        loss, micro_metrics = loss_fn(micro_batch)
        shares = _aggregation_weights(mask_of(micro_batch)) / whole
        if plan.is_filler(piece):  # a forward and backward to match another rank's count: it weighs nothing
            shares = shares * 0
        parts = loss if isinstance(loss, dict) else {loss_agg_mode: loss}
        total = sum((part * shares[LOSS_AGG_MODES.index(mode)] for mode, part in parts.items()),
                    start=torch.zeros((), device=shares.device))
        total.backward()
        return micro_metrics, float(shares[LOSS_AGG_MODES.index(loss_agg_mode)])

    def discard() -> None:
        """Drop a failed attempt's gradients (its pass released first: it may still land some)."""
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    def tokens(piece: Piece) -> tuple[int, int]:
        sequences = arranged.select(torch.arange(piece.first, piece.first + piece.count))
        return int(sequences.prompt_mask.sum()), int(sequences.response_real_mask.sum())

    with memory.accumulating() if memory is not None else contextlib.nullcontext():
        retried = retry_out_of_memory(backward, plan.pieces, memory, discard=discard, tokens=tokens)
    return mini_batch_metrics([result for _, result in retried.done]), retried.recoveries, retried.fitting


def _aggregation_weights(mask: torch.Tensor) -> torch.Tensor:
    """[len(LOSS_AGG_MODES)] what each loss_agg_mode's mean over `mask` divides by (`aggregation_weight`), in one
    tensor: on several ranks one collective sums them all."""
    return torch.stack([aggregation_weight(mask, mode).float() for mode in LOSS_AGG_MODES])


def mini_batch_metrics(done: list[tuple[dict[str, float], float]]) -> dict[str, list[float]]:
    """One entry per metric for a mini-batch: the sum of its micro-batches' values, each weighed by its share (the
    weight of its loss: the shares of one rank's mini-batch sum to 1). A loss is then the mini-batch's, whatever the
    micro-batches: the same whether they were merged (MicroBatchMerging), split after running out of memory, or as
    configured (their plain mean would weigh a micro-batch of few tokens as much as one of many: a PPO loss near 0
    changed sign with the split). With several ranks each rank's shares are of the global mini-batch's weight over
    the world size, so the mean over the ranks (metrics.combine_rank_metrics) is the global mini-batch's value."""
    sums: dict[str, float] = defaultdict(float)
    for values, share in done:
        for key, value in values.items():
            sums[key] += share * value
    return {key: [value] for key, value in sums.items()}
