"""Decoding over a static KV cache: one preallocated cache for the batch, sampling on the device, and the
sequences that have finished dropped from the batch as they accumulate (issue 15).

transformers' `generate` with its dynamic cache grows every layer's cache by a concatenation at every token
and runs its logits processors and stopping criteria in Python. Here the cache is transformers' own
`StaticCache` (the library's static layout: one [batch, kv heads, longest prompt + new tokens, head dim]
buffer per layer, written in place), the model is called directly once per token, and the sampling is the
same arithmetic as generate's warpers (temperature, then top-k, then top-p, then one multinomial draw), so
the same logits give the same distribution, and with the same random state the same tokens.

Finished sequences: once at most half of the batch's rows still decode, the rows still decoding are
gathered (cache included) into a batch of the next smaller bucket (a power of two; rows that finished fill
it up) and decoding goes on with that. Buckets keep the batch shapes to a few: each one's per-token step
may be captured in a CUDA graph (`cuda_graphs`).

A forward over the prompts fills the cache; then each step (`_step`) decodes one token for every row, in
place in the batch's tensors. Between steps no forward is in flight: the caller's safe point (dynamic
offload) may move layers there. The host reads how many rows still decode every CHECK_EVERY tokens, not
at every one: between two reads it queues steps without waiting for the device.

CUDA graphs and the offload engine: a graph replays the addresses it captured, so the model's `GraphSafety`
(the offload engine, for a model it places) says when a forward reads only tensors that stay put (layers
and groups kept on the GPU, no copy, no update running) and gives a key for them; a graph is replayed only
under the key it was captured with, and a safe point that moves layers makes a new key (decoding goes on
eagerly, or under a new graph).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel, StaticCache

from trainer.rollout.fused_mlp import fused_mlps
from trainer.rollout.fused_norms import fused_rms_norms
from trainer.rollout.fused_rotary import fused_rotary
from trainer.rollout.live_keys import LiveWindow, live_length, live_step
from trainer.rollout.refill import PendingRows, copy_prompt_rows, ring_columns, set_write_column, supports_ring

SAFE_POINT_EVERY = 8
"""Decoded tokens between two safe points of a rollout (a memory reading each: microseconds)."""
CHECK_EVERY = 4
"""Decoded tokens between two host reads of how many rows still decode (whether to stop or shrink the batch).
A read waits for the device; rows that finished meanwhile decode pads (up to CHECK_EVERY - 1 steps)."""


class GraphSafety(Protocol):
    """What a model's owner (the offload engine) tells a CUDA graph of the model's forward."""

    def graph_key(self) -> Hashable | None:
        """What a graph of a no-grad forward would read, as a key; None when it may not be captured now."""

    def replayed(self) -> None:
        """A graph of the forward has been replayed on the current stream."""


class _Resident:
    """A model with nothing placed by an engine: its weights stay where they are."""

    @staticmethod
    def graph_key() -> Hashable:
        return ()

    @staticmethod
    def replayed() -> None:
        return None


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits, as transformers' generate does with these settings."""

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    """0 (or below): no top-k."""
    top_p: float = 1.0
    """1.0: no top-p."""

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits (any float dtype) -> [rows] token ids, on the logits' device."""
        scores = logits.float()
        if not self.do_sample:
            return scores.argmax(dim=-1)
        # transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in generate's order.
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k > 0:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1])).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= 1 - self.top_p
            remove[..., -1:] = False  # the most likely token always stays
            scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def _cache_bytes(cache: StaticCache) -> int:
    """Device bytes the cache's layers hold (keys and values; a layer the prefill did not reach holds none)."""
    tensors = [tensor for layer in cache.layers for tensor in (getattr(layer, "keys", None),
                                                               getattr(layer, "values", None))
               if isinstance(tensor, torch.Tensor)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def buckets(batch: int) -> list[int]:
    """The batch sizes decoding goes through as sequences finish: the batch, then the powers of two below it."""
    sizes = [batch]
    size = 1 << max(0, (batch - 1).bit_length() - 1)
    while size >= 1:
        if size < sizes[-1]:
            sizes.append(size)
        size //= 2
    return sizes


def fine_buckets(batch: int, ratio: float = 0.75) -> list[int]:
    """Finer batch sizes than `buckets` (issue 40): each at most `ratio` of the one before, multiples of 8 from 16 up
    and powers of two below (sizes vLLM captures CUDA graphs at), so a batch pays for at most a third more rows than
    still decode where powers of two pay for up to twice as many, in about twice as many graphs."""
    sizes = [batch]
    while sizes[-1] > 1:
        below = max(1, int(sizes[-1] * ratio))
        size = below // 8 * 8 if below >= 16 else 1 << (below.bit_length() - 1)
        sizes.append(min(size, sizes[-1] - 1))
    return sizes


@dataclass
class _Rows:
    """The rows decoding now: each one's original row, last token, whether it finished, next position, which cache
    positions it attends to, the cache position the next token goes to, its last token's log-probability and the
    response column its last token went to; `limit`: the tokens a response may have; `ring`: whether the cache's
    columns are a ring (refilled rows, refill.py) whose write position the step sets."""

    index: torch.Tensor
    tokens: torch.Tensor
    done: torch.Tensor
    position: torch.Tensor
    valid: torch.Tensor
    slot: torch.Tensor
    chosen: torch.Tensor | None
    column: torch.Tensor
    limit: int
    ring: bool = False

    def rows(self, keep: torch.Tensor) -> _Rows:
        """A batch of the rows `keep` (new tensors: a CUDA graph of the step is per batch)."""
        return _Rows(self.index[keep], self.tokens[keep], self.done[keep], self.position[keep], self.valid[keep],
                     self.slot.clone(), None if self.chosen is None else self.chosen[keep], self.column[keep],
                     self.limit, self.ring)


def _chosen(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-probability (fp32) softmax(`logits` / `temperature`) gives each of `tokens`: what the actor's scoring
    forward computes at the sampling temperature (before top-k and top-p, which it does not apply either)."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    return (scores.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1))


class StaticDecoder:
    """Samples up to `max_new_tokens` per prompt over a static cache, stopping each row at an EOS.

    With `cuda_graphs` (on a GPU, with SDPA attention and no sliding window), each batch size's per-token
    step is captured in a CUDA graph at its second step and replayed from then on: the host launches one graph
    a token instead of every kernel. `safety` (the offload engine of a model it places) says when the
    forward may be captured (see the module's docstring)."""

    def __init__(self, model: PreTrainedModel, *, eos_ids: list[int], pad_id: int, sampling: Sampling,
                 compact: bool = True, cuda_graphs: bool = False, safety: GraphSafety | None = None,
                 check_every: int = CHECK_EVERY, agree_active: Callable[[int], int] | None = None,
                 warn: Callable[[str], None] | None = None):
        self.model, self.sampling, self.compact, self.check_every = model, sampling, compact, check_every
        self.warn: Callable[[str], None] = warn or warnings.warn
        """Gets the one line that says the rotary embedding or the MLPs' activation could not be compiled, or
        disagreed (fused_rotary.py, fused_mlp.py); Python's warnings by default."""
        self.agree_active = agree_active
        """With a model sharded over several ranks: every rank's count of rows still decoding in, the largest out
        (Ranks.max). Each forward gathers the layers' shards from every rank, so every rank decodes until every
        rank's rows have finished (a rank whose rows have decodes pads meanwhile), and none captures a graph (the
        gathers are collectives a replay would not redo)."""
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.bucket_history: list[int] = []
        """The batch sizes the last generate decoded with, in order (the buckets it went through)."""
        # transformers renamed the forward's cache argument (5.2x: `cache`; the old `past_key_values` warns).
        self._cache_argument = ("cache" if "cache" in inspect.signature(model.forward).parameters
                                else "past_key_values")
        self.keep_log_probs = False
        """Whether generate keeps each sampled token's log-probability (`log_probs`): a logsumexp a token, inside
        the captured step (into the step's own buffer) under CUDA graphs."""
        self.log_probs = torch.zeros(0, 0)
        self.cuda_graphs = cuda_graphs
        self.safety: GraphSafety = safety or _Resident()
        self.replays = 0
        """Steps the last generate ran as CUDA graph replays (the others ran eagerly)."""
        self.fuse_norms = True
        """On a GPU, whether the model's RMSNorms run torch's fused kernel while decoding (fused_norms.py)."""
        self.fused_norms = 0
        """How many RMSNorms the last generate ran fused."""
        self.fuse_rotary = True
        """On a GPU, whether decode steps rotate queries and keys with the compiled copy of the model's own rotary
        function (fused_rotary.py)."""
        self.fused_rotary = 0
        """How many modeling modules' rotary functions the last generate swapped for their compiled copies."""
        self.fuse_mlps = True
        """On a GPU, whether decode steps run gated SiLU MLPs' activation and product as one compiled kernel
        (fused_mlp.py)."""
        self.fused_mlps = 0
        """How many MLPs the last generate ran fused."""
        self.cache_bytes = 0
        """Device bytes of the last generate's static KV cache (keys and values of every layer, allocated whole)."""
        self.graph_pool_bytes = 0
        """Device memory the last generate's CUDA graph captures reserved (their private pool)."""
        self.fine_buckets = True
        """Whether a shrinking batch goes through `fine_buckets`' sizes (about 3/4 each) instead of powers of two."""
        self.refill = True
        """Whether a generate given fewer `slots` than prompts refills finished rows with waiting prompts
        (continuous batching, refill.py) instead of decoding in pieces."""
        self.refill_share = 0.125
        """Refill once this share of the slots (at least one) has finished: each refill is a prefill forward, which
        reads the weights once as a decode step does."""
        self.refilled = 0
        """Rows the last generate refilled (prompts that took a finished row's slot)."""
        self.steps = 0
        """Decode steps (one token for every row of the batch) the last generate ran, its prefills left out."""
        self.live_keys = True
        """Whether a decode step's attention reads only the cache's columns some row has written, rounded up to a
        multiple of `live_step` (live_keys.py), instead of the whole static cache; a ring cache (refills) reads all."""
        self.live_step: int | None = None
        """The multiple the read length is rounded up to; None: an eighth of the cache's columns, in 64s."""
        self.columns_read = 0
        """Cache columns the last generate's decode steps read, summed over its steps (a step reads every row's
        keys and values at these columns, in every layer)."""
        self.cache_columns = 0
        """Columns of the last generate's cache: what a step reads without `live_keys`."""

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
                 safe_point: Callable[[], object] | None = None, slots: int | None = None) -> torch.Tensor:
        """[B, P] left-padded prompts -> [B, T] new tokens (T <= max_new_tokens: decoding stops once every row has
        finished), each row's tokens after its first EOS set to the pad id, as generate returns them.
        `safe_point` runs every SAFE_POINT_EVERY tokens, between two forwards. With `keep_log_probs`, `log_probs`
        holds afterwards the [B, T] log-probabilities (fp32, at the sampling temperature) the model gave each token as
        it was sampled (0 after a row's EOS). `slots` (fewer than B): at most that many rows decode at once, a row
        whose sequence finished taking the next waiting prompt (refill.py); where the cache cannot be a ring (see
        `refills`), in pieces of `slots` rows."""
        rows, prompt_length = prompt_ids.shape
        device = prompt_ids.device
        slots = rows if slots is None else max(1, min(rows, slots))
        # One column more than a response holds: a finished row's pads go there (see _step).
        out = torch.full((rows, max_new_tokens + 1), self.pad_id, dtype=prompt_ids.dtype, device=device)
        self.log_probs = torch.zeros((rows, max_new_tokens + 1), dtype=torch.float32, device=device)
        self.bucket_history, self.refilled, self.steps, self.columns_read = [slots], 0, 0, 0
        if rows == 0 or max_new_tokens == 0:
            self.log_probs = self.log_probs[:, :0]
            return out[:, :0]
        fused = fused_rms_norms(self.model, device) if self.fuse_norms else contextlib.nullcontext(0)
        rotary = fused_rotary(self.model, device, self.warn) if self.fuse_rotary else contextlib.nullcontext(0)
        mlps = fused_mlps(self.model, device, self.warn) if self.fuse_mlps else contextlib.nullcontext(0)
        with fused as self.fused_norms, rotary as self.fused_rotary, mlps as self.fused_mlps:
            if slots < rows and not self.refills():
                for first in range(0, rows, slots):
                    self._generate(prompt_ids, prompt_mask, max_new_tokens, safe_point, out,
                                   range(first, min(rows, first + slots)))
            else:
                self._generate(prompt_ids, prompt_mask, max_new_tokens, safe_point, out, range(rows), slots)
        # Steps decoded after every row had finished (between two reads) hold pads only: generate stops at the
        # token where the last row finishes.
        length = self._decoded_length(out[:, :max_new_tokens], torch.tensor(self.eos_ids, device=device))
        self.log_probs = self.log_probs[:, :length]
        return out[:, :length]

    def refills(self) -> bool:
        """Whether a finished row's slot may take a waiting prompt: the cache's columns become a ring, which needs
        a [rows, 1, 1, positions] mask every layer takes as it is and no ranks stepping together (a refill's prefill
        is a forward the others would not run)."""
        return self.refill and self._full_attention_only() and self.agree_active is None

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
                  safe_point: Callable[[], object] | None, out: torch.Tensor, batch: range,
                  slots: int | None = None) -> None:
        """Decodes the rows `batch` of the prompts into `out`, `slots` of them at once (all of them: None)."""
        prompt_length = prompt_ids.shape[1]
        device = prompt_ids.device
        slots = len(batch) if slots is None else slots
        ring = prompt_length + max_new_tokens
        cache = StaticCache(config=self.model.config, max_cache_len=ring)
        window, self.cache_columns = LiveWindow(cache), ring
        first = torch.arange(batch.start, batch.start + slots, device=device)
        # Left padding: a row's first real token is at position 0 (generate's position ids).
        positions = (prompt_mask[first].long().cumsum(dim=1) - 1).clamp(min=0)
        logits = self._forward(prompt_ids[first], positions, prompt_mask[first], cache)[:, -1]
        self.cache_bytes, self.graph_pool_bytes = _cache_bytes(cache), 0  # the prefill allocated the cache
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        tokens = self._next_tokens(first, torch.zeros_like(first), logits)
        pending = PendingRows(batch.stop, batch.start + slots)
        column = torch.zeros(slots, dtype=torch.long, device=device)
        state = _Rows(
            index=first, tokens=tokens, done=torch.isin(tokens, eos) | (column >= max_new_tokens - 1),
            position=positions[:, -1:] + 1,
            # Which cache positions each row attends to: its prompt's real tokens, then every token decoded.
            valid=torch.cat([prompt_mask[first].bool(), torch.zeros((slots, max_new_tokens), dtype=torch.bool,
                                                                    device=device)], dim=1),
            slot=torch.tensor([prompt_length], device=device),
            chosen=_chosen(logits, tokens, self.sampling.temperature) if self.keep_log_probs else None,
            column=column, limit=max_new_tokens, ring=len(pending) > 0)
        if state.ring and not supports_ring(cache):
            raise RuntimeError("the installed transformers' StaticCache keeps no write position in a tensor: "
                               "a static decode cannot refill its rows (decode in pieces: slots=None)")
        self._record(out, state)
        mask_4d = self._full_attention_only()
        capturable = self.cuda_graphs and device.type == "cuda" and mask_4d and self.agree_active is None
        key = self.safety.graph_key() if capturable else None
        pool = torch.cuda.graph_pool_handle() if capturable else None  # one pool: graphs replay one at a time
        graphs: dict[tuple[int, Hashable, int], torch.cuda.CUDAGraph] = {}
        warm: set[tuple[int, Hashable, int]] = set()  # (batch size, key, columns read)s whose step ran once
        self.replays = 0
        sizes = fine_buckets(slots) if self.fine_buckets else buckets(slots)
        horizon = max_new_tokens - 1  # the steps after which every row of the batch has run to its length
        step = 0
        while True:
            ended = step >= horizon
            if ended or step % self.check_every == 0:
                active = int((~state.done).sum())  # waits for the device: whether to stop, refill or shrink
                if pending and (ended or slots - active >= max(1, int(slots * self.refill_share))):
                    active += self._refill(state, cache, pending, prompt_ids, prompt_mask, out, eos,
                                           next_column=(prompt_length + step) % ring)
                    horizon, ended = step + max_new_tokens - 1, False
                if ended or (active if self.agree_active is None else self.agree_active(active)) == 0:
                    break
                if self.compact and not pending and len(sizes) > 1 and active <= sizes[1]:
                    while len(sizes) > 1 and active <= sizes[1]:
                        sizes.pop(0)
                    keep = self._rows_to_keep(state.done, sizes[0])
                    self._compact(cache, keep)
                    state = state.rows(keep)
                    self.bucket_history.append(sizes[0])
            step += 1
            if safe_point is not None and step % SAFE_POINT_EVERY == 0:
                safe_point()
                if capturable:
                    key = self.safety.graph_key()  # layers may have moved
                    graphs = {shape: graph for shape, graph in graphs.items() if shape[1] == key}
            # Without a ring every row has written the first prompt_length + step columns, this step's included.
            live = self.live_keys and mask_4d and not state.ring
            window.length = live_length(prompt_length + step, ring, self.live_step or live_step(ring)) if live else None
            self.columns_read += window.length or ring
            shape = (len(state.index), key, window.length or ring)
            graph = graphs.get(shape) if key is not None else None
            if graph is None and key is not None and shape in warm:
                graphs[shape] = graph = torch.cuda.CUDAGraph()
                # Recorded, not run: the replay runs this token's step. thread_local: the offload engines' workers go
                # on meanwhile (another model's update on the GPU, page-locking its states), and under the default
                # ("global") a CUDA call of theirs that is unsafe during a capture would invalidate this one.
                reserved = torch.cuda.memory_reserved(device)
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._step(state, cache, eos, mask_4d=True, columns=window.length)
                self.graph_pool_bytes += max(0, torch.cuda.memory_reserved(device) - reserved)
            if graph is not None:
                graph.replay()
                self.safety.replayed()
                self.replays += 1
            else:
                # Also a capture's warm-up: a graph of a batch size is captured at its second step.
                self._step(state, cache, eos, mask_4d=mask_4d, columns=window.length)
                warm.add(shape)
            self._record(out, state)
        self.steps += step

    def _refill(self, state: _Rows, cache: StaticCache, pending: PendingRows, prompt_ids: torch.Tensor,
                prompt_mask: torch.Tensor, out: torch.Tensor, eos: torch.Tensor, *, next_column: int) -> int:
        """The finished rows of `state` take the next waiting prompts, in place (a captured step reads the same
        tensors): each prompt prefilled alone and copied into its row's cache before `next_column`, its first token
        sampled and recorded. Returns how many rows it refilled."""
        free = torch.nonzero(state.done).squeeze(1)
        rows = torch.tensor(pending.take(len(free)), dtype=torch.long, device=free.device)
        free = free[:len(rows)]
        if len(rows) == 0:
            return 0
        ids, mask = prompt_ids[rows], prompt_mask[rows]
        prompts = StaticCache(config=self.model.config, max_cache_len=ids.shape[1])
        positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        logits = self._forward(ids, positions, mask, prompts)[:, -1]
        tokens = self._next_tokens(rows, torch.zeros_like(rows), logits)
        columns = ring_columns(next_column, ids.shape[1], state.valid.shape[1], free.device)
        copy_prompt_rows(cache, prompts, free, columns)
        valid = torch.zeros((len(rows), state.valid.shape[1]), dtype=torch.bool, device=free.device)
        valid.index_copy_(1, columns, mask.bool())
        state.valid.index_copy_(0, free, valid)
        state.index.index_copy_(0, free, rows)
        state.tokens.index_copy_(0, free, tokens)
        state.position.index_copy_(0, free, positions[:, -1:] + 1)
        state.column.index_fill_(0, free, 0)
        state.done.index_copy_(0, free, torch.isin(tokens, eos) | (state.limit <= 1))
        if state.chosen is not None:
            state.chosen.index_copy_(0, free, _chosen(logits, tokens, self.sampling.temperature))
        out[rows, 0] = tokens
        if state.chosen is not None:
            self.log_probs[rows, 0] = state.chosen[free]
        self.refilled += len(rows)
        return len(rows)

    @staticmethod
    def _decoded_length(out: torch.Tensor, eos: torch.Tensor) -> int:
        """The columns up to the last row's first EOS (all of them when a row has none)."""
        finished = torch.isin(out, eos)
        if out.shape[1] == 0 or not bool(finished.any(dim=1).all()):
            return out.shape[1]
        return int(finished.int().argmax(dim=1).max()) + 1

    def _step(self, state: _Rows, cache: StaticCache, eos: torch.Tensor, *, mask_4d: bool,
              columns: int | None = None) -> None:
        """One token for every row, in place in `state`'s tensors (what a CUDA graph of the step replays): the cache
        position `slot` becomes attended, the model reads each row's last token at its position, the next one is
        sampled; a row that had finished gets the pad id, and its response column stays past the last (`limit`: the
        output's spare column). `columns`: how many of the cache's columns attention reads (the cache's LiveWindow
        returns as many; None: all)."""
        state.valid.index_fill_(1, state.slot, True)
        if mask_4d:
            # A [rows, 1, 1, positions] boolean mask is taken as it is: no mask to build, no host read.
            attention_mask = state.valid[:, None, None, :columns]
        else:  # sliding-window layers: transformers builds their masks from the 2-D one
            attention_mask = state.valid[:, :int(state.slot) + 1].long()
        if state.ring:
            set_write_column(cache, state.slot)
        logits = self._forward(state.tokens[:, None], state.position, attention_mask, cache)[:, -1]
        state.position.add_(1)
        state.slot.add_(1)
        if state.ring:
            state.slot.remainder_(state.valid.shape[1])
        state.column.add_(1).clamp_(max=state.limit)
        tokens = self._next_tokens(state.index, state.column, logits).masked_fill(state.done, self.pad_id)
        if state.chosen is not None:  # 0 for a row that had finished
            state.chosen.copy_(_chosen(logits, tokens, self.sampling.temperature).masked_fill(state.done, 0.0))
        state.tokens.copy_(tokens)
        finished = torch.isin(tokens, eos) | (state.column >= state.limit - 1)
        torch.logical_or(state.done, finished, out=state.done)

    def _next_tokens(self, index: torch.Tensor, column: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """[rows] the next token of each row from its [rows, vocab] logits; `index`: the rows' original rows,
        `column`: the response column the token goes to (a benchmark forces an EOS here: uneven_decode.py)."""
        return self.sampling.next_tokens(logits)

    def _record(self, out: torch.Tensor, state: _Rows) -> None:
        out[state.index, state.column] = state.tokens
        if state.chosen is not None:
            self.log_probs[state.index, state.column] = state.chosen

    def _full_attention_only(self) -> bool:
        """Whether a [rows, 1, 1, positions] boolean mask means what it says to every layer: SDPA attention (the
        eager implementation adds its mask, flash-attention takes none of that shape) with no sliding window."""
        config = self.model.config
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        # Ulysses' wrapper of SDPA (trainer/distributed/ulysses.py) is SDPA itself in a forward not sequence-parallel.
        return (getattr(config, "_attn_implementation", None) in ("sdpa", "ulysses_sdpa")
                and all(kind == "full_attention" for kind in layer_types))

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 cache: StaticCache) -> torch.Tensor:
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=True, logits_to_keep=1, **{self._cache_argument: cache})
        return output.logits

    @staticmethod
    def _rows_to_keep(done: torch.Tensor, size: int) -> torch.Tensor:
        """The rows still decoding, then finished ones up to `size` (they decode pads, and are ignored)."""
        order = torch.argsort(done.to(torch.int8), stable=True)  # the unfinished first, each kind in order
        return order[:size]

    @staticmethod
    def _compact(cache: StaticCache, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` of every layer's keys and values (the cache's own buffers, gathered)."""
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
                layer.batch_size = keep.numel()
