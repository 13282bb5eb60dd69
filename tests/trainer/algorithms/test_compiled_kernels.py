"""actor.use_torch_compile (trainer/algorithms/compiled_kernels.py): the update's log-prob and entropy chunks compiled
on a GPU, checked against the functions as written at their first call; as written on a CPU or where compiling fails
or disagrees, said in one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from trainer.algorithms.compiled_kernels import CompiledChunk, compiled_kernels
from trainer.algorithms.functional import EAGER_KERNELS, log_probs_and_entropy_from_logits


def chunk_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 11, generator=generator), torch.randint(0, 11, (2, 3), generator=generator)


def counting_compiler(replacement: Callable[..., Any]) -> tuple[list[int], Callable[..., Any]]:
    calls: list[int] = []

    def compiler(function: Callable[..., Any]) -> Callable[..., Any]:
        def compiled(*args: Any) -> Any:
            calls.append(1)
            return replacement(*args)
        return compiled

    return calls, compiler


def test_on_a_cpu_the_functions_run_as_written_and_nothing_is_compiled() -> None:
    calls, compiler = counting_compiler(EAGER_KERNELS.forward)
    chunk = CompiledChunk(EAGER_KERNELS.forward, compiler=compiler)
    logits, labels = chunk_inputs()
    for expected, got in zip(EAGER_KERNELS.forward(logits, labels, 1.0), chunk(logits, labels, 1.0), strict=True):
        torch.testing.assert_close(got, expected)
    assert calls == [] and chunk.agrees == {}


def test_a_compiled_function_that_agrees_is_used_from_then_on() -> None:
    calls, compiler = counting_compiler(EAGER_KERNELS.forward)
    said: list[str] = []
    chunk = CompiledChunk(EAGER_KERNELS.forward, said.append, compiler=compiler, device_types=("cpu",))
    logits, labels = chunk_inputs()
    chunk(logits, labels, 1.0)
    chunk(logits, labels, 1.0)
    assert calls == [1, 1] and said == [], "checked once, then used alone"
    assert chunk.agrees == {(torch.float32, (False, False, False)): True}


def test_a_compiled_function_that_disagrees_or_fails_is_dropped_with_one_line() -> None:
    def wrong(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> Any:
        log_probs, entropies, totals = EAGER_KERNELS.forward(logits, labels, temperature)
        return log_probs + 0.5, entropies, totals

    calls, compiler = counting_compiler(wrong)
    said: list[str] = []
    chunk = CompiledChunk(EAGER_KERNELS.forward, said.append, compiler=compiler, device_types=("cpu",))
    logits, labels = chunk_inputs()
    first, again = chunk(logits, labels, 1.0), chunk(logits, labels, 1.0)
    expected = EAGER_KERNELS.forward(logits, labels, 1.0)
    torch.testing.assert_close(first[0], expected[0])
    torch.testing.assert_close(again[0], expected[0])
    assert calls == [1] and len(said) == 1 and "disagreed" in said[0]

    def no_triton(function: Callable[..., Any]) -> Callable[..., Any]:
        raise RuntimeError("Cannot find a working triton installation")

    failing = CompiledChunk(EAGER_KERNELS.forward, said.append, compiler=no_triton, device_types=("cpu",))
    torch.testing.assert_close(failing(logits, labels, 1.0)[0], expected[0])
    assert "did not compile (RuntimeError: Cannot find a working triton installation)" in said[1]


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_kernels_give_the_log_probs_entropies_and_gradients_as_written_on_a_gpu(temperature: float) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(3, 40, 3000, device="cuda", generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 3000, (3, 40), device="cuda", generator=generator)
    said: list[str] = []
    kernels = compiled_kernels(said.append)
    results = []
    for chosen in (EAGER_KERNELS, kernels, kernels):  # the compiled ones checked, then used alone
        leaf = logits.clone().requires_grad_(True)
        log_probs, entropies = log_probs_and_entropy_from_logits(leaf, labels, temperature, kernels=chosen)
        (log_probs.sum() + 0.3 * entropies.sum()).backward()
        results.append((log_probs, entropies, leaf.grad))
    assert said == [] and all(kernels.forward.agrees.values()) and all(kernels.backward.agrees.values())
    for got in results[1:]:
        for expected_tensor, got_tensor in zip(results[0], got, strict=True):
            torch.testing.assert_close(got_tensor.float(), expected_tensor.float(), rtol=1e-3, atol=1e-3)
