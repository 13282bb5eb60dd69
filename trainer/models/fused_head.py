"""A causal LM's output head swapped, around one forward, for the fused log-probs and entropies
(actor_rollout_ref.model.use_fused_kernels; the arithmetic: trainer/algorithms/fused_head.py).

The head is still called as the model calls it, so every hook around it fires once around the fused computation as
it does around its matrix product: FSDP2's unshard and reshard of its weight, the offload engine's swap of a head it
keeps in a device slot (which the swapped forward reads as `head.weight`). A head the engine streams in chunks from
the CPU has a forward of the engine's own (trainer/offload/rows.py), which offers the same computation over its
chunks (`fused`); the swapped forward then goes through it.

The model's logits are then float32 [..., 2]: each kept position's log-prob of the token after it and its entropy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import slice_logits_to_keep

from trainer.algorithms.fused_head import fused_log_probs_and_entropy
from trainer.models.vision_language import is_vision_language

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""HF config keys of models whose forward changes the logits after the head (Gemma 2's soft cap, Cohere's and
Granite's scales): the head's product alone is not their logits."""


def fused_head_blocker(model: nn.Module, *, sequence_parallel: bool = False) -> str | None:
    """Why `model`'s log-probs cannot come from the fused head (one line), or None when they can. With
    `sequence_parallel` (Ulysses) its forwards run on sequence shards, whose log-probs come from their logits."""
    if sequence_parallel:
        return "the sequence-parallel forward (Ulysses) computes each shard's log-probs from its logits"
    if is_vision_language(model):
        return "a vision-language model's forward is not fused here"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "the model has no output head"
    if not isinstance(head, nn.Linear):
        return f"its output head is a {type(head).__name__} (a LoRA adapter on the head is one), not a linear layer"
    if head.bias is not None:
        return "its output head has a bias"
    config = model.config
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"its config's {name}={value} changes the logits after the head"
    return None


@dataclass(frozen=True)
class FusedScoring:
    """The fused head's settings for one forward: the sampling temperature, and whether the entropies carry their
    gradient (without an entropy bonus they are a metric)."""

    temperature: float
    entropy_graph: bool = True

    @contextlib.contextmanager
    def around(self, model: nn.Module, input_ids: torch.Tensor,
               logits_to_keep: int | torch.Tensor = 0) -> Iterator[None]:
        """Within it, `model`'s forward on the [B, T] rows `input_ids` with `logits_to_keep` (as the forward gets it;
        0: every position) gives as its logits float32 [..., 2]: per kept position, the log-prob of the token after
        it (the last position's: of token 0, never read) and the entropy."""
        following = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
        labels = slice_logits_to_keep(following.unsqueeze(-1), logits_to_keep).squeeze(-1)
        with fused_head_forward(model.get_output_embeddings(), labels, self.temperature,
                                entropy_graph=self.entropy_graph):
            yield


@contextlib.contextmanager
def fused_head_forward(head: nn.Module, labels: torch.Tensor, temperature: float, *,
                       entropy_graph: bool = True) -> Iterator[None]:
    """Within it, `head`'s forward takes the hidden states [..., H] (`labels` [...] in the same layout) and returns
    float32 [..., 2]: each position's log-prob of its label and entropy at `temperature`."""
    routed = head.__dict__.get("forward")  # a forward of the offload engine's (a head streamed from the CPU)
    streamed = getattr(routed, "fused", None)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        placed = labels.to(hidden.device)
        if streamed is not None:
            log_probs, entropies = streamed(hidden, placed, temperature, entropy_graph=entropy_graph)
        else:
            # Read here, not before: the hooks before this call put the weight the forward computes with in place.
            log_probs, entropies = fused_log_probs_and_entropy(hidden, head.weight, placed, temperature,
                                                               entropy_graph=entropy_graph)
        return torch.stack([log_probs, entropies], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        if routed is None:
            del head.forward
        else:
            head.forward = routed
