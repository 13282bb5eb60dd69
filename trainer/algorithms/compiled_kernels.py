"""actor.use_torch_compile (verl's key, on by default as in verl): the per-chunk functions of the actor update's
log-probs and entropy (functional.log_probs_and_entropy_from_logits) compiled with torch.compile, as verl compiles
its entropy_from_logits. Inductor fuses each chunk's upcast, logsumexp, gather and entropy (and the backward's
softmax and products) into a few kernels that read the half-precision logits without the float32 copies the
functions as written make.

On a GPU only: a CPU runs the functions as written (inductor's CPU code needs a C++ compiler and compiles for tens of
seconds, for arithmetic that is not the CPU run's cost). Each compiled function is checked against the one as written
at its first call of each kind (dtype, which gradients); one that fails to compile or disagrees is not used again,
and one line says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.algorithms.functional import EAGER_KERNELS, ChunkKernels

# float32 results of the same arithmetic summed in another order (a logsumexp over a vocabulary).
_TOLERANCE = 1e-4


class CompiledChunk:
    """`function` (a chunk function, its first argument the logits) compiled at its first call on logits of one of
    `device_types` (CUDA's); as written elsewhere, or where the compiled one failed or disagreed."""

    def __init__(self, function: Callable[..., Any], say: Callable[[str], None] = print, *,
                 compiler: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
                 device_types: tuple[str, ...] = ("cuda",)):
        self.function = function
        self.say = say
        self._compile = compiler or (lambda function: torch.compile(function, dynamic=True))
        self.device_types = device_types
        self.compiled: Callable[..., Any] | None = None
        self.agrees: dict[tuple[Any, ...], bool] = {}
        """Per kind of call (logits dtype, which arguments are None): whether the compiled function agreed."""
        self.failure: str | None = None

    def __call__(self, *args: Any) -> Any:
        logits = args[0]
        if logits.device.type not in self.device_types or self.failure is not None:
            return self.function(*args)
        kind = (logits.dtype, tuple(argument is None for argument in args))
        if kind in self.agrees:
            return (self.compiled if self.agrees[kind] and self.compiled is not None else self.function)(*args)
        expected = self.function(*args)
        try:
            self.compiled = self.compiled or self._compile(self.function)
            got = self.compiled(*args)
        except torch.OutOfMemoryError:
            raise  # the update's out-of-memory recovery handles it, as for the function as written
        # torch.compile's failures (no Triton, no C compiler, an op it cannot trace) share no exception type.
        except Exception as error:  # noqa: BLE001
            self.failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self.say(f"actor.use_torch_compile: {self.function.__name__} did not compile ({self.failure}); the "
                     "update's log-probs and entropy run as written")
            return expected
        self.agrees[kind] = _same(expected, got)
        if not self.agrees[kind]:
            self.say(f"actor.use_torch_compile: the compiled {self.function.__name__} disagreed with the one as "
                     f"written on {logits.dtype} logits; the update's log-probs and entropy run as written")
        return expected


def compiled_kernels(say: Callable[[str], None] = print) -> ChunkKernels:
    """The chunk functions of log_probs_and_entropy_from_logits, compiled on a GPU (CompiledChunk)."""
    return ChunkKernels(CompiledChunk(EAGER_KERNELS.forward, say), CompiledChunk(EAGER_KERNELS.backward, say))


def _same(expected: Any, got: Any) -> bool:
    pairs = list(zip(expected, got, strict=True)) if isinstance(expected, tuple) else [(expected, got)]
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=_TOLERANCE, atol=_TOLERANCE)
               for a, b in pairs)
