"""actor_rollout_ref.model.use_fused_kernels (verl's key): each position's log-prob of its label and entropy, both of
softmax(h W^T / temperature), computed from the last hidden states h [N, H] and the output head's weight W [V, H] a
tile of positions by vocabulary rows at a time, never the [N, V] logits (verl's FusedLinearForPPO,
verl/utils/experimental/torch_functional.py, chunks positions over the whole vocabulary; here the vocabulary is
chunked too, so that a head the offload engine streams in row chunks is read one chunk at a time).

The forward keeps, per position, a running maximum, the sum of exp(z - max) and the sum of exp(z - max) z over the
vocabulary chunks seen (the logsumexp and the softmax's mean logit, combined chunk by chunk as flash attention
combines its softmax), and the label's logit. It saves the hidden states, the weight (a reference), the labels and
two float32 numbers per position; the backward computes each tile's logits again and from them the gradients of the
hidden states and of the weight. What the composed path keeps is the [N, V] logits, 1.25 GB in bf16 per
4112-token sequence of a 152k vocabulary (and as much again for their gradient).

Arithmetic as `functional.log_probs_and_entropy_from_logits` does it: the logits in the weight's dtype, then float32
divided by the temperature; the gradient of the logits rounded to that dtype before the two matrix products.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainer.algorithms.functional import LOSS_CHUNK_ELEMENTS, softmax_gradient

HEAD_ROWS_PER_CHUNK = 8192
"""Vocabulary rows of a resident head's weight a tile reads (the weight gradient of a chunk adds up in float32:
8192 x 3584 x 4 bytes = 117 MB for a 7B head)."""
TILE_ELEMENTS = LOSS_CHUNK_ELEMENTS
"""Logits a tile computes at once (positions x chunk rows; 64 MB in float32), as the unfused path chunks them."""


class HeadRows:
    """The head's [V, H] weight as the fused computation reads it: a resident weight, in slices of `rows_per_chunk`
    rows, whose gradient autograd accumulates. The offload engine's head streamed in chunks is a subclass
    (trainer/offload/rows.py) that fetches each chunk and sends each chunk's gradient to the host itself."""

    sends_weight_grad = False
    """Whether `send_weight_grad` takes the weight's gradient (else autograd gets it)."""

    def __init__(self, rows_per_chunk: int | None = None):
        self.rows_per_chunk = rows_per_chunk or HEAD_ROWS_PER_CHUNK

    def chunks(self, weight: torch.Tensor, *, backward: bool) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, the weight's rows from there) in order, reversed in the backward; each one is read only
        until the next is asked for."""
        firsts = range(0, weight.shape[0], self.rows_per_chunk)
        for first in reversed(firsts) if backward else firsts:
            yield first, weight[first:first + self.rows_per_chunk]

    def begin_backward(self) -> None:
        """Called once as the backward starts, before any chunk is asked for."""

    def send_weight_grad(self, first: int, grad: torch.Tensor) -> None:
        raise NotImplementedError("a resident head's weight gradient goes through autograd")


def fused_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                temperature: float = 1.0, *, entropy_graph: bool = True,
                                rows: HeadRows | None = None,
                                tile_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] hidden states, the head's [V, H] weight and [...] labels -> float32 [...] log-probs of the labels and
    entropies of softmax(hidden weight^T / temperature), without the [..., V] logits (see the module's docstring).
    Without `entropy_graph` the entropies carry no gradient (a metric). `rows`: how the weight is read (a resident
    weight by default); `tile_elements`: the logits computed at once (TILE_ELEMENTS)."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"fused head: labels of shape {tuple(labels.shape)} for hidden states of shape "
                         f"{tuple(hidden.shape)}; the labels need one per position")
    log_probs, entropies = _FusedHeadLogProbs.apply(  # type: ignore[no-untyped-call]
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).long(), temperature,
        rows or HeadRows(), tile_elements or TILE_ELEMENTS)
    shape = hidden.shape[:-1]
    return log_probs.view(shape), (entropies if entropy_graph else entropies.detach()).view(shape)


class _FusedHeadLogProbs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], labels [N]) -> float32 [N] log-probs and entropies, tile by tile."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                rows: HeadRows, tile_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused output (the entropy as a metric) gets no gradient at all
        count = hidden.shape[0]
        maxes = torch.full((count,), -torch.inf, dtype=torch.float32, device=hidden.device)
        sums, weighted, picked = torch.zeros_like(maxes), torch.zeros_like(maxes), torch.zeros_like(maxes)
        for first, chunk in rows.chunks(weight, backward=False):
            for part in _tiles(count, chunk.shape[0], tile_elements):
                scaled = _scaled_logits(hidden[part], chunk, temperature)
                new_max = torch.maximum(maxes[part], scaled.amax(-1))
                exponentials = torch.exp(scaled - new_max.unsqueeze(-1))
                rescale = torch.exp(maxes[part] - new_max)  # 0 where nothing was seen yet (-inf)
                sums[part] = sums[part] * rescale + exponentials.sum(-1)
                weighted[part] = weighted[part] * rescale + (exponentials * scaled).sum(-1)
                maxes[part] = new_max
                inside, index = _labels_in(labels[part], first, chunk.shape[0])
                picked[part] += torch.where(inside, scaled.gather(-1, index.unsqueeze(-1)).squeeze(-1), 0.0)
        totals = maxes + torch.log(sums)  # logsumexp
        means = weighted / sums  # sum_j p_j z_j
        ctx.save_for_backward(hidden, weight, labels, totals, means)
        ctx.temperature, ctx.rows, ctx.tile_elements = temperature, rows, tile_elements
        return picked - totals, totals - means

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None,
                 grad_entropies: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, totals, means = ctx.saved_tensors
        nothing = (None, None, None, None, None, None)
        if grad_log_probs is None and grad_entropies is None:
            return nothing
        rows: HeadRows = ctx.rows
        rows.begin_backward()
        trains_weight = weight.requires_grad if rows.sends_weight_grad else ctx.needs_input_grad[1]
        grad_weight = torch.empty_like(weight) if trains_weight and not rows.sends_weight_grad else None
        grad_hidden = (torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
                       if ctx.needs_input_grad[0] else None)
        count = hidden.shape[0]
        for first, chunk in rows.chunks(weight, backward=True):
            chunk_grad = (torch.zeros(chunk.shape, dtype=torch.float32, device=chunk.device)
                          if trains_weight else None)
            for part in _tiles(count, chunk.shape[0], ctx.tile_elements):
                grad_logits = _grad_of_logits(
                    _scaled_logits(hidden[part], chunk, ctx.temperature), *_labels_in(labels[part], first,
                                                                                     chunk.shape[0]),
                    totals[part], means[part], None if grad_log_probs is None else grad_log_probs[part],
                    None if grad_entropies is None else grad_entropies[part], ctx.temperature).to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[part] += grad_logits @ chunk
                if chunk_grad is not None:
                    chunk_grad += grad_logits.t() @ hidden[part]
            if chunk_grad is None:
                continue
            if grad_weight is not None:
                grad_weight[first:first + chunk.shape[0]] = chunk_grad
            else:
                rows.send_weight_grad(first, chunk_grad.to(weight.dtype))
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight, *nothing[2:])


def _tiles(count: int, chunk_rows: int, tile_elements: int) -> list[slice]:
    """The position runs of one weight chunk's tiles: as many positions as `tile_elements` logits hold."""
    positions = max(1, tile_elements // max(1, chunk_rows))
    return [slice(first, first + positions) for first in range(0, count, positions)]


def _scaled_logits(hidden: torch.Tensor, chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A tile's logits in the weight's dtype, then float32 over the temperature (as the unfused path scales them)."""
    logits = (hidden @ chunk.t()).float()
    return logits / temperature if temperature != 1.0 else logits


def _labels_in(labels: torch.Tensor, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels fall in the chunk of `rows` rows from `first`, and their index in it (0 for the others)."""
    inside = (labels >= first) & (labels < first + rows)
    return inside, torch.where(inside, labels - first, 0)


def _grad_of_logits(scaled: torch.Tensor, inside: torch.Tensor, index: torch.Tensor, totals: torch.Tensor,
                    means: torch.Tensor, grad_log_probs: torch.Tensor | None, grad_entropies: torch.Tensor | None,
                    temperature: float) -> torch.Tensor:
    """A tile's float32 gradient of the logits: the logits' path's arithmetic (softmax_gradient) over this tile's
    columns, with the labels that fall in it."""
    return softmax_gradient(scaled, totals, index, grad_log_probs, grad_entropies, temperature, means=means,
                            inside=inside)
