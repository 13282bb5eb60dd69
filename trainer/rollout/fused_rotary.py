"""A decode's rotary position embedding as one compiled kernel (issue 15).

transformers' `apply_rotary_pos_emb` (Llama, Qwen2, Mistral and most decoder models define their own copy in
their modeling module) runs as about ten kernels for a decoded token: for the queries and for the keys, the
product with the cosines, the negation and concatenation of `rotate_half`, the product with the sines and the
sum. Each is a few microseconds of launch for a [batch, heads, 1, head dim] tensor: measured on an H200 with the
7B shape (benchmarks/README.md, `static_profile`) about 0.8 ms of a 7.2 ms step, 28 layers.

Inside the decode, on a GPU, the model's own function is compiled with `torch.compile` (inductor fuses it into
one or two kernels) and called for decode steps, where the cosines cover one position; the prompt's forward
keeps the original. Compiling the model's own function, not writing one, keeps whatever the architecture does
(partial rotary dimensions, another layout, an unsqueeze dimension). The compiled function is checked against
the original on the first decode call's own inputs: where compiling fails (no Triton, no C compiler) or the
two disagree beyond bf16's rounding of one product, the decode keeps the original and says so once.

Shapes are compiled dynamic once, so the batch buckets of a shrinking batch reuse one compilation, and each
bucket's first step (eager, before its CUDA graph is captured) runs the compiled code: a capture never
compiles. The compilation is paid once per process (a few seconds, at the first rollout).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from torch import nn

NAME = "apply_rotary_pos_emb"

_COMPILED: dict[Callable, Callable] = {}
"""Each original function's compiled one (dynamic shapes: one compilation for every batch size)."""
_AGREES: dict[tuple[Callable, torch.dtype], bool] = {}
"""Whether the compiled function gave the original's result, per (original, dtype): checked once."""
_FAILURES: dict[Callable, str] = {}
"""Why a function could not be compiled: said once, then the original is kept."""


def _modules_applying_rotary(model: nn.Module) -> list[ModuleType]:
    """The modeling modules whose classes' forwards call their module's own `apply_rotary_pos_emb`."""
    found: dict[str, ModuleType] = {}
    for module in model.modules():
        cls = type(module)
        forward = getattr(cls, "forward", None)
        # Under transformers' decorators (deprecate_kwarg, ...): the forward they wrap.
        code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None
        python_module = sys.modules.get(cls.__module__)
        if code is None or python_module is None or NAME not in code.co_names:
            continue
        if callable(getattr(python_module, NAME, None)):
            found[python_module.__name__] = python_module
    return list(found.values())


def _decoding(cos: torch.Tensor) -> bool:
    """Whether the call rotates one position per row ([batch, 1, head dim] cosines): a decode step."""
    return cos.dim() == 3 and cos.shape[1] == 1 and cos.is_cuda


def _check(original: Callable, compiled: Callable, args: tuple, kwargs: dict) -> tuple[bool, object]:
    """Whether the compiled function gives the original's result on these inputs, and its result."""
    expected = original(*args, **kwargs)
    got = compiled(*args, **kwargs)
    pairs = list(zip(expected, got, strict=True)) if isinstance(expected, tuple) else [(expected, got)]
    # One rounding where transformers rounds each product and the sum: a unit in bf16's last place or two.
    tolerance = 1e-5 if args[0].dtype == torch.float32 else 2 ** -6
    agrees = all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance)
                 for a, b in pairs)
    return agrees, got if agrees else expected


def _fused(original: Callable, say: Callable[[str], None]) -> Callable:
    """`original` for a prompt's forward, its compiled copy for a decode step once that agreed with it."""

    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args, **kwargs):
        if not _decoding(cos) or original in _FAILURES:
            return original(q, k, cos, sin, *args, **kwargs)
        key = (original, q.dtype)
        if key in _AGREES:
            return (_COMPILED[original] if _AGREES[key] else original)(q, k, cos, sin, *args, **kwargs)
        try:
            compiled = _COMPILED.get(original) or torch.compile(original, dynamic=True, fullgraph=True)
            _COMPILED[original] = compiled
            _AGREES[key], result = _check(original, compiled, (q, k, cos, sin, *args), kwargs)
        # torch.compile's failures (no Triton, no C compiler, an op it cannot trace) share no exception type.
        except Exception as error:  # noqa: BLE001
            _FAILURES[original] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            say(f"rotary embedding: {original.__module__}.{NAME} did not compile ({_FAILURES[original]}); "
                "the decode keeps transformers' own (about 0.8 ms a token at 7B)")
            return original(q, k, cos, sin, *args, **kwargs)
        if not _AGREES[key]:
            say(f"rotary embedding: the compiled {original.__module__}.{NAME} disagreed with the original in "
                f"{q.dtype}; the decode keeps transformers' own")
        return result

    apply.fused_rotary_of = original  # type: ignore[attr-defined]
    return apply


@contextlib.contextmanager
def fused_rotary(model: nn.Module, device: torch.device, say: Callable[[str], None] = print) -> Iterator[int]:
    """Inside, on a GPU: the decode steps of `model` rotate queries and keys with the compiled copy of their
    modeling module's own `apply_rotary_pos_emb`; yields how many modeling modules that covers. On a CPU nothing
    changes (no graphs there, and the launches cost nothing beside the arithmetic): yields 0. `say` gets the
    one line that says a function could not be compiled or disagreed."""
    patched: list[tuple[ModuleType, Callable]] = []
    if device.type == "cuda":
        for python_module in _modules_applying_rotary(model):
            original = getattr(python_module, NAME)
            if hasattr(original, "fused_rotary_of"):
                continue  # already inside another decode's swap
            setattr(python_module, NAME, _fused(original, say))
            patched.append((python_module, original))
    try:
        yield len(patched)
    finally:
        for python_module, original in patched:
            setattr(python_module, NAME, original)
