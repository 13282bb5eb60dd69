"""The headline scenario of issue 5: one GRPO step of a 7B-shaped actor (rollout, reference
log-probs, reward-model scoring, actor update with optimizer offload) with a 1.5B-shaped reward
model, under a GPU memory cap, within the host's memory.

    python benchmarks/grpo_headline.py --cap-gib 40 --out headline.json          # on one H200
    python benchmarks/grpo_headline.py --cap-gib 0 --out uncapped.json            # the same step uncapped
    python benchmarks/grpo_headline.py --quick --device cpu                       # a smoke run of the script

Random weights (the built-in tiny tokenizer, so every token id is below 19: the shapes, not the
text, are what is measured). The actor keeps its embedding and lm_head on the CPU, its transformer
layers under dynamic offload, fp32 masters, bf16 gradients and AdamW on the CPU; the reference
and the reward model stay on the GPU. Three steps run and the last is reported, with the peak GPU
memory (allocator), the peak host memory (RSS, sampled), step time and tokens/s: each step's
rollout waits for the CPU update of the step before, and the first update also allocates and
first touches AdamW's 61 GB of host states, so the second step is not yet a steady one.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config, Qwen2ForSequenceClassification  # noqa: E402

from benchmarks.offload_bench import GIB, SHAPE, machine, random_bf16  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.models import load_tokenizer  # noqa: E402
from trainer.offload.units import UpdateDone  # noqa: E402
from trainer.rollout.hf_rollout import SAFE_POINT_EVERY  # noqa: E402

REWARD_SHAPE = dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
"""Qwen2-1.5B's shape."""
QUICK_ACTOR = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=4096)
QUICK_REWARD = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096)


class StepsOnly(Trainer):
    """The trainer without its end-of-run checkpoint: the 7B actor's would hold about 92 GB (fp32
    master weights and AdamW states), more than the H200 machine's 64 GiB disk (a save there filled it on
    2026-11-30); the benchmark measures steps."""

    def save(self, *, final: bool = False):
        return None


def flow(mapping: dict) -> str:
    return "{" + ", ".join(f"{key}: {str(value).lower() if isinstance(value, bool) else value}"
                           for key, value in mapping.items()) + "}"


def save_reward_model(directory: Path, shape: dict, device: str) -> None:
    """A random sequence classifier of `shape` with the built-in tokenizer, as a local model directory."""
    model = random_bf16(Qwen2ForSequenceClassification, Qwen2Config(**shape, num_labels=1, pad_token_id=0), device)
    model.to("cpu").save_pretrained(directory)
    load_tokenizer("builtin:tiny-qwen2").save_pretrained(directory)
    del model


class Profile:
    """Where a step's time goes (--profile): seconds per trainer phase of the engines' worker tasks
    (gradient landing, CPU updates), of the main thread's waits for them, and of the optimizer's
    calls, keyed by the step they ran in. Wraps the trainer's and engines' methods in place; a
    benchmark aid, not part of the trainer."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.phase = "start"
        self.seconds: dict[int, dict[str, dict[str, float]]] = {}
        self._lock = threading.Lock()
        original_phase = trainer.control.phase_started

        def on_phase(name: str) -> None:
            if name != "step":
                self.phase = name
            original_phase(name)

        trainer.control.phase_started = on_phase
        for engine in trainer.memory.engines:
            self._wrap_engine(engine)
        bus = trainer.memory.bus
        wait_turn = bus.wait_turn

        def timed_wait_turn(role: str) -> None:  # a device update held while a more used model has the bus
            phase, step, started = self.phase, self.trainer.step + 1, time.perf_counter()
            try:
                wait_turn(role)
            finally:
                waited = time.perf_counter() - started
                if waited > 1e-4:
                    self.add(f"{role} update waits for its turn on the bus", waited, phase, step)

        bus.wait_turn = timed_wait_turn
        optimizer = trainer.actor.optimizer
        for method in ("clip_grad_norm_", "step", "zero_grad", "_step_sliced", "_step_groups"):
            if hasattr(optimizer, method):  # the offload optimizer's; a plain one (e2e_bench's fsdp2) has some
                setattr(optimizer, method, self._timed(getattr(optimizer, method), f"actor optimizer.{method}"))
        rollout = trainer.rollout
        rollout.sample = self._timed(rollout.sample, "rollout generate")  # generate() calls sample() too
        # The decode's safe points (every few tokens) time its chunks: the first holds the prefill
        # (and any wait for the update), the others decoding alone.
        # (Without dynamic offload the rollout gets safe points for the timing alone.)
        self.safe_point_times: dict[int, list[float]] = {}
        safe_point = rollout.safe_point or (lambda: None)

        def timed_safe_point() -> None:
            if self.phase == "gen":
                self.safe_point_times.setdefault(self.trainer.step + 1, []).append(time.perf_counter())
            safe_point()

        rollout.safe_point = timed_safe_point

    def add(self, name: str, seconds: float, phase: str | None = None, step: int | None = None, *,
            replace: bool = False) -> None:
        """Add `seconds` to the step's and phase's figure `name` (with `replace`: set it, a figure not a time)."""
        with self._lock:
            step = self.trainer.step + 1 if step is None else step
            table = self.seconds.setdefault(step, {}).setdefault(phase or self.phase, {})
            table[name] = seconds if replace else table.get(name, 0.0) + seconds

    def _timed(self, function, name: str):
        @functools.wraps(function)  # keeps what torch marks on optimizer.step for its LR schedulers
        def timed(*args, **kwargs):
            phase, step, started = self.phase, self.trainer.step + 1, time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started, phase, step)
        return timed

    def _wrap_engine(self, engine) -> None:
        role = engine.role
        submit = engine.worker.submit

        def timed_submit(function, *args, inline=None):
            name = getattr(function, "__name__", None) or getattr(getattr(function, "func", None), "__name__", "task")
            return submit(self._timed(function, f"{role} worker {name}"), *args, inline=inline)

        engine.worker.submit = timed_submit
        if engine.updates.device_worker is not None:  # optimizer_update gpu or both: the device path's own worker
            device_submit = engine.updates.device_worker.submit

            def timed_device_submit(function, *args, inline=None):
                name = getattr(function, "__name__", None) or "task"
                return device_submit(self._timed(function, f"{role} device worker {name}"), *args, inline=inline)

            engine.updates.device_worker.submit = timed_device_submit
        if engine.updates.publisher is not None:  # a delayed update: its arenas written after the rollout
            publisher_submit = engine.updates.publisher.submit

            def timed_publisher_submit(function, *args, inline=None):
                return publisher_submit(self._timed(function, f"{role} publisher writes the arenas"), *args,
                                        inline=inline)

            engine.updates.publisher.submit = timed_publisher_submit
        if engine.update_split is not None:  # optimizer_update both: each step's shares and the estimates
            plan = engine.updates.plan_update_paths

            def timed_plan(units):
                paths = plan(units)
                # The step's last optimizer step's figures (not summed over its mini-batches, as times are).
                if engine.update_split.last_host_share is not None:
                    self.add(f"{role} update split: host share of elements", engine.update_split.last_host_share,
                             replace=True)
                for path, seconds in engine.update_split.seconds_per_element.items():
                    self.add(f"{role} update split: {path} ns/element, estimated", seconds * 1e9, replace=True)
                if engine.update_split.window is not None:
                    self.add(f"{role} update split: window s, estimated", engine.update_split.window, replace=True)
                return paths

            engine.updates.plan_update_paths = timed_plan
        for owner, method, name in ((engine.gradients, "finish", "finish_backward"),
                                    (engine.updates, "wait_for_updates", "wait_for_updates"),
                                    (engine.gradients, "_land", "land"),
                                    (engine.updates, "after_update", "after_update")):
            setattr(owner, method, self._timed(getattr(owner, method), f"{role} {name}"))
        # A gradient waits here for room in the pinned staging ring (for the worker to land older ones).
        staging = engine.gradients.staging
        staging.take = self._timed(staging.take, f"{role} staging ring take")
        profile = self

        class TimedEvent(UpdateDone):
            def wait(self, timeout=None):
                if self.is_set():
                    return True
                started = time.perf_counter()
                try:
                    return super().wait(timeout)  # (lets a held update go first, as the unit's own event does)
                finally:
                    profile.add(f"{role} main waits for an update ({threading.current_thread().name})",
                                time.perf_counter() - started)

        for unit in engine.units:
            # A delayed update's publish at the unit's first read: the main thread's wait for the publisher, or
            # its own writing of the arena where no publisher ran.
            unit.finish_publish = self._timed(unit.finish_publish, f"{role} main publishes an update")
            event = TimedEvent()
            event.before_wait = unit.ready.before_wait
            if unit.ready.is_set():
                event.set()
            unit.ready = event

    def report(self) -> dict:
        report = {str(step): {phase: {name: round(value, 3) for name, value in sorted(table.items())}
                              for phase, table in phases.items()} for step, phases in self.seconds.items()}
        for step, times in self.safe_point_times.items():
            gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
            if gaps:
                report[str(step)].setdefault("gen", {})["decode ms per token, after the first safe point"] = round(
                    statistics.median(gaps) / SAFE_POINT_EVERY * 1e3, 2)
        return report


class PeakRSS:
    """The process's resident memory, sampled every 50 ms; `peak` is the largest seen."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, process.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def overrides(args, reward_dir: Path, runs_dir: Path) -> list[str]:
    actor = QUICK_ACTOR if args.quick else {key: SHAPE[key] for key in
                                            ("hidden_size", "num_hidden_layers", "intermediate_size",
                                             "num_attention_heads", "num_key_value_heads", "vocab_size",
                                             "tie_word_embeddings")}
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        "data.train_files=[builtin:counting]", f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        "actor_rollout_ref.model.path=builtin:tiny-qwen2",
        f"actor_rollout_ref.model.override_config={flow(actor)}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"{fsdp}.model_dtype=bf16", f"{fsdp}.optimizer_offload=true", f"{fsdp}.offload_grad_dtype=bf16",
        f"{fsdp}.offload_policy={{embedding: cpu, lm_head: cpu}}",
        f"{fsdp}.dynamic_offload.enabled=true", f"dynamic_offload.gpu_memory_threshold={args.threshold}",
        "actor_rollout_ref.ref.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "reward_model.enable=true", f"reward_model.model.path={reward_dir}",
        "reward_model.model.fsdp_config.model_dtype=bf16", "reward_model.micro_batch_size_per_gpu=8",
        "critic.enable=false", f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1",
        f"trainer.device={args.device}", f"trainer.runs_dir={runs_dir}", "trainer.experiment_name=headline",
    ]


def _cgroup_memory_limit() -> int | None:
    """The container's memory limit (cgroup v2), which the kernel enforces below the machine's memory."""
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction call needs an index
    capped = device.type == "cuda" and args.cap_gib > 0
    result = {**(machine() if device.type == "cuda" else {}), "cap_gib": args.cap_gib if capped else None,
              "host_total_gib": psutil.virtual_memory().total / GIB}
    result["host_limit_gib"] = _cgroup_memory_limit() / GIB if _cgroup_memory_limit() else None
    # On disk, not in /tmp: a tmpfs /tmp would hold the reward model's 3 GB in host memory all run.
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="grpo_headline_") as scratch:
        reward_dir = Path(scratch) / "reward_model"
        started = time.perf_counter()
        save_reward_model(reward_dir, QUICK_REWARD if args.quick else REWARD_SHAPE, args.device)
        result["reward_model_saved_s"] = time.perf_counter() - started
        if capped:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / total, device)
        config = load_config(None, overrides(args, reward_dir, Path(scratch) / "runs"))
        logs: list[str] = []
        with PeakRSS() as rss:
            started = time.perf_counter()
            trainer = StepsOnly(config, log=logs.append, warn=logs.append)
            result["build_s"] = time.perf_counter() - started
            profile = Profile(trainer) if args.profile else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            trainer.fit()
        rows = trainer.metrics_log.read()
    last = rows[-1]
    result.update(
        steps=len(rows), step_s=last["timing_s/step"], tokens_per_s=last["perf/throughput"],
        phases_s={key.removeprefix("timing_s/"): value for key, value in last.items() if key.startswith("timing_s/")},
        peak_gpu_gib=last["perf/max_memory_allocated_gb"], peak_host_gib=rss.peak / GIB,
        layers_on_gpu={engine.role: [engine.layers_on_gpu, len(engine.transformer_units)]
                       for engine in trainer.memory.engines},
        oom_recoveries=sum(row.get("perf/oom_recoveries", 0) for row in rows),
        summary=trainer.memory.summary_lines(),
        profile=profile.report() if profile is not None else None,
        log=[line for line in logs if line.startswith(("dynamic offload", "per-phase placement", "out of GPU memory"))],
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=40.0, help="GPU memory cap (0: none); default 40")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--response-length", type=int, default=128, help="tokens per response at most (128)")
    parser.add_argument("--threshold", type=float, default=0.9, help="dynamic offload threshold (0.9)")
    parser.add_argument("--steps", type=int, default=3, help="steps to run (the last is reported); default 3")
    parser.add_argument("--profile", action="store_true",
                        help="also report per phase the seconds of the offload worker's tasks and the waits for them")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--scratch", type=Path, default=Path.cwd(),
                        help="directory on disk for the reward model and the run (default: the current one)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ERROR: --device cuda, but no CUDA GPU is visible; use --device cpu --quick for a smoke run",
              file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"ERROR: --steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    if args.cap_gib < 0:
        print(f"ERROR: --cap-gib must be 0 (no cap) or positive, got {args.cap_gib}", file=sys.stderr)
        return 2
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
