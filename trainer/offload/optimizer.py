"""AdamW where each parameter's states and update live on the device its master weight lives on.

One param group per unit (embedding, each transformer block, norm, head, ...), so that the layout
does not depend on the placement: a checkpoint taken with one offload policy resumes under another.
Groups on the GPU step there at once. Groups on the CPU step with torch's fused CPU AdamW (about
4x faster than the for-each kernel, 5x faster than the plain loop on 16 cores) in the engine's
worker thread, in forward order, and the next forward waits for each block only when it reaches
that block: the CPU update overlaps whatever the trainer does next on the device. With
optimizer_update gpu they step on the device instead (device_update.py), on a worker of their own;
with both, each step splits them between the two workers (update_split.py), which run at once.

`clip_grad_norm_` computes the norm and folds the clipping into the fused update (its grad_scale
input divides the gradients as it reads them): torch.nn.utils.clip_grad_norm_ would make one more
read-and-write pass over every fp32 gradient on the CPU, which costs more than the update itself.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.offload.device_update import pinned_states
from trainer.offload.gradients import SquareSums
from trainer.offload.units import UPDATE_SLICE_ELEMENTS, Unit
from trainer.offload.update_split import UpdatePath
from trainer.offload.updates import UnitUpdates


class OffloadAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused) over an offloaded model; LR schedulers and state_dict work as usual."""

    def __init__(self, updates: UnitUpdates, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.01, eps: float = 1e-8):
        groups, units = [], []
        for unit in updates.units:
            parameters = [entry.parameter for entry in unit.entries if entry.parameter.requires_grad]
            if parameters:
                groups.append({"params": parameters})
                units.append(unit)
        if not groups:
            raise ValueError(f"the {updates.role} has no trainable parameter to optimize")
        super().__init__(groups, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, fused=True)
        self.updates = updates
        self._units = units
        self._grad_scale: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._squares = SquareSums()  # the norm's own buffer: the engine's worker may be updating with the optimizer's
        self.slice_elements = UPDATE_SLICE_ELEMENTS
        # The states' first allocation and first touch (page faults over every byte: 61 GB for a 7B actor) cost
        # the first update 8 s more than the others (measured on the H200 machine, 2026-11-30), and the rollout
        # after it waits for that update: made in the worker once every model is placed (the host budget of the
        # models placed after this one counts them as still to come), they overlap the first step instead.
        updates.first_optimizer_states = self._first_states

    def _first_states(self) -> None:
        """AdamW's states of the groups stepped on the CPU, as torch's fused AdamW would make them at the first
        step (a step count of 0, zeroed moments); a state already there is left as it is."""
        for group, unit in zip(self.param_groups, self._units, strict=True):
            if not unit.offloaded:
                continue
            for parameter in group["params"]:
                self._fresh_state(parameter)
            if self.updates.device_update is not None:
                pinned_states([self.state[parameter] for parameter in group["params"]], self.updates.device)

    def _fresh_state(self, parameter: torch.Tensor) -> None:
        """The parameter's AdamW state as torch's fused AdamW makes it at a first step, unless it has one."""
        state = self.state[parameter]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("OffloadAdamW.step takes no closure")
        updates = self.updates
        updates.wait_for_updates()
        grad_scale, self._grad_scale = self._grad_scale, None
        on_device = [group for group, unit in zip(self.param_groups, self._units, strict=True) if not unit.offloaded]
        if on_device:
            self._step_groups(on_device, grad_scale)
        offloaded = [(group, unit) for group, unit in zip(self.param_groups, self._units, strict=True)
                     if unit.offloaded]
        # Each unit's path (the device's or the host's worker); with both, the split balances the two.
        paths = updates.plan_update_paths([unit for _, unit in offloaded])
        for (group, unit), path in zip(offloaded, paths, strict=True):
            # A copy of the group: a scheduler changing the lr from now on applies to the next step.
            snapshot = dict(group)
            # Under a delayed update the arena keeps the weights from before this one until a read that may
            # not be stale publishes it (Unit.settled); the rollout reads them meanwhile.
            unit.publish_pending = updates.delayed_update
            updates.submit_update(unit, self._update_unit, snapshot, unit, grad_scale, path, path=path)
        if updates.device_update is not None:
            # Its device buffers go back between steps, for the phases that run meanwhile (once the device
            # path's updates are done: they run on its worker, in order).
            updates.after_updates(updates.device_update.release, path="device")
        return None

    def _update_unit(self, group: dict[str, Any], unit: Unit, grad_scale: torch.Tensor | None,
                     path: UpdatePath) -> None:
        """One unit's AdamW step on `path`; either gives the same states, step counts and weights."""
        try:
            written: set[int] = set()
            if path == "host" and self.updates.device_update is not None:
                # Page-locked as the device path keeps them, so that a unit the split sends to the device at a
                # later step streams its states at once (torch's own first step makes them in pageable memory).
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        self._fresh_state(parameter)
                pinned_states([self.state[parameter] for parameter in group["params"] if parameter in self.state],
                              self.updates.device)
            if path == "device":
                written = self._step_on_device(group, grad_scale, unit)
            elif any(parameter.grad is not None and parameter.grad.dtype != parameter.dtype
                     for parameter in group["params"]):
                written = self._step_sliced(group, grad_scale, unit)
            else:
                # Whole tensors, one multi-tensor call: sliced like the bf16 case, it measured no faster on the
                # 2-core machine (0.250 against 0.262 s, inside the noise), and on a host of many cores small
                # slices would cost a thread fork and join each.
                self._step_groups([group], grad_scale)
            if not unit.publish_pending:
                self.updates.after_update(unit, written)
        finally:
            with self.updates.update_lock:
                if unit.grads_after_update is not None:
                    self._clear_grads(group["params"], unit.grads_after_update == "none")
                    unit.grads_after_update = None
                unit.ready.set()

    def _step_on_device(self, group: dict[str, Any], grad_scale: torch.Tensor | None, unit: Unit) -> set[int]:
        """The unit's AdamW step on the compute device over its masters and states streamed from the host
        (DeviceUpdate): the same states and step counts as torch's fused AdamW keeps, so checkpoints load either
        way. Returns the entries whose arena it wrote."""
        self._check_plain(group)
        parameters = [parameter for parameter in group["params"] if parameter.grad is not None]
        for parameter in parameters:
            self._fresh_state(parameter)
        states = [self.state[parameter] for parameter in parameters]
        pinned_states(states, self.updates.device)
        torch._foreach_add_([state["step"] for state in states], 1)
        to_arena = not unit.publish_pending and not unit.master_is_arena and unit.arena is not None
        assert self.updates.device_update is not None
        return self.updates.device_update.step_unit(unit, parameters, states, group, grad_scale, to_arena)

    @staticmethod
    def _check_plain(group: dict[str, Any]) -> None:
        if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
            raise ValueError("OffloadAdamW: bf16 host gradients and the update on the device support plain AdamW "
                             "(no amsgrad, maximize, capturable or differentiable)")

    def _step_sliced(self, group: dict[str, Any], grad_scale: torch.Tensor | None, unit: Unit) -> set[int]:
        """The fused AdamW step of one group whose host gradients are bf16 beside fp32 masters
        (offload_grad_dtype), which the kernel wants in the masters' dtype: each gradient is read back in
        fp32 a slice at a time into one reused buffer (only the engine's worker runs updates), and each
        updated slice of the masters goes into the unit's arena (the device's copy) at once, while it is
        still in the cache, unless a delayed update keeps the arena as it was. Returns the entries whose
        arena it wrote. A slice small enough for the buffer to stay in the cache (UPDATE_SLICE_ELEMENTS)
        and the arena written on the way: on this project's 2-core CPU machine (2026-12-02) one 150M-element
        tensor's update went from 0.37 to 0.18-0.21 s; a 231M-parameter model's OffloadAdamW step (its largest
        tensors 22.5M elements, the tiny vocabulary) was within the noise (medians 0.345 and 0.338 s); the
        same values. The slice is 2**22 elements so that each of a 16-core host's threads still gets a
        megabyte of one. Not yet measured on the GPU machine's host, where the 3B actor's update takes 1.2 s.

        Written against torch's kernel (torch._fused_adamw_) because the optimizer's step() takes
        whole tensors only; it does what AdamW.step does for fused CPU groups: the same state
        (step, exp_avg, exp_avg_sq, so checkpoints load either way), one step increment per
        parameter, then the elementwise kernel, here slice by slice, which gives the same values."""
        self._check_plain(group)
        parameters = [parameter for parameter in group["params"] if parameter.grad is not None]
        for parameter in parameters:
            self._fresh_state(parameter)
        steps = [self.state[parameter]["step"] for parameter in parameters]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        slice_elements = self.slice_elements
        to_arena = not unit.publish_pending and not unit.master_is_arena and unit.arena is not None
        written = set()
        for parameter, step in zip(parameters, steps, strict=True):
            state = self.state[parameter]
            flat = [tensor.view(-1) for tensor in (parameter, parameter.grad, state["exp_avg"], state["exp_avg_sq"])]
            index = unit.index_of(parameter)
            arena = unit.arena_view(index).view(-1) if to_arena else None
            for start in range(0, parameter.numel(), slice_elements):
                length = min(slice_elements, parameter.numel() - start)
                weight, narrow, exp_avg, exp_avg_sq = (tensor[start:start + length] for tensor in flat)
                if self._scratch is None or self._scratch.numel() < length:
                    self._scratch = torch.empty(min(parameter.numel(), slice_elements), dtype=parameter.dtype)
                wide = self._scratch[:length].copy_(narrow)
                torch._fused_adamw_([weight], [wide], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False,
                                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                    eps=group["eps"], maximize=False, grad_scale=grad_scale, found_inf=None)
                if arena is not None:
                    arena[start:start + length].copy_(weight)
            if arena is not None:
                written.add(index)
        return written

    def _step_groups(self, groups: list[dict[str, Any]], grad_scale: torch.Tensor | None = None) -> None:
        """torch's AdamW step over some of the groups: a view of this optimizer sharing its state."""
        view = object.__new__(torch.optim.AdamW)
        view.__dict__.update(self.__dict__)
        view.param_groups = groups
        if grad_scale is not None:
            view.grad_scale = grad_scale  # type: ignore[attr-defined]  # the fused kernels divide the gradients by it
        torch.optim.AdamW.step(view)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The 2-norm of all gradients; the next step() scales them to at most `max_norm`, as
        torch.nn.utils.clip_grad_norm_ would, but inside the update instead of in one more pass.
        The gradients themselves are left as they are."""
        # A unit whose host gradient is exactly what its device sent in one pass has its square already (taken
        # on the device, GradientPath.add_square): its host gradient is not read again.
        known = [unit.grad_square for unit in self._units if unit.grad_square is not None]
        grads = [parameter.grad for group, unit in zip(self.param_groups, self._units, strict=True)
                 if unit.grad_square is None for parameter in group["params"] if parameter.grad is not None]
        if not grads and not known:
            return torch.zeros(())
        host = [grad for grad in grads if grad.device.type == "cpu" and grad.dtype == torch.float32]
        narrow = [grad for grad in grads if grad.device.type == "cpu" and grad.dtype != torch.float32]
        others = [grad for grad in grads if grad.device.type != "cpu"]
        squares = []
        if host:
            # BLAS dot products use every core; torch's norm reduces each CPU tensor on one thread
            # (10 GB/s on an H200 host, where the fused AdamW moves 84 GB/s).
            squares.append(torch.stack([torch.dot(grad.view(-1), grad.view(-1)) for grad in host]).sum())
        if narrow:
            narrow_square = self._squares.of(narrow, self.slice_elements)
            assert narrow_square is not None
            squares.append(narrow_square)
        if others:
            squares.append(torch.nn.utils.get_total_norm(others, norm_type=2.0).square().float().cpu())
        if known:
            squares.append(torch.stack(known).sum().cpu())  # one wait for the device, not one a unit
        total = torch.stack(squares).sum().sqrt()
        # torch.nn.utils.clip_grad_norm_ multiplies by max_norm / (total + 1e-6), at most 1.
        self._grad_scale = ((total + 1e-6) / max_norm).clamp(min=1.0).float()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scale = None
        for group, unit in zip(self.param_groups, self._units, strict=True):
            unit.grad_square = None
            with self.updates.update_lock:
                if not unit.ready.is_set():
                    # Its update still reads the gradient: the worker clears it once done.
                    unit.grads_after_update = "none" if set_to_none else "zero"
                    continue
            self._clear_grads(group["params"], set_to_none)

    @staticmethod
    def _clear_grads(parameters: list[torch.Tensor], set_to_none: bool) -> None:
        for parameter in parameters:
            if parameter.grad is None:
                continue
            if set_to_none:
                parameter.grad = None
            else:
                parameter.grad.zero_()

    def wait(self) -> None:
        """Block until the CPU updates of the last step have landed."""
        self.updates.wait_for_updates()

    def state_dict(self) -> dict[str, Any]:
        self.updates.wait_for_updates()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates.wait_for_updates()
        # The states loaded replace the ones there (made zeroed in the background): let those go first, so
        # that host memory never holds both (61 GB each for a 7B actor).
        self.state.clear()
        super().load_state_dict(state_dict)
