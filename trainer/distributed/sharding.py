"""FSDP2 sharding of a run's models over the data-parallel ranks (world size > 1), each group placed as configured.

Each model is wrapped with `torch.distributed.fsdp.fully_shard` on the ranks' 1-D mesh of all ranks (("dp",), or
("dp_sp",) beside Ulysses' (dp, sp) mesh: the ranks of a sequence-parallel group shard the models too). The units
are the groups that offload_policy places (trainer/offload/groups.py): one per decoder layer, the embedding, the
final norm and the head, then the root, which keeps whatever is left (parameters of no group). A rank keeps
1/world of every parameter as a DTensor shard and gathers a unit's whole weights only around its forward and
backward. Optimizers built over `model.parameters()` then update the local shards, and
`torch.nn.utils.clip_grad_norm_` computes the global norm over DTensor gradients.

A group placed on the CPU (param_offload, offload_policy; sequence_parallel_offload for the policy's embedding and
head) is a unit with FSDP2's `CPUOffloadPolicy`: its local shards' parameters, gradients and optimizer states stay
in (pinned) host memory, and its part of the optimizer step runs on the CPU. The project's own offload engine
(trainer/offload/) lays out whole single-device models, not local shards, so with several ranks this is the
placement. A head tied to the embedding (tie_word_embeddings) is one weight, so both stay in the root's unit, on
the device if either group is (as on one rank: trainer/offload/layout.py).

optimizer_offload keeps AdamW's states and arithmetic on the CPU wherever the parameters are: the workers step
a sharded model with HostAdamW (trainer/distributed/host_adamw.py), which copies each step's gradient shards down
and the step up. A trained bf16 model with optimizer_offload keeps fp32 masters, as one rank's engine does: its
shards become fp32, and FSDP2's MixedPrecisionPolicy gathers them in bf16 for the forward and backward and reduces
the gradients in fp32, so the checkpoints hold fp32 weights that one rank's engine resumes from (and the other way
round).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from trainer.config import FSDPConfig
from trainer.distributed.ranks import Ranks
from trainer.offload.groups import GROUPS, TITLES, ModelParts, find_parts
from trainer.offload.layout import format_bytes


def group_placements(fsdp_config: FSDPConfig, parts: ModelParts) -> dict[str, bool]:
    """Whether each group's local shards live on the CPU, from param_offload and offload_policy (optimizer_offload
    places AdamW's states, not the parameters: HostAdamW)."""
    on_cpu = {group: fsdp_config.placement(group) == "cpu" for group in GROUPS}
    if parts.tied:  # one weight: on the device if either group wants it there
        on_cpu["embedding"] = on_cpu["lm_head"] = on_cpu["embedding"] and on_cpu["lm_head"]
    return on_cpu


@dataclass(frozen=True)
class Sharded:
    """How shard_model placed a model: the model, whether each group's local shards live on the CPU, its groups'
    modules (FSDP2 units now), and the bytes of its whole weights in the dtype its forward gathers them in."""

    model: nn.Module
    on_cpu: dict[str, bool]
    parts: ModelParts
    whole_bytes: int = 0


def shard_model(model: nn.Module, fsdp_config: FSDPConfig, ranks: Ranks, *, role: str,
                log: Callable[[str], None]) -> Sharded:
    """`model` sharded in place over `ranks.mesh`: a unit per decoder layer and per group, then the root."""
    assert ranks.mesh is not None, "sharding needs several ranks"
    # A value model's output (transformers' token classifier) is a view, which FSDP2 warns about at every
    # forward: an in-place op on it would skip the pre-backward hook. The workers only read model outputs
    # out of place (the sharded critic trains as one rank does: tests/trainer/distributed/test_ranks.py).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    parts = find_parts(model, fsdp_config.wrap_policy.transformer_layer_cls_to_wrap)
    on_cpu = group_placements(fsdp_config, parts)
    # Pinned host memory only exists beside a GPU (its copies are what pinning speeds up).
    offloaded = CPUOffloadPolicy(pin_memory=ranks.device.type == "cuda")
    precision = fp32_masters(model, fsdp_config)

    def unit(modules: nn.Module | list[nn.Module], group: str) -> None:
        # fully_shard moves each unit's states to the device and then its shards to the CPU where offloaded:
        # the device holds one unit's whole weights at a time, never the model's.
        fully_shard(modules, mesh=ranks.mesh, offload_policy=offloaded if on_cpu[group] else OffloadPolicy(),
                    mp_policy=precision)

    for layer in parts.layers:
        unit(layer, "transformer")
    if not parts.tied:
        unit(parts.embedding, "embedding")
        if parts.head is not None:
            unit(parts.head, "lm_head")
    if parts.norm is not None:
        unit(parts.norm, "norm")
    # The root: the tied embedding and head when they are one weight, and parameters of no group (on the device,
    # as on one rank).
    root_on_cpu = on_cpu["embedding"] if parts.tied else False
    fully_shard(model, mesh=ranks.mesh, offload_policy=offloaded if root_on_cpu else OffloadPolicy(),
                mp_policy=precision)
    line = describe_sharding(role, ranks.world_size, on_cpu, parts)
    if fsdp_config.optimizer_offload and any(parameter.requires_grad for parameter in model.parameters()):
        line += ("; AdamW's states on the CPU (optimizer_offload)" if fsdp_config.optimizer_update in ("gpu", "both")
                 else
                 "; AdamW's states and arithmetic on the CPU (optimizer_offload: each step copies the gradient "
                 "shards down and the update up)")
        if fsdp_config.optimizer_update == "gpu":
            line += ("; the update runs on the device over the moments streamed up and back (optimizer_update gpu: no "
                     "gradient or update crosses)")
        elif fsdp_config.optimizer_update == "both":
            line += ("; each step splits the update between the host's arithmetic and the device's over the moments "
                     "streamed up (optimizer_update both)")
        elif fsdp_config.offload_grad_dtype == "bf16":
            line += "; the gradient shards go down in bf16 (offload_grad_dtype)"
        if fsdp_config.delayed_update:
            line += ("; the host computes each step's update during the next rollout, which samples with the weights "
                     "from before it (delayed_update)")
        elif role == "critic" and fsdp_config.optimizer_update in ("auto", "cpu"):
            line += ("; the host computes its update beside the actor's, and the next values apply it first")
    if precision.param_dtype is not None:
        line += (f"; fp32 masters of the {_dtype_name(precision.param_dtype)} weights, which the forward and "
                 "backward gather in that dtype (FSDP2's MixedPrecisionPolicy; gradients reduced in fp32)")
    log(line)
    gathered = precision.param_dtype
    whole = sum(parameter.numel() * (gathered or parameter.dtype).itemsize for parameter in model.parameters())
    return Sharded(model, on_cpu, parts, whole)


WHOLE_WEIGHTS_SHARE = 0.5
"""The most of a rank's free device memory the whole weights may take for a phase's forwards without gradients
(the rest: the KV cache, activations and logits)."""


def free_device_bytes(device: torch.device) -> float:
    """What the device can still give: the driver's free memory and what torch's allocator holds unused (infinite
    on the CPU, where the host's memory holds every weight anyway)."""
    if device.type != "cuda":
        return math.inf
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@contextlib.contextmanager
def whole_weights(sharded: Sharded, ranks: Ranks) -> Iterator[bool]:
    """Inside: every rank holds the sharded model's whole weights, gathered once, if they fit in
    WHOLE_WEIGHTS_SHARE of every rank's free device memory (yields whether they do). Forwards without gradients
    (a decode's tokens, a scoring's micro-batches) then gather nothing, where FSDP2 would gather every unit's
    shards for every forward (and copy the shards of units on the CPU up each time). Afterwards the whole weights
    are freed and FSDP2 gathers around each forward again (its defaults: every unit but the root frees them after
    its forward). Every rank must enter together: the decision and the gathers are collective."""
    model = sharded.model
    if not isinstance(model, FSDPModule):
        yield False
        return
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]  # the root first
    fits = sharded.whole_bytes <= WHOLE_WEIGHTS_SHARE * free_device_bytes(ranks.device)
    if ranks.sum(float(fits)) < ranks.world_size:
        yield False
        return
    root: FSDPModule = model
    root.set_reshard_after_forward(False)
    try:
        for unit in units:
            unit.unshard()
        yield True
    finally:
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)  # FSDP2's default for the root
        for unit in units:
            unit.reshard()


@contextlib.contextmanager
def plain_forwards(model: nn.Module) -> Iterator[bool]:
    """Inside `whole_weights` (every unit's whole weights held): forwards without gradients (grad mode is off
    inside) that are the plain modules' own, FSDP2's forward hooks detached from every unit. With nothing to
    gather those hooks only keep books, and the root's orders FSDP2's gather streams after the compute stream: a
    CUDA graph capture would take those streams into its graph and end with them unjoined. So a decode's step can be
    captured, and no rank's forwards wait for another's. Yields whether every unit's hooks were found (FSDP2 binds
    them, or a grouped unit's wrappers of them, to the unit's state; a torch that hooks otherwise leaves them in
    place, and yields False). The hooks are put back in their places afterwards.

    Written by hand: FSDP2 has no switch for its hooks (`set_reshard_after_forward` still runs them)."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    found: list[tuple[OrderedDict[int, Callable[..., object]], int]] = []
    for unit in units:
        state = fully_shard.state(unit)
        hooks = [(table, key) for table in (unit._forward_pre_hooks, unit._forward_hooks)
                 for key, hook in table.items() if _bound_to(hook) is state]
        found += hooks
        if len(hooks) != 2:  # a pre-forward and a post-forward hook
            found = []
            break
    tables = {id(table): (table, list(table.items())) for table, _ in found}  # each table's hooks, in order
    for table, key in found:
        del table[key]
    try:
        with torch.no_grad():
            yield bool(found)
    finally:
        removed = {(id(table), key) for table, key in found}
        for table, hooks in tables.values():
            # FSDP2's hooks back at their places among the others; any hook added meanwhile stays, after them.
            now = list(table.items())
            table.clear()
            table.update((key, hook) for key, hook in hooks if (id(table), key) in removed or key in dict(now))
            table.update(now)


def _bound_to(hook: Callable[..., object]) -> object:
    """The object a hook is a method of, through wrappers (functools.wraps) down to the first bound method."""
    return getattr(inspect.unwrap(hook, stop=lambda function: hasattr(function, "__self__")), "__self__", None)


def fp32_masters(model: nn.Module, fsdp_config: FSDPConfig) -> MixedPrecisionPolicy:
    """The precision of a model's shards: with optimizer_offload a trained model in bf16 (or fp16) keeps fp32
    masters, as on one rank (trainer/offload/layout.py), so its parameters become fp32 here and FSDP2 gathers them
    in the model's dtype for the forward and backward and reduces the gradients in fp32. Anything else computes
    and updates in the dtype it was loaded in (no policy)."""
    dtype = next(model.parameters()).dtype
    trains = any(parameter.requires_grad for parameter in model.parameters())
    if not (fsdp_config.optimizer_offload and trains and dtype in (torch.bfloat16, torch.float16)):
        return MixedPrecisionPolicy()
    # Exact: every bf16 value is an fp32 one. Frozen weights (a LoRA adapter's base) keep their dtype: no update
    # needs their precision, and FSDP2 gathers a unit's parameters of several dtypes in param_dtype alike.
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def describe_sharding(role: str, world_size: int, on_cpu: dict[str, bool], parts: ModelParts) -> str:
    """The start-of-run line that says how a model is sharded and which groups' shards live on the CPU."""
    present = [group for group in GROUPS
               if not (group == "lm_head" and parts.head is None or group == "norm" and parts.norm is None)]
    names = [TITLES[group].lower() if group != "lm_head" else "head" for group in present]
    names = ["decoder layers" if group == "transformer" else name for group, name in zip(present, names, strict=True)]
    where = [name for group, name in zip(present, names, strict=True) if on_cpu[group]]
    tied = " (the head, tied to the embedding, shares its unit)" if parts.tied else ""
    line = f"{role}: {world_size} ranks shard the model with FSDP2, a unit per decoder layer and per group{tied}"
    if not where:
        return line + "; every group's shards on the device"
    holders = ("every group keeps its" if len(where) == len(present)
               else f"the {where[0]} keeps its" if len(where) == 1 else f"the {_listed(where)} keep their")
    return (f"{line}; {holders} local shards' parameters, gradients and optimizer states on the CPU through "
            "FSDP2's CPUOffloadPolicy (the project's own offload engine places whole models on one rank only)")


def offload_summary(on_cpu: dict[str, bool], parts: ModelParts, device: torch.device) -> list[str]:
    """A sharded model's offload summary in the article's words, as one rank's engine says it (offload/layout.py
    summary_lines): each group OFFLOADED to CPU or KEPT on the device, with the bytes of this rank's local shards,
    and the device memory that saves on each rank."""
    on_gpu = device.type == "cuda"
    resident = "KEPT on GPU" if on_gpu else f"KEPT on the compute device, the {device.type.upper()}"
    modules = {"embedding": [parts.embedding], "transformer": list(parts.layers),
               "norm": [parts.norm] if parts.norm is not None else [],
               "lm_head": [parts.head] if parts.head is not None else []}
    lines, saved = [], 0
    for group in GROUPS:
        if not modules[group]:
            continue
        title = TITLES[group] + (f" ({len(parts.layers)} layers)" if group == "transformer" else "")
        if group == "lm_head" and parts.tied:
            lines.append(f"{title}: tied to the embedding")
            continue
        nbytes = sum(_local_bytes(parameter) for module in modules[group] for parameter in module.parameters())
        saved += nbytes if on_cpu[group] else 0
        lines.append(f"{title}: {'OFFLOADED to CPU' if on_cpu[group] else resident} ({format_bytes(nbytes)} of "
                     "this rank's shards)")
    lines.append(f"Total GPU Memory Saved: {format_bytes(saved)} on each rank" if on_gpu else
                 f"Total GPU Memory Saved on a GPU: {format_bytes(saved)} on each rank (this run computes on the "
                 f"{device.type.upper()})")
    return lines


def _local_bytes(parameter: torch.Tensor) -> int:
    """The bytes this rank holds of a parameter: its local shard where FSDP2 sharded it."""
    local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
    return local.numel() * local.element_size()


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)

