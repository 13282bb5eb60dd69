"""Decoding responses of long-tailed lengths (issue 40): useful tokens a second of the static decode's ways with
finished rows, against a static batch that decodes every row until its longest ends, and against the HBM floor.

RL responses are long-tailed: most end early, a few run to the limit. A random-init model never ends a row by
itself, so each row ends at a length drawn from a log-normal distribution (clipped to the limit): `ForcedEnds`, a
benchmark-only decoder, samples as the rollout does and puts an EOS at the row's drawn length. Useful tokens are the
tokens up to each row's end (the EOS counted); a decode's useful tokens a second are their sum over its seconds.

Variants, all with the rollout's static decode on the GPU (CUDA graphs, `slots` rows at once):
  static        compaction and refills off: each piece of `slots` rows decodes until its longest row ends
  buckets_pow2  finished rows leave the batch through powers of two (the decode before issue 40), in pieces
  buckets_fine  through fine_buckets' sizes (about 3/4 each), in pieces
  refill        a finished row's slot takes the next waiting prompt (continuous batching), fine buckets after

`useful_speedup` is a variant's useful tokens a second over `static`'s. The floor of the useful decode is what a
decode must read from HBM at least: the weights once a step, for as many steps as the longest row or the tokens over
the slots need, and each useful token's keys and values of its prefix; `vs_floor` is the decode's time over it.
`step` times one decode step of a full batch of `slots` rows (none ends) against the floor of one step: the weights
and the rows' live keys and values (`step_floor_ms`), and with the keys and values of the whole static cache, which
the masked attention reads (`step_floor_allocated_ms`).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from trainer.rollout.static_decode import Sampling, StaticDecoder

VARIANTS: dict[str, dict[str, bool]] = {
    "static": {"compact": False, "fine_buckets": False, "refill": False},
    "buckets_pow2": {"compact": True, "fine_buckets": False, "refill": False},
    "buckets_fine": {"compact": True, "fine_buckets": True, "refill": False},
    "refill": {"compact": True, "fine_buckets": True, "refill": True},
}
"""Each variant's StaticDecoder settings."""


@dataclasses.dataclass(frozen=True)
class UnevenPlan:
    rows: int = 512
    """Responses a step samples (gsm8k7b: 64 prompts x 8)."""
    slots: int = 256
    """Rows decoding at once (rollout.max_num_seqs' default)."""
    prompt_tokens: int = 128
    new_tokens: int = 1024
    """The response limit: a row whose drawn length is longer ends there."""
    median_tokens: int = 160
    """The log-normal's median response length."""
    sigma: float = 1.0
    """The log-normal's sigma: at 1.0 and a median of 160, 3% of the rows reach a 1024-token limit."""
    step_tokens: int = 64
    """Tokens the full-batch step measure decodes."""
    iters: int = 1
    seed: int = 0


QUICK_UNEVEN = UnevenPlan(rows=16, slots=8, prompt_tokens=8, new_tokens=24, median_tokens=6, step_tokens=8)
"""The smoke shape (a CPU test runs it with the tiny model)."""


def long_tailed_lengths(rows: int, limit: int, *, median_tokens: int, sigma: float, seed: int) -> torch.Tensor:
    """[rows] response lengths (int64) from a log-normal of median `median_tokens` and `sigma`, clipped to [2, limit]
    (at least an answer and its EOS)."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.exp(math.log(median_tokens) + sigma * torch.randn(rows, generator=generator, dtype=torch.float64))
    return drawn.round().clamp(2, limit).long()


class ForcedEnds(StaticDecoder):
    """The static decode with an EOS forced at each row's drawn length (`ends`, [rows] on the model's device) and
    never before it (a sampled EOS id is replaced): a random-init model's responses of the drawn lengths."""

    def __init__(self, model: Any, ends: torch.Tensor, eos_id: int, **settings: Any):
        super().__init__(model, eos_ids=[eos_id], pad_id=eos_id, sampling=Sampling(), **settings)
        self.ends, self.eos_id = ends, eos_id

    def _next_tokens(self, index: torch.Tensor, column: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tokens = super()._next_tokens(index, column, logits)
        tokens = tokens.masked_fill(tokens == self.eos_id, self.eos_id + 1)
        return torch.where(column == self.ends[index] - 1, self.eos_id, tokens)


def end_at_drawn_lengths(decoder: StaticDecoder, *, median_tokens: int, sigma: float, seed: int = 0) -> None:
    """Makes `decoder` (a trainer's rollout's) end each row at a length drawn anew for every generate (seeds `seed`,
    `seed` + 1, ...), as `ForcedEnds` does: what e2e_bench.py's long-tailed shapes decode with random-init models."""
    generate, choose = decoder.generate, decoder._next_tokens
    eos_ids = torch.tensor(decoder.eos_ids)
    # A token that ends nothing, for a sampled one that would (ids 0, 1, ...: the first that is neither EOS nor pad).
    other = next(token for token in range(len(decoder.eos_ids) + 2)
                 if token not in decoder.eos_ids and token != decoder.pad_id)
    calls = itertools.count(seed)
    ends: list[torch.Tensor] = []

    def drawn(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int, *args: Any,
              **kwargs: Any) -> torch.Tensor:
        # On the device before the decode: a captured step may not copy from the host.
        lengths = long_tailed_lengths(len(prompt_ids), max(2, max_new_tokens), median_tokens=median_tokens,
                                      sigma=sigma, seed=next(calls))
        ends[:] = [lengths.to(prompt_ids.device), eos_ids.to(prompt_ids.device)]
        return generate(prompt_ids, prompt_mask, max_new_tokens, *args, **kwargs)

    def forced(index: torch.Tensor, column: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tokens = choose(index, column, logits)
        tokens = tokens.masked_fill(torch.isin(tokens, ends[1]), other)
        return torch.where(column == ends[0][index] - 1, decoder.eos_ids[0], tokens)

    decoder.generate = drawn  # type: ignore[method-assign]
    decoder._next_tokens = forced  # type: ignore[method-assign]


def useful_floor_s(lengths: torch.Tensor, *, prompt_tokens: int, slots: int, weight_bytes: int,
                   kv_bytes_per_token: int, bytes_per_s: float) -> float:
    """Seconds a decode of rows ending at `lengths` must read HBM at least: the weights once a step, for the longest
    row's steps or the useful tokens over the slots, whichever is more, and each useful token's prefix of keys and
    values (its prompt and the tokens before it)."""
    steps = max(int(lengths.max()), math.ceil(int(lengths.sum()) / slots))
    lengths_f = lengths.double()
    prefix_tokens = float((lengths_f * prompt_tokens + lengths_f * (lengths_f - 1) / 2).sum())
    return (steps * weight_bytes + prefix_tokens * kv_bytes_per_token) / bytes_per_s


def kv_bytes_per_token(config: Any, element_bytes: int) -> int:
    """Bytes of one token's keys and values over every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_bytes


def measure(model: Any, plan: UnevenPlan, device: torch.device, *, hbm_bytes_per_s: float,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant on the same prompts and drawn lengths, then the full-batch step; the results as one dict."""
    generator = torch.Generator().manual_seed(plan.seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(2, vocab, (plan.rows, plan.prompt_tokens), generator=generator).to(device)
    mask = torch.ones_like(prompts)
    lengths = long_tailed_lengths(plan.rows, plan.new_tokens, median_tokens=plan.median_tokens, sigma=plan.sigma,
                                  seed=plan.seed)
    ends = lengths.to(device)
    parameter = next(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = kv_bytes_per_token(model.config, parameter.element_size())
    floor = useful_floor_s(lengths, prompt_tokens=plan.prompt_tokens, slots=plan.slots, weight_bytes=weight_bytes,
                           kv_bytes_per_token=per_token, bytes_per_s=hbm_bytes_per_s)
    useful = int(lengths.sum())
    cuda_graphs = device.type == "cuda"
    result: dict[str, Any] = {
        "plan": dataclasses.asdict(plan), "useful_tokens": useful, "floor_s": floor,
        "lengths": {"mean": float(lengths.double().mean()), "median": float(lengths.median()),
                    "p90": float(lengths.double().quantile(0.9)), "at_limit": int((lengths == plan.new_tokens).sum())},
        "hbm_bytes_per_s": hbm_bytes_per_s, "weight_bytes": weight_bytes, "kv_bytes_per_token": per_token,
        "variants": {}}
    # A short warm-up compiles the fused kernels (fused_rotary.py, fused_mlp.py) before anything is timed.
    warm = ForcedEnds(model, torch.full_like(ends, 4), 0, cuda_graphs=cuda_graphs)
    warm.generate(prompts[:plan.slots], mask[:plan.slots], 8)
    del warm
    for name, settings in VARIANTS.items():
        decoder = None
        held = _released(device)
        decoder = ForcedEnds(model, ends, 0, cuda_graphs=cuda_graphs)
        for key, value in settings.items():
            setattr(decoder, key, value)
        responses: torch.Tensor | None = None
        seconds = []
        for _ in range(plan.iters):
            started = _now(device)
            responses = decoder.generate(prompts, mask, plan.new_tokens, slots=plan.slots)
            seconds.append(_now(device) - started)
        assert responses is not None
        decoded = (responses != 0).sum(dim=1) + 1  # the tokens before each row's EOS, and the EOS
        run = {"seconds": statistics.median(seconds), "steps": decoder.steps, "refilled": decoder.refilled,
               "buckets": decoder.bucket_history, "replays": decoder.replays,
               "lengths_as_drawn": bool(torch.equal(decoded.cpu(), lengths)), "held_before_gib": held}
        run["useful_tokens_per_s"] = useful / run["seconds"]
        run["vs_floor"] = run["seconds"] / floor
        result["variants"][name] = run
    static = result["variants"]["static"]["useful_tokens_per_s"]
    for run in result["variants"].values():
        run["useful_speedup"] = run["useful_tokens_per_s"] / static
    result["useful_speedup"] = result["variants"]["refill"]["useful_speedup"]
    del decoder, responses
    for name, live_keys in (("step", True), ("step_whole_cache", False)):
        result[name] = full_batch_step(model, prompts[:plan.slots], mask[:plan.slots], plan, device,
                                       weight_bytes=weight_bytes, kv_bytes_per_token=per_token,
                                       hbm_bytes_per_s=hbm_bytes_per_s, live_keys=live_keys)
    for line in report(result):
        log(line)
    return result


def full_batch_step(model: Any, prompts: torch.Tensor, mask: torch.Tensor, plan: UnevenPlan, device: torch.device, *,
                    weight_bytes: int, kv_bytes_per_token: int, hbm_bytes_per_s: float,
                    live_keys: bool = True) -> dict[str, float]:
    """Milliseconds of one decode step of `len(prompts)` rows, none ending, in the static cache of the plan's
    response limit: the difference of two decodes (step_tokens and half as many) over their steps' difference (each
    decode runs its first step eagerly and captures the second: the difference leaves both out). `live_keys`: the
    decoder's (attention over the cache's written columns only, else the whole cache); `columns_read`: the cache
    columns attention read a step over the same steps, of the cache's `cache_columns`."""
    rows = len(prompts)
    times, read = {}, {}
    half = max(2, plan.step_tokens // 2)
    cache_columns = 0
    for tokens in (half, plan.step_tokens):
        decoder = None
        held = _released(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        decoder = ForcedEnds(model, torch.full((rows,), tokens, dtype=torch.long, device=device), 0,
                             cuda_graphs=device.type == "cuda")
        decoder.live_keys = live_keys
        decoder.generate(prompts, mask, plan.new_tokens)  # captures the step's graphs
        started = _now(device)
        decoder.generate(prompts, mask, plan.new_tokens)
        times[tokens] = _now(device) - started
        read[tokens], cache_columns = decoder.columns_read, decoder.cache_columns
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    step_s = (times[plan.step_tokens] - times[half]) / (plan.step_tokens - half)
    columns_read = (read[plan.step_tokens] - read[half]) / (plan.step_tokens - half)
    live_tokens = rows * (plan.prompt_tokens + plan.step_tokens / 2)
    allocated_tokens = rows * (plan.prompt_tokens + plan.new_tokens)
    floor = (weight_bytes + live_tokens * kv_bytes_per_token) / hbm_bytes_per_s
    allocated = (weight_bytes + allocated_tokens * kv_bytes_per_token) / hbm_bytes_per_s
    return {"rows": rows, "step_ms": step_s * 1e3, "step_floor_ms": floor * 1e3,
            "step_floor_allocated_ms": allocated * 1e3, "vs_floor": step_s / floor,
            "vs_floor_allocated": step_s / allocated, "live_keys": live_keys, "columns_read": columns_read,
            "cache_columns": cache_columns, "held_before_gib": held, "peak_gib": peak}


def _released(device: torch.device) -> float:
    """GiB the device still holds once the decoders before are gone. A ForcedEnds decoder is cyclic garbage (its
    generate is a closure over it), freed by the collector, not when its name is rebound. On 2026-12-08 (H100) the
    full-batch step's prefill found 76.8 GiB allocated (the 7B weights are 15 GiB, a full batch's cache 17 GiB):
    each decoder now starts after a collection, and the variants record what was still held (held_before_gib)."""
    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 2**30


def report(result: dict[str, Any]) -> list[str]:
    """The variants' table and the full-batch step, as printed lines."""
    plan, lengths = result["plan"], result["lengths"]
    lines = [f"uneven lengths: {plan['rows']} rows, {plan['slots']} at once, prompt {plan['prompt_tokens']}, limit "
             f"{plan['new_tokens']}; lengths mean {lengths['mean']:.0f}, median {lengths['median']:.0f}, p90 "
             f"{lengths['p90']:.0f}, {lengths['at_limit']} at the limit; floor {result['floor_s']:.2f} s",
             "| variant | s | steps | refilled | useful tok/s | useful_speedup | vs floor | lengths as drawn |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, run in result["variants"].items():
        lines.append(f"| {name} | {run['seconds']:.2f} | {run['steps']} | {run['refilled']} | "
                     f"{run['useful_tokens_per_s']:.0f} | {run['useful_speedup']:.2f} | {run['vs_floor']:.2f} | "
                     f"{run['lengths_as_drawn']} |")
    for name in ("step", "step_whole_cache"):
        step = result.get(name)
        if not step:
            continue
        how = "only the live keys" if step.get("live_keys", True) else "the whole cache"
        lines.append(f"decode step at batch {step['rows']}, attention over {how}: {step['step_ms']:.2f} ms; "
                     f"cache length read {step.get('columns_read', 0):.0f} of {step.get('cache_columns', 0)} "
                     f"columns; floor {step['step_floor_ms']:.2f} ms with the live keys and values "
                     f"({step['vs_floor']:.2f}x), {step['step_floor_allocated_ms']:.2f} ms with the whole cache "
                     f"({step['vs_floor_allocated']:.2f}x)")
    return lines


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
