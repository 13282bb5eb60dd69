"""use_fused_kernels' arithmetic (trainer/algorithms/fused_head.py): log-probs, entropies and the gradients of the
hidden states and the head's weight equal those of the logits' path to float32 rounding, tile by tile, without ever
making a tensor of the [N, V] logits' size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.algorithms import log_probs_and_entropy_from_logits
from trainer.algorithms.fused_head import HeadRows, fused_log_probs_and_entropy

POSITIONS, WIDTH, VOCABULARY = (3, 40), 16, 300
# float32 sums over the vocabulary in another order (each path is as far from float64's numbers as the other).
TOLERANCE = {"rtol": 1e-5, "atol": 5e-5}


def head_inputs(seed: int = 0, *, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Logits of about 2 nats' spread over the vocabulary, as a language model's.
    hidden = (torch.randn(*POSITIONS, WIDTH, generator=generator) / 2).to(dtype).requires_grad_()
    weight = torch.randn(VOCABULARY, WIDTH, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCABULARY, POSITIONS, generator=generator)
    return hidden, weight, labels


def scores_and_gradients(log_probs: torch.Tensor, entropies: torch.Tensor,
                         inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
    """The forward's two outputs, then the gradients of a loss that weighs each position's figures differently."""
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(2, *POSITIONS, generator=generator).to(log_probs.device)
    loss = (log_probs * weights[0]).sum()
    if entropies.requires_grad:
        loss = loss + (entropies * weights[1]).sum()
    gradients = torch.autograd.grad(loss, [tensor for tensor in inputs if tensor.requires_grad], allow_unused=True)
    return [log_probs.detach(), entropies.detach(), *gradients]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy_graph", [True, False])
@pytest.mark.parametrize(("rows_per_chunk", "tile_elements"), [(None, None), (64, 1000), (300, 700), (7, 50)],
                         ids=["defaults", "chunks_of_64_rows", "whole_vocabulary_few_positions", "tiny_tiles"])
def test_fused_log_probs_entropies_and_gradients_are_the_logits_paths(temperature, entropy_graph, rows_per_chunk,
                                                                      tile_elements):
    hidden, weight, labels = head_inputs()
    expected = scores_and_gradients(*log_probs_and_entropy_from_logits(
        hidden @ weight.t(), labels, temperature, entropy_graph=entropy_graph), (hidden, weight))
    got = scores_and_gradients(*fused_log_probs_and_entropy(
        hidden, weight, labels, temperature, entropy_graph=entropy_graph, rows=HeadRows(rows_per_chunk),
        tile_elements=tile_elements), (hidden, weight))
    for name, value, reference in zip(("log-probs", "entropies", "hidden grad", "weight grad"), got, expected,
                                      strict=True):
        torch.testing.assert_close(value, reference, **TOLERANCE, msg=lambda message, name=name: f"{name}: {message}")


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_get_theirs():
    hidden, weight, labels = head_inputs()
    weight.requires_grad_(False)
    expected = scores_and_gradients(*log_probs_and_entropy_from_logits(hidden @ weight.t(), labels, 0.8), (hidden,))
    got = scores_and_gradients(*fused_log_probs_and_entropy(hidden, weight, labels, 0.8, rows=HeadRows(64),
                                                            tile_elements=500), (hidden,))
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, **TOLERANCE)


def test_bf16_inputs_give_the_logits_paths_numbers_to_bf16_rounding():
    hidden, weight, labels = head_inputs(dtype=torch.bfloat16)
    expected = scores_and_gradients(*log_probs_and_entropy_from_logits(hidden @ weight.t(), labels, 0.7),
                                    (hidden, weight))
    got = scores_and_gradients(*fused_log_probs_and_entropy(hidden, weight, labels, 0.7, rows=HeadRows(64),
                                                            tile_elements=1000), (hidden, weight))
    assert [value.dtype for value in got] == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value.float(), reference.float(), rtol=2e-2, atol=2e-2)


def test_labels_of_another_shape_are_one_line_naming_both_shapes():
    hidden, weight, labels = head_inputs()
    with pytest.raises(ValueError, match=r"labels of shape \(3, 39\) for hidden states of shape \(3, 40, 16\)"):
        fused_log_probs_and_entropy(hidden, weight, labels[:, 1:])


class LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an operation made while it was active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_of_the_logits_size_is_made_in_the_forward_or_the_backward():
    hidden, weight, labels = head_inputs()
    logits_size = hidden.shape[0] * hidden.shape[1] * VOCABULARY  # 36,000
    with LargestOutput() as unfused:
        log_probs, entropies = log_probs_and_entropy_from_logits(hidden @ weight.t(), labels)
        (log_probs.sum() + entropies.sum()).backward()
    assert unfused.largest >= logits_size, "the probe sees the logits of the path that makes them"
    with LargestOutput() as fused:
        log_probs, entropies = fused_log_probs_and_entropy(hidden, weight, labels, rows=HeadRows(100),
                                                           tile_elements=2000)
        (log_probs.sum() + entropies.sum()).backward()
    # The largest: the weight's gradient (V x H = 4,800) and its float32 chunk, a tile's 2,000 logits, the hidden
    # states' gradient (N x H = 1,920).
    assert fused.largest <= max(VOCABULARY * WIDTH, 2000), fused.largest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_on_a_gpu_the_fused_tiles_give_the_logits_paths_figures(dtype):
    """The tiles' matrix products and reductions on the GPU's kernels (bf16 as the models train), against the
    logits' path on the same device: bf16's own rounding of the logits bounds the difference there."""
    cuda = [tensor.detach().cuda().requires_grad_(tensor.requires_grad) for tensor in head_inputs(dtype=dtype)[:2]]
    hidden, weight = cuda
    labels = head_inputs()[2].cuda()
    expected = scores_and_gradients(*log_probs_and_entropy_from_logits(hidden @ weight.t(), labels, 0.6),
                                    (hidden, weight))
    got = scores_and_gradients(*fused_log_probs_and_entropy(hidden, weight, labels, 0.6,
                                                            rows=HeadRows(64), tile_elements=1000), (hidden, weight))
    tolerance = TOLERANCE if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, value, reference in zip(("log-probs", "entropies", "hidden grad", "weight grad"), got, expected,
                                      strict=True):
        torch.testing.assert_close(value.float().cpu(), reference.float().cpu(), **tolerance,
                                   msg=lambda message, name=name: f"{name}: {message}")
