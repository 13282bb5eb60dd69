"""AdamW of an offloaded unit on the compute device, over its masters and states streamed from pinned host memory.

The CPU update is bound by the host's memory: about 28 bytes a parameter read and written (fp32 master,
both moments, the gradient, the bf16 arena copy). On the H200 machine (16 cores) a 3B actor's update took
1.4 s alone and 2.4 s beside the critic's (2026-12-02), and the next rollout waits for it: it was most of
what an offloaded PPO step spent above the all-GPU step (issue 14). The same update on the GPU moves
14 bytes a parameter each way over PCIe (master, moments and gradient up; master, moments and the new
compute-dtype weights down), both directions at once: about 0.8 s for 3B at 55 GB/s, on the copy engines
and the GPU, so it does not take the host's cores from the other model's update either.

Each tensor goes in slices through a ring of device buffers: the copies up and the update run on one
stream, the copies down on another, so a slice's way up overlaps the previous slice's way down. The
update is torch's fused AdamW kernel (the one `torch.optim.AdamW(fused=True)` runs), with the same state
layout (step, exp_avg, exp_avg_sq) as the CPU path, so checkpoints move between the two.

On a CPU compute device the "device" is the CPU: the same code copies CPU to CPU, which lets the suite
check its bookkeeping and values against the host path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.offload.copies import CopyLog, pinned_empty
from trainer.offload.units import Unit, standalone

DEVICE_UPDATE_SLICE_ELEMENTS = 1 << 22
"""Elements of a tensor updated on the device at a time: 4 Mi elements move 56 MiB each way (about 1 ms at
55 GB/s), long enough that the few kernel launches of a slice (about 10) cost little beside the copies."""
DEVICE_UPDATE_BUFFERS = 3
"""Slices on their way at once (the ring of device buffers): one going up, one being updated, one coming down."""


@dataclass(eq=False)
class _SliceBuffers:
    """Device memory for one slice: the master, both moments, the gradient as it came and in fp32, the new weights."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    grad_wide: torch.Tensor | None
    weight: torch.Tensor | None
    free: torch.cuda.Event | None
    """Recorded once the slice's way down has read the buffers."""


class DeviceUpdate:
    """Runs the fused AdamW of offloaded units on `device`, one unit at a time (from the engine's device-update
    worker, a thread of its own, so that the host worker may update other units at the same time)."""

    def __init__(self, device: torch.device, log: CopyLog, *, master_dtype: torch.dtype, grad_dtype: torch.dtype,
                 compute_dtype: torch.dtype, slice_elements: int = DEVICE_UPDATE_SLICE_ELEMENTS,
                 buffers: int = DEVICE_UPDATE_BUFFERS):
        self.device, self.log = device, log
        self.cuda = device.type == "cuda"
        self.master_dtype, self.grad_dtype, self.compute_dtype = master_dtype, grad_dtype, compute_dtype
        self.slice_elements, self.buffer_count = slice_elements, buffers
        self.up = torch.cuda.Stream(device) if self.cuda else None
        self.down = torch.cuda.Stream(device) if self.cuda else None
        self._ring: list[_SliceBuffers] = []
        self._turn = 0
        self._grad_scale: tuple[torch.Tensor, torch.Tensor] | None = None  # (the host's, its device copy)

    def device_bytes(self) -> int:
        """Device memory the ring holds once the first update has made it."""
        return self.buffer_count * self.slice_elements * self._bytes_per_element()

    def bytes_each_way(self) -> int:
        """Bytes an element of a unit crosses the bus each way: up the master, both moments and the gradient;
        down the three and the new weights in the compute dtype (the larger of the two: they overlap)."""
        moments_and_master = 3 * self.master_dtype.itemsize
        return max(moments_and_master + self.grad_dtype.itemsize, moments_and_master + self.compute_dtype.itemsize)

    def _bytes_per_element(self) -> int:
        wide = self.master_dtype.itemsize if self.grad_dtype != self.master_dtype else 0
        weight = self.compute_dtype.itemsize if self.compute_dtype != self.master_dtype else 0
        return 3 * self.master_dtype.itemsize + self.grad_dtype.itemsize + wide + weight

    def release(self) -> None:
        """Give the ring's device memory back (it is made again at the next update)."""
        if self.down is not None:
            self.down.synchronize()
        self._ring = []
        self._grad_scale = None

    # -------------------------------------------------------------------------------- a unit

    @torch.no_grad()  # (the worker thread's own grad mode)
    def step_unit(self, unit: Unit, parameters: Sequence[torch.Tensor], states: Sequence[dict[str, Any]],
                  group: dict[str, Any], grad_scale: torch.Tensor | None, to_arena: bool) -> set[int]:
        """One AdamW step of `parameters` (the unit's masters with a gradient) whose states are `states`
        (each made already, its step count already advanced): the masters and moments come up, are updated
        and go back in place; with `to_arena`, the new weights in the compute dtype go into the unit's arena
        too. Returns the entries whose arena it wrote. Returns once everything is back on the host."""
        # Everything made on the device here is made on the stream that reads it: made on the worker thread's
        # default stream (the main thread's too), a fill could still wait behind the trainer's kernels when the
        # update reads it, and its memory could be handed out again before that read.
        with torch.cuda.stream(self.up) if self.up is not None else contextlib.nullcontext():
            beta1, beta2 = group["betas"]
            scale = self._device_grad_scale(grad_scale)
            written: set[int] = set()
            last: torch.cuda.Event | None = None
            steps = []  # held until the unit's last slice is back: their memory stays the kernel's
            for parameter, state in zip(parameters, states, strict=True):
                index = unit.index_of(parameter)
                arena = unit.arena_view(index).view(-1) if to_arena else None
                # The step count on the device, made there (a fill, no copy): the kernel reads it from device memory.
                steps.append(torch.full((), float(state["step"]), dtype=torch.float32, device=self.device))
                assert parameter.grad is not None, "the update is given only masters with a gradient"
                flat = [tensor.view(-1) for tensor in (parameter, state["exp_avg"], state["exp_avg_sq"],
                                                       parameter.grad)]
                for start in range(0, parameter.numel(), self.slice_elements):
                    length = min(self.slice_elements, parameter.numel() - start)
                    host = [tensor[start:start + length] for tensor in flat]
                    last = self._slice(unit.group, host, None if arena is None else arena[start:start + length],
                                       steps[-1], scale, group, beta1, beta2)
                if arena is not None:
                    written.add(index)
            if last is not None:
                last.synchronize()
        return written

    def _slice(self, group_name: str, host: list[torch.Tensor], arena: torch.Tensor | None, step: torch.Tensor,
               grad_scale: torch.Tensor | None, group: dict[str, Any], beta1: float, beta2: float,
               ) -> torch.cuda.Event | None:
        master, exp_avg, exp_avg_sq, grad = host
        length = master.numel()
        buffers = self._next_buffers()
        device = [tensor[:length] for tensor in (buffers.master, buffers.exp_avg, buffers.exp_avg_sq, buffers.grad)]
        if self.up is not None and buffers.free is not None:
            self.up.wait_event(buffers.free)
        up_bytes = sum(tensor.numel() * tensor.element_size() for tensor in host)
        computed = self.log.timed("h2d", group_name, up_bytes, self.up, lambda: self._up_and_update(
            device, host, buffers, length, step, grad_scale, group, beta1, beta2))
        if self.down is not None and computed is not None:
            self.down.wait_event(computed)
        down_bytes = sum(tensor.numel() * tensor.element_size() for tensor in host[:3])
        if arena is not None:
            down_bytes += arena.numel() * arena.element_size()
        end = self.log.timed("d2h", group_name, down_bytes, self.down,
                             lambda: self._down(device, host, buffers, length, arena))
        if buffers.free is not None and self.down is not None:
            buffers.free.record(self.down)
        return end

    def _up_and_update(self, device: list[torch.Tensor], host: list[torch.Tensor], buffers: _SliceBuffers,
                       length: int, step: torch.Tensor, grad_scale: torch.Tensor | None, group: dict[str, Any],
                       beta1: float, beta2: float) -> None:
        for target, source in zip(device, host, strict=True):
            target.copy_(source, non_blocking=True)
        master, exp_avg, exp_avg_sq, grad = device
        if buffers.grad_wide is not None:
            grad = buffers.grad_wide[:length].copy_(grad)
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False, lr=group["lr"],
                            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            maximize=False, grad_scale=grad_scale, found_inf=None)
        if buffers.weight is not None:
            buffers.weight[:length].copy_(master)

    @staticmethod
    def _down(device: list[torch.Tensor], host: list[torch.Tensor], buffers: _SliceBuffers, length: int,
              arena: torch.Tensor | None) -> None:
        for target, source in zip(host[:3], device[:3], strict=True):
            target.copy_(source, non_blocking=True)
        if arena is not None:
            arena.copy_(buffers.weight[:length] if buffers.weight is not None else device[0], non_blocking=True)

    def _next_buffers(self) -> _SliceBuffers:
        if not self._ring:
            self._ring = [self._buffers() for _ in range(self.buffer_count)]
        buffers = self._ring[self._turn % len(self._ring)]
        self._turn += 1
        return buffers

    def _buffers(self) -> _SliceBuffers:
        def empty(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(self.slice_elements, dtype=dtype, device=self.device)

        wide = empty(self.master_dtype) if self.grad_dtype != self.master_dtype else None
        weight = empty(self.compute_dtype) if self.compute_dtype != self.master_dtype else None
        return _SliceBuffers(empty(self.master_dtype), empty(self.master_dtype), empty(self.master_dtype),
                             empty(self.grad_dtype), wide, weight, torch.cuda.Event() if self.cuda else None)

    def _device_grad_scale(self, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The clipping's divisor on the device, copied once per optimizer step (the kernel reads it there)."""
        if grad_scale is None:
            return None
        if self._grad_scale is None or self._grad_scale[0] is not grad_scale:
            self._grad_scale = (grad_scale, grad_scale.to(self.device))
        return self._grad_scale[1]


def pinned_states(states: Sequence[dict[str, Any]], device: torch.device) -> None:
    """Move AdamW's moments in `states` into one page-locked buffer (when `device` is a GPU), unless they are
    there: copies from pageable memory run at a sixth of the speed and are not asynchronous. Made once per unit
    (the first update, or after a checkpoint's states were loaded, which torch makes in ordinary memory)."""
    if device.type != "cuda":
        return
    moments = [(state, key) for state in states for key in ("exp_avg", "exp_avg_sq")
               if not state[key].is_pinned()]
    if not moments:
        return
    total = sum(state[key].numel() * state[key].element_size() for state, key in moments)
    buffer = pinned_empty(total, device)
    offset = 0
    for state, key in moments:
        tensor = state[key]
        pinned = standalone(buffer, offset, tensor.shape, tensor.dtype)
        pinned.copy_(tensor)
        state[key] = pinned
        offset += tensor.numel() * tensor.element_size()
