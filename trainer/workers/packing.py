"""verl's use_remove_padding and use_dynamic_bsz: a padding-free forward, and micro-batches by token budget.

Padding-free forward (`packed_response_outputs`): the real tokens of a micro-batch's sequences go through
the model as one packed row, each sequence's position ids restarting at 0 and no attention mask, as
transformers' padding-free training lays them out (DataCollatorWithFlattening). transformers reads the
boundaries from the position ids for sdpa and eager attention (masking_utils.find_packed_sequence_indices:
a block-diagonal causal mask), and takes them from the cu_seq_lens/max_length keywords passed here for
flash_attention_2/3 (varlen kernels, nothing inferred). The outputs go back to the padded [B, R, ...]
layout, zeros where the response is padding, so every loss reads what the padded forward gives it.

Micro-batches by token budget (`plan_micro_batches`): as verl's rearrange_micro_batches, as few groups as
the budget allows, balanced by their real tokens (prompt and response); results go back in the batch's order.
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from trainer.distributed.ulysses import PREFIX as ULYSSES_PREFIX
from trainer.errors import RunSetupError
from trainer.models.fused_head import FusedScoring
from trainer.rollout.batch import RolloutBatch
from trainer.workers.recovery import Piece, split_into_pieces

PACKED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")
"""transformers' attention implementations that keep the sequences of a packed row apart."""
PACKED_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Layer types that read the boundaries from the position ids (linear attention and convolutions do not)."""


class TokenBudgetError(ValueError):
    """A sequence longer than the micro-batch token budget: no micro-batch could hold it."""


def check_packable(model: PreTrainedModel, setting: str) -> None:
    """Refuse a padding-free forward that would let a packed row's sequences see each other: an attention
    implementation that builds no packed mask (a custom one), or layers that ignore position ids."""
    config = model.config
    # Ulysses' wrapper (ulysses_sdpa) builds the mask of the implementation it wraps.
    attention = config._attn_implementation.removeprefix(ULYSSES_PREFIX)
    if attention not in PACKED_ATTENTION:
        raise RunSetupError(f"{setting}: true, but the model's attention implementation {attention!r} keeps no "
                            f"sequences of a packed row apart (those that do: {', '.join(PACKED_ATTENTION)}); "
                            f"set {setting}=false")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(PACKED_LAYER_TYPES))
    if other:
        raise RunSetupError(f"{setting}: true, but {config.model_type} has {', '.join(other)} layers, which ignore "
                            f"the sequence boundaries of a packed row; set {setting}=false")


def takes_logits_to_keep(model: PreTrainedModel) -> bool:
    """Whether the model's forward takes `logits_to_keep` (a causal LM's: only those positions go through the head,
    so logits no one reads are never made); a value model's gives every position."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@dataclass(frozen=True)
class PackedRow:
    """Where a [B, T] batch's real tokens sit in its padding-free row, and which of them a loss reads.

    real: [B, T] the real tokens (attention_mask), in the row in this order.
    keep: [K] the row's index of the position that predicts (or values) each real response token, in the order of
    `wanted`'s true entries; position t predicts token t + 1, as in the padded forward.
    wanted: [B, R] the real response tokens (response_mask).
    """

    real: torch.Tensor
    keep: torch.Tensor
    wanted: torch.Tensor

    @classmethod
    def of(cls, batch: RolloutBatch) -> PackedRow:
        real = batch.attention_mask.bool()
        prompt_length, response_length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        packed_index = real.flatten().cumsum(0).view(real.shape) - 1
        predicting = slice(prompt_length - 1, prompt_length - 1 + response_length)
        wanted = batch.response_mask.bool()
        if not bool(real[:, predicting][wanted].all()):
            raise ValueError("a response mask with a gap before a response token (or an empty prompt): the packed "
                             "forward needs each sequence's real tokens contiguous")
        return cls(real, packed_index[:, predicting][wanted], wanted)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [1, N]: the real tokens' entries in one row."""
        return tensor[self.real].unsqueeze(0)

    def unpack(self, kept: torch.Tensor) -> torch.Tensor:
        """[K, ...] figures of the kept positions -> [B, R, ...], zeros where the response is padding."""
        padded = kept.new_zeros((*self.wanted.shape, *kept.shape[1:]))
        padded[self.wanted] = kept
        return padded


def packed_response_outputs(model: PreTrainedModel, batch: RolloutBatch, *,
                            fused: FusedScoring | None = None) -> torch.Tensor:
    """[B, R, ...] the model's output at the positions that predict (or value) each response token, from one
    padding-free forward; zeros where the response is padding. With `fused`, [B, R, 2] log-probs and entropies
    from the fused head (optimization.response_logits)."""
    row = PackedRow.of(batch)
    # Only the kept positions go through the head (a causal LM's logits_to_keep): for a long prompt most
    # of the [T, V] logits the padded forward computes are never read.
    head_only_kept = takes_logits_to_keep(model)
    input_ids = row.pack(batch.input_ids)
    with fused.around(model, input_ids, row.keep if head_only_kept else 0) if fused else contextlib.nullcontext():
        output = model(
            input_ids=input_ids,
            position_ids=row.pack(batch.position_ids),
            use_cache=False,
            **packed_boundary_keywords(model, row.real.sum(dim=1)),
            **({"logits_to_keep": row.keep} if head_only_kept else {}),
        )
    return row.unpack(output.logits[0] if head_only_kept else output.logits[0, row.keep])


def packed_boundary_keywords(model: PreTrainedModel, lengths: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The keywords that tell flash_attention_2/3 where the sequences of a packed row of [B] `lengths` start (sdpa
    and eager ignore them, reading the boundaries from the position ids); none for a forward without **kwargs
    (remote code), where flash attention infers them from the position ids."""
    parameters = inspect.signature(model.forward).parameters
    if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return {}
    boundaries = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    return {"cu_seq_lens_q": boundaries, "cu_seq_lens_k": boundaries, "max_length_q": longest,
            "max_length_k": longest}


@dataclass(frozen=True)
class MicroBatches:
    """How a batch splits into micro-batches: the batch reordered by `order`, then `pieces` of it in turn."""

    order: torch.Tensor | None
    """[B] the sequences in micro-batch order; None: the batch's own order. After them, `fillers` more."""
    pieces: list[Piece]
    """Consecutive pieces of the reordered batch, one per micro-batch."""
    fillers: int = 0
    """Micro-batches of one sequence (a copy of the batch's first) after the batch's own: a rank whose share is
    shorter than another's runs as many forwards as it (a sharded model's are collectives); their results are
    dropped and their loss weighs nothing (`is_filler`)."""

    def arrange(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch in micro-batch order, the fillers' copies after it."""
        return batch if self.order is None else batch.select(self.order)

    def restore(self, results: torch.Tensor) -> torch.Tensor:
        """Per-sequence `results` in micro-batch order, back in the batch's order (the fillers' dropped)."""
        if self.order is None:
            return results
        own = len(self.order) - self.fillers
        return results[:own][torch.argsort(self.order[:own]).to(results.device)]

    def is_filler(self, piece: Piece) -> bool:
        return self.order is not None and piece.first >= len(self.order) - self.fillers


AgreeCount = Callable[[int], int]
"""Every rank's count in, the largest out (Ranks.max): a collective, so every rank calls it as often."""


def plan_micro_batches(batch: RolloutBatch, micro_batch_size: int, max_token_len: int | None,
                       agree: AgreeCount | None = None) -> MicroBatches:
    """Micro-batches of `micro_batch_size` sequences in order or, with `max_token_len`, by token budget.

    With several ranks (`agree`, the largest of every rank's count), the token budget's micro-batches are as
    many on every rank: a sharded model's forward and backward are collectives (FSDP2's gathers), and a rank
    that ran one micro-batch fewer would leave the others waiting for it. Each rank splits its share into the
    most any rank needs (verl's rearrange_micro_batches does the same over its data-parallel group).

    A rank whose share is shorter (sequences that do not divide among the ranks, with use_dynamic_bsz) may have
    fewer sequences than the agreed count: it runs `MicroBatches.fillers` to make up the count. With fixed sizes the
    counts agree the same way (one collective)."""
    if max_token_len is None:
        pieces = split_into_pieces(len(batch), micro_batch_size)
        fillers = agree(len(pieces)) - len(pieces) if agree is not None else 0
        if not fillers:
            return MicroBatches(None, pieces)
        order = list(range(len(batch)))
    else:
        lengths = batch.attention_mask.sum(dim=1).tolist()
        groups, agreed = ((token_budget_partitions(lengths, max_token_len), 0) if agree is None
                          else agreed_partitions(lengths, max_token_len, agree))
        pieces, first = [], 0
        for group in groups:
            pieces.append(Piece(first, len(group)))
            first += len(group)
        order = [index for group in groups for index in group]
        fillers = max(0, agreed - len(groups))
    pieces += [Piece(len(order) + number, 1) for number in range(fillers)]
    return MicroBatches(torch.tensor(order + [0] * fillers, dtype=torch.long), pieces, fillers)


def agreed_partitions(lengths: Sequence[int], max_tokens: int, agree: AgreeCount) -> tuple[list[list[int]], int]:
    """token_budget_partitions into as many groups on every rank: the most any rank needs, and that count. A
    balanced split into that many can overflow the budget on some rank, which then needs one more; the ranks agree
    again until none does. A rank never needs more groups than sequences, so the count stops there at the latest;
    a rank with fewer sequences than the count returns fewer groups (its caller adds fillers)."""
    count = len(token_budget_partitions(lengths, max_tokens))
    while True:
        agreed = agree(count)
        groups = token_budget_partitions(lengths, max_tokens, at_least=agreed)
        count = len(groups)
        if agree(count) == agreed:  # no rank needed more than was agreed
            return groups, agreed


def token_budget_partitions(lengths: Sequence[int], max_tokens: int, at_least: int = 1) -> list[list[int]]:
    """Indices of `lengths` in the fewest balanced groups (from ceil(total / max_tokens), or `at_least`, up) whose
    lengths each sum to at most `max_tokens`; each group's indices ascending, groups by their first index.

    Balancing is the longest-first greedy (each sequence to the lightest group), written here as verl's
    own Karmarkar-Karp partitioner has no library to take it from; a split that overflows a group tries
    one group more, and one sequence a group always fits.
    """
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise TokenBudgetError(f"a token budget of {max_tokens} is smaller than one sequence of {longest} tokens")
    count = min(len(lengths), max(1, at_least, math.ceil(sum(lengths) / max_tokens)))
    while True:
        groups = _balanced_groups(lengths, count)
        if all(sum(lengths[index] for index in group) <= max_tokens for group in groups):
            return sorted((sorted(group) for group in groups), key=lambda group: group[0])
        count += 1


def _balanced_groups(lengths: Sequence[int], count: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [(0, number) for number in range(count)]  # a heap of (tokens so far, group)
    for index in sorted(range(len(lengths)), key=lambda index: (-lengths[index], index)):
        load, number = heapq.heappop(loads)
        groups[number].append(index)
        heapq.heappush(loads, (load + lengths[index], number))
    return [group for group in groups if group]
