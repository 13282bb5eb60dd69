"""Offload engine speed on one GPU, against all-on-GPU, FSDP2's CPU offload and accelerate.

    python benchmarks/offload_bench.py --out results.json            # the full set (about 5 minutes on an H200)
    python benchmarks/offload_bench.py --quick --out quick.json      # a smoke run: 4 layers, fewer repeats
    python benchmarks/offload_bench.py --only bandwidth,allgpu,ours_full --out part.json
    python benchmarks/offload_bench.py --report part.json            # print a saved run's table again

A Qwen2-7B-shaped decoder (hidden 3584, 28 layers, intermediate 18944, 28 heads / 4 KV heads,
vocab 152064, untied) with random bf16 weights, batch 4 x 1024 tokens. Everything is measured in
the same run: the pinned and pageable host-to-device bandwidth, then each variant. The floor of a
streaming variant is max(all-GPU time, bytes streamed host-to-device / pinned bandwidth).

Sections (--only): bandwidth, allgpu, ours_full, ours_layered, fsdp2, accelerate, checkpointing,
optimizer, remove_padding. Each writes its rows to --out as soon as it finishes; a section that fails
records its error and the others still run.

remove_padding (verl's use_remove_padding and use_dynamic_bsz): the trainer's own log-prob pass and
training step (Actor.update: forward and backward over the micro-batches, clip, AdamW) on a rollout batch
of 8 sequences, prompts 50-100% of 512 tokens and responses 10-100% of 1024, all on the GPU with gradient
checkpointing: padded, padding-free, and padding-free by token budget; tokens/s counts real tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from trainer.config import ActorConfig, FSDPConfig  # noqa: E402
from trainer.data import PromptRecord  # noqa: E402
from trainer.offload import OffloadOptions, attach_offload  # noqa: E402
from trainer.rollout.batch import RolloutBatch  # noqa: E402
from trainer.workers.actor import Actor, compute_log_probs  # noqa: E402

GIB = 1024**3
SHAPE = dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
             num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
             rms_norm_eps=1e-6, use_cache=False)
SECTIONS = ("bandwidth", "allgpu", "ours_full", "ours_layered", "fsdp2", "accelerate", "checkpointing", "optimizer",
            "remove_padding", "host")
FULL = FSDPConfig(param_offload=True)
LAYERED = FSDPConfig.model_validate({"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}})


@dataclasses.dataclass
class Plan:
    layers: int
    batch: int
    tokens: int
    long_tokens: int
    """Tokens per sequence of the gradient-checkpointing runs."""
    optimizer_layers: int
    """Layers of the model the optimizer_offload section runs (its fp32 states must fit in host memory)."""
    warmup: int
    iters: int


FULL_PLAN = Plan(layers=28, batch=4, tokens=1024, long_tokens=4096, optimizer_layers=8, warmup=2, iters=5)
QUICK_PLAN = Plan(layers=4, batch=2, tokens=512, long_tokens=1024, optimizer_layers=2, warmup=1, iters=2)


@dataclasses.dataclass(frozen=True)
class PaddingPlan:
    """The remove_padding section's rollout batch and micro-batches."""

    sequences: int
    prompt: int
    """Longest prompt; prompts run from half of it to all of it, left-padded."""
    response: int
    """Longest response; responses run from a tenth of it to all of it, right-padded."""
    log_prob_micro: int
    update_micro: int
    log_prob_budget: int
    """Tokens per log-prob micro-batch by token budget (rollout.log_prob_max_token_len_per_gpu)."""
    update_budget: int
    """Tokens per update micro-batch by token budget (actor.ppo_max_token_len_per_gpu)."""


FULL_PADDING = PaddingPlan(sequences=8, prompt=512, response=1024, log_prob_micro=8, update_micro=2,
                           log_prob_budget=16384, update_budget=4096)
QUICK_PADDING = PaddingPlan(sequences=4, prompt=64, response=128, log_prob_micro=4, update_micro=2,
                            log_prob_budget=768, update_budget=384)


class Bench:
    def __init__(self, plan: Plan, out: Path, profile_dir: Path | None = None):
        self.plan, self.out, self.profile_dir = plan, out, profile_dir
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.rows: list[dict] = []
        self.errors: dict[str, str] = {}
        self.pinned_gbps: float | None = None
        self.meta = {
            **machine(),
            "shape": {**SHAPE, "num_hidden_layers": plan.layers},
            "batch": [plan.batch, plan.tokens],
            "plan": dataclasses.asdict(plan),
        }

    @classmethod
    def from_results(cls, path: Path) -> Bench:
        """A finished run read back from its --out JSON, for report() (no GPU needed)."""
        saved = json.loads(path.read_text())
        bench = cls.__new__(cls)
        bench.meta, bench.rows, bench.errors = saved["meta"], saved["rows"], saved.get("errors", {})
        bench.plan, bench.out, bench.profile_dir = Plan(**saved["meta"]["plan"]), None, None
        bench.pinned_gbps = saved["pinned_gbps"]
        return bench

    # ------------------------------------------------------------------------------ helpers

    def config(self, layers: int | None = None) -> Qwen2Config:
        return Qwen2Config(**{**SHAPE, "num_hidden_layers": layers or self.plan.layers})

    def build(self, layers: int | None = None, checkpointing: bool = False) -> Qwen2ForCausalLM:
        """Random bf16 weights, initialised on the GPU (fast), in training mode."""
        release()
        model = random_bf16(Qwen2ForCausalLM, self.config(layers), self.device)
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    def ids(self, tokens: int | None = None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, SHAPE["vocab_size"], (self.plan.batch, tokens or self.plan.tokens),
                             generator=generator).to(self.device)

    def measure(self, run: Callable[[], None], *, iters: int | None = None, warmup: int | None = None):
        """(median milliseconds, peak GiB allocated during the timed runs)."""
        for _ in range(self.plan.warmup if warmup is None else warmup):
            run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(iters or self.plan.iters):
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3, torch.cuda.max_memory_allocated() / GIB

    def record(self, name: str, pass_: str, ms: float, peak: float, tokens: int, *, h2d_bytes: float = 0.0,
               d2h_bytes: float = 0.0, **extra) -> dict:
        row = {"name": name, "pass": pass_, "ms": ms, "tokens_per_s": tokens / (ms / 1e3), "peak_gib": peak,
               "h2d_gb": h2d_bytes / 1e9, "d2h_gb": d2h_bytes / 1e9,
               "h2d_gbps": h2d_bytes / 1e9 / (ms / 1e3) if h2d_bytes else None, **extra}
        self.rows.append(row)
        self.save()
        print(f"  {name:<38} {pass_:<32} {ms:9.1f} ms  {row['tokens_per_s']:9.0f} tok/s  peak {peak:6.1f} GiB"
              + (f"  H2D {row['h2d_gb']:.1f} GB at {row['h2d_gbps']:.1f} GB/s" if h2d_bytes else ""), flush=True)
        return row

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps({"meta": self.meta, "pinned_gbps": self.pinned_gbps, "rows": self.rows,
                                            "errors": self.errors}, indent=2))

    def tokens(self, long: bool = False) -> int:
        return self.plan.batch * (self.plan.long_tokens if long else self.plan.tokens)

    # ------------------------------------------------------------------------------ sections

    def bandwidth(self) -> None:
        """Host-to-device copies of 1 GiB: pinned (page-locked) and pageable source memory."""
        nbytes = GIB if self.plan.layers > 4 else GIB // 4
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        for kind, host in (("pinned", torch.ones(nbytes, dtype=torch.uint8).pin_memory()),
                           ("pageable", torch.ones(nbytes, dtype=torch.uint8))):
            ms, _ = self.measure(lambda host=host: device.copy_(host, non_blocking=True), iters=10, warmup=2)
            gbps = nbytes / 1e9 / (ms / 1e3)
            if kind == "pinned":
                self.pinned_gbps = gbps
            self.rows.append({"name": f"h2d {kind}", "pass": "copy 1 GiB", "ms": ms, "h2d_gbps": gbps})
            print(f"  H2D {kind:<8} {gbps:6.1f} GB/s", flush=True)
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        ms, _ = self.measure(lambda: pinned.copy_(device, non_blocking=True), iters=10, warmup=2)
        self.rows.append({"name": "d2h pinned", "pass": "copy 1 GiB", "ms": ms, "d2h_gbps": nbytes / 1e9 / (ms / 1e3)})
        print(f"  D2H pinned   {nbytes / 1e9 / (ms / 1e3):6.1f} GB/s", flush=True)
        self.save()

    def host(self) -> None:
        """What bounds an offloaded update (optimizer_update gpu, cpu or both): both copy directions at once, the
        host's memory, and the host's fused AdamW, each alone and beside the others (the two update paths share
        the host's memory: the device path's copies read and write it as the host path's cores do)."""
        elements = (1 << 28) if self.plan.layers > 4 else (1 << 24)  # 1 GiB of fp32 (64 MiB quick)
        nbytes = elements * 4
        up_host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
        down_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        up_device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        down_device = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        up_stream, down_stream = torch.cuda.Stream(), torch.cuda.Stream()

        def both_ways() -> None:
            with torch.cuda.stream(up_stream):
                up_device.copy_(up_host, non_blocking=True)
            with torch.cuda.stream(down_stream):
                down_host.copy_(down_device, non_blocking=True)
            up_stream.synchronize()
            down_stream.synchronize()

        source, target = torch.ones(elements), torch.empty(elements)
        master, moment, second = torch.zeros(elements), torch.zeros(elements), torch.zeros(elements)
        grad = torch.full((elements,), 1e-3)
        step = torch.zeros(())

        def host_copy() -> None:
            target.copy_(source)

        def adamw() -> None:
            torch._fused_adamw_([master], [grad], [moment], [second], [], [step], amsgrad=False, lr=1e-6,
                                beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False,
                                grad_scale=None, found_inf=None)

        def timed(run: Callable[[], None], repeats: int = 5) -> float:
            run()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        def beside(run: Callable[[], None], other: Callable[[], None]) -> tuple[float, float]:
            """(seconds of `run`, seconds of `other`), each repeating on a thread of its own until both ran 5 times."""
            counts, seconds, stop = [0, 0], [[], []], threading.Event()

            def loop(index: int, work: Callable[[], None]) -> None:
                while counts[index] < 5 or not stop.is_set():
                    start = time.perf_counter()
                    work()
                    seconds[index].append(time.perf_counter() - start)
                    counts[index] += 1
                    if min(counts) >= 5:
                        stop.set()
            threads = [threading.Thread(target=loop, args=(0, run)), threading.Thread(target=loop, args=(1, other))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return statistics.median(seconds[0][1:]), statistics.median(seconds[1][1:])

        gb = nbytes / 1e9
        alone = {"both ways": timed(both_ways), "host copy": timed(host_copy), "host AdamW": timed(adamw)}
        rows = [("both copy directions at once", alone["both ways"], 2 * gb, "GB/s over the bus, both ways summed"),
                ("host memory copy (read + write)", alone["host copy"], 2 * gb, "GB/s of host memory"),
                ("host fused AdamW, fp32", alone["host AdamW"], None, "ns per element")]
        for name, other in (("host copy", host_copy), ("host AdamW", adamw)):
            copies, work = beside(both_ways, other)
            bus = "GB/s over the bus, both ways summed"
            rows.append((f"both copy directions beside a {name}", copies, 2 * gb, bus))
            copy = name == "host copy"
            rows.append((f"{name} beside both copy directions", work, 2 * gb if copy else None,
                         "GB/s of host memory" if copy else "ns per element"))
        for name, seconds, moved, unit in rows:
            value = moved / seconds if moved is not None else seconds / elements * 1e9
            self.rows.append({"name": name, "pass": f"{nbytes >> 20} MiB", "ms": seconds * 1e3, "value": value,
                              "unit": unit})
            print(f"  {name:<45} {seconds * 1e3:8.1f} ms  {value:7.2f} {unit}", flush=True)
        self.save()

    def forward_backward(self, model, ids) -> Callable[[], None]:
        def run() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            for parameter in model.parameters():
                parameter.grad = None
        return run

    def forward(self, model, ids) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                model(input_ids=ids)
        return run

    def passes(self, model, ids) -> list[tuple[str, Callable[[], None]]]:
        return [("forward", self.forward(model, ids)), ("forward+backward", self.forward_backward(model, ids))]

    def allgpu(self) -> None:
        model = self.build()
        ids = self.ids()
        for pass_, run in self.passes(model, ids):
            row = self.record("all-GPU", pass_, *self.measure(run), self.tokens())
        self.profile("all-GPU forward+backward", run)
        self.note_loss_peak(row, model, ids)
        del model

    def profile(self, name: str, run: Callable[[], None]) -> None:
        """With --profile DIR: one more pass of `run` under torch.profiler, its Chrome trace (gzipped,
        named after the variant) written to DIR and its kernel table (by device time) added to
        DIR/tables.txt."""
        if self.profile_dir is None:
            return
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        self.profile_dir.mkdir(parents=True, exist_ok=True)
        slug = "".join(char if char.isalnum() else "_" for char in name).strip("_")
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            run()
            torch.cuda.synchronize()
        profiler.export_chrome_trace(str(self.profile_dir / f"{slug}.trace.json.gz"))
        table = profiler.key_averages().table(sort_by="self_device_time_total", row_limit=30)
        with (self.profile_dir / "tables.txt").open("a") as tables:
            tables.write(f"{name}\n{table}\n\n")

    def note_loss_peak(self, row: dict, model, ids) -> None:
        """Where a forward+backward's peak comes: the peak up to the loss (forward with grad), beside
        the whole pass's, from one more pass (untimed)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        row["peak_at_loss_gib"] = torch.cuda.max_memory_allocated() / GIB
        loss.backward()
        for parameter in model.parameters():
            parameter.grad = None
        torch.cuda.synchronize()
        row["peak_whole_pass_gib"] = torch.cuda.max_memory_allocated() / GIB
        self.save()
        print(f"  {'':<38} {'peak up to the loss / whole pass':<32} {row['peak_at_loss_gib']:6.1f} / "
              f"{row['peak_whole_pass_gib']:.1f} GiB", flush=True)

    def ours(self, name: str, fsdp_config: FSDPConfig, options: OffloadOptions | None = None, *,
             phase: str | None = None) -> None:
        model = self.build()
        engine = attach_offload(model, fsdp_config, self.device, role="actor", options=options)
        engine.log.timed_per_drain = None  # every copy timed, not a sample: the table adds up copy times
        ids = self.ids()
        placed = engine.placed_for(phase) if phase is not None else contextlib.nullcontext()
        with placed:
            self._measure_ours(name, model, engine, ids, phase)
        engine.close()
        del model, engine

    def _measure_ours(self, name: str, model, engine, ids, phase: str | None) -> None:
        for pass_, run in self.passes(model, ids):
            if phase is not None:
                run = _as_after_an_update(engine, run)
            self.measure(run, iters=1)  # warm-up, and one pass's copies to count
            before = engine.copied_bytes()
            run()
            torch.cuda.synchronize()
            h2d, d2h = _delta(before, engine.copied_bytes())
            engine.drain_copy_stats()
            ms, peak = self.measure(run, warmup=0)
            row = self.record(name, pass_, ms, peak, self.tokens(), h2d_bytes=h2d, d2h_bytes=d2h,
                              copy_seconds=_copy_seconds(engine.drain_copy_stats()),
                              working_set_gib=engine.working_set_bytes() / GIB)
        self.profile(f"{name} forward+backward", run)
        self.note_loss_peak(row, model, ids)

    def layered(self) -> None:
        """Embedding and head on the CPU, with the head streamed through three chunk slots (least
        device memory), through as many slots as it has chunks (prefetched whole while the resident
        transformer computes), and kept whole by the training phase (`placed_for("training")`, what
        the trainer does when it fits; copied again before each pass, as after an update)."""
        self.ours("ours layered (embedding+lm_head cpu)", LAYERED)
        self.ours("ours layered, whole head prefetched", LAYERED, OffloadOptions(head_slots=1 << 10))
        self.ours("ours layered, head kept for training", LAYERED, phase="training")

    def fsdp2_model(self, checkpointing: bool = False):
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if not dist.is_initialized():
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    device_id=self.device)
        model = self.build(checkpointing=checkpointing)
        policy = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        return model

    def fsdp2(self) -> None:
        model = self.fsdp2_model()
        ids = self.ids()
        parameter_bytes = _parameter_bytes(self.config())
        for pass_, run, passes in (("forward", self.forward(model, ids), 1),
                                   ("forward+backward", self.forward_backward(model, ids), 2)):
            self.record("FSDP2 CPUOffloadPolicy", pass_, *self.measure(run), self.tokens(),
                        h2d_bytes=passes * parameter_bytes)
        del model

    def accelerate(self) -> None:
        from accelerate import cpu_offload

        model = self.build()
        cpu_offload(model, execution_device=self.device)
        ids = self.ids()
        ms, peak = self.measure(self.forward(model, ids), iters=2, warmup=1)
        self.record("accelerate.cpu_offload", "forward", ms, peak, self.tokens(),
                    h2d_bytes=_parameter_bytes(self.config()))
        del model

    def checkpointing(self) -> None:
        """4 x 4096 tokens with gradient checkpointing: compute per layer is large enough to hide the copies."""
        ids = self.ids(self.plan.long_tokens)
        tokens = self.tokens(long=True)
        model = self.build(checkpointing=True)
        self.record("all-GPU", "f+b 4x4096 checkpointed", *self.measure(self.forward_backward(model, ids)), tokens)
        del model
        model = self.build(checkpointing=True)
        engine = attach_offload(model, FULL, self.device, role="actor")
        run = self.forward_backward(model, ids)
        self.measure(run, iters=1)
        before = engine.copied_bytes()
        ms, peak = self.measure(run, warmup=0)
        h2d, d2h = (nbytes / self.plan.iters for nbytes in _delta(before, engine.copied_bytes()))
        self.record("ours full streaming", "f+b 4x4096 checkpointed", ms, peak, tokens, h2d_bytes=h2d, d2h_bytes=d2h)
        engine.close()
        del model, engine
        model = self.fsdp2_model(checkpointing=True)
        ms, peak = self.measure(self.forward_backward(model, ids))
        self.record("FSDP2 CPUOffloadPolicy", "f+b 4x4096 checkpointed", ms, peak, tokens,
                    h2d_bytes=2 * _parameter_bytes(self.config()))
        del model

    def remove_padding(self) -> None:
        """The log-prob pass and training step, padded against padding-free (see the module's docstring)."""
        plan = QUICK_PADDING if self.plan.layers <= 4 else FULL_PADDING
        model = self.build(checkpointing=True)
        batch = ragged_rollout(plan, SHAPE["vocab_size"], self.device)
        real = int(batch.attention_mask.sum())
        padded_ms: dict[str, float] = {}
        for pass_, run in padding_passes(model, plan, batch):
            ms, peak = self.measure(run)
            kind = pass_.split(",")[0]
            padded_ms.setdefault(kind, ms)  # each kind's padded pass comes first
            self.record("remove_padding", pass_, ms, peak, real, vs_padded=padded_ms[kind] / ms, real_tokens=real,
                        padded_tokens=batch.attention_mask.numel(), padding_plan=dataclasses.asdict(plan))
        del model

    def optimizer(self) -> None:
        """optimizer_offload: the fused CPU AdamW on fp32 masters, and how much of it the next forward hides.

        Runs a model of `optimizer_layers` layers: a 7B model's fp32 masters, gradients and two states
        (16 bytes a parameter, 122 GB) do not fit beside everything else in the host's memory.
        """
        layers = self.plan.optimizer_layers
        model = self.build(layers=layers)
        config = FSDPConfig(param_offload=True, optimizer_offload=True)
        engine = attach_offload(model, config, self.device, role="actor")
        optimizer = engine.optimizer(lr=1e-5)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        ids = self.ids()
        tokens = self.tokens()
        name = f"ours optimizer_offload ({parameters / 1e9:.2f}B)"
        size = f"{layers} layers"

        def forward_backward() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        def clip() -> None:
            optimizer.clip_grad_norm_(1.0)  # folded into the fused update: no pass over the gradients

        def torch_clip() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        def update() -> None:
            optimizer.step()
            optimizer.wait()

        def training_step() -> None:
            forward_backward()
            clip()
            optimizer.step()

        forward_backward()
        update()
        fb_ms, fb_peak = self.measure(forward_backward, warmup=1)
        self.record(name, f"forward+backward, {size}", fb_ms, fb_peak, tokens)
        forward_backward()
        torch_clip_ms, _ = self.measure(torch_clip, warmup=0, iters=2)
        clip_ms, _ = self.measure(clip, warmup=0)
        update_ms, _ = self.measure(update, warmup=0)
        self.record(name, f"torch clip_grad_norm_, {size}", torch_clip_ms, 0.0, tokens)
        self.record(name, f"clip_grad_norm_ in the update, {size}", clip_ms, 0.0, tokens)
        per_billion = update_ms / 1e3 / (parameters / 1e9)
        self.record(name, f"CPU AdamW update, {size}", update_ms, 0.0, tokens, seconds_per_billion_params=per_billion,
                    extrapolated_7b_seconds=per_billion * _parameter_count(self.config(28)) / 1e9)
        for pipelined in (False, True):
            engine.options = dataclasses.replace(engine.options, pipelined_update=pipelined)
            step_ms, peak = self.measure(training_step, warmup=1)
            optimizer.wait()
            hidden = fb_ms + clip_ms + update_ms - step_ms
            self.record(name, f"step{' pipelined' if pipelined else ''}, {size}", step_ms, peak, tokens,
                        added_ms=step_ms - fb_ms, hidden_update_ms=hidden, hidden_fraction=hidden / update_ms)
        engine.close()

    # --------------------------------------------------------------------------------- report

    def report(self) -> None:
        by_key = {(row["name"], row["pass"]): row for row in self.rows if "tokens_per_s" in row}
        print()
        print(f"{self.meta['gpu']}, {self.meta['host_cores']} host cores, torch {self.meta['torch']}, "
              f"transformers {self.meta['transformers']}, {self.meta['date']}")
        shape = self.meta["shape"]
        print(f"Qwen2-shaped decoder: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
              f"intermediate {shape['intermediate_size']}, "
              f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocab {shape['vocab_size']}, "
              f"bf16; batch {self.plan.batch} x {self.plan.tokens}")
        d2h_gbps = next((row["d2h_gbps"] for row in self.rows if row["name"] == "d2h pinned"), None)
        if self.pinned_gbps:
            print(f"pinned H2D {self.pinned_gbps:.1f} GB/s (floor = max(all-GPU time, H2D bytes / this))")
        if self.pinned_gbps and d2h_gbps:
            print(f"pinned D2H {d2h_gbps:.1f} GB/s (/both: a forward+backward's floor per phase and direction, "
                  "see both_ways_floor_ms)")
        header = (f"{'variant':<38} {'pass':<32} {'ms':>8} {'tok/s':>8} {'peak GiB':>8} {'GB/s':>6} "
                  f"{'vs GPU':>7} {'vs FSDP2':>8} {'/floor':>7} {'/both':>6}")
        print(header)
        print("-" * len(header))
        for row in self.rows:
            if "tokens_per_s" not in row:
                continue
            gpu = by_key.get(("all-GPU", row["pass"]))
            fsdp = by_key.get(("FSDP2 CPUOffloadPolicy", row["pass"]))
            floor = None
            if gpu and self.pinned_gbps and row["h2d_gb"]:
                floor = max(gpu["ms"], row["h2d_gb"] / self.pinned_gbps * 1e3)
                row["floor_ms"] = floor
            row["vs_all_gpu"] = gpu["ms"] / row["ms"] if gpu else None
            row["vs_fsdp2"] = fsdp["ms"] / row["ms"] if fsdp else None
            row["over_floor"] = row["ms"] / floor if floor else None
            both = None
            if row["pass"] == "forward+backward" and row.get("d2h_gb") and self.pinned_gbps and d2h_gbps:
                both = both_ways_floor_ms(row, by_key.get((row["name"], "forward")), by_key.get(("all-GPU", "forward")),
                                          gpu, self.pinned_gbps, d2h_gbps)
            row["both_ways_floor_ms"] = both
            row["over_both_ways_floor"] = row["ms"] / both if both else None
            print(f"{row['name']:<38} {row['pass']:<32} {row['ms']:8.1f} {row['tokens_per_s']:8.0f} "
                  f"{row['peak_gib']:8.1f} {_fmt(row['h2d_gbps'], 6, 1)} {_fmt(row['vs_all_gpu'], 7, 2)} "
                  f"{_fmt(row['vs_fsdp2'], 8, 2)} {_fmt(row['over_floor'], 7, 2)} "
                  f"{_fmt(row['over_both_ways_floor'], 6, 2)}")
        for row in self.rows:
            if "hidden_fraction" in row:
                print(f"optimizer_offload, {row['pass']}: clip and update add {row['added_ms']:.0f} ms to "
                      f"forward+backward; {row['hidden_update_ms']:.0f} ms of the CPU update "
                      f"({row['hidden_fraction']:.0%}) overlaps other work")
            if "vs_padded" in row and "padded," not in row["pass"]:
                print(f"remove_padding, {row['pass']}: {row['vs_padded']:.2f}x the padded pass's speed "
                      f"({row['real_tokens']} real of {row['padded_tokens']} padded tokens)")
            if "extrapolated_7b_seconds" in row:
                print(f"fused CPU AdamW: {row['seconds_per_billion_params']:.2f} s per billion fp32 parameters "
                      f"(about {row['extrapolated_7b_seconds']:.1f} s for the 7B shape)")
        for section, error in self.errors.items():
            print(f"section {section} failed: {error.strip().splitlines()[-1]}")
        self.save()


def both_ways_floor_ms(row: dict, forward: dict | None, gpu_forward: dict | None, gpu: dict | None,
                       h2d_gbps: float, d2h_gbps: float) -> float | None:
    """The least time a streamed forward+backward can take, phase by phase: its forward cannot be
    faster than the all-GPU forward nor than its weights' H2D copy, and the backward (which starts
    only at the loss) neither than the all-GPU backward, its own H2D copies, nor the gradients'
    D2H copy (PCIe carries both directions at once, so the two copies overlap each other). The
    plain floor, max(all-GPU time, H2D bytes / bandwidth), lets the gradients cross for free."""
    if forward is None or gpu_forward is None or gpu is None:
        return None
    forward_h2d = forward["h2d_gb"]
    forward_ms = max(gpu_forward["ms"], forward_h2d / h2d_gbps * 1e3)
    backward_ms = max(gpu["ms"] - gpu_forward["ms"], (row["h2d_gb"] - forward_h2d) / h2d_gbps * 1e3,
                      row["d2h_gb"] / d2h_gbps * 1e3)
    return forward_ms + backward_ms


def _fmt(value, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else " " * (width - 1) + "-"


def _delta(before: dict, after: dict) -> tuple[int, int]:
    h2d = sum(after[key] - before.get(key, 0) for key in after if key[0] == "h2d")
    d2h = sum(after[key] - before.get(key, 0) for key in after if key[0] == "d2h")
    return h2d, d2h


def _copy_seconds(copies: list[dict]) -> dict[str, dict]:
    """Per direction and group: copies, bytes, summed seconds and the bandwidth of the copies themselves."""
    totals: dict[str, dict] = {}
    for copy in copies:
        entry = totals.setdefault(f"{copy['direction']}/{copy['group']}", {"copies": 0, "bytes": 0, "seconds": 0.0})
        entry["copies"] += 1
        entry["bytes"] += copy["bytes"]
        entry["seconds"] += copy["seconds"]
    for entry in totals.values():
        entry["gbps"] = entry["bytes"] / 1e9 / entry["seconds"] if entry["seconds"] else None
    return totals


def _parameter_count(config: Qwen2Config) -> int:
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    attention = hidden * hidden * 2 + hidden * kv * 2 + hidden + 2 * kv
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * config.vocab_size * hidden + hidden


def _parameter_bytes(config: Qwen2Config) -> int:
    return 2 * _parameter_count(config)


def ragged_rollout(plan: PaddingPlan, vocab_size: int, device: torch.device | str, seed: int = 0) -> RolloutBatch:
    """A rollout batch as the trainer lays it out, its lengths spread evenly over the plan's ranges."""
    generator = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0, 1, plan.sequences)
    prompts = (plan.prompt * (0.5 + 0.5 * spread)).long().clamp(min=1)
    responses = (plan.response * (0.1 + 0.9 * spread.flip(0))).long().clamp(min=1)
    prompt_mask = (torch.arange(plan.prompt) >= plan.prompt - prompts[:, None]).long()
    response_mask = (torch.arange(plan.response) < responses[:, None]).float()
    prompt_ids = torch.randint(3, vocab_size, prompt_mask.shape, generator=generator) * prompt_mask
    response_ids = torch.randint(3, vocab_size, response_mask.shape, generator=generator) * response_mask.long()
    advantages = torch.randn(response_mask.shape, generator=generator) * response_mask
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, group_index=torch.arange(plan.sequences),
                         records=[PromptRecord(prompt="", data_source="bench")] * plan.sequences, advantages=advantages)
    return batch.to(device)


def padding_passes(model, plan: PaddingPlan, batch: RolloutBatch) -> list[tuple[str, Callable[[], None]]]:
    """The trainer's log-prob pass and training step (Actor.update) over `batch`: padded, padding-free, and
    padding-free by token budget. Each kind's padded pass comes first."""
    base = ActorConfig(ppo_mini_batch_size=plan.sequences, ppo_micro_batch_size_per_gpu=plan.update_micro,
                       optim={"lr": 1e-9})
    # One actor (one optimizer's states) for every variant: each pass sets what it measures.
    actor = Actor(model, base, temperature=1.0, rollout_n=1, log_prob_micro_batch_size=plan.log_prob_micro,
                  total_steps=1 << 20, seed=0)
    batch.old_log_probs = compute_log_probs(model, batch, micro_batch_size=plan.log_prob_micro, temperature=1.0)
    variants = (("padded", False, None, None), ("padding-free", True, None, None),
                ("padding-free, token budget", True, plan.log_prob_budget, plan.update_budget))
    passes: list[tuple[str, Callable[[], None]]] = []
    for name, remove_padding, log_prob_budget, _ in variants:
        passes.append((f"log-probs, {name}", functools.partial(
            compute_log_probs, model, batch, micro_batch_size=plan.log_prob_micro, temperature=1.0,
            remove_padding=remove_padding, max_token_len=log_prob_budget)))
    for name, remove_padding, _, update_budget in variants:
        config = base.model_copy(update={"use_dynamic_bsz": update_budget is not None,
                                         "ppo_max_token_len_per_gpu": update_budget or base.ppo_max_token_len_per_gpu})

        def step(config=config, remove_padding=remove_padding) -> None:
            actor.config, actor.remove_padding = config, remove_padding
            actor.update(batch)

        passes.append((f"training step, {name}", step))
    return passes


def random_bf16(model_class, config, device):
    """A `model_class(config)` with random bf16 weights drawn on `device`: on a GPU far faster than on the
    host, whose random generator is serial (45 s for a 3B model on the H200 machine's host)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return model_class(config)
    finally:
        torch.set_default_dtype(default)


def release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 layers, short sequences, few repeats")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also write a torch.profiler trace of each forward+backward variant to DIR")
    parser.add_argument("--report", type=Path, metavar="JSON", help="print the table of a finished run's --out file")
    args = parser.parse_args(argv)
    if args.report is not None:
        try:
            bench = Bench.from_results(args.report)
        except OSError as error:
            print(f"ERROR: --report {args.report}: cannot read it ({error.strerror or error})", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError) as error:
            print(f"ERROR: --report {args.report}: not an offload_bench result ({error!r})", file=sys.stderr)
            return 2
        bench.report()
        return 0
    sections = chosen_sections(args.only, SECTIONS)
    if sections is None:
        return 2
    if not torch.cuda.is_available():
        print("ERROR: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    bench = Bench(QUICK_PLAN if args.quick else FULL_PLAN, args.out, args.profile)
    print(f"{bench.meta['gpu']}, {bench.meta['host_cores']} host cores", flush=True)
    if "bandwidth" not in sections and any(name not in ("optimizer", "host") for name in sections):
        sections.insert(0, "bandwidth")  # every floor needs the pinned bandwidth of this run
    runs = {"bandwidth": bench.bandwidth, "allgpu": bench.allgpu,
            "ours_full": lambda: bench.ours("ours full streaming", FULL),
            "ours_layered": bench.layered,
            "fsdp2": bench.fsdp2, "accelerate": bench.accelerate, "checkpointing": bench.checkpointing,
            "optimizer": bench.optimizer, "remove_padding": bench.remove_padding, "host": bench.host}
    run_sections(bench, [name for name in SECTIONS if name in sections], lambda name: runs[name]())
    bench.report()
    return 0


def _as_after_an_update(engine, run: Callable[[], None]) -> Callable[[], None]:
    """`run` as the first pass after an optimizer step: a kept head is copied again each time."""

    def after_an_update() -> None:
        for unit in engine.units:
            if unit.group == "lm_head":
                engine.updates.after_update(unit)
        run()

    return after_an_update


def chosen_sections(only: str, known: tuple[str, ...]) -> list[str] | None:
    """The sections --only names, or None after a one-line error naming the unknown ones."""
    sections = [name.strip() for name in only.split(",") if name.strip()]
    unknown = sorted(set(sections) - set(known))
    if unknown:
        print(f"ERROR: unknown sections {unknown}; choose from {', '.join(known)}", file=sys.stderr)
        return None
    return sections


def machine() -> dict:
    """When and on what a benchmark ran: date, GPU, host cores and library versions."""
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "host_cores": os.cpu_count(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def run_sections(bench, names: list[str], run: Callable[[str], None]) -> None:
    """Run each section in turn, timed; one that fails records its error in `bench.errors` (and
    the results file) and the others still run."""
    for name in names:
        print(f"[{name}]", flush=True)
        started = time.perf_counter()
        try:
            run(name)
        except Exception:  # noqa: BLE001 - one broken variant must not lose the other measurements
            bench.errors[name] = traceback.format_exc()
            print(bench.errors[name], file=sys.stderr, flush=True)
            bench.save()
        release()
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
