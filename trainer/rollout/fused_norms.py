"""A decode's RMSNorms as torch's fused kernel (issue 15).

transformers' RMSNorm of Llama-style models (Qwen2RMSNorm, LlamaRMSNorm, MistralRMSNorm, ...) runs as about
seven kernels: the cast to fp32, the square, the mean, the epsilon, the reciprocal square root, the product and
the weight's. A decoded token's step is small enough that each costs its launch more than its arithmetic:
measured on an H200 with the 7B shape (benchmarks/README.md, `static_profile`), the norms were about 1.6 ms of
a 7.9 ms step, 57 norms of [32, 3584]. torch.nn.functional.rms_norm computes the same thing in one kernel on a
GPU (aten::_fused_rms_norm).

Which modules: any whose forward gives what `F.rms_norm` gives over its last dimension with its `weight` and
epsilon (`variance_epsilon` or `eps`), checked on a random input once per class and dtype rather than guessed
from its name, so a norm that differs (Gemma's scales by 1 + weight) keeps its own forward. The two differ
by the rounding of one product (transformers rounds to the model's dtype before the weight, the kernel after
it): within one unit in the last place in bf16, identical in fp32. Only the decode's forwards use it; the
training and scoring forwards keep transformers' own.

Written by hand because transformers routes its RMSNorm through the `kernels` hub
(`use_kernel_forward_from_hub`), which downloads its kernels at run time: not possible on machines without a
network, and the kernel torch ships does the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

_VERIFIED: dict[tuple[type[nn.Module], torch.dtype, str], bool] = {}
"""Whether a norm class computes F.rms_norm, per (class, weight dtype, device type): checked once."""


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    # A DTensor weight is a sharded model's shard (FSDP2 gathers it around the forward): not this module's whole.
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor)
            and not isinstance(weight, DTensor) and weight.dim() == 1
            and _epsilon(module) is not None and not list(module.children()))


def _fused_forward(module: nn.Module, epsilon: float):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), module.weight, epsilon)

    return forward


@torch.no_grad()
def _computes_rms_norm(module: nn.Module, epsilon: float) -> bool:
    """Whether the module's own forward gives F.rms_norm's result on a random input (its own weight, and once
    more with a random one: a weight of ones would hide a norm that scales by 1 + weight)."""
    weight = module.weight
    key = (type(module), weight.dtype, weight.device.type)
    if key not in _VERIFIED:
        generator = torch.Generator(device=weight.device).manual_seed(0)
        sample = torch.randn((4, weight.numel()), generator=generator, device=weight.device).to(weight.dtype)
        # object's __new__: an FSDP2 unit's class (FSDPQwen2RMSNorm) has a __new__ that calls __init__.
        probe = object.__new__(type(module))
        probe.__dict__.update(module.__dict__)
        probe._parameters = dict(module._parameters)
        probe._parameters["weight"] = nn.Parameter(
            torch.rand(weight.shape, generator=generator, device=weight.device).to(weight.dtype) + 0.5,
            requires_grad=False)
        same = True
        for candidate in (module, probe):
            expected = type(module).forward(candidate, sample).float()
            fused = F.rms_norm(sample, (sample.shape[-1],), candidate.weight, epsilon).float()
            tolerance = 1e-5 if weight.dtype == torch.float32 else 2 ** -6
            same = same and expected.shape == fused.shape and torch.allclose(expected, fused, rtol=tolerance,
                                                                              atol=tolerance)
        _VERIFIED[key] = same
    return _VERIFIED[key]


@contextlib.contextmanager
def fused_rms_norms(model: nn.Module, device: torch.device) -> Iterator[int]:
    """Inside, on a GPU: every RMSNorm of `model` that computes F.rms_norm runs it (one kernel) instead of its own
    forward; yields how many. On a CPU nothing changes (the same kernels either way): yields 0."""
    forwards = {}
    if device.type == "cuda":
        for module in model.modules():
            if not _candidate(module) or "forward" in module.__dict__:
                continue
            epsilon = _epsilon(module)
            assert epsilon is not None
            if _computes_rms_norm(module, epsilon):
                forwards[module] = _fused_forward(module, epsilon)
    with swapped_forwards(forwards) as swapped:
        yield swapped


@contextlib.contextmanager
def swapped_forwards(forwards: dict[nn.Module, Callable]) -> Iterator[int]:
    """Inside: each module runs the forward given for it (an instance attribute over its class's); yields how
    many. Afterwards each has its class's forward again."""
    for module, forward in forwards.items():
        module.forward = forward  # type: ignore[method-assign]
    try:
        yield len(forwards)
    finally:
        for module in forwards:
            del module.forward
