"""Rollout (decode) speed on one GPU: all-GPU, accelerate, FSDP2's CPU offload and the offload engine.

    python benchmarks/rollout_bench.py --out rollout.json            # the full set
    python benchmarks/rollout_bench.py --quick --out quick.json      # a smoke run: 4 layers, batch 8, 16 new tokens
    python benchmarks/rollout_bench.py --only allgpu,ours_phase --out part.json

The Qwen2-7B shape of offload_bench.py with random bf16 weights samples 128 new tokens after each
of 32 prompts of 128 random tokens, through `model.generate` (temperature 1, no top-k or top-p, no
EOS: every variant decodes exactly the same number of steps). ms/step is (generate time - prefill
time) / (new tokens - 1), the prefill time being that of a generate of one token; `vs GPU` is the
all-GPU ms/step over the variant's (its decode throughput relative to all-GPU).

`uneven` (issue 40): responses of long-tailed lengths (--rows, --slots), as benchmarks/uneven_decode.py says; its row
carries `useful_speedup`, the refilled decode's useful tokens a second over a static batch's.

Sections (--only): allgpu, allgpu_static, allgpu_static_graphs, allgpu_static_graphs_unfused,
allgpu_static_graphs_repeat_kv, accelerate, fsdp2, ours_layered, ours_phase, ours_phase_static, uneven, capped
(`_static`: the same variant decoded by rollout.decode=static, trainer/rollout/static_decode.py, instead of generate;
`_graphs`: with its per-token step in CUDA graphs; `_unfused`: with transformers' own RMSNorm instead of the fused
kernel the static decode runs; `_repeat_kv`: with transformers' own SDPA attention instead of
trainer/models/attention.py's).
`capped` runs last: it caps this process's GPU memory below the model's weights, where the all-GPU rollout
cannot run and the engine's dynamic offload keeps only the layers that fit. Each section writes its rows to
--out as soon as it finishes; a section that fails records its error and the others still run.
`static_profile` (only when --only names it) prints where a static decode step's device time goes, against
the floor of reading the weights once a step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import socket
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, StoppingCriteriaList  # noqa: E402

from benchmarks import uneven_decode  # noqa: E402
from benchmarks.offload_bench import (  # noqa: E402
    GIB,
    LAYERED,
    SHAPE,
    chosen_sections,
    machine,
    random_bf16,
    release,
    run_sections,
)
from trainer.config import FSDPConfig  # noqa: E402
from trainer.models import attention  # noqa: E402
from trainer.offload import OffloadOptions, attach_offload  # noqa: E402
from trainer.rollout.static_decode import Sampling, StaticDecoder  # noqa: E402

SECTIONS = ("allgpu", "allgpu_static", "allgpu_static_graphs", "allgpu_static_graphs_unfused",
            "allgpu_static_graphs_unfused_rotary",
            "allgpu_static_graphs_repeat_kv", "accelerate", "fsdp2",
            "ours_layered", "ours_phase", "ours_phase_static", "uneven", "capped", "static_profile")
DEFAULT_SECTIONS = SECTIONS[:-1]
"""What a run without --only measures (static_profile is a diagnosis, not a comparison)."""
CACHE_ROWS = 8192
"""Embedding rows the device cache of the layered variants holds (rollout.embedding_cache.cache_size)."""
THRESHOLD = 0.9
"""GPU memory threshold of the capped run's dynamic offload (fraction of the cap)."""
PHASE_TARGET = 0.92
"""ours_phase's decode throughput relative to all-GPU that the issue asks for."""

Place = Callable[[], contextlib.AbstractContextManager]
"""Returns the context one generate runs in (an engine placement, or nothing); it yields the staged groups."""


@dataclasses.dataclass
class Plan:
    layers: int
    batch: int
    prompt_tokens: int
    new_tokens: int
    warmup_tokens: int
    """New tokens of the warm-up generate each variant runs before it is timed."""
    iters: int
    slow_iters: int
    """Generates timed for accelerate and FSDP2 (each step copies gigabytes: one generate already averages many)."""
    cap_gib: float
    """GPU memory cap of the `capped` section: below the weights, so the all-GPU rollout runs out of memory."""


# The warm-up decodes as far as the timed runs: on 2026-11-30 an 8-token warm-up left the first variant of
# each process (all-GPU) at 42-73 ms per step against 22-24 ms for the next ones, every cache length
# it had not seen yet costing extra the first time.
FULL_PLAN = Plan(layers=28, batch=32, prompt_tokens=128, new_tokens=128, warmup_tokens=128, iters=3, slow_iters=1,
                 cap_gib=12.0)  # the 7B shape's weights are 15.2 GB (14.2 GiB)
QUICK_PLAN = Plan(layers=4, batch=8, prompt_tokens=32, new_tokens=16, warmup_tokens=16, iters=1, slow_iters=1,
                  cap_gib=3.0)  # 4 layers: 4.05 GB of weights


@dataclasses.dataclass(frozen=True)
class Decode:
    """Medians over the timed generates of one variant, and the peak device memory they reached."""

    prefill_s: float
    generate_s: float
    peak_gib: float

    def ms_per_step(self, new_tokens: int) -> float:
        """Milliseconds a decoded token's step, the prefill left out (Bench.record's ms_per_step)."""
        return (self.generate_s - self.prefill_s) / (new_tokens - 1) * 1e3


class Bench:
    def __init__(self, plan: Plan, out: Path | None, uneven_plan: uneven_decode.UnevenPlan | None = None):
        self.plan, self.out = plan, out
        self.uneven_plan = uneven_plan or uneven_decode.UnevenPlan()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.rows: list[dict] = []
        self.errors: dict[str, str] = {}
        generator = torch.Generator().manual_seed(0)
        # All tokens real: an attention mask of ones, so no variant pays for padding.
        self.prompt = torch.randint(0, SHAPE["vocab_size"], (plan.batch, plan.prompt_tokens),
                                    generator=generator).to(self.device)
        self.attention_mask = torch.ones_like(self.prompt)
        self.generation_configs = {tokens: _sampling(tokens) for tokens in {1, plan.warmup_tokens, plan.new_tokens}}
        self.meta = {
            **machine(),
            "accelerate": _version("accelerate"),
            "shape": {**SHAPE, "num_hidden_layers": plan.layers, "use_cache": True},
            "plan": dataclasses.asdict(plan),
        }

    # ------------------------------------------------------------------------------ helpers

    def config(self) -> Qwen2Config:
        return Qwen2Config(**{**SHAPE, "num_hidden_layers": self.plan.layers, "use_cache": True})

    def build(self, *, on_gpu: bool = False) -> Qwen2ForCausalLM:
        """Random bf16 weights in eval mode, on the host unless `on_gpu`.

        Initialised on the GPU and then moved to the host: random init of 7.6 B parameters on the
        host's cores takes far longer, and the result is the same bf16 model on the CPU."""
        release()
        model = random_bf16(Qwen2ForCausalLM, self.config(), self.device)
        if not on_gpu:
            model.to("cpu")
            release()
        return model.eval()

    def generate(self, model, new_tokens: int, place: Place = contextlib.nullcontext,
                 stopping: StoppingCriteriaList | None = None,
                 decoder: StaticDecoder | None = None) -> list[str] | None:
        """One sampled rollout of `new_tokens` (through `decoder`, rollout.decode=static, when given); returns
        what `place` staged (None outside an engine placement)."""
        with place() as staged, torch.no_grad():
            if decoder is not None:
                decoder.generate(self.prompt, self.attention_mask, new_tokens)
            else:
                model.generate(input_ids=self.prompt, attention_mask=self.attention_mask,
                               generation_config=self.generation_configs[new_tokens], stopping_criteria=stopping)
        return staged

    def warm_up(self, model, place: Place = contextlib.nullcontext,
                stopping: StoppingCriteriaList | None = None, decoder: StaticDecoder | None = None) -> list[str] | None:
        staged = self.generate(model, self.plan.warmup_tokens, place, stopping, decoder)
        torch.cuda.synchronize()
        return staged

    def decode(self, model, place: Place = contextlib.nullcontext, stopping: StoppingCriteriaList | None = None,
               *, iters: int | None = None, decoder: StaticDecoder | None = None) -> Decode:
        """Median seconds of `iters` prefills (one new token) and of `iters` whole generates, and the
        peak device memory of them all. Call it once the variant is warmed up."""
        iters = iters or self.plan.iters
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        prefill = _median_seconds(lambda: self.generate(model, 1, place, stopping, decoder), iters)
        whole = _median_seconds(lambda: self.generate(model, self.plan.new_tokens, place, stopping, decoder), iters)
        return Decode(prefill, whole, torch.cuda.max_memory_allocated() / GIB)

    def record(self, variant: str, decode: Decode | None, notes: str, **extra) -> dict:
        """One row; `decode` is None for a variant that could not run (its notes say why)."""
        row = {"variant": variant, "ms_per_step": None, "generate_s": None, "prefill_s": None, "tokens_per_s": None,
               "peak_gib": None, "notes": notes, **extra}
        if decode is not None:
            row.update(ms_per_step=decode.ms_per_step(self.plan.new_tokens),
                       generate_s=decode.generate_s, prefill_s=decode.prefill_s,
                       tokens_per_s=self.plan.batch * self.plan.new_tokens / decode.generate_s,
                       peak_gib=decode.peak_gib)
            print(f"  {variant:<22} {row['ms_per_step']:8.1f} ms/step  {row['tokens_per_s']:8.0f} tok/s  "
                  f"generate {decode.generate_s:7.2f} s  peak {decode.peak_gib:6.1f} GiB  {notes}", flush=True)
        else:
            print(f"  {variant:<22} {notes}", flush=True)
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps({"meta": self.meta, "rows": self.rows, "errors": self.errors}, indent=2))

    def warm_cache(self, model, engine):
        """The embedding cache of a layered engine, filled from the tokens of one warm-up generate."""
        cache = engine.enable_embedding_cache(cache_size=CACHE_ROWS, warmup_steps=1)
        self.warm_up(model)
        cache.end_step()
        cache.take_hit_ratio()  # counts from the timed generates only
        return cache

    # ------------------------------------------------------------------------------ sections

    def allgpu(self) -> None:
        model = self.build(on_gpu=True)
        self.warm_up(model)
        self.record("allgpu", self.decode(model), "the whole model on the GPU")

    def allgpu_static(self) -> None:
        model = self.build(on_gpu=True)
        decoder = _static_decoder(model)
        self.warm_up(model, decoder=decoder)
        self.record("allgpu_static", self.decode(model, decoder=decoder),
                    "the whole model on the GPU, rollout.decode=static (static cache, eager)")

    def allgpu_static_graphs(self) -> None:
        model = self.build(on_gpu=True)
        decoder = _static_decoder(model, cuda_graphs=True)
        self.warm_up(model, decoder=decoder)
        self.record("allgpu_static_graphs", self.decode(model, decoder=decoder),
                    "the whole model on the GPU, rollout.decode=static with each token's step in a CUDA graph; "
                    + _fused(decoder))

    def allgpu_static_graphs_unfused(self) -> None:
        """allgpu_static_graphs with transformers' own RMSNorm (about seven kernels each) instead of torch's fused
        one (trainer/rollout/fused_norms.py): against allgpu_static_graphs, what fusing the norms gives."""
        model = self.build(on_gpu=True)
        decoder = _static_decoder(model, cuda_graphs=True)
        decoder.fuse_norms = False
        self.warm_up(model, decoder=decoder)
        self.record("allgpu_static_graphs_unfused", self.decode(model, decoder=decoder),
                    "allgpu_static_graphs with transformers' own RMSNorm forwards (not fused)")

    def allgpu_static_graphs_unfused_rotary(self) -> None:
        """allgpu_static_graphs with transformers' own apply_rotary_pos_emb (about ten kernels a layer) and MLP
        activation and product (two) in the decode steps instead of their torch.compile'd fusions
        (trainer/rollout/fused_rotary.py, fused_mlp.py): against allgpu_static_graphs, what compiling them gives."""
        model = self.build(on_gpu=True)
        decoder = _static_decoder(model, cuda_graphs=True)
        decoder.fuse_rotary = decoder.fuse_mlps = False
        self.warm_up(model, decoder=decoder)
        self.record("allgpu_static_graphs_unfused_rotary", self.decode(model, decoder=decoder),
                    "allgpu_static_graphs with transformers' own rotary embedding and MLP activation (not compiled)")

    def allgpu_static_graphs_repeat_kv(self) -> None:
        """allgpu_static_graphs with the installed transformers' own SDPA attention, which before its 5.2x
        releases copies the keys and values out to every query head at each layer and token (repeat_kv):
        against allgpu_static_graphs, what trainer/models/attention.py's packing of a decoded token gives."""
        packed, attention.AttentionInterface._global_mapping["sdpa"] = (
            attention.AttentionInterface._global_mapping["sdpa"], attention.LIBRARY_SDPA)
        try:
            model = self.build(on_gpu=True)
            decoder = _static_decoder(model, cuda_graphs=True)
            self.warm_up(model, decoder=decoder)
            self.record("allgpu_static_graphs_repeat_kv", self.decode(model, decoder=decoder),
                        "allgpu_static_graphs with transformers' own SDPA attention "
                        f"({'packs a decoded token itself' if attention.library_packs_gqa() else 'repeat_kv'})")
        finally:
            attention.AttentionInterface._global_mapping["sdpa"] = packed

    def static_profile(self) -> None:
        """Where a decode step's device time goes (rollout.decode=static, eager, all on the GPU): torch.profiler's
        kernel times over the steps of one rollout, against the floor (the weights' bytes read once a step at the
        HBM bandwidth of a device-to-device copy). Not in the default set: --only static_profile."""
        from torch.profiler import ProfilerActivity, profile

        model = self.build(on_gpu=True)
        decoder = _static_decoder(model)
        self.warm_up(model, decoder=decoder)
        steps = 16
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.generate(model, steps + 1, decoder=decoder)
            torch.cuda.synchronize()
        kernels = sorted(((event.key, event.device_time_total / 1e3, event.count) for event in prof.key_averages()
                          if event.device_time_total > 0), key=lambda kernel: -kernel[1])
        device_ms = sum(kernel[1] for kernel in kernels)
        weight_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
        bandwidth = _hbm_bandwidth(self.device)
        floor_ms = weight_bytes / bandwidth * 1e3
        # The prefill's kernels are in the total too: `per_step` counts the steps' share by the step count.
        print(f"  device time {device_ms:.1f} ms over the prefill and {steps} steps; floor {floor_ms:.2f} ms a step "
              f"({weight_bytes / GIB:.1f} GiB of weights at {bandwidth / 1e12:.2f} TB/s)", flush=True)
        for name, milliseconds, count in kernels[:15]:
            print(f"  {milliseconds:8.2f} ms {count:6d}x  {name[:110]}", flush=True)
        self.rows.append({"variant": "static_profile", "ms_per_step": None, "tokens_per_s": None, "peak_gib": None,
                          "device_ms": device_ms, "steps": steps, "floor_ms": floor_ms, "hbm_bytes_per_s": bandwidth,
                          "notes": f"device time {device_ms:.1f} ms for the prefill and {steps} steps, eager; "
                                   f"floor {floor_ms:.2f} ms a step",
                          "kernels": [{"name": name, "ms": ms, "count": count} for name, ms, count in kernels[:40]]})
        self.save()

    def ours_phase_static(self) -> None:
        """ours_phase's first variant (head and embedding staged whole for the rollout), decoded by
        rollout.decode=static: eagerly, then with its per-token step in CUDA graphs (the engine says when its
        forward may be captured: StaticDecoder's `safety`)."""
        model = self.build()
        engine = attach_offload(model, LAYERED, self.device, role="actor")
        try:
            def place():
                return engine.placed_for("rollout")

            for variant, graphs in (("ours_phase_static", False), ("ours_phase_static_graphs", True)):
                decoder = _static_decoder(model, cuda_graphs=graphs, safety=engine)
                staged = self.warm_up(model, place, decoder=decoder)
                decode = self.decode(model, place, decoder=decoder)
                how = f"CUDA graphs, {decoder.replays} of the last rollout's steps replayed" if graphs else "eager"
                self.record(variant, decode, f"placed_for('rollout'), no budget: staged {_groups(staged)}; "
                            f"rollout.decode=static, {how}; {_fused(decoder)}", staged=staged,
                            replays=decoder.replays)
        finally:
            engine.close()

    def uneven(self) -> None:
        """Long-tailed response lengths (issue 40, benchmarks/uneven_decode.py): useful tokens a second of a static
        batch, the shrinking buckets and the refilled slots, against each other and the HBM floor; and one decode
        step of a full batch of `--slots` rows against its floor. --quick: the smoke plan."""
        model = self.build(on_gpu=True)
        plan = self.uneven_plan
        result = uneven_decode.measure(model, plan, self.device, hbm_bytes_per_s=_hbm_bandwidth(self.device),
                                       log=lambda line: print(f"  {line}", flush=True))
        step, whole = result["step"], result["step_whole_cache"]
        self.rows.append({"variant": "uneven", "ms_per_step": step["step_ms"], "tokens_per_s": None, "peak_gib": None,
                          "useful_speedup": result["useful_speedup"], "uneven": result,
                          "notes": f"refill: {result['useful_speedup']:.2f}x the useful tokens/s of a static batch, "
                                   f"{result['variants']['refill']['vs_floor']:.2f}x its HBM floor; a step at batch "
                                   f"{step['rows']} {step['vs_floor']:.2f}x its floor reading "
                                   f"{step['columns_read']:.0f} of {step['cache_columns']} cache columns "
                                   f"({whole['vs_floor']:.2f}x reading them all)"})
        self.save()

    def accelerate(self) -> None:
        """The issue's baseline: embedding and head through `accelerate.cpu_offload`, the rest on the GPU."""
        from accelerate import cpu_offload

        model = self.build()
        # Before the offload: it leaves its modules' parameters on the meta device, which `.to` cannot move.
        for module in (model.model.layers, model.model.norm, model.model.rotary_emb):
            module.to(self.device)
        for module in (model.model.embed_tokens, model.lm_head):
            cpu_offload(module, execution_device=self.device)
        self.warm_up(model)
        self.record("accelerate", self.decode(model, iters=self.plan.slow_iters),
                    "accelerate.cpu_offload of embedding and lm_head: both copied from pageable memory every step")

    def fsdp2(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        with _one_rank_process_group(self.device):
            model = self.build()
            policy = CPUOffloadPolicy(pin_memory=True)
            for layer in model.model.layers:
                fully_shard(layer, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            self.warm_up(model)
            self.record("fsdp2", self.decode(model, iters=self.plan.slow_iters),
                        "fully_shard per layer and on the root, CPUOffloadPolicy(pin_memory=True), one rank")
            del model

    def ours_layered(self) -> None:
        """Embedding and head on the CPU as in training: the head streams every step, the embedding
        goes through the device cache of its most frequent rows."""
        model = self.build()
        engine = attach_offload(model, LAYERED, self.device, role="actor")
        try:
            cache = self.warm_cache(model, engine)
            decode = self.decode(model)
            hit_ratio = cache.take_hit_ratio()
            self.record("ours_layered", decode, f"embedding + lm_head on the CPU, no per-phase placement; "
                        f"embedding cache hits {_ratio(hit_ratio)}", embedding_cache_hit_ratio=hit_ratio)
        finally:
            engine.close()

    def ours_phase(self) -> None:
        """Per-phase placement: the rollout runs with the CPU-resident head (and embedding) staged whole
        on the GPU, dropped on exit; then with a budget of the head's bytes only, the embedding served
        by its cache. The cache is filled from an unplaced warm-up, as in ours_layered."""
        model = self.build()
        engine = attach_offload(model, LAYERED, self.device, role="actor")
        try:
            cache = self.warm_cache(model, engine)
            head_bytes = engine.stageable_bytes()["lm_head"]
            for variant, budget in (("ours_phase", None), ("ours_phase_head_only", head_bytes)):
                def place(budget=budget):
                    return engine.placed_for("rollout", budget_bytes=budget)

                staged = self.warm_up(model, place)
                decode = self.decode(model, place)
                hit_ratio = cache.take_hit_ratio()
                budget_text = "no budget" if budget is None else f"budget {budget / GIB:.2f} GiB"
                self.record(variant, decode, f"placed_for('rollout'), {budget_text}: staged {_groups(staged)}; "
                            f"embedding cache hits {_ratio(hit_ratio)}", staged=staged, budget_bytes=budget,
                            embedding_cache_hit_ratio=hit_ratio)
        finally:
            engine.close()

    def capped(self) -> None:
        """A per-process memory cap below the weights: all-GPU first (expected out of memory), then the
        engine with dynamic offload, starting from the layers that fit and moving them at safe points."""
        model = self.build()  # before the cap: the model is initialised on the GPU
        h2d = _h2d_bandwidth(self.device)  # before the cap too: its buffer would not fit under it
        with _memory_cap(self.device, int(self.plan.cap_gib * GIB)):
            self.capped_allgpu(model)
            self.capped_dynamic(model, h2d)

    def capped_allgpu(self, model) -> None:
        """The whole model to the GPU under the cap; the model is back on the host afterwards."""
        cap = self.plan.cap_gib
        where, decode = "at .to(device)", None
        try:
            model.to(self.device)
            where = "in generate"
            self.warm_up(model)
            decode = self.decode(model, iters=1)
        except torch.OutOfMemoryError:
            pass
        model.to("cpu")  # after the except block: the error's frames no longer hold device tensors
        release()
        if decode is None:
            self.record("capped_allgpu", None, f"out of memory {where} under a {cap:g} GiB cap",
                        status="out of memory", cap_gib=cap)
        else:
            self.record("capped_allgpu", decode, f"the cap is not tight: all-GPU ran under {cap:g} GiB",
                        status="ran", cap_gib=cap)

    def capped_dynamic(self, model, h2d_bytes_per_s: float) -> None:
        """The engine under the cap: the layers that fit stay on the GPU, the rest stream; the head and
        embedding are staged while the budget under the threshold allows; the decode loop calls the
        dynamic-offload controller every 8 tokens. Against the PCIe floor: the streamed layers' bytes copied up
        once a step at `h2d_bytes_per_s` (a pinned host-to-device copy's, measured)."""
        from trainer.offload.dynamic import ModelLayers, device_memory_probe, layers_that_fit, plan_layers
        from trainer.rollout.hf_rollout import SafePoints

        fsdp = FSDPConfig.model_validate({
            "offload_policy": {"embedding": "cpu", "lm_head": "cpu"},
            "dynamic_offload": {"enabled": True},  # at THRESHOLD and no layer minimum: the settings below
        })
        probe = device_memory_probe(self.device)  # under the cap: (bytes this process holds, the cap)
        layer_bytes = _parameter_bytes(model.model.layers[0])
        fit = layers_that_fit(probe, threshold=THRESHOLD, layer_bytes=layer_bytes,
                              total_layers=len(model.model.layers), reserve_bytes=self.reserve_bytes(model))
        engine = attach_offload(model, fsdp, self.device, role="actor", layers_on_gpu=fit)
        try:
            settings = types.SimpleNamespace(gpu_memory_threshold=THRESHOLD, min_transformer_layers_on_gpu=0,
                                             dynamic_offload_enabled=True)
            decisions: list[str] = []

            def log(line: str) -> None:
                decisions.append(line)
                print(f"  {line}", flush=True)

            def safe_point() -> None:  # what the memory manager does between decode chunks
                used, total = probe()
                layers = ModelLayers("actor", engine.layers_on_gpu, len(engine.transformer_units), engine.layer_bytes,
                                     engine.ring_slots)
                for decision in plan_layers([layers], used=used, total=total, settings=settings).values():
                    engine.set_transformer_layers_on_gpu(decision.layers_on_gpu)
                    torch.cuda.empty_cache()
                    log(f"{decision.describe()} [actor]")

            stopping = StoppingCriteriaList([SafePoints(safe_point, every=8)])
            release()  # the probe counts the allocator's cached blocks
            used, allowed = probe()
            budget = max(0, int(THRESHOLD * allowed) - used)

            def place():
                return engine.placed_for("rollout", budget_bytes=budget)

            staged = self.warm_up(model, place, stopping)
            decode = self.decode(model, place, stopping)
            streamed = len(model.model.layers) - engine.layers_on_gpu
            floor_ms = streamed * layer_bytes / h2d_bytes_per_s * 1e3
            versus = f"{decode.ms_per_step(self.plan.new_tokens) / floor_ms:.2f}x" if floor_ms else "n/a"
            self.record("capped_dynamic", decode,
                        f"{self.plan.cap_gib:g} GiB cap, dynamic offload: {fit} -> {engine.layers_on_gpu} of "
                        f"{len(model.model.layers)} layers on GPU, moves {engine.moves}, staged {_groups(staged)}; "
                        f"PCIe floor of the {streamed} streamed layers {floor_ms:.1f} ms a step ({versus})",
                        pcie_floor_ms=floor_ms, h2d_bytes_per_s=h2d_bytes_per_s, streamed_layers=streamed,
                        cap_gib=self.plan.cap_gib, layers_on_gpu_start=fit, layers_on_gpu=engine.layers_on_gpu,
                        moves=dict(engine.moves), staged=staged, budget_bytes=budget,
                        probe_gib=[used / GIB, allowed / GIB], decisions=decisions)
        finally:
            engine.close()

    def reserve_bytes(self, model) -> int:
        """Device bytes a capped rollout needs besides its resident layers (an estimate, on the high
        side): the head and embedding staged whole, the ring of streamed-layer slots, the KV cache,
        and the prefill's largest activations and the fp32 logits of the sampled position."""
        config = model.config
        staged = _parameter_bytes(model.lm_head) + _parameter_bytes(model.model.embed_tokens)
        ring = min(OffloadOptions().prefetch + 1, config.num_hidden_layers) * _parameter_bytes(model.model.layers[0])
        element = next(model.parameters()).element_size()
        head_dim = config.hidden_size // config.num_attention_heads
        tokens = self.plan.batch * (self.plan.prompt_tokens + self.plan.new_tokens)
        kv_cache = 2 * config.num_hidden_layers * tokens * config.num_key_value_heads * head_dim * element
        prefill = 3 * self.plan.batch * self.plan.prompt_tokens * config.intermediate_size * element
        logits = 3 * self.plan.batch * config.vocab_size * 4
        return staged + ring + kv_cache + prefill + logits

    # --------------------------------------------------------------------------------- report

    def report(self) -> None:
        by_variant = {row["variant"]: row for row in self.rows}
        gpu = by_variant.get("allgpu")
        for row in self.rows:
            measured = gpu is not None and row["ms_per_step"] is not None
            row["vs_all_gpu"] = gpu["ms_per_step"] / row["ms_per_step"] if measured else None
        shape, plan = self.meta["shape"], self.plan
        print()
        print(f"{self.meta['gpu']}, {self.meta['host_cores']} host cores, torch {self.meta['torch']}, "
              f"transformers {self.meta['transformers']}, accelerate {self.meta['accelerate']}, {self.meta['date']}")
        print(f"Qwen2-shaped decoder: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
              f"intermediate {shape['intermediate_size']}, "
              f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocab {shape['vocab_size']}, "
              f"bf16; batch {plan.batch}, prompt {plan.prompt_tokens}, {plan.new_tokens} new tokens sampled")
        print()
        print("| variant | ms/step | tokens/s | peak GiB | vs GPU | notes |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for row in self.rows:
            print(f"| {row['variant']} | {_cell(row['ms_per_step'], 1)} | {_cell(row['tokens_per_s'], 0)} | "
                  f"{_cell(row['peak_gib'], 1)} | {_cell(row['vs_all_gpu'], 2)} | {row['notes']} |")
        print()
        phase = by_variant.get("ours_phase")
        if phase is not None and phase["vs_all_gpu"] is not None:
            verdict = "met" if phase["vs_all_gpu"] >= PHASE_TARGET else "missed"
            print(f"ours_phase vs all-GPU decode throughput: {phase['vs_all_gpu']:.2f}× "
                  f"(target ≥ {PHASE_TARGET:.2f}×): {verdict}")
        capped, dynamic = by_variant.get("capped_allgpu"), by_variant.get("capped_dynamic")
        if capped is not None:
            outcome = "OOM" if capped["status"] == "out of memory" else "ran (the cap is not tight)"
            line = f"all-GPU under the {capped['cap_gib']:g} GiB cap: {outcome}"
            if dynamic is not None:
                line += (f"; dynamic offload: {dynamic['ms_per_step']:.1f} ms/step, {dynamic['layers_on_gpu']} "
                         f"layers on GPU (moves {dynamic['moves']})")
            print(line)
        for section, error in self.errors.items():
            print(f"section {section} failed: {error.strip().splitlines()[-1]}")
        self.save()


def _sampling(new_tokens: int) -> GenerationConfig:
    """Plain sampling of exactly `new_tokens`: no EOS to stop early, top_k=0 (None would take the
    library's default of 50), temperature and top_p at 1 (no logits processors)."""
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                            top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0, use_cache=True)


def _static_decoder(model, *, cuda_graphs: bool = False, safety=None) -> StaticDecoder:
    """rollout.decode=static with `_sampling`'s settings: plain sampling, no EOS (every token is decoded)."""
    return StaticDecoder(model, eos_ids=[-1], pad_id=0, sampling=Sampling(temperature=1.0, top_k=0, top_p=1.0),
                         cuda_graphs=cuda_graphs, safety=safety)


def _fused(decoder: StaticDecoder) -> str:
    """What the last generate of `decoder` ran compiled or fused (a piece that fell back shows as 0)."""
    return (f"fused: {decoder.fused_norms} norms, {decoder.fused_mlps} MLPs, "
            f"rotary {'compiled' if decoder.fused_rotary else 'own'}; {_cache_read(decoder)}")


def _cache_read(decoder: StaticDecoder) -> str:
    """The cache length the last generate's attention read a step, of the cache's (live_keys.py)."""
    mean = decoder.columns_read / max(1, decoder.steps)
    return f"cache length read {mean:.0f} of {decoder.cache_columns} columns a step"


def _h2d_bandwidth(device: torch.device) -> float:
    """Bytes a second of a 512 MiB copy from page-locked host memory to the device."""
    source = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(source, device=device)
    return source.numel() / _median_seconds(lambda: target.copy_(source, non_blocking=True), 5)


def _hbm_bandwidth(device: torch.device) -> float:
    """Bytes a second of a 1 GiB device-to-device copy (it reads and writes each byte)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / _median_seconds(lambda: target.copy_(source), 5)


def _median_seconds(run: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in module.parameters())


@contextlib.contextmanager
def _one_rank_process_group(device: torch.device) -> Iterator[None]:
    """A one-rank NCCL group on a free loopback port, for FSDP2; destroyed on exit."""
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)
    try:
        yield
    finally:
        release()
        dist.destroy_process_group()


@contextlib.contextmanager
def _memory_cap(device: torch.device, cap_bytes: int) -> Iterator[None]:
    """This process's allocator may hold at most `cap_bytes` of the device inside the block."""
    release()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _cell(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _groups(staged: list[str] | None) -> str:
    return ", ".join(staged) if staged else "nothing"


def _ratio(value: float | None) -> str:
    return "– (no lookups)" if value is None else f"{value:.2f}"


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--only", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 layers, batch 8, prompt 32, 16 new tokens")
    parser.add_argument("--cap-gib", type=float, help="GPU memory cap of the capped section (default: 12, quick: 3)")
    parser.add_argument("--iters", type=int, help="timed generates per variant (default: 3, quick: 1)")
    parser.add_argument("--batch", type=int, help="sequences decoded at once (default: 32, quick: 8)")
    parser.add_argument("--slots", type=int, help="uneven: rows decoding at once (default: 256, quick: 8)")
    parser.add_argument("--rows", type=int, help="uneven: responses of long-tailed lengths (default: 512, quick: 16)")
    args = parser.parse_args(argv)
    sections = chosen_sections(args.only, SECTIONS)
    if sections is None:
        return 2
    if args.cap_gib is not None and args.cap_gib <= 0:
        print(f"ERROR: --cap-gib must be positive, got {args.cap_gib}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ERROR: the benchmark needs a CUDA GPU (torch.cuda.is_available() is false)", file=sys.stderr)
        return 2
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.cap_gib is not None:
        plan = dataclasses.replace(plan, cap_gib=args.cap_gib)
    if args.iters is not None:
        if args.iters < 1:
            print(f"ERROR: --iters must be at least 1, got {args.iters}", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, iters=args.iters)
    if args.batch is not None:
        if args.batch < 1:
            print(f"ERROR: --batch must be at least 1, got {args.batch}", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, batch=args.batch)
    uneven_plan = uneven_decode.QUICK_UNEVEN if args.quick else uneven_decode.UnevenPlan()
    for name in ("slots", "rows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"ERROR: --{name} must be at least 1, got {value}", file=sys.stderr)
            return 2
        if value is not None:
            uneven_plan = dataclasses.replace(uneven_plan, **{name: value})
    torch.manual_seed(0)
    # As the trainer's model loading does: a decoded token attends on the key/value heads on any transformers.
    print("attention: a decoded token on the key/value heads by " +
          ("this project's packing" if attention.use_packed_gqa() else "transformers' own pack_gqa"))
    bench = Bench(plan, args.out, uneven_plan)
    print(f"{bench.meta['gpu']}, {bench.meta['host_cores']} host cores", flush=True)
    # In this order whatever --only says: capped, which caps memory, comes last.
    run_sections(bench, [name for name in SECTIONS if name in sections], lambda name: getattr(bench, name)())
    bench.report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
