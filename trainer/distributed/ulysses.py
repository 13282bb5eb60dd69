"""Ulysses sequence parallelism for HuggingFace causal LMs (Jacobs et al. 2023, "DeepSpeed Ulysses",
arXiv:2309.14509), registered through transformers' attention interface.

A sequence-parallel (sp) group of S ranks shares every sequence of a micro-batch: each rank embeds, runs the
MLPs and norms, and applies the head on its own 1/S of the positions. Around attention an all-to-all trades
the local positions of all heads for all positions of 1/S of the heads, so each rank attends over the whole
sequence for its heads, and a second all-to-all trades back. Key-value heads fewer than S are repeated so
that each rank holds a whole one. The rotary embedding is right on every shard because each rank is given
the full batch's position ids of its own positions (`SequenceParallel.shard`), and the attention mask is
the full sequence's, built once per forward by transformers for the wrapped implementation.

Wiring into a trainer (the trainer owns the model calls; this module owns no global state)::

    mesh = sequence_parallel_mesh("cuda", world_size, sp_size)     # (dp, sp), via init_device_mesh
    sp = SequenceParallel.from_mesh(mesh)                           # this rank's sp group
    use_ulysses_attention(model)                                    # once, after the model is built
    ...
    shard = sp.shard(model, input_ids=..., attention_mask=..., position_ids=...)   # each micro-batch
    output = model(**shard.model_inputs(), use_cache=False)         # logits of the local positions only
    log_probs = shard.log_probs(logits)                             # [B, T] on every rank of the group
    values = shard.gather(values_local)                             # a critic's [B, T]

Every rank of an sp group must see the same micro-batch (the data-parallel rank, not the global rank, picks
the data), computes the same loss from the gathered tensors, and calls backward. The gathers' backward is
the all-gather's adjoint, a reduce-scatter: with the loss repeated on S ranks, each rank's parameter
gradients are S times its own positions' share, so *averaging* the gradients over the sp group (as FSDP2
over the flattened (dp, sp) mesh, or a data-parallel average over all ranks, does) gives the gradient of one
rank running the whole sequence. That is verl's convention (its gather's grad_scaler) too.

Generation and any forward without `sequence_parallel` in its inputs run the wrapped implementation as
it is, so one model serves rollout and the sharded update.

`sequence_parallel_offload`: in the trainer, with FSDP2 over all ranks (trainer/distributed/sharding.py), the key
puts the policy's embedding and head units on the CPU through CPUOffloadPolicy; FSDP2 shards them by rows, so
each rank keeps and copies only its 1/world of the embedding rows and of the head's vocabulary chunks, and
all-gathers the rest around each forward and backward. What the project's single-device offload engine would
see under Ulysses instead (not a configuration the trainer runs: that engine places whole models on one rank):
- Embedding rows: the model embeds `shard.input_ids`, the local positions only, so an embedding on the CPU
  (trainer/offload/rows.py) gathers and ships only the rows of the rank's own tokens, and only their
  gradients come back. Nothing more is needed from the engine.
- Output head: each rank applies the head to its own positions only (logits are [B, T/S, V] per rank, never
  the whole sequence's), but the matmul needs every vocabulary row, so a head on the CPU still streams all
  its chunks to every rank. For each rank to move only 1/S of the chunks the head must be split by
  vocabulary: the engine streams rank s only rows [s V/S, (s+1) V/S), the hidden states are all-gathered
  along the sequence before the head, and log-softmax, entropy and the label's logit are reduced over the
  group (vocabulary-parallel cross-entropy). That needs an engine hook for a per-rank row range of the
  head unit; it is not built here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as collectives
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainer.algorithms import log_probs_from_logits

PREFIX = "ulysses_"
"""Registered names are this prefix and the wrapped implementation's: ulysses_sdpa."""
WRAPPABLE = ("sdpa",)
"""Implementations Ulysses can wrap. Not flash-attention yet: transformers' flash path picks its kernel from
module.config._attn_implementation, which reads ulysses_flash_attention_2 under the wrapper (it would need a
module view reporting the wrapped name), and no machine here has flash-attn to test it on."""
MODEL_KEYWORD = "sequence_parallel"
"""The model-call keyword that carries an `UlyssesAttention` down to every attention layer."""

# The all-gather with autograd is named all_gather_single_autograd from torch 2.13 on.
_all_gather = getattr(collectives, "all_gather_single_autograd", None) or collectives.all_gather_tensor_autograd


# --------------------------------------------------------------------------------- registration


def register_ulysses_attention(base: str = "sdpa") -> str:
    """Register ``ulysses_<base>`` with transformers (attention and mask function) and return the name."""
    if base not in WRAPPABLE:
        raise ValueError(f"Ulysses attention wraps one of {', '.join(WRAPPABLE)}; got {base!r}")
    name = PREFIX + base

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, sequence_parallel: UlyssesAttention | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        wrapped = ALL_ATTENTION_FUNCTIONS[base]
        if sequence_parallel is None:
            output: tuple[torch.Tensor, None] = wrapped(module, query, key, value, attention_mask, *args, **kwargs)
            return output
        return sequence_parallel.attend(wrapped, module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, attention)
    # The same mask as the wrapped implementation's: without a sequence_parallel input the model is unchanged.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def use_ulysses_attention(model: PreTrainedModel) -> str:
    """Switch `model` to the Ulysses wrapper of its current attention implementation; returns the name."""
    current = model.config._attn_implementation
    base = current.removeprefix(PREFIX)
    if base not in WRAPPABLE:
        raise ValueError(f"Ulysses sequence parallelism needs attn_implementation sdpa; "
                         f"the model uses {current!r}")
    name = register_ulysses_attention(base)
    model.set_attn_implementation(name)
    return name


# ---------------------------------------------------------------------------------- the group


def sequence_parallel_mesh(device_type: str, world_size: int, sp_size: int) -> DeviceMesh:
    """The (dp, sp) mesh of all ranks: ranks r*sp_size ... (r+1)*sp_size - 1 share sequences (an sp group),
    so an sp group sits on one node whenever sp_size divides the ranks per node."""
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"ulysses_sequence_parallel_size: got {sp_size}; it must divide the {world_size} ranks")
    return init_device_mesh(device_type, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))


class SequenceParallel:
    """This rank's sequence-parallel group: splits micro-batches along the sequence and gathers outputs.

    `group` None (or a group of one rank) is sequence parallelism of degree 1: shards are the whole batch and
    gathers return their input, so a trainer keeps one code path for every degree.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, dimension: str = "sp") -> SequenceParallel:
        """The group of `mesh`'s `dimension` that holds this rank."""
        names = mesh.mesh_dim_names or ()
        if dimension not in names:
            raise ValueError(f"the device mesh has no {dimension!r} dimension; it has {names}")
        return cls(mesh.get_group(dimension) if mesh.size(names.index(dimension)) > 1 else None)

    def shard(self, model: PreTrainedModel, *, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor, pad_token_id: int = 0,
              decoder: torch.nn.Module | None = None) -> SequenceShard:
        """This rank's part of a [B, T] micro-batch (padded on the right to a multiple of the degree).

        `attention_mask` is 1 at real tokens (the trainer's left-padded prompts and right-padded responses);
        `position_ids` are the full batch's, so each rank's rotary embedding sees the true positions. A padding-free
        row ([1, N], the sequences' real tokens one after another, each one's position ids from 0) has no mask:
        transformers finds its sequences from the position ids and keeps them apart (a block-diagonal causal
        mask). Its padding up to a multiple of the degree has position id 0 everywhere, so each padding token is a
        sequence of its own, seen by no real token.

        With `decoder`, the model's decoder module, the micro-batch is split at the decoder's entry instead of
        before the model: for a model whose forward computes what its decoder reads (a vision-language model merges
        its images' embeddings into the tokens'), the whole padded sequence goes into the model, and the decoder's
        `inputs_embeds` and `position_ids` (here [3, B, T] multimodal ones too, split along their last dimension)
        are cut to this rank's positions there (`SequenceShard.forward`).
        """
        length = input_ids.shape[1]
        labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=pad_token_id)
        if self.size == 1:
            return SequenceShard(self, input_ids, position_ids, labels, length, attention_mask=attention_mask)
        padding = -length % self.size
        padded = [torch.nn.functional.pad(tensor, (0, padding), value=value) for tensor, value in
                  ((input_ids, pad_token_id), (position_ids, 0), (labels, pad_token_id))]
        padded_mask = None if attention_mask is None else torch.nn.functional.pad(attention_mask, (0, padding))
        # Multimodal positions carry no sequence boundaries; the mask is the padding's then.
        text_positions = padded[1] if padded[1].dim() == 2 else None
        full_mask = _full_sequence_mask(model, padded_mask, padded[0], text_positions)
        attention = UlyssesAttention(self, full_mask, text_positions)
        local_labels = padded[2].chunk(self.size, dim=1)[self.rank]
        if decoder is not None:
            return SequenceShard(self, padded[0], padded[1], local_labels, length, attention=attention,
                                 attention_mask=padded_mask, decoder=decoder)
        local = [tensor.chunk(self.size, dim=1)[self.rank] for tensor in padded[:2]]
        return SequenceShard(self, local[0], local[1], local_labels, length, attention=attention)

    def gather(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The group's shards of `local` joined along `dim` in rank order (autograd: a reduce-scatter back)."""
        if self.size == 1:
            return local
        # The functional all-gather joins along dimension 0 in its backward too; other dims go through it.
        leading = local.movedim(dim, 0).contiguous()
        gathered: torch.Tensor = _all_gather(leading, 0, self._group())
        return gathered.movedim(0, dim)

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError("a sequence-parallel degree of 1 exchanges nothing")
        return self.group

    def sequence_to_heads(self, states: torch.Tensor) -> torch.Tensor:
        """[B, H, T/S, D] local positions of all heads -> [B, H/S, T, D] all positions of this rank's heads."""
        batch, heads, local_length, width = states.shape
        parts = states.reshape(batch, self.size, heads // self.size, local_length, width).transpose(0, 1)
        received = collectives.all_to_all_single_autograd(parts.contiguous(), None, None, self._group())
        # received[s] holds sequence shard s of this rank's heads.
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * local_length, width)

    def heads_to_sequence(self, states: torch.Tensor) -> torch.Tensor:
        """[B, T, H/S, D] all positions of this rank's heads -> [B, T/S, H, D] local positions of all heads."""
        batch, length, heads, width = states.shape
        parts = states.reshape(batch, self.size, length // self.size, heads, width).transpose(0, 1)
        received = collectives.all_to_all_single_autograd(parts.contiguous(), None, None, self._group())
        # received[s] holds head shard s of this rank's positions.
        return received.permute(1, 2, 0, 3, 4).reshape(batch, length // self.size, self.size * heads, width)


def _full_sequence_mask(model: PreTrainedModel, attention_mask: torch.Tensor | None, input_ids: torch.Tensor,
                        position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The mask transformers would build for the whole [B, T] sequence of `input_ids` for the wrapped implementation:
    for SDPA a [B, 1, T, T] boolean mask, or None when there is no padding (causality alone, SDPA's is_causal).
    Without `attention_mask`, a row of packed sequences (position ids restarting at 0) gets the block-diagonal one."""
    # A multimodal model's decoder builds its mask from its text settings (the same object for a text model).
    config = model.config.get_text_config()
    if not config._attn_implementation.startswith(PREFIX):
        raise ValueError(f"the model uses attn_implementation {config._attn_implementation!r}; call "
                         "use_ulysses_attention(model) before sharding its inputs")
    # Only the shape, dtype and device of the embeddings matter to the mask; an empty hidden dimension is free.
    shape_only = torch.empty(*input_ids.shape, 0, dtype=model.dtype, device=input_ids.device)
    mask: torch.Tensor | None = create_causal_mask(config, shape_only, attention_mask, None, position_ids)
    return mask


# ----------------------------------------------------------------------------- the micro-batch


@dataclass
class UlyssesAttention:
    """What every attention layer of one sharded forward needs: the group, and the whole sequence's mask and
    position ids (an attention that reads sequence boundaries from position_ids gets the whole sequence's)."""

    parallel: SequenceParallel
    mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    """[B, T] text positions; None for a multimodal model's, which its layers are not given either."""

    def attend(self, wrapped: Callable[..., tuple[torch.Tensor, Any]], module: torch.nn.Module,
               query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
        """`wrapped` attention over the whole sequence for this rank's heads; [B, T/S, H, D] like the wrapped's."""
        if kwargs.get("sliding_window") is not None:
            raise ValueError("Ulysses sequence parallelism supports full attention only; this layer has a sliding "
                             f"window of {kwargs['sliding_window']}")
        heads, key_value_heads = query.shape[1], key.shape[1]
        size = self.parallel.size
        repeats = max(1, size // key_value_heads)
        if heads % size or (key_value_heads * repeats) % size:
            raise ValueError(f"Ulysses over {size} ranks needs heads divisible by {size}: the layer has "
                             f"{heads} attention and {key_value_heads} key-value heads")
        if repeats > 1:  # Each rank needs a whole key-value head; the same layout as transformers' repeat_kv.
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
            layer: Any = _KeyValueGroups(module, heads // (key_value_heads * repeats))
        else:
            layer = module
        query, key, value = (self.parallel.sequence_to_heads(states) for states in (query, key, value))
        if "position_ids" in kwargs:
            kwargs["position_ids"] = self.position_ids
        output, _ = wrapped(layer, query, key, value, self.mask, *args, **kwargs)
        return self.parallel.heads_to_sequence(output), None


class _KeyValueGroups:
    """An attention module as the wrapped function sees it once key-value heads were repeated: the same
    module with fewer query heads per key-value head (SDPA's own repeat reads num_key_value_groups)."""

    def __init__(self, module: torch.nn.Module, groups: int):
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@dataclass
class SequenceShard:
    """One rank's part of a [B, T] micro-batch: its [B, T/S] (padded) positions and how to gather outputs.

    labels: [B, T/S] the token each local position predicts (the next one; padding past the end).
    length: T, the micro-batch's length before padding; gathered tensors are cut back to it.
    With `decoder` (split at the decoder's entry), input_ids and position_ids are the whole padded sequence's.
    """

    parallel: SequenceParallel
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    length: int
    attention: UlyssesAttention | None = None
    attention_mask: torch.Tensor | None = None
    """The local batch's own mask when unsharded (degree 1); sharded forwards carry the full one in `attention`
    (split at the decoder, this is the padded [B, T] mask the model's own steps before it read)."""
    decoder: torch.nn.Module | None = None
    """The module whose inputs are split, when not the model's (SequenceParallel.shard)."""

    def forward(self, model: torch.nn.Module, **inputs: Any) -> Any:
        """The model's output for this shard (its logits are those of this rank's positions); `inputs`: what else
        the call takes (a vision-language model's pixel values and image grids)."""
        if self.decoder is None or self.attention is None:
            return model(**self.model_inputs(), **inputs, use_cache=False)
        handle = self.decoder.register_forward_pre_hook(self._decoder_inputs, with_kwargs=True)
        try:
            return model(**self.model_inputs(), **inputs, use_cache=False)
        finally:
            handle.remove()

    def _decoder_inputs(self, decoder: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The decoder's call with this rank's positions of the whole sequence's embeddings and position ids, the
        whole sequence's mask, and the group's attention (a forward pre-hook's answer)."""
        embeddings, positions = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
        if embeddings is None or positions is None:
            raise ValueError(f"{type(decoder).__name__} was called without inputs_embeds and position_ids, which "
                             "Ulysses splits at its entry")
        size, rank = self.parallel.size, self.parallel.rank
        return args, {**kwargs, "inputs_embeds": embeddings.chunk(size, dim=1)[rank],
                      "position_ids": positions.chunk(size, dim=-1)[rank], "attention_mask": self.attention.mask,
                      MODEL_KEYWORD: self.attention}

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model call for this shard (split at the decoder: the whole sequence's, which
        `forward` cuts at the decoder's entry)."""
        if self.attention is None or self.decoder is not None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                    "position_ids": self.position_ids}
        # A ready 4-D mask is passed through by transformers untouched, so no local-length mask is built (without
        # padding, transformers finds causality enough for the local positions too and builds none).
        return {"input_ids": self.input_ids, "attention_mask": self.attention.mask, "position_ids": self.position_ids,
                MODEL_KEYWORD: self.attention}

    def gather(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """[..., T/S, ...] computed on this rank's positions -> [..., T, ...] of the whole micro-batch."""
        if self.attention is None:
            return local
        return self.parallel.gather(local, dim).narrow(dim, 0, self.length)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of each next token from this rank's [B, T/S, V] logits (already temperature-scaled);
        column t is log p(token t+1 | tokens up to t), as the trainer's response_logits slices them."""
        return self.gather(log_probs_from_logits(logits, self.labels))
