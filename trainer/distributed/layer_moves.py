"""Dynamic offload on several ranks: a sharded model's decoder layers move their local shards between the device
and the host as the rank's own memory asks.

Each rank's memory manager (trainer/memory.py) plans and moves layers from its own device's memory, as one rank's
does for its offload engine: over the live threshold layers leave the GPU, least used model first; each phase's
plan brings back what fits. The ranks need not agree: a unit's local shard is copied up before each all-gather
wherever it lives, so ranks whose shards live in different places gather the same weights (a rank with less free
memory keeps fewer layers, and the advisor reports the imbalance in copy times).

FSDP2 decides at `fully_shard` where a unit's shards live (CPUOffloadPolicy), but reads that decision at every
gather and reduce-scatter from each FSDPParam's own `offload_to_cpu`: a shard on the CPU is copied up before its
all-gather, its gradient copied down after its reduce-scatter. Moving a unit therefore moves each of its shards (its
padded flat storage, `_sharded_param_data`, and the DTensor parameter viewing it), the shard's gradient if one is
being accumulated, and the optimizer's states of it (torch's AdamW steps a parameter where its states are;
HostAdamW keeps them on the CPU anyway), then flips the flags. The parameter keeps its identity
(`torch.utils.swap_tensors`, what `nn.Module.to()` does for tensor subclasses), so the optimizer, the module and
FSDP2 still hold the same object. Written against FSDP2's FSDPParam attributes because torch has no public way to
change a unit's offload policy after `fully_shard` (torch 2.11 and 2.13 checked by the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.distributed.host_adamw import shard_like


def fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """The unit's FSDPParamGroups (one a unit in torch 2.11, a list of them in 2.13; none without parameters)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def fsdp_params_of(unit: FSDPModule) -> list[Any]:
    """The unit's FSDPParams (FSDP2's per-parameter records, in its parameter groups)."""
    return [fsdp_param for group in fsdp_param_groups(unit) for fsdp_param in group.fsdp_params]


def _moved_dtensor(tensor: DTensor, device: torch.device) -> DTensor:
    return shard_like(tensor._local_tensor.to(device), tensor)


class ShardedLayers:
    """A sharded model's decoder layers (`layers`: its FSDP2 units, Sharded.parts.layers) as the memory manager moves
    them (the same surface as an offload engine's: role, layers_on_gpu, transformer_units, layer_bytes, moves,
    set_transformer_layers_on_gpu). The first `layers_on_gpu` layers keep their shards on the device, the others on
    the host (pinned beside a GPU)."""

    ring_slots = 0
    """Streamed layers take no slots of their own: FSDP2 gathers each into memory it frees after the forward."""

    def __init__(self, role: str, layers: Sequence[nn.Module], device: torch.device, *,
                 optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None):
        self.role, self.device = role, device
        self.transformer_units: list[FSDPModule] = [layer for layer in layers if isinstance(layer, FSDPModule)]
        self.optimizer = optimizer  # read at each move: built after the model is placed
        self._on_device = [all(not fsdp_param.offload_to_cpu for fsdp_param in fsdp_params_of(unit))
                           for unit in self.transformer_units]
        self.layer_bytes = max((sum(fsdp_param._sharded_param_data.numel()
                                    * fsdp_param._sharded_param_data.element_size()
                                    for fsdp_param in fsdp_params_of(unit)) for unit in self.transformer_units),
                               default=0)
        """Device bytes one layer's local shards take (what moving one frees or takes on this rank)."""
        self.moves = {"to_cpu": 0, "to_gpu": 0}

    @property
    def layers_on_gpu(self) -> int:
        return sum(self._on_device)

    def stageable_bytes(self, phase: str | None = None) -> dict[str, int]:
        """Groups a phase could copy to the device whole: none (FSDP2 gathers them; trainer/distributed/sharding.py's
        whole weights do that for a phase without gradients)."""
        return {}

    def set_transformer_layers_on_gpu(self, count: int) -> tuple[int, int]:
        """Keep the first `count` layers' shards on the device and the others' on the host, at a safe point (no
        forward or backward in flight); returns the layers moved (to the CPU, to the GPU)."""
        count = max(0, min(count, len(self.transformer_units)))
        to_cpu = to_gpu = 0
        for index, unit in enumerate(self.transformer_units):
            wanted = index < count
            if wanted == self._on_device[index]:
                continue
            self._move(unit, to_device=wanted)
            self._on_device[index] = wanted
            to_gpu += wanted
            to_cpu += not wanted
        self.moves["to_cpu"] += to_cpu
        self.moves["to_gpu"] += to_gpu
        return to_cpu, to_gpu

    @torch.no_grad()
    def _move(self, unit: FSDPModule, *, to_device: bool) -> None:
        target = self.device if to_device else torch.device("cpu")
        pinned = not to_device and self.device.type == "cuda"
        optimizer = self.optimizer()
        for fsdp_param in fsdp_params_of(unit):
            old: nn.Parameter = fsdp_param.sharded_param
            data = fsdp_param._sharded_param_data
            flat = torch.empty(data.shape, dtype=data.dtype, device=target, pin_memory=pinned)
            flat.copy_(data)
            dim = fsdp_param.fsdp_placement.dim
            local = flat.view(fsdp_param.padded_sharded_param_size).narrow(dim, 0, old._local_tensor.size(dim))
            new = nn.Parameter(shard_like(local, old), requires_grad=old.requires_grad)
            if old.grad is not None:  # a mini-batch's gradient still adding up across micro-batches
                new.grad = _moved_dtensor(old.grad, target)
            torch.utils.swap_tensors(old, new)  # `old` is the moved parameter now, still the object everyone holds
            fsdp_param._sharded_param_data = flat.view(-1)
            fsdp_param.offload_to_cpu = not to_device
            fsdp_param.pin_memory = pinned
            state = optimizer.state.get(old) if optimizer is not None else None
            if state and not getattr(optimizer, "states_on_cpu", False):
                for key, value in list(state.items()):
                    if isinstance(value, DTensor) and value._local_tensor.device != target:
                        state[key] = _moved_dtensor(value, target)
                    elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != target:
                        state[key] = value.to(target)
