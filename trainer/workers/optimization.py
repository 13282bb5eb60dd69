"""What the actor and critic updates share: the forward over responses, AdamW with warm-up,
and the mini-batch / micro-batch loop with gradient accumulation."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from trainer.config import OptimConfig
from trainer.offload import offload_engine
from trainer.rollout.batch import RolloutBatch

LossFn = Callable[[RolloutBatch], tuple[torch.Tensor, dict[str, float]]]


def response_logits(model: PreTrainedModel, batch: RolloutBatch) -> torch.Tensor:
    """[B, R, ...] the model's output at the positions that predict (or value) each response token."""
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    prompt_length = batch.prompt_ids.shape[1]
    response_length = batch.response_ids.shape[1]
    # Position t predicts token t + 1: the last prompt position predicts the first response token.
    return output.logits[:, prompt_length - 1: prompt_length - 1 + response_length]


def build_optimizer(model: PreTrainedModel, config: OptimConfig) -> torch.optim.AdamW:
    engine = offload_engine(model)
    if engine is not None:
        # Per-layer parameter groups, and the update on the CPU when optimizer_offload is set.
        return engine.optimizer(lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def warmup_steps(config: OptimConfig, total_steps: int) -> int:
    if config.lr_warmup_steps >= 0:
        return config.lr_warmup_steps
    return int(config.lr_warmup_steps_ratio * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int):
    """Linear warm-up, then constant or cosine decay to min_lr_ratio; stepped once per training step."""
    warmup = warmup_steps(config, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if config.warmup_style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run_updates(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    loss_fn: LossFn,
    *,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    grad_clip: float,
    shuffle_generator: torch.Generator | None,
) -> dict[str, list[float]]:
    """PPO's inner loop: `epochs` passes, one optimizer step per mini-batch of `mini_batch_size`
    sequences, gradients accumulated over micro-batches. Returns every micro-batch's metrics."""
    metrics: dict[str, list[float]] = defaultdict(list)
    model.train()
    for _ in range(epochs):
        order = (torch.randperm(len(batch), generator=shuffle_generator) if shuffle_generator is not None
                 else torch.arange(len(batch)))
        for mini_batch in batch.select(order).split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            for micro_batch in mini_batch.split(micro_batch_size):
                loss, micro_metrics = loss_fn(micro_batch)
                # Weight each micro-batch by its share of the mini-batch: the sum is the mini-batch mean.
                (loss * (len(micro_batch) / len(mini_batch))).backward()
                for key, value in micro_metrics.items():
                    metrics[key].append(value)
            # The offload optimizer clips inside its update (one read of CPU-resident gradients).
            clip = getattr(optimizer, "clip_grad_norm_", None)
            grad_norm = clip(grad_clip) if clip is not None else torch.nn.utils.clip_grad_norm_(
                model.parameters(), grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                # A non-finite gradient would poison the weights and every later step.
                metrics["skipped_steps"].append(1.0)
            metrics["grad_norm"].append(grad_norm.item())
    optimizer.zero_grad(set_to_none=True)
    return metrics
