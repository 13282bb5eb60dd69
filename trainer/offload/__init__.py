"""Per-module-group CPU offload of parameters, gradients and optimizer states (docs/design.md, "The offload engine").

    engine = attach_offload(model, fsdp_config, device, role="actor")
    optimizer = engine.optimizer(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)
    log(engine.summary_lines())                    # "Embedding: OFFLOADED to CPU (1.02 GiB)", ...
    send(offload_message([engine], with_summary=True))  # an OffloadMessage (trainer/config/messages.py)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer.config import FSDPConfig
from trainer.config.messages import CopyCount, Direction, Group, OffloadMessage
from trainer.offload.copies import MAX_RECORDS_PER_DRAIN, CopyLog
from trainer.offload.engine import OffloadEngine
from trainer.offload.groups import GROUPS, UnsupportedModel
from trainer.offload.layout import HostMemoryError, format_bytes
from trainer.offload.optimizer import OffloadAdamW
from trainer.offload.options import OffloadOptions
from trainer.offload.update_split import UpdateMode

__all__ = ["GROUPS", "HostMemoryError", "OffloadAdamW", "OffloadEngine", "OffloadOptions", "UnsupportedModel",
           "UpdateMode", "attach_offload", "format_bytes", "offload_message", "update_mode", "updates_on_device"]


def attach_offload(model: nn.Module, fsdp_config: FSDPConfig, device: torch.device | str, *, role: str,
                   options: OffloadOptions | None = None, layers_on_gpu: int | None = None,
                   host_budget: int | None = None) -> OffloadEngine:
    """Place `model`'s module groups as `fsdp_config` says and return the engine that streams them.

    Call it instead of `model.to(device)`, after the model is built (and frozen, for the reference
    and reward models). Groups placed on the GPU move there; the others move into pinned host
    memory. Build the model's optimizer with `engine.optimizer(...)`. With dynamic offload,
    `layers_on_gpu` (see dynamic.layers_that_fit) keeps only the first ones on the GPU at the start.
    With `host_budget` (host memory free now, besides what the model's weights hold: packing gives
    that back), a placement that would need more host memory (OffloadEngine.host_bytes) raises
    HostMemoryError before allocating any.
    """
    return OffloadEngine(
        model,
        {group: fsdp_config.placement(group) for group in GROUPS},
        torch.device(device),
        role=role,
        optimizer_offload=fsdp_config.optimizer_offload,
        options=options or OffloadOptions(),
        layer_classes=fsdp_config.wrap_policy.transformer_layer_cls_to_wrap,
        dynamic_layers=fsdp_config.dynamic_offload.enabled,
        layers_on_gpu=layers_on_gpu,
        host_budget=host_budget,
        host_grad_dtype=torch.bfloat16 if fsdp_config.offload_grad_dtype == "bf16" else None,
        delayed_update=fsdp_config.delayed_update,
        optimizer_update=update_mode(fsdp_config, torch.device(device)),
    )


def update_mode(fsdp_config: FSDPConfig, device: torch.device) -> UpdateMode:
    """Where an offloaded optimizer's update runs (fsdp_config.optimizer_update). "auto" is both paths at once on a
    GPU (the device's over states streamed through the bus, and the host's cores: they use different resources,
    so their split ends sooner than either alone), with or without a delayed update, and the host's alone on a CPU.
    Measured on an H200 (2026-12-04, benchmarks/README.md), once merged micro-batches had taken the gradients'
    adding off the host's cores during the update: a 7B GRPO step 4.85 s with both against 5.47 s on the device
    path alone, a 3B PPO step with a critic 3.92 against 3.95 s (before, 2026-12-02/03, the two were inside each
    other's noise at 3B and "both" was 0.46 s slower once). Under a delayed update, which runs beside the
    rollout's decoding, both against the host alone in one run (2026-12-04 13:40): 7B GRPO 3.97 against 4.80 s
    (old_log_prob, the first read that needs the update, waited 0.25 s for it against 1.48 s), 3B PPO 3.11
    against 3.38 s."""
    if fsdp_config.optimizer_update == "auto":
        return "both" if device.type == "cuda" else "cpu"
    return fsdp_config.optimizer_update


def updates_on_device(fsdp_config: FSDPConfig, device: torch.device) -> bool:
    """Whether any of an offloaded optimizer's update runs on the compute device (optimizer_update gpu or both)."""
    return update_mode(fsdp_config, device) != "cpu"


def offload_message(engines: Sequence[OffloadEngine], *, with_summary: bool,
                    plans: Sequence[dict[str, object]] | None = None, logs: Sequence[CopyLog] = ()) -> OffloadMessage:
    """The OffloadMessage for all of a run's engines and the other copy `logs` (HostAdamW's, on several ranks):
    the timed copies drained since the last call, at most MAX_RECORDS_PER_DRAIN of them in all (the rest folded
    per direction and group), the count and bytes of every copy since the last call, the placement summary of
    every role when `with_summary`, and the phases' `plans` of the dynamic layers (MemoryManager.plan_rows) when
    given.

    The engines report plain rows; they become the message's models here, validated in one call
    (pydantic's compiled validator: about 30% cheaper than building each row's model in Python).
    """
    budget = MAX_RECORDS_PER_DRAIN // max(1, len(engines) + len(logs))
    counts: dict[tuple[Direction, Group], CopyCount] = {}
    for rows in [engine.drain_copy_counts() for engine in engines] + [log.drain_counts() for log in logs]:
        for row in rows:
            count = CopyCount.model_validate(row)
            before = counts.get((count.direction, count.group))
            if before is not None:  # several models copy the same groups: one row each for the daemon
                count = CopyCount(direction=count.direction, group=count.group, copies=before.copies + count.copies,
                                  bytes=before.bytes + count.bytes)
            counts[(count.direction, count.group)] = count
    return OffloadMessage.model_validate({
        "copies": [copy for engine in engines for copy in engine.drain_copy_stats(budget)]
                  + [copy for log in logs for copy in log.drain(budget)],
        "counts": list(counts.values()),
        "summary": [row for engine in engines for row in engine.summary()] if with_summary else None,
        "plans": list(plans) if plans is not None else None,
    })
