"""The copies FSDP2 makes of the local shards a rank keeps on the CPU, counted and a sample timed, for the per-rank
offload report.

A unit whose shards live on the CPU (CPUOffloadPolicy at `fully_shard`, or moved there by dynamic offload,
layer_moves.py) has each shard copied up to the device before every all-gather: at each forward, each backward
that gathers again, each decoded token. Those are most of a rank's copies between the host and the device, and
the per-rank offload report (`verl_offload_copy_duration_seconds`, `verl_offload_copies_total` with a `rank`
label; the advisor's check of ranks whose copy times drift apart) needs them beside HostAdamW's.

FSDP2 makes that copy in `FSDPParam.all_gather_inputs`, on its all-gather copy-in stream, for every offloaded
parameter (the foreach fast path takes only parameters on the device). Each FSDPParam of a watched model becomes
an instance of a subclass whose `all_gather_inputs` runs FSDP2's own through a CopyLog, the offload engine's: every
copy counted by direction and group, one in a stride timed with CUDA events on that stream. Written against
FSDP2's FSDPParam because torch has no hook around its copies.

The gradient shards' copies down after each reduce-scatter (one per offloaded parameter a backward, made in FSDP2's
foreach_reduce) are counted, not timed: each unit's parameter group's `post_backward` is wrapped, and the shards it
reduced count once it returns. A hook on the gradient would see them one by one, but FSDP2 overlaps the copy with
the backward only while no such hook exists, and nothing here can time a copy FSDP2 queues itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

from trainer.distributed.layer_moves import fsdp_param_groups, fsdp_params_of
from trainer.offload.copies import D2H, H2D, CopyLog


class _CountedFSDPParam(FSDPParam):
    """An FSDPParam whose copy of an offloaded shard to the device goes through a CopyLog."""

    copies: CopyLog
    copy_group: str

    @property
    def all_gather_inputs(self) -> list[torch.Tensor]:  # type: ignore[override]
        gather_inputs = FSDPParam.all_gather_inputs.fget  # type: ignore[attr-defined]
        if not self.offload_to_cpu or self.sharded_state != ShardedState.SHARDED:
            return gather_inputs(self)
        data = self._sharded_param_data
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        result: list[Any] = []
        self.copies.timed(H2D, self.copy_group, data.numel() * data.element_size(), stream,
                          lambda: result.append(gather_inputs(self)))
        return result[0]


def watch_shard_copies(model: nn.Module, copies: CopyLog, groups: Mapping[int, str]) -> None:
    """Count (and time a sample of) the copies up of sharded `model`'s offloaded shards in `copies`, and count the
    copies down of their gradient shards, each under its parameter's group (`groups`: by the sharded parameter's id,
    groups.parameter_groups; else "other")."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for fsdp_param in fsdp_params_of(module):
            if type(fsdp_param) is FSDPParam:
                fsdp_param.__class__ = _CountedFSDPParam
            fsdp_param.copies = copies
            fsdp_param.copy_group = groups.get(id(fsdp_param.sharded_param), "other")
        for param_group in fsdp_param_groups(module):
            _count_gradient_copies(param_group, copies)


def _count_gradient_copies(param_group: Any, copies: CopyLog) -> None:
    """Wrap `param_group`'s post_backward so that the gradient shards it reduces to the host count as copies down."""
    if getattr(param_group, "_counts_gradient_copies", False):
        return
    post_backward = param_group.post_backward

    def counted(*args: Any) -> Any:
        # The parameters FSDP2's post_backward reduces: those with a gradient of this backward (or one accumulated
        # unreduced), as it picks them.
        sent = [fsdp_param for fsdp_param in param_group.fsdp_params
                if fsdp_param.offload_to_cpu and hasattr(fsdp_param, "_unsharded_param")
                and (fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.unsharded_param.grad is not None)]
        result = post_backward(*args)
        if param_group.reduce_grads:
            for fsdp_param in sent:
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    local = grad.to_local() if hasattr(grad, "to_local") else grad
                    copies.count(D2H, getattr(fsdp_param, "copy_group", "other"), local.numel() * local.element_size())
        return result

    param_group.post_backward = counted
    param_group._counts_gradient_copies = True
