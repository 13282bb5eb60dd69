"""FSDP2 sharding of a run's models over the data-parallel ranks (world size > 1).

Each model is wrapped with `torch.distributed.fsdp.fully_shard`, every decoder layer (the classes the
model lists in `_no_split_modules`) then the root, on the ranks' 1-D mesh of all ranks (("dp",), or ("dp_sp",)
beside Ulysses' (dp, sp) mesh: the ranks of a sequence-parallel group shard the models too): a rank keeps 1/world of
every parameter as a DTensor shard and gathers a layer's whole weights only around its forward and
backward. Optimizers built over `model.parameters()` then update the local shards, and
`torch.nn.utils.clip_grad_norm_` computes the global norm over DTensor gradients.

The project's own offload engine (trainer/offload/) lays out whole single-device models, not local shards,
so with several ranks CPU placement is FSDP2's `CPUOffloadPolicy`: the shards' parameters, gradients and
optimizer states stay in (pinned) host memory and the optimizer step runs on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from trainer.config import FSDPConfig
from trainer.distributed.ranks import Ranks

NON_ROOT_GROUPS = ("embedding", "lm_head", "norm")
"""The module groups that stay in the root's FSDP unit (everything outside the decoder layers)."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules of the classes HuggingFace keeps whole (`_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return layers


def cpu_placement(fsdp_config: FSDPConfig) -> tuple[bool, bool]:
    """(decoder layers on the CPU, root groups on the CPU) as param_offload, offload_policy and
    optimizer_offload ask. FSDP2 offloads a unit's parameters, gradients and optimizer states together,
    so optimizer_offload alone puts every unit on the CPU."""
    if fsdp_config.optimizer_offload:
        return True, True
    return (fsdp_config.placement("transformer") == "cpu",
            any(fsdp_config.placement(group) == "cpu" for group in NON_ROOT_GROUPS))


def shard_model(model: nn.Module, fsdp_config: FSDPConfig, ranks: Ranks, *, role: str,
                log: Callable[[str], None]) -> nn.Module:
    """`model` sharded in place over `ranks.mesh` (per decoder layer, then the root); returns it."""
    assert ranks.mesh is not None, "sharding needs several ranks"
    # A value model's output (transformers' token classifier) is a view, which FSDP2 warns about at every
    # forward: an in-place op on it would skip the pre-backward hook. The workers only read model outputs
    # out of place (the sharded critic trains as one rank does: tests/trainer/distributed/test_ranks.py).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    layers_on_cpu, root_on_cpu = cpu_placement(fsdp_config)
    on_gpu = ranks.device.type == "cuda"
    # Pinned host memory only exists beside a GPU (its copies are what pinning speeds up).
    offload = CPUOffloadPolicy(pin_memory=on_gpu)
    if layers_on_cpu or root_on_cpu:
        where = ("every group" if layers_on_cpu and root_on_cpu
                 else "the decoder layers" if layers_on_cpu else "the embedding, head and norm")
        log(f"{role}: {ranks.world_size} ranks shard the model with FSDP2; {where} keep their local shards' "
            "parameters, gradients and optimizer states on the CPU through FSDP2's CPUOffloadPolicy (the "
            "project's own offload engine places whole models on one rank only)")
    if not (layers_on_cpu and root_on_cpu):
        model.to(ranks.device)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=ranks.mesh, offload_policy=offload if layers_on_cpu else OffloadPolicy())
    fully_shard(model, mesh=ranks.mesh, offload_policy=offload if root_on_cpu else OffloadPolicy())
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)

