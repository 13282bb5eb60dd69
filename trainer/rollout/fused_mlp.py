"""A decode's gated MLP activation as one compiled kernel (issue 15).

Llama-style MLPs (Qwen2MLP, LlamaMLP, MistralMLP, ...) compute `down_proj(act_fn(gate_proj(x)) * up_proj(x))`.
For a decoded token the activation and the product are two kernels over a [batch, 1, intermediate] tensor, each
mostly launch: measured on an H200 with the 7B shape (benchmarks/README.md, `static_profile`, 2026-12-04) about
0.4 ms of a 6.6 ms step over 28 layers. Inside the decode, on a GPU, a decode step's MLP runs the same three
projections with the activation and the product as one `torch.compile`d function (inductor fuses them).

Which modules: those with `gate_proj`, `up_proj`, `down_proj` and an `act_fn` that is SiLU, whose own forward
gives what the fused one gives on a probe of small random projections (checked once per class), so an MLP that
computes something else (GELU under another name, a scaled product) keeps its own forward; a mixture of experts
has no such projections and is not a candidate. Where compiling fails (no Triton, no C compiler), the decode keeps
the module's own forward and says so once. The prompt's forward keeps it too: only decode steps, one token a row,
run the fused one. A layer the offload engine streams is fused as a resident one is (its class is checked on a
probe, not on its weights, which sit on the host between its forwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.rollout.fused_norms import swapped_forwards

_FUSED: list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = []
"""The compiled silu(gate) * up (dynamic shapes: one compilation for every batch size), once made."""
_VERIFIED: dict[type[nn.Module], bool] = {}
"""Whether a class's forward computes the gated SiLU MLP: checked once."""
_FAILURE: list[str] = []
"""Why the function could not be compiled: said once, then every MLP keeps its own forward."""


def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _candidate(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    # A DTensor weight is a sharded model's shard (FSDP2 gathers it around the forward): not this module's whole.
    return (all(isinstance(linear, nn.Linear) and not isinstance(linear.weight, DTensor) for linear in linears)
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")
            and "forward" not in module.__dict__)


def _gated(module: nn.Module, x: torch.Tensor, act_and_mul: Callable) -> torch.Tensor:
    return module.down_proj(act_and_mul(module.gate_proj(x), module.up_proj(x)))


@torch.no_grad()
def _computes_gated_silu(module: nn.Module) -> bool:
    """Whether the module's class computes down(silu(gate(x)) * up(x)): its own forward on a probe of it (small
    random projections, fp32, on the CPU) against that formula. A probe, not the module: the offload engine keeps
    a streamed layer's weights on the host between its forwards, possibly as fp32 masters of a bf16 compute, and
    what is checked is the class's arithmetic, not these weights. A forward that fails on the probe (one that
    reads sizes from its config) counts as not computing it."""
    key = type(module)
    if key not in _VERIFIED:
        generator = torch.Generator().manual_seed(0)
        probe = object.__new__(type(module))  # object's: an FSDP2 unit's class has a __new__ that calls __init__
        probe.__dict__.update(module.__dict__)
        probe._modules = dict(module._modules)
        for name, (inputs, outputs) in {"gate_proj": (16, 32), "up_proj": (16, 32), "down_proj": (32, 16)}.items():
            linear = nn.Linear(inputs, outputs, bias=getattr(module, name).bias is not None, dtype=torch.float32)
            for tensor in linear.parameters():
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32))
            probe._modules[name] = linear
        sample = torch.randn((2, 1, 16), generator=generator, dtype=torch.float32) * 4  # well into SiLU's curve
        try:
            expected = type(module).forward(probe, sample)
        except Exception:  # noqa: BLE001 - any failure of a class's own forward on the probe means "not this"
            _VERIFIED[key] = False
        else:
            fused = _gated(probe, sample, _silu_and_mul)
            _VERIFIED[key] = (isinstance(expected, torch.Tensor) and expected.shape == fused.shape
                              and torch.allclose(expected, fused, rtol=1e-5, atol=1e-5))
    return _VERIFIED[key]


def _compiled(say: Callable[[str], None]) -> Callable | None:
    if _FAILURE:
        return None
    if not _FUSED:
        try:
            compiled = torch.compile(_silu_and_mul, dynamic=True, fullgraph=True)
            probe = torch.randn((2, 1, 8), device="cuda", dtype=torch.bfloat16)
            compiled(probe, probe)  # compiles now, outside any capture
        # torch.compile's failures (no Triton, no C compiler) share no exception type.
        except Exception as error:  # noqa: BLE001
            _FAILURE.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            say(f"gated MLP: silu(gate) * up did not compile ({_FAILURE[0]}); the decode keeps the models' own MLP "
                "forwards")
            return None
        _FUSED.append(compiled)
    return _FUSED[0]


def _decode_forward(module: nn.Module, act_and_mul: Callable) -> Callable:
    own = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[1] == 1:
            return _gated(module, x, act_and_mul)
        return own(module, x)

    return forward


@contextlib.contextmanager
def fused_mlps(model: nn.Module, device: torch.device, say: Callable[[str], None] = print) -> Iterator[int]:
    """Inside, on a GPU: every gated SiLU MLP of `model` runs its decode steps with the activation and product
    compiled into one kernel; yields how many. On a CPU nothing changes: yields 0. `say` gets the one line that
    says the function could not be compiled. A class is checked on a probe of it (_computes_gated_silu), so a
    layer the offload engine streams, its weights on the host between forwards, is fused as a resident one is."""
    forwards = {}
    if device.type == "cuda":
        candidates = [module for module in model.modules() if _candidate(module)]
        act_and_mul = _compiled(say) if candidates else None
        if act_and_mul is not None:
            forwards = {module: _decode_forward(module, act_and_mul) for module in candidates
                        if _computes_gated_silu(module)}
    with swapped_forwards(forwards) as swapped:
        yield swapped

