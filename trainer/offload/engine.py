"""The offload engine: parameters, gradients and optimizer states on the CPU, per module group (docs/design.md,
"The offload engine").

The engine wires its collaborators together for one model, and is what the rest of the trainer sees:

- `layout`: units, blocks, slots, host arenas and their byte accounting (trainer/offload/layout.py);
- `streamer`: hooks that swap blocks into device slots around their forward and backward, with
  prefetch on a copy stream (streamer.py);
- `gradients`: the gradient path from the device to the host masters, its staging ring and the
  worker thread that lands them (gradients.py);
- `updates`: where and when the optimizer's updates run: the host's worker, the device's, the split
  between them, the bus's turns and a delayed update's publishing (updates.py);
- `rows`: an embedding gathered by rows and a head streamed in chunks (rows.py);
- `staging`: what a phase keeps on the device (placement.py); `layers`: transformer layers moved at
  run time by dynamic offload (layer_mover.py).

Units placed on the GPU stay there, untouched (with optimizer_offload, their fp32 masters and
optimizer states live on the CPU and a compute copy stays on the GPU). Every copy is logged
(direction, group, bytes) and a sample of them timed with CUDA events read lazily (copies.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from trainer.offload.bus import BusTurns
from trainer.offload.copies import CopyLog, CopyStreams
from trainer.offload.device_update import DeviceUpdate
from trainer.offload.embedding_cache import EmbeddingCache
from trainer.offload.gradients import GradientPath, HostWorker
from trainer.offload.layer_mover import LayerMover
from trainer.offload.layout import (
    HostMemoryError,
    Layout,
    format_bytes,
    host_arenas,
    host_memory_message,
    model_host_bytes,
    pack,
    plan_layout,
    summary_lines,
    summary_rows,
)
from trainer.offload.optimizer import OffloadAdamW
from trainer.offload.options import OffloadOptions
from trainer.offload.placement import PhaseStaging
from trainer.offload.rows import RowsAndChunks
from trainer.offload.streamer import Streamer
from trainer.offload.units import Block, PassState, Placement, Unit
from trainer.offload.update_split import UpdateMode, UpdateSplit
from trainer.offload.updates import UnitUpdates

__all__ = ["HostMemoryError", "OffloadEngine", "format_bytes"]


class OffloadEngine:
    """Places one model's module groups, streams the offloaded ones, and accounts for every copy.

    Build it with `attach_offload`. The model keeps working as a plain nn.Module: forward with or
    without grad, backward (with gradient checkpointing), generate with a KV cache, state_dict.
    """

    def __init__(self, model: nn.Module, placements: dict[str, str], device: torch.device, *, role: str,
                 optimizer_offload: bool = False, options: OffloadOptions | None = None,
                 layer_classes: Sequence[str] | None = None, dynamic_layers: bool = False,
                 layers_on_gpu: int | None = None, host_budget: int | None = None,
                 host_grad_dtype: torch.dtype | None = None, delayed_update: bool = False,
                 optimizer_update: UpdateMode = "cpu"):
        self.model, self.role = model, role
        self.device = torch.device(device)
        self.options = options or OffloadOptions()
        self.streams = CopyStreams(self.device)
        self.log = CopyLog(self.streams.cuda)
        self.layout: Layout = plan_layout(model, placements, optimizer_offload=optimizer_offload,
                                          layer_classes=layer_classes, dynamic_layers=dynamic_layers,
                                          layers_on_gpu=layers_on_gpu, host_grad_dtype=host_grad_dtype)
        if host_budget is not None:
            # Packing gives back the host memory the model's weights hold now (they move into the
            # arena or to the GPU), so that memory counts as available to the placement.
            host_budget += model_host_bytes(model)
            if sum(self.host_bytes().values()) > host_budget:
                raise HostMemoryError(host_memory_message(role, self.host_bytes(), host_budget))
        if optimizer_update not in ("cpu", "gpu", "both"):
            raise ValueError(f"the {role}'s optimizer_update must be cpu, gpu or both, got {optimizer_update!r}")
        self.layout.device_update = optimizer_update != "cpu" and self.layout.optimizer_offload
        self.layout.split_update = optimizer_update == "both" and self.layout.optimizer_offload
        pack(model, self.layout, self.device)
        self.worker = HostWorker(cuda=self.streams.cuda, role=role, threads=self.options.worker_threads)
        """The host's thread for CPU work that waits on copies: it lands gradients and runs the host path's
        updates, in submission order."""
        self.updates = UnitUpdates(self.layout, self.log, self.worker, self.device, role=role, options=self.options,
                                   delayed_update=delayed_update)
        """Where and when the optimizer's updates run (updates.py): OffloadAdamW submits to it."""
        self.passes = PassState()
        self.gradients = GradientPath(self.layout, self.streams, self.log, self.options, self.worker, self.passes,
                                      self.device, finish=self._finish_backward)
        self.staging = PhaseStaging(self.layout, self.streams, self.log, self.device)
        self.streamer = Streamer(self.layout, self.streams, self.log, self.options, self.passes, self.staging,
                                 self.device, self.gradients.on_grad_accumulated)
        self.layers = LayerMover(self.layout, self.streamer, self.passes, self.options, self.device, role)
        self.rows = RowsAndChunks(self.layout, self.streams, self.log, self.streamer, self.gradients, self.staging,
                                  self.device)
        self._install_hooks()

    def _install_hooks(self) -> None:
        self.model.register_state_dict_pre_hook(lambda *_: self.wait_for_updates())
        self.model.register_load_state_dict_pre_hook(lambda *_, **__: self.wait_for_updates())
        self.streamer.install_hooks(self.model, on_backward=self.gradients.enter_backward)
        self.rows.install()
        if any(unit.offloaded for unit in self.units):
            _present_compute_placement(self.model, self.device, self.layout.dtypes.compute)

    def _finish_backward(self) -> None:
        self.gradients.flush_pending()
        self.streamer.release_all()
        self.gradients.finish()

    # ---------------------------------------------------------------------------- the layout

    @property
    def units(self) -> list[Unit]:
        return self.layout.units

    @property
    def blocks(self) -> list[Block]:
        return self.streamer.blocks

    @property
    def placements(self) -> dict[str, Placement]:
        return self.layout.placements

    @property
    def transformer_units(self) -> list[Unit]:
        return self.layout.transformer_units

    @property
    def layer_bytes(self) -> int:
        """Device bytes of the largest transformer block (what moving one to the CPU frees, at most)."""
        return self.layout.layer_bytes

    @property
    def ring_slots(self) -> int:
        """Device slots of a block's size that streamed transformer blocks rotate through while any streams."""
        return self.options.prefetch + 1

    # ---------------------------------------------------------------------------- the summary

    def summary(self) -> list[dict[str, object]]:
        """Each group: where it lives and its parameters' size (for the start-of-run log and /v1/status)."""
        return summary_rows(self.layout, self.role, self.device)

    def summary_lines(self) -> list[str]:
        """The offload summary in words, e.g. "Embedding: OFFLOADED to CPU (1.02 GiB)"."""
        return summary_lines(self.layout, role=self.role, device=self.device, host=self.host_bytes(),
                             saved_gpu_bytes=self.saved_gpu_bytes())

    def host_bytes(self) -> dict[str, int]:
        """Host memory the placement holds once it trains, by use (Layout.host_bytes)."""
        return self.layout.host_bytes(cuda=self.streams.cuda, staging_buffers=self.options.staging_buffers)

    def saved_gpu_bytes(self) -> int:
        return self.layout.saved_gpu_bytes(self.working_set_bytes())

    def working_set_bytes(self) -> int:
        """Device memory of the engine's static slots."""
        return self.streamer.working_set_bytes()

    def host_tensors(self) -> list[torch.Tensor]:
        """The host arenas the offloaded groups live in (pinned when the device is a GPU)."""
        return host_arenas(self.layout)

    # -------------------------------------------------------------------------------- copies

    def drain_copy_stats(self, max_records: int | None = None) -> list[dict[str, Any]]:
        """Timed copies completed since the last drain: [{direction, group, bytes, seconds}], bounded
        (a sample: see CopyLog; drain_copy_counts has every copy)."""
        return self.log.drain(max_records)

    def drain_copy_counts(self) -> list[dict[str, Any]]:
        """Every copy since the last call: [{direction, group, copies, bytes}]."""
        return self.log.drain_counts()

    def copied_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes copied so far per (direction, group)."""
        return dict(self.log.totals)

    def copy_counts(self) -> dict[tuple[str, str], int]:
        return dict(self.log.counts)

    # ----------------------------------------------------------------------------- optimizer

    def optimizer(self, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.01,
                  eps: float = 1e-8) -> OffloadAdamW:
        """AdamW over the model's trainable parameters, each on the device its master lives on."""
        return OffloadAdamW(self.updates, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)

    # What the rest of the trainer asks of the updates; the other calls (the optimizer's) go to `updates` itself.

    @property
    def delayed_update(self) -> bool:
        """Whether the optimizer's update runs during the next rollout (UnitUpdates.delayed_update)."""
        return self.updates.delayed_update

    @property
    def device_update(self) -> DeviceUpdate | None:
        """The update on the device (device_update.py); None: on the host alone."""
        return self.updates.device_update

    @property
    def update_split(self) -> UpdateSplit | None:
        """With optimizer_update both: which units each step updates on the device and which on the host."""
        return self.updates.update_split

    @property
    def update_mode(self) -> UpdateMode:
        """Where the offloaded units' optimizer updates run: cpu, gpu (the device path) or both."""
        return self.updates.mode

    def make_optimizer_states(self) -> None:
        """Start making the CPU optimizer's states in the background (UnitUpdates.make_optimizer_states)."""
        self.updates.make_optimizer_states()

    def wait_for_updates(self) -> None:
        """Block until every pending optimizer update has landed (UnitUpdates.wait_for_updates)."""
        self.updates.wait_for_updates()

    def publish_updates(self) -> None:
        """Publish a delayed update to every unit now (UnitUpdates.publish_updates)."""
        self.updates.publish_updates()

    def stale_reads(self) -> contextlib.AbstractContextManager[None]:
        """Reads inside take the weights from before a delayed update (UnitUpdates.stale_reads)."""
        return self.updates.stale_reads()

    def share_bus(self, turns: BusTurns) -> None:
        """Take turns on the bus with the run's other models (UnitUpdates.share_bus)."""
        self.updates.share_bus(turns)

    def claiming_bus(self) -> contextlib.AbstractContextManager[None]:
        """A training phase of this model: the bus is its own (UnitUpdates.claiming_bus)."""
        return self.updates.claiming_bus()

    # ------------------------------------------------------------------------------- passes

    def close(self) -> None:
        """Finish pending work and give back the device slots; the model cannot run afterwards."""
        self.updates.close()
        self.worker.shutdown()
        self.streams.synchronize()
        for block in self.blocks:
            block.slot.give_back()
        for unit in self.units:
            unit.compute_params = []
        self.gradients.close()

    def abandon_pass(self) -> None:
        """Forget a forward or backward that raised (a CUDA out-of-memory error): give back the
        blocks it held and drop the gradients it was still sending. The masters' gradients, which
        it may have added to, are the caller's to discard."""
        self.wait_for_updates()
        self.streams.synchronize()
        self.streamer.release_all()
        self.gradients.abandon()

    # -------------------------------------------------------------------- placement per phase

    @property
    def phase(self) -> str:
        return str(self.staging.phase)

    def stageable_bytes(self, phase: str | None = None) -> dict[str, int]:
        """The CPU-resident groups a no-grad phase may copy whole to the device (Layout.stageable_bytes); of those,
        with `phase`, the ones that phase may keep (training: the head alone)."""
        return self.layout.stageable_bytes() if phase is None else self.staging.keepable_bytes(phase)

    def placed_for(self, phase: str, *,
                   budget_bytes: int | None = None) -> contextlib.AbstractContextManager[list[str]]:
        """Place the groups for one phase of a step (PhaseStaging.placed_for); yields the groups kept."""
        return self.staging.placed_for(phase, budget_bytes=budget_bytes)

    def graph_key(self) -> tuple[object, ...] | None:
        """Whether a CUDA graph may capture a no-grad forward of the model now, and of what (Streamer.graph_key)."""
        return self.streamer.graph_key() if self.streams.cuda else None

    def replayed(self) -> None:
        """A CUDA graph of a forward was replayed (Streamer.replayed)."""
        self.streamer.replayed()

    def drop_kept(self) -> list[str]:
        """Give back the device copies the current phase keeps; the groups dropped."""
        return self.staging.drop_kept()

    def enable_embedding_cache(self, *, cache_size: int, warmup_steps: int) -> EmbeddingCache | None:
        return self.rows.enable_embedding_cache(cache_size=cache_size, warmup_steps=warmup_steps)

    # ------------------------------------------------------------------------ dynamic offload

    @property
    def moves(self) -> dict[str, int]:
        """Transformer layers moved so far, "to_cpu" and "to_gpu"."""
        return self.layers.moves

    @moves.setter
    def moves(self, value: dict[str, int]) -> None:
        self.layers.moves = value

    @property
    def layers_on_gpu(self) -> int:
        """Transformer blocks on the device between passes (resident, or a compute copy kept there)."""
        return self.layers.layers_on_gpu

    def set_transformer_layers_on_gpu(self, count: int) -> tuple[int, int]:
        """Keep the first `count` transformer blocks on the device (LayerMover); the blocks moved.
        Gradients a block still holds on the device land first: its slot may go."""
        if count != self.layers.layers_on_gpu:
            self.gradients.send_deferred()
        return self.layers.set_transformer_layers_on_gpu(count)

    # ------------------------------------------------------------------------------ gradients

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """The backward passes of one mini-batch's micro-batches: the gradients of blocks kept in device
        slots of their own (dynamic offload's layers on the GPU; units on the GPU whose masters live on
        the host) add up on the device and go to the host once, when the context ends, instead of once
        a micro-batch (issue 14: every micro-batch sent all its gradients home and the host added them
        up). Only where the host keeps gradients in the compute dtype (a bf16 model with
        offload_grad_dtype bf16, or fp32 throughout): the sum is then the same; fp32 host gradients of a
        bf16 model still add up on the host, in fp32. A context left by an error drops what it held."""
        self.gradients.defer = self.layout.dtypes.grad == self.layout.dtypes.compute
        try:
            yield
        except BaseException:
            self.gradients.defer = False
            self.abandon_pass()
            raise
        self.gradients.defer = False
        self.gradients.send_deferred()


_COMPUTE_PLACEMENT_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _compute_placement_class(model_class: type[nn.Module]) -> type[nn.Module]:
    """The model's class, reporting the compute device and dtype whatever its masters' placement.

    HF code places new tensors on `model.device` (the first parameter's device) and casts to
    `model.dtype`; with the embedding on the CPU or fp32 masters those would be wrong. One such class
    per model class (a model placed twice, or two of one class, share it).
    """
    if model_class not in _COMPUTE_PLACEMENT_CLASSES:
        _COMPUTE_PLACEMENT_CLASSES[model_class] = type(model_class.__name__, (model_class,), {
            "__module__": model_class.__module__,
            "__qualname__": model_class.__qualname__,
            "device": property(lambda self: self._offload_compute_device),
            "dtype": property(lambda self: self._offload_compute_dtype),
        })
    return _COMPUTE_PLACEMENT_CLASSES[model_class]


def _present_compute_placement(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    # object.__setattr__: nn.Module's own would register a tensor-typed attribute differently.
    object.__setattr__(model, "_offload_compute_device", device)
    object.__setattr__(model, "_offload_compute_dtype", dtype)
    model.__class__ = _compute_placement_class(type(model))
