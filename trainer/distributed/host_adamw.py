"""AdamW whose states and arithmetic live on the host while a sharded model's parameters stay on the device.

With several ranks, `optimizer_offload: true` without `param_offload` asks what one rank's engine does: AdamW's
states on the CPU, the weights the forward reads on the GPU. FSDP2's CPUOffloadPolicy cannot say that: it keeps a
unit's parameters, gradients and states together, on the CPU, and copies every shard up at every gather (each
forward, backward and decoded token). So the units stay on the device and this optimizer splits the update
(ZeRO-Offload's split, on FSDP2's local shards):

- each step copies a parameter's local gradient shard down into a (pinned) host buffer;
- the host updates AdamW's moments there and computes the step direction m̂ / (√v̂ + ε) into the same buffer;
- the direction goes up and the device applies AdamW's decoupled update to the shard it already holds:
  p ← p·(1 − lr·wd) − lr·direction.

One gradient copy down and one direction copy up per step, each 1/world of the model in fp32, and the device never
holds AdamW's moments (8 bytes a parameter). The parameters are the masters: a bf16 model's shards are fp32 under
FSDP2's MixedPrecisionPolicy (trainer/distributed/sharding.py), so nothing the update needs is on the host but the
moments. `state[p]` holds AdamW's own keys (step, exp_avg, exp_avg_sq in fp32, sharded as `p`, local tensors on
the CPU), so checkpoints are AdamW's and resume on any number of ranks.

With `delayed` (the actor's fsdp_config.delayed_update) a step only sends the gradients down: the host's arithmetic
runs in a thread of its own while the trainer goes on (the next rollout, which samples with the weights from before
the step), and `publish` applies the update; the next step, a state_dict and the next mini-batch publish first. The
critic's runs so always (trainer/workers/critic.py): its arithmetic beside the actor's update, published before the
next values, which is exact, since nothing reads the critic in between.

With `grad_dtype` bf16 (fsdp_config.offload_grad_dtype) each gradient shard, accumulated and reduced in fp32 on the
device, goes down in bf16: half the bytes down, into the first half of the parameter's fp32 buffer. The host widens
it in place a slice at a time from the last (each slice's bf16 bytes are read into a small scratch first: the first
slice's fp32 bytes cover them), just before the kernel reads the slice, while it is in the cache. The update is
AdamW's of the gradient rounded to bf16 once a step; one rank's engine keeps its host gradients in bf16 across the
micro-batches, so the two differ by that rounding. The direction still goes up in fp32.

With `update` "gpu" (fsdp_config.optimizer_update) the update runs where the shard is instead: each step streams the
moments up a slice at a time through a ring of device buffers, torch's fused AdamW updates the shard in place from
its gradient, and the moments stream back. The bus then carries the moments, 8 bytes an element each way, where the
host's update moves the gradient down and the direction up, 4 bytes each, and computes on the host's cores; the
device never holds more of the moments than the ring. With "both" each step splits the parameters between the two
(trainer/offload/update_split.py, as one rank's engine splits its units: each path's seconds per element learned
from the steps before): the host's gradients are queued down first, then the device's slices, and the host computes
while the GPU streams. `delayed` then defers the host's share alone: the device's changes the shards at once, so the
config refuses the actor's delayed_update with either (the rollout would read them); the critic's background update
takes it (nothing reads the critic before the next values publish it). There the split learns its window, from the
step to the `publish` that needs it, and gives the host what it ends within it (UpdateSplit.assign).

A unit kept on the CPU (param_offload) has its shards and gradients there already: the same arithmetic runs on
them with no copy. The copies go through a CopyLog, as the offload engine's do: counted per direction and group,
a sample timed with CUDA events, and sent to the daemon with each step's offload report (copy latency per rank).

Written by hand because torch's AdamW steps tensors on one device only (its states follow the parameters); the
arithmetic is torch.optim.AdamW's, equal to it to float32 rounding (tests/trainer/distributed/test_host_adamw.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from trainer.offload.copies import CopyLog
from trainer.offload.units import UPDATE_SLICE_ELEMENTS
from trainer.offload.update_split import UpdateMode, UpdateSplit, UpdateTiming

Sent = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.cuda.Event | None]
"""A gradient on its way down: (parameter, its fp32 host buffer, the bf16 view of that buffer's first half it comes
down into or None, the copy's end)."""

DEVICE_SLICE_ELEMENTS = 1 << 24
"""The moments' slice that one buffer of the device path's ring holds (64 MB each moment in fp32; less where no
parameter's shard is as large)."""
DEVICE_RING = 3
"""Buffers in the device path's ring: one slice coming up, one updating, one going down."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor sharded as `like` (same mesh, placements, global shape and stride) whose local shard is `local`,
    on whatever device `local` is on. `DTensor.from_local` would move a CPU shard of a GPU mesh to the GPU (it
    converts the local tensor to the mesh's device type), so this builds the DTensor from its spec, as FSDP2 does for
    the shards and gradients it keeps on the CPU (CPUOffloadPolicy)."""
    spec = DTensorSpec(like.device_mesh, like.placements,
                       tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


def host_zeros(parameter: torch.Tensor, *, pinned: bool = False) -> torch.Tensor:
    """fp32 zeros shaped and sharded as `parameter`, whose local tensor is on the CPU (a moment of AdamW); page-locked
    with `pinned` (a device path streams them: copies from pageable memory are neither fast nor asynchronous)."""
    local = torch.zeros(_local(parameter).shape, dtype=torch.float32, device="cpu", pin_memory=pinned)
    return shard_like(local, parameter) if isinstance(parameter, DTensor) else local


class HostAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments, no amsgrad) with the moments and
    their arithmetic on the CPU; LR schedulers, zero_grad and state_dict work as on any optimizer."""

    states_on_cpu = True
    """Where checkpoint loading makes this optimizer's states (trainer/checkpoint.py reads it)."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, groups: Mapping[int, str] | None = None,
                 delayed: bool = False, grad_dtype: torch.dtype = torch.float32, update: UpdateMode = "cpu"):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        if grad_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"HostAdamW's grad_dtype must be torch.float32 or torch.bfloat16, got {grad_dtype}")
        if update not in ("cpu", "gpu", "both"):
            raise ValueError(f"HostAdamW's update must be cpu, gpu or both, got {update!r}")
        self.update = update
        """fsdp_config.optimizer_update: cpu (the host's arithmetic), gpu (the moments stream up and the update runs
        where each shard is) or both (each step splits the parameters between the two)."""
        self.split = UpdateSplit.guessed(2 * 4) if update == "both" else None
        """With "both": which parameters each step updates on the device (each moment's 4 bytes an element each
        way) and which on the host."""
        self._timing: tuple[int, float | Callable[[], float], int, float | Callable[[], float]] | None = None
        """The last split step's (device elements, its seconds or how to read them, host elements, host seconds or
        how to read them), folded into the split at the next step."""
        self._background_seconds = 0.0
        """The last host arithmetic's seconds in the background thread (`delayed`)."""
        self._planned: float | None = None
        """When the last delayed split step was planned (perf_counter): its `publish`, the first read that needs it,
        ends the split's window (UpdateSplit.window: how long the host's share may take)."""
        self._ring: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._moments_back: torch.cuda.Event | None = None
        """The device path's last copy of moments back to the host: waited for before the host reads them."""
        self.grad_dtype = grad_dtype
        """The dtype the gradient shards go down in (fsdp_config.offload_grad_dtype); the moments stay fp32."""
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        """Per parameter: the host buffer its gradient comes down into, then its step direction goes up from."""
        self._scratch: torch.Tensor | None = None
        """With a bf16 grad_dtype: one slice of a gradient's bf16 bytes, read out before widening overwrites them."""
        self._groups = dict(groups or {})
        """Each parameter's module group by id (groups.parameter_groups), for its copies' records; else "other"."""
        self.copies: CopyLog | None = None
        """Every copy between the host and the device, counted and a sample timed; made at the first step."""
        self.delayed = delayed
        """fsdp_config.delayed_update: `step` returns once the gradients are on their way down; the host computes
        the update meanwhile (a thread of its own), and `publish` applies it."""
        self._pending: Future[list[tuple[torch.Tensor, torch.Tensor, float, float]]] | None = None
        self._worker: ThreadPoolExecutor | None = None

    def _buffer(self, parameter: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(parameter)
        if buffer is None:
            # Pinned beside a GPU: the copies then run asynchronously on the copy engine.
            buffer = torch.empty(local.shape, dtype=torch.float32, pin_memory=local.device.type == "cuda")
            self._buffers[parameter] = buffer
        return buffer

    def _state(self, parameter: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of `parameter`, made at its first step; a state loaded elsewhere (a checkpoint's, on the
        parameter's device) is moved to the CPU once."""
        state = self.state[parameter]
        pinned = self.update != "cpu" and _local(parameter).device.type == "cuda"
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=host_zeros(parameter, pinned=pinned),
                         exp_avg_sq=host_zeros(parameter, pinned=pinned))
        for key in ("exp_avg", "exp_avg_sq"):
            local = _local(state[key])
            if local.device.type != "cpu" or local.dtype != torch.float32 or (pinned and not local.is_pinned()):
                moved = host_zeros(parameter, pinned=pinned)
                _local(moved).copy_(_local(state[key]))
                state[key] = moved
        # The fused kernel's step count: an fp32 scalar beside the moments (a checkpoint may give a number, or a
        # tensor on the parameter's device).
        step = state["step"]
        if not isinstance(step, torch.Tensor) or step.device.type != "cpu" or step.dtype != torch.float32:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return state

    def _copy(self, direction: str, parameter: torch.Tensor, nbytes: int, device: torch.device,
              copy: Callable[[], object]) -> torch.cuda.Event | None:
        """Run `copy` on the current stream, through the copy log when it crosses between the host and a device
        (a CPU-only run logs its copies too, timed on the host's clock, as the offload engine's are); returns the
        event that marks a device copy's end (None for a copy done when this returns)."""
        if self.copies is None:
            self.copies = CopyLog(cuda=device.type == "cuda")
        if device.type == "cuda" or not self.copies.cuda:
            stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            return self.copies.timed(direction, self._groups.get(id(parameter), "other"), nbytes, stream, copy)
        copy()
        return None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.publish()  # an update still pending lands before the next one
        self._learn_split()
        paths = self._paths()
        if self.delayed and self.split is not None:
            self._planned = time.perf_counter()
        # Every host gradient on its way down first (the copies queue on one stream), then the device path's slices;
        # the host starts on each gradient as soon as it has landed, while the later ones are still coming.
        # Each group's hyperparameters as they are now: a scheduler changes them before a delayed update lands.
        work = [({key: group[key] for key in ("betas", "lr", "eps", "weight_decay")},
                 self._send_down([parameter for parameter in group["params"] if paths.get(parameter) == "host"]))
                for group in self.param_groups]
        device_elements = sum(_local(parameter).numel() for parameter, path in paths.items() if path == "device")
        device_seconds = self._step_on_device(paths) if device_elements else 0.0
        host_elements = sum(_local(parameter).numel() for parameter, path in paths.items() if path == "host")
        if not host_elements:
            self._timing = (device_elements, device_seconds, 0, 0.0) if self.split is not None else None
            return loss
        if self.delayed:
            if self._worker is None:
                # The host's arithmetic with as many threads as the trainer's (a new thread has OpenMP's default).
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="host-adamw",
                                                  initializer=torch.set_num_threads,
                                                  initargs=(torch.get_num_threads(),))

            def timed_arithmetic() -> list[tuple[torch.Tensor, torch.Tensor, float, float]]:
                started = time.perf_counter()
                directions = self._host_arithmetic(work)
                self._background_seconds = time.perf_counter() - started
                return directions

            self._pending = self._worker.submit(timed_arithmetic)
            if self.split is not None:  # (read once `publish` has waited for it)
                self._timing = (device_elements, device_seconds, host_elements, lambda: self._background_seconds)
        else:
            started = time.perf_counter()
            directions = self._host_arithmetic(work)
            host_seconds = time.perf_counter() - started
            if self.split is not None:
                self._timing = (device_elements, device_seconds, host_elements, host_seconds)
            self._apply(directions)
        return loss

    def _paths(self) -> dict[torch.Tensor, str]:
        """Where each parameter with a gradient is updated this step: "host" or "device"."""
        parameters = [parameter for group in self.param_groups for parameter in group["params"]
                      if parameter.grad is not None]
        if self.split is None:
            return dict.fromkeys(parameters, "host" if self.update == "cpu" else "device")
        return dict(zip(parameters, self.split.assign([_local(parameter).numel() for parameter in parameters]),
                        strict=True))

    def _learn_split(self) -> None:
        """The last split step's timings folded into the split (its device path's events have ended: `publish`)."""
        timing, self._timing = self._timing, None
        if timing is None or self.split is None:
            return
        device_elements, device_seconds, host_elements, host_seconds = timing
        self.split.learn([
            UpdateTiming("device", device_elements, device_seconds() if callable(device_seconds) else device_seconds),
            UpdateTiming("host", host_elements, host_seconds() if callable(host_seconds) else host_seconds)])

    @torch.no_grad()
    def publish(self) -> None:
        """A delayed step's update applied to the parameters, once the host has computed it (re-raising what it
        raised); nothing when none is pending. The loop calls it before anything reads the weights as updated."""
        planned, self._planned = self._planned, None
        if planned is not None and self.split is not None:
            self.split.learn_window(time.perf_counter() - planned)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._apply(pending.result())
        moments_back, self._moments_back = self._moments_back, None
        if moments_back is not None:  # the host's moments are AdamW's again (a checkpoint reads them)
            moments_back.synchronize()

    @property
    def pending(self) -> bool:
        """Whether a delayed step's update has not been applied yet."""
        return self._pending is not None

    def state_dict(self) -> dict[str, Any]:
        self.publish()  # a checkpoint holds the states after the last step
        return super().state_dict()

    def _send_down(self, parameters: list[torch.Tensor]) -> list[Sent]:
        """Each parameter's gradient shard copied into its host buffer (in bf16: into the buffer's first half):
        (parameter, buffer, the bf16 gradient's view of the buffer or None, the copy's end)."""
        sent = []
        for parameter in parameters:
            if parameter.grad is None:
                continue
            grad = _local(parameter.grad)
            buffer = self._buffer(parameter, grad)
            narrow = None
            if self.grad_dtype != torch.float32:
                narrow = buffer.view(-1).view(self.grad_dtype)[:buffer.numel()]
                # Narrowed on the device, in the stream that copies it: the caching allocator hands its memory out
                # again only to work queued after the copy.
                grad = grad.to(self.grad_dtype).view(-1)
            target = buffer if narrow is None else narrow
            landed = self._copy("d2h", parameter, grad.numel() * grad.element_size(), grad.device,
                                lambda target=target, grad=grad: target.copy_(grad, non_blocking=True))
            sent.append((parameter, buffer, narrow, landed))
        return sent

    def _host_arithmetic(self, work: list[tuple[dict[str, Any], list[Sent]]]
                         ) -> list[tuple[torch.Tensor, torch.Tensor, float, float]]:
        """AdamW's moments updated on the host and each buffer's gradient turned into the negated step direction
        −m̂ / (√v̂ + ε): (parameter, negated direction, lr, weight decay) to apply, with each group's
        hyperparameters as the step read them.

        One pass of torch's fused CPU AdamW kernel (torch._fused_adamw_, what AdamW(fused=True) runs, as
        trainer/offload/optimizer.py calls it) with the buffer as both its parameter and its gradient, at lr 1 and
        weight decay 1: the parameter it writes is buffer·(1 − 1·1) − direction, the negated direction, and the
        moments and step count are AdamW's own. The kernel reads each element of both before it writes it. It
        moves 24 bytes an element where the eight separate tensor ops it replaces moved 76: 0.43 against 1.45 ns an
        element on 2 cores (2026-12-04, this CPU machine, 50 M elements); the same values to fp32 rounding
        (test_host_adamw.py holds them to torch's AdamW)."""
        directions = []
        for group, sent in work:
            beta1, beta2 = group["betas"]
            for parameter, buffer, narrow, landed in sent:
                if landed is not None:
                    landed.synchronize()
                state = self._state(parameter)
                state["step"] += 1  # torch's AdamW counts the step before its kernel (which does not count it)
                moments = [_local(state["exp_avg"]).view(-1), _local(state["exp_avg_sq"]).view(-1)]
                flat = buffer.view(-1)
                # A bf16 gradient: widened in place a slice at a time from the last, each read by the kernel at once,
                # while it is still in the cache (slices as OffloadAdamW._step_sliced's).
                width = max(1, flat.numel()) if narrow is None else UPDATE_SLICE_ELEMENTS
                for start in reversed(range(0, flat.numel(), width)):
                    part = flat[start:start + width]
                    if narrow is not None:
                        part.copy_(self._read_out(narrow[start:start + width]))
                    torch._fused_adamw_([part], [part], [moments[0][start:start + width]],
                                        [moments[1][start:start + width]], [], [state["step"]], amsgrad=False,
                                        lr=1.0, beta1=beta1, beta2=beta2, weight_decay=1.0, eps=group["eps"],
                                        maximize=False, grad_scale=None, found_inf=None)
                directions.append((parameter, buffer, group["lr"], group["weight_decay"]))
        return directions

    def _step_on_device(self, paths: dict[torch.Tensor, str]) -> float | Callable[[], float]:
        """AdamW's step of the parameters whose path is "device", where their shards are, the moments streamed up
        and back a slice at a time (on a CPU the kernel reads the host's moments in place). Returns its seconds, or
        on a GPU how to read them once its copies have ended."""
        started_at = time.perf_counter()
        start: torch.cuda.Event | None = None
        on_device = [(group, parameter) for group in self.param_groups for parameter in group["params"]
                     if paths.get(parameter) == "device"]
        for group, parameter in on_device:
            beta1, beta2 = group["betas"]
            state = self._state(parameter)
            state["step"] += 1
            shard, grad = _local(parameter).view(-1), _local(parameter.grad).view(-1)
            moments = [_local(state["exp_avg"]).view(-1), _local(state["exp_avg_sq"]).view(-1)]
            if shard.device.type != "cuda":
                torch._fused_adamw_([shard], [grad], [moments[0]], [moments[1]], [], [state["step"]], amsgrad=False,
                                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                    eps=group["eps"], maximize=False, grad_scale=None, found_inf=None)
                continue
            if start is None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(torch.cuda.current_stream(shard.device))
            # The kernel reads its step count from device memory: made there, a fill, not a copy.
            step = torch.full((), float(state["step"]), dtype=torch.float32, device=shard.device)
            for first in range(0, shard.numel(), DEVICE_SLICE_ELEMENTS):
                last = min(first + DEVICE_SLICE_ELEMENTS, shard.numel())
                self._device_slice(parameter, shard[first:last], grad[first:last],
                                   [moment[first:last] for moment in moments], step, group, beta1, beta2)
        if start is None:
            return time.perf_counter() - started_at
        assert self._streams is not None
        end = torch.cuda.Event(enable_timing=True)
        end.record(self._streams[1])  # after the last slice's moments are back

        def seconds() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return seconds

    def _device_slice(self, parameter: torch.Tensor, shard: torch.Tensor, grad: torch.Tensor,
                      moments: list[torch.Tensor], step: torch.Tensor, group: dict[str, Any], beta1: float,
                      beta2: float) -> None:
        """One slice: its moments up on the up stream into the ring's next buffer (once its last slice is back),
        updated on the compute stream with the shard, and back on the down stream."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(shard.device), torch.cuda.Stream(shard.device))
        up, down = self._streams
        compute = torch.cuda.current_stream(shard.device)
        if len(self._ring) < DEVICE_RING:
            # As large as the largest slice this optimizer can have: a small model's ring holds no more than it.
            elements = min(DEVICE_SLICE_ELEMENTS, max(_local(parameter).numel() for group in self.param_groups
                                                      for parameter in group["params"]))
            self._ring.append((torch.empty(elements, device=shard.device),
                               torch.empty(elements, device=shard.device), None))
        index = self._turn % len(self._ring)
        self._turn += 1
        exp_avg, exp_avg_sq, free = self._ring[index]
        length = shard.numel()
        device_moments = [exp_avg[:length], exp_avg_sq[:length]]
        if free is not None:
            up.wait_event(free)
        nbytes = 2 * length * 4
        group_name = self._groups.get(id(parameter), "other")
        if self.copies is None:
            self.copies = CopyLog(cuda=True)
        arrived = self.copies.timed("h2d", group_name, nbytes, up, lambda: [
            target.copy_(source, non_blocking=True) for target, source in zip(device_moments, moments, strict=True)])
        if arrived is not None:
            compute.wait_event(arrived)
        torch._fused_adamw_([shard], [grad], [device_moments[0]], [device_moments[1]], [], [step], amsgrad=False,
                            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=False, grad_scale=None, found_inf=None)
        updated = torch.cuda.Event()
        updated.record(compute)
        down.wait_event(updated)
        back = self.copies.timed("d2h", group_name, nbytes, down, lambda: [
            target.copy_(source, non_blocking=True) for target, source in zip(moments, device_moments, strict=True)])
        # (The step count's memory is the compute stream's, which queues nothing after the kernel that reads it
        # before the allocator could hand it out again.)
        self._ring[index] = (exp_avg, exp_avg_sq, back)
        self._moments_back = back

    def _read_out(self, narrow: torch.Tensor) -> torch.Tensor:
        """A slice of a bf16 gradient copied into the scratch (its bytes lie under the fp32 slice it widens into)."""
        if self._scratch is None or self._scratch.numel() < narrow.numel():
            self._scratch = torch.empty(UPDATE_SLICE_ELEMENTS, dtype=narrow.dtype)
        return self._scratch[:narrow.numel()].copy_(narrow)

    def _apply(self, directions: list[tuple[torch.Tensor, torch.Tensor, float, float]]) -> None:
        """Each negated direction up, and AdamW's decoupled update of the shard the device holds."""
        for parameter, negated, lr, weight_decay in directions:
            shard = _local(parameter)
            shard.mul_(1 - lr * weight_decay)
            landed: list[torch.Tensor] = []
            self._copy("h2d", parameter, negated.numel() * negated.element_size(), shard.device,
                       lambda negated=negated, shard=shard, landed=landed: landed.append(
                           negated.to(shard.device, non_blocking=True)))
            shard.add_(landed[0], alpha=lr)
