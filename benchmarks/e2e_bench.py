"""Whole training steps of the real trainer: all on the GPU, offloaded under a memory cap, and the actor
on FSDP2's CPUOffloadPolicy, on the same shapes, data and seed (issue 14's measure).

    python benchmarks/e2e_bench.py --shape headline --out r.json   # 7B GRPO + reference + 1.5B reward model, 40 GiB cap
    python benchmarks/e2e_bench.py --shape ppo3b --out r.json      # 3B-class PPO with a critic, 12 GiB cap
    python benchmarks/e2e_bench.py --shape quick --device cpu      # the smoke shape the test suite runs
    python benchmarks/e2e_bench.py --report r.json                 # print a saved run's table again

The shape's random models are drawn once, on the device, and saved as local model directories that every
variant loads (as a user's `model.path`). Each variant runs in a process of its own (a fresh CUDA context and
allocator, and a cap that cannot leak into the next one) through `Trainer.fit`, what `verl train`'s trainer
process runs. Steps after the first `--warmup` (2: the first allocates the optimizer states, warms CUDA up and
learns what each phase needs; the second places the layers for it) are the steady state; their mean is
reported: each phase's seconds (verl's timing_s/*) as a ratio against the all-GPU run, the bytes copied each
way per step against the PCIe floor (bytes / the pinned bandwidth measured in the same process), and the
transformer layers moved per step.

Variants: `all_gpu` (every group and the optimizer on the GPU, bf16, no cap: where it fits), `offload` (the shape's
offload settings under the cap), `fsdp2` (the actor under torch's fully_shard with CPUOffloadPolicy on a one-GPU
mesh, the other models on the GPU, under the cap: the trainer has no FSDP2 path yet, so the benchmark places the
actor itself; GPU only) and `offload_delayed` (`offload` with the actor's delayed parameter update: each rollout
samples with the weights before the previous update; not run unless asked for; its update split between the GPU's
streamed update and the host's cores, `auto`'s pick), `offload_delayed_host` (`offload_delayed` with
`optimizer_update: cpu`: the delayed update on the host's cores alone, `auto`'s pick under it before 2026-12-04
13:40; not run unless asked for), `offload_host_update` (`offload` with `optimizer_update: cpu`: AdamW on the
host's cores instead of on the GPU over the streamed states; not run unless asked for), `offload_both_update`
(`offload` with `optimizer_update: both`: each step's units split between the GPU's streamed update and the host's
cores, running at once; what `auto` picks on a GPU since 2026-12-04; not run unless asked for),
`offload_device_update` (`offload` with `optimizer_update: gpu`: the device path alone, `auto`'s pick before; not
run unless asked for) and `offload_lora` (`offload` with a rank-64 LoRA adapter on the actor's and the critic's
linear layers, so the reference is the actor with its adapter off: issue 18's LoRA against full fine-tuning with
offload, step time and peak GPU memory; not run unless asked for).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.main import use_allocator_defaults  # noqa: E402

use_allocator_defaults()  # as `verl train`'s trainer process does, before CUDA starts

import torch  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from benchmarks.grpo_headline import (  # noqa: E402
    QUICK_ACTOR,
    QUICK_REWARD,
    REWARD_SHAPE,
    Profile,
    StepsOnly,
    flow,
    save_reward_model,
)
from benchmarks.offload_bench import GIB, SHAPE, machine, random_bf16  # noqa: E402
from benchmarks.uneven_decode import end_at_drawn_lengths  # noqa: E402
from trainer.models import load_tokenizer  # noqa: E402
from trainer.models.tiny import tiny_qwen2_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEP_KEYS = ("timing_s/", "offload/moves", "offload/phase", "offload/transformer_layers_on_gpu", "perf/max_memory",
             "perf/oom_recoveries", "response_length/", "actor/skipped_steps", "critic/skipped_steps")
"""The metrics of each step a result keeps (besides the steady state's means)."""
VARIANTS = ("all_gpu", "offload", "fsdp2", "offload_delayed", "offload_delayed_host", "offload_host_update",
            "offload_both_update", "offload_device_update", "offload_lora", "offload_balanced",
            "offload_delayed_balanced")
"""`_balanced`: the variant without it, with the update split's window off (update_split.py: every update split to
end as early as both paths allow, as before the window): against it, what the window buys."""
LORA = {"lora_rank": 64, "lora_alpha": 32}
"""The `offload_lora` variant's adapter (model.*: verl's LoRA example scripts' rank and alpha), on all-linear."""
QWEN_3B = dict(hidden_size=2048, num_hidden_layers=36, intermediate_size=11008, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
"""Qwen2.5-3B's shape (tied embeddings)."""
OFFLOADED = {"model_dtype": "bf16", "optimizer_offload": True, "offload_grad_dtype": "bf16",
             "offload_policy": {"embedding": "cpu", "lm_head": "cpu"}, "dynamic_offload": {"enabled": True}}
"""The offload settings of a trained model (actor, critic) in the `offload` variant."""
FROZEN_OFFLOADED = {"model_dtype": "bf16", "dynamic_offload": {"enabled": True}}
"""The reference's and the reward model's in the `offload` variant: their layers give the GPU to the
models the other phases run (they run once a step)."""


QWEN_14B = dict(hidden_size=5120, num_hidden_layers=48, intermediate_size=13824, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)
"""Qwen2.5-14B's shape: 29.5 GB of bf16 weights, more than a 40 GiB cap holds beside a step's activations."""
ACTOR_SHAPES: dict[str, dict[str, Any]] = {
    "headline": {key: SHAPE[key] for key in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                             "num_attention_heads", "num_key_value_heads", "vocab_size",
                                             "tie_word_embeddings")},
    "ppo3b": QWEN_3B, "long3b": QWEN_3B, "lora14b": QWEN_14B,
}
ACTOR_SHAPES["gsm8k7b"] = ACTOR_SHAPES["headline"]


def _actor_shape(shape: str) -> dict[str, Any]:
    return ACTOR_SHAPES.get(shape, QUICK_ACTOR)  # the quick and the *_tiny shapes: the tiny actor


LONG_TAILED = {"median_tokens": 160, "sigma": 1.0}
"""Response lengths of the realistic shapes (issue 40): log-normal, clipped to the limit (uneven_decode.py); a
random-init model's rows end at them (an EOS forced at the drawn length, in the benchmark only)."""
SHAPES: dict[str, dict[str, Any]] = {
    "headline": {"cap_gib": 40.0, "algorithm": "grpo", "prompts": 8, "n": 4, "response_length": 128,
                 "reference": True, "reward_model": True, "lora": False, "lengths": None, "fused_head": False},
    "ppo3b": {"cap_gib": 12.0, "algorithm": "gae", "prompts": 16, "n": 1, "response_length": 128,
              "reference": False, "reward_model": False, "lora": False, "lengths": None, "fused_head": False},
    "quick": {"cap_gib": 0.0, "algorithm": "gae", "prompts": 4, "n": 2, "response_length": 8,
              "reference": True, "reward_model": True, "lora": False, "lengths": None, "fused_head": False},
    # Issue 40's shapes: what RL recipes run. gsm8k7b: verl's GSM8K GRPO recipe's batch at 7B; long3b: long responses
    # (its rows run to the limit); lora14b: a model whose bf16 weights do not fit a 40 GiB cap beside a step's work.
    # gsm8k7b and long3b run with model.use_fused_kernels (in every variant: a setting of the shape, as verl's
    # fused-kernel recipe sets it), their results from before it measured without: their [B, R, V] logits (1.25 GB
    # in bf16 per 4112-token sequence of long3b, kept for the backward) are never made.
    "gsm8k7b": {"cap_gib": 40.0, "algorithm": "grpo", "prompts": 64, "n": 8, "response_length": 1024,
                "reference": True, "reward_model": False, "lora": False, "lengths": LONG_TAILED, "fused_head": True},
    "long3b": {"cap_gib": 12.0, "algorithm": "gae", "prompts": 16, "n": 1, "response_length": 4096,
               "reference": False, "reward_model": False, "lora": False, "lengths": None, "fused_head": True},
    "lora14b": {"cap_gib": 40.0, "algorithm": "grpo", "prompts": 16, "n": 4, "response_length": 512,
                "reference": True, "reward_model": False, "lora": True, "lengths": LONG_TAILED, "fused_head": False},
}
for _name in ("gsm8k7b", "long3b", "lora14b"):
    # The CPU smoke of each: its algorithm, models and options at the tiny actor's size.
    SHAPES[f"{_name}_tiny"] = SHAPES[_name] | {"cap_gib": 0.0, "prompts": 4, "n": 2, "response_length": 8}
    if SHAPES[_name]["lengths"] is not None:
        SHAPES[f"{_name}_tiny"]["lengths"] = {"median_tokens": 3, "sigma": 1.0}


def gpu_tag(device: str) -> str:
    """The card in a result's name: h100, h200, ... (the device name's model), or cpu."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return (found.group(1) if found else name.split()[-1]).lower()


def fsdp_overrides(prefix: str, settings: dict[str, Any]) -> list[str]:
    return [f"{prefix}.{key}={flow(value) if isinstance(value, dict) else str(value).lower()}"
            for key, value in settings.items()]


def overrides(shape: str, variant: str, device: str, runs_dir: Path, models: Path, steps: int,
              decode: str = "auto") -> list[str]:
    """The variant's run: the actor, the critic and the reference load from `models`/policy (save_models),
    the reward model from `models`/reward_model; the rollout decodes as `decode` says (rollout.decode)."""
    spec = SHAPES[shape]
    actor = "actor_rollout_ref.actor.fsdp_config"
    variant = variant.removesuffix("_balanced")
    offloaded = variant in ("offload", "offload_delayed", "offload_delayed_host", "offload_host_update",
                            "offload_both_update", "offload_device_update", "offload_lora")
    trained = OFFLOADED if offloaded else {"model_dtype": "bf16"}
    if variant in ("offload_host_update", "offload_delayed_host"):
        trained = {**trained, "optimizer_update": "cpu"}
    if variant == "offload_both_update":
        trained = {**trained, "optimizer_update": "both"}
    if variant == "offload_device_update":
        trained = {**trained, "optimizer_update": "gpu"}
    delayed = variant in ("offload_delayed", "offload_delayed_host")
    actor_settings = {**trained, "delayed_update": True} if delayed else trained
    plain = {"model_dtype": "bf16"}
    # The reference's and the reward model's settings. The headline's stay on the GPU: their host arenas (15 GB
    # pinned for the 7B reference) would not fit beside the actor's 118 GiB on the H200 machine's 125 GiB host.
    frozen = FROZEN_OFFLOADED if offloaded and shape != "headline" else plain
    rows = [
        f"algorithm.adv_estimator={spec['algorithm']}", "algorithm.use_kl_in_reward=false",
        "data.train_files=[builtin:counting]", f"data.train_batch_size={spec['prompts']}",
        "data.max_prompt_length=16", f"data.max_response_length={spec['response_length']}",
        f"actor_rollout_ref.model.path={models / 'policy'}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        f"actor_rollout_ref.rollout.n={spec['n']}",
        f"actor_rollout_ref.model.use_fused_kernels={str(spec['fused_head']).lower()}",
        # Drawn lengths are forced in the static decode (auto is static on a GPU; on the CPU it is generate).
        f"actor_rollout_ref.rollout.decode={'static' if spec['lengths'] and decode == 'auto' else decode}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec['prompts']}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.actor.use_kl_loss={str(spec['reference']).lower()}",
        *fsdp_overrides(actor, actor_settings if variant != "fsdp2" else plain),
        "dynamic_offload.gpu_memory_threshold=0.9",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", f"trainer.device={device}",
        f"trainer.runs_dir={runs_dir}", f"trainer.experiment_name=e2e-{shape}-{variant}",
    ]
    if variant == "offload_lora" or spec["lora"]:
        rows += fsdp_overrides("actor_rollout_ref.model", LORA)
        if spec["algorithm"] == "gae":
            rows += fsdp_overrides("critic.model", LORA)
    if spec["reference"]:
        rows += [*fsdp_overrides("actor_rollout_ref.ref.fsdp_config", frozen),
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
    if spec["algorithm"] == "gae":
        # The critic checkpoints as the actor does (verl's default for both): without it the critic's update kept every
        # layer's activations, about 19 GiB for one 4112-token sequence of long3b's 3B (the actor's: about 1 GiB).
        rows += ["critic.enable=true", "critic.model.enable_gradient_checkpointing=true",
                 "critic.ppo_micro_batch_size_per_gpu=8", "critic.optim.lr=1e-5",
                 *fsdp_overrides("critic.fsdp_config", trained if offloaded else plain)]
    else:
        rows.append("critic.enable=false")
    if spec["reward_model"]:
        rows += ["reward_model.enable=true", f"reward_model.model.path={models / 'reward_model'}",
                 *fsdp_overrides("reward_model.model.fsdp_config", frozen),
                 "reward_model.micro_batch_size_per_gpu=8"]
    return rows


# ------------------------------------------------------------------------------------------ child


def save_models(models: Path, shape: str, device: str) -> None:
    """The shape's random models as local model directories (`policy`: the actor, the critic's backbone
    and the reference; `reward_model`), drawn on `device`, which every variant loads as a user's
    `model.path` would: the built-in preset draws its weights on the host, one random number at a time
    (torch's CPU generator is serial), which took 45 s per 3B model on the H200 machine, three times per
    variant (the critic's preset draws the policy again), where a load takes seconds."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = random_bf16(Qwen2ForCausalLM, tiny_qwen2_config(tokenizer, _actor_shape(shape)), device)
    model.to("cpu").save_pretrained(models / "policy")
    tokenizer.save_pretrained(models / "policy")
    del model
    if SHAPES[shape]["reward_model"]:
        save_reward_model(models / "reward_model", QUICK_REWARD if shape == "quick" else REWARD_SHAPE, device)


def pinned_bandwidth(device: torch.device) -> dict[str, float]:
    """Host-to-device and device-to-host GB/s of a 1 GiB pinned copy (the floor's denominator)."""
    if device.type != "cuda":
        return {"h2d": float("nan"), "d2h": float("nan")}
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(GIB, dtype=torch.uint8, device=device)
    result = {}
    for direction, copy in (("h2d", lambda: target.copy_(host, non_blocking=True)),
                            ("d2h", lambda: host.copy_(target, non_blocking=True))):
        copy()
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(3):
            copy()
        torch.cuda.synchronize(device)
        result[direction] = 3 * GIB / (time.perf_counter() - started) / 1e9
    return result


def place_actor_on_fsdp2(device: torch.device) -> None:
    """The `fsdp2` variant: the memory manager hands the actor to fully_shard with CPUOffloadPolicy."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import trainer.loop
    from trainer.memory import MemoryManager

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)

    class FSDP2Actor(MemoryManager):
        def place(self, model, fsdp_config, role):
            if role != "actor":
                return super().place(model, fsdp_config, role)
            policy = CPUOffloadPolicy(pin_memory=True)
            for layer in model.model.layers:
                fully_shard(layer, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            return model

    trainer.loop.MemoryManager = FSDP2Actor


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    spec = SHAPES[args.shape]
    if args.variant.endswith("_balanced"):
        from trainer.offload import update_split

        update_split.WINDOW_SHARE = 0.0
    capped = device.type == "cuda" and args.variant != "all_gpu" and spec["cap_gib"] > 0
    result: dict[str, Any] = {"variant": args.variant, "cap_gib": spec["cap_gib"] if capped else None,
                              "bandwidth_gbps": pinned_bandwidth(device)}
    from trainer.config import load_config

    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="e2e_bench_") as scratch:
        if capped:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(spec["cap_gib"] * GIB / total, device)
        if args.variant == "fsdp2":
            place_actor_on_fsdp2(device)
        config = load_config(None, overrides(args.shape, args.variant, args.device, Path(scratch) / "runs",
                                             args.models, args.steps, args.decode) + list(args.set))
        logs: list[str] = []

        def log(line: str) -> None:  # kept for the result, and on stderr: the variant's log file
            logs.append(line)
            print(line, file=sys.stderr, flush=True)

        started = time.perf_counter()
        trainer = StepsOnly(config, log=log, warn=log)
        if spec["lengths"] is not None:
            if trainer.rollout.decoder is None:
                raise SystemExit(f"ERROR: shape {args.shape} ends rows at drawn lengths in the static decode: "
                                 "--decode static or auto")
            end_at_drawn_lengths(trainer.rollout.decoder, **spec["lengths"])
        log(f"e2e_bench: {args.variant} built in {time.perf_counter() - started:.1f} s")
        copied: list[dict[str, int]] = []
        observer = CopiedPerStep(trainer, copied)
        trainer.observers.append(observer)
        profile = Profile(trainer) if args.profile else None
        trainer.fit()
        rows = trainer.metrics_log.read()
    per_step = [{key: row[key] for key in row if key.startswith(STEP_KEYS)} | copies
                for row, copies in zip(rows, copied, strict=True)]
    result.update(
        steps=len(rows),
        **steady_state(per_step, args.warmup),
        peak_gpu_gib=max(row.get("perf/max_memory_allocated_gb", 0.0) for row in rows),
        # The variant's process at its largest (pinned arenas included): lora14b's must fit a 128 GiB host.
        peak_host_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        oom_recoveries=sum(row.get("perf/oom_recoveries", 0) for row in rows),
        # Updates skipped on a non-finite gradient norm: a variant that skips them is faster for nothing.
        skipped_updates=sum(row.get(f"{role}/skipped_steps", 0) for row in rows for role in ("actor", "critic")),
        losses=[row.get("actor/pg_loss") for row in rows],
        per_step=per_step,
        plans=trainer.memory.plan_lines(),
        update_split=update_estimates(trainer.memory.engines),
        profile=profile.report() if profile is not None else None,
        log=[line for line in logs if line.startswith(("dynamic offload", "per-phase placement", "out of GPU",
                                                        "placement plan"))][-30:],
    )
    return result


def update_estimates(engines: list[Any]) -> dict[str, dict[str, Any]]:
    """Per model whose offloaded update is split between the device and the host (optimizer_update both): each
    path's seconds per element as the split learned them from the run's steps (the two running beside each other),
    and the elements an update steps (its trained parameters on the host)."""
    estimates = {}
    for engine in engines:
        if engine.update_split is None:
            continue
        elements = sum(entry.parameter.numel() for unit in engine.units if unit.offloaded
                       for entry in unit.entries if entry.parameter.requires_grad)
        estimates[engine.role] = {"seconds_per_element": dict(engine.update_split.seconds_per_element),
                                  "elements": elements, "window_s": engine.update_split.window}
    return estimates


def exact_update_floor(all_gpu_step: float, estimate: dict[str, Any]) -> tuple[float, float]:
    """(the update's seconds, the step's floor): with exact updates the next rollout's first token needs every layer
    as the actor's update left it, so nothing the step needs overlaps that update; split ideally between the two
    paths at the speeds the run learned, it takes elements / (1/device + 1/host). The step's floor is the all-GPU
    step (whose AdamW on the GPU is milliseconds) plus that."""
    rate = estimate["seconds_per_element"]
    update = estimate["elements"] / (1 / rate["device"] + 1 / rate["host"])
    return update, all_gpu_step + update


def steady_state(per_step: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """The means over the steps after the first `warmup` (all of them when there are no more): each phase's
    seconds, the bytes copied each way, the layer moves and the phases' planned swaps."""
    steady = per_step[warmup:] or per_step
    return {
        "warmup": warmup,
        "phases_s": {key.removeprefix("timing_s/"): statistics.fmean(row[key] for row in steady)
                     for key in steady[-1] if key.startswith("timing_s/")},
        "copied_bytes_per_step": {direction: statistics.fmean(row.get(direction, 0) for row in steady)
                                  for direction in ("h2d", "d2h")},
        "layer_moves_per_step": statistics.fmean(row.get("offload/moves_to_cpu", 0) + row.get("offload/moves_to_gpu", 0)
                                                 for row in steady),
        "phase_swaps_per_step": statistics.fmean(row.get("offload/phase_swaps", 0) for row in steady),
    }


def with_warmup(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A saved result's steady state again, with `warmup` steps not counted (from each variant's per_step;
    a result written before per_step was kept is returned as it is)."""
    variants = {name: run | steady_state(run["per_step"], warmup) if run.get("per_step") else run
                for name, run in result["variants"].items()}
    return result | {"variants": variants, "warmup": warmup}


class CopiedPerStep:
    """Bytes the offload engines copied each way during each step (an observer of the trainer)."""

    def __init__(self, trainer: Any, copied: list[dict[str, int]]):
        self.trainer, self.copied = trainer, copied
        self._last = {"h2d": 0, "d2h": 0}

    def _totals(self) -> dict[str, int]:
        totals = {"h2d": 0, "d2h": 0}
        for engine in self.trainer.memory.engines:
            for (direction, _), nbytes in engine.copied_bytes().items():
                totals[direction] += nbytes
        return totals

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        totals = self._totals()
        self.copied.append({direction: totals[direction] - self._last[direction] for direction in totals})
        self._last = totals
        phases = " ".join(f"{key.removeprefix('timing_s/')} {value:.2f}" for key, value in metrics.items()
                          if key.startswith("timing_s/") and key != "timing_s/step")
        print(f"e2e_bench: step {step} took {metrics.get('timing_s/step', float('nan')):.2f} s ({phases}); "
              f"H2D {self.copied[-1]['h2d'] / 1e9:.1f} GB, D2H {self.copied[-1]['d2h'] / 1e9:.1f} GB; layers on the "
              f"GPU {metrics.get('offload/transformer_layers_on_gpu', 0):.0f}, moves "
              f"{metrics.get('offload/moves_to_cpu', 0) + metrics.get('offload/moves_to_gpu', 0):.0f}, phase swaps "
              f"{metrics.get('offload/phase_swaps', 0):.0f}; peak {metrics.get('perf/max_memory_allocated_gb', 0):.1f} "
              f"GiB allocated, {metrics.get('perf/max_memory_reserved_gb', 0):.1f} reserved; OOMs recovered "
              f"{metrics.get('perf/oom_recoveries', 0):.0f}; updates skipped "
              f"{metrics.get('actor/skipped_steps', 0) + metrics.get('critic/skipped_steps', 0):.0f}",
              file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- parent


def run_shape(args: argparse.Namespace, out: Path, logs: Path) -> dict[str, Any]:
    """The shape's models once (save_models), then each variant in a process of its own; the result is written
    to `out` after each (a run cut short keeps what it measured), each variant's output to a log in `logs`."""
    variants = [variant for variant in args.variants if variant != "fsdp2" or args.device == "cuda"]
    result: dict[str, Any] = {**(machine() if args.device == "cuda" else {}), "shape": args.shape,
                              "spec": SHAPES[args.shape], "steps": args.steps, "warmup": args.warmup,
                              "decode": args.decode, "set": list(args.set),
                              "variants": {}}
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="e2e_models_") as models:
        started = time.perf_counter()
        # In a process of its own too: this one never starts CUDA (its context would hold device memory
        # beside every variant's).
        prepared = subprocess.run([sys.executable, __file__, "--child", "--prepare", "--shape", args.shape,
                                   "--device", args.device, "--models", models, "--steps", str(args.steps),
                                   "--warmup", str(args.warmup)],
                                  capture_output=True, text=True)
        if prepared.returncode != 0:
            raise SystemExit(f"ERROR: the shape's models could not be made:\n{prepared.stderr[-3000:]}")
        result["models_s"] = time.perf_counter() - started
        print(f"[models] {result['models_s']:.1f} s", flush=True)
        for variant in variants:
            result["variants"][variant] = run_one(args, variant, Path(models), logs / f"{out.stem}-{variant}.log")
            out.write_text(json.dumps(result, indent=2))
    return result


def run_one(args: argparse.Namespace, variant: str, models: Path, log_path: Path) -> dict[str, Any]:
    """One variant in a child process: its result, or its error with the end of its log."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        child_out = Path(handle.name)
    command = [sys.executable, __file__, "--child", "--variant", variant, "--shape", args.shape,
               "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--scratch", str(args.scratch), "--models", str(models), "--decode", args.decode,
               *(["--profile"] if args.profile else []),
               *(f"--set={setting}" for setting in args.set),
               "--out", str(child_out)]
    print(f"[{variant}]", flush=True)
    started = time.perf_counter()
    with log_path.open("w") as log_file:
        try:
            completed = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            completed = None
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    if completed is None:
        run = {"error": "\n".join([*tail, f"did not finish within --timeout {args.timeout:.0f} s (log: {log_path})"])}
    elif completed.returncode != 0:
        run = {"error": "\n".join([*tail, f"exit code {completed.returncode}"])}
    else:
        run = json.loads(child_out.read_text())
    run["wall_s"] = time.perf_counter() - started
    child_out.unlink(missing_ok=True)
    return run


def phase_rows(variants: dict[str, dict[str, Any]], *, width: int) -> list[str]:
    """A header of the variants' names, then each phase's seconds per variant (the step first) and its ratio to
    the all_gpu variant's where there is one."""
    base = variants.get("all_gpu", {}).get("phases_s", {})
    rows = [f"{'phase':<16}" + "".join(f"{name:>{width}}" for name in variants)]
    phases = sorted({phase for run in variants.values() for phase in run.get("phases_s", {})},
                    key=lambda phase: (phase != "step", phase))
    for phase in phases:
        cells = []
        for run in variants.values():
            seconds = run.get("phases_s", {}).get(phase)
            ratio = f" ({seconds / base[phase]:.2f}x)" if seconds is not None and base.get(phase) else ""
            cells.append(f"{seconds:.3f} s{ratio}" if seconds is not None else "-")
        rows.append(f"{phase:<16}" + "".join(f"{cell:>{width}}" for cell in cells))
    return rows


def table(result: dict[str, Any]) -> str:
    """Each phase's seconds per variant and the ratio to all-GPU; copies against the PCIe floor; moves."""
    variants = result["variants"]
    header = (f"{result.get('gpu', 'CPU')}, shape {result['shape']} {result['spec']}, steps {result['steps']}"
              f" (the first {result.get('warmup', 1)} not counted), rollout.decode {result.get('decode', 'generate')}")
    lines = [header, *phase_rows(variants, width=22)]
    for name, run in variants.items():
        if "error" in run:
            lines.append(f"{name}: FAILED: {' | '.join(run['error'].splitlines()[-3:]) or '?'}")
            continue
        copied, bandwidth = run["copied_bytes_per_step"], run["bandwidth_gbps"]
        floor = sum(copied[direction] / 1e9 / bandwidth[direction] for direction in ("h2d", "d2h")
                    if bandwidth[direction] == bandwidth[direction] and copied[direction])
        lines.append(f"{name}: H2D {copied['h2d'] / 1e9:.2f} GB, D2H {copied['d2h'] / 1e9:.2f} GB a step "
                     f"(PCIe floor {floor:.3f} s at {bandwidth['h2d']:.1f}/{bandwidth['d2h']:.1f} GB/s); "
                     f"layer moves a step {run['layer_moves_per_step']:.1f} (phase swaps "
                     f"{run.get('phase_swaps_per_step', 0):.1f}); peak GPU {run['peak_gpu_gib']:.1f} GiB, host "
                     f"{run.get('peak_host_gib', float('nan')):.1f} GiB; "
                     f"OOMs recovered {run['oom_recoveries']:.0f}"
                     + (f"; UPDATES SKIPPED {run['skipped_updates']:.0f} (non-finite gradient norms: its times do not "
                        "count)" if run.get("skipped_updates") else ""))
    all_gpu_step = variants.get("all_gpu", {}).get("phases_s", {}).get("step")
    for name, run in variants.items():
        actor = (run.get("update_split") or {}).get("actor")
        step = run.get("phases_s", {}).get("step")
        if actor and all_gpu_step and step:
            update, floor = exact_update_floor(all_gpu_step, actor)
            rate = actor["seconds_per_element"]
            lines.append(f"{name}: exact-update floor {floor:.3f} s ({floor / all_gpu_step:.2f}x all-GPU): the all-GPU "
                         f"step and the actor's update of {actor['elements'] / 1e9:.3g} G elements split ideally at "
                         f"the speeds this run learned (device {rate['device'] * 1e9:.3f}, host "
                         f"{rate['host'] * 1e9:.3f} ns an element), {update:.3f} s; this step is {step / floor:.2f}x "
                         "that floor")
    for name, run in variants.items():
        profile = run.get("profile") or {}
        # The last step run (a CPU update of the last step may be timed under the step after it).
        steps = [step for step in profile if int(step) <= run.get("steps", 0)]
        if steps:
            step = max(steps, key=int)
            lines.append(f"{name} profile of step {step} (seconds; --profile):")
            for phase, table_ in profile[step].items():
                largest = sorted(table_.items(), key=lambda item: -item[1])[:6]
                lines.append(f"  {phase}: " + "; ".join(f"{key} {value:g}" for key, value in largest))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="headline", choices=sorted(SHAPES))
    parser.add_argument("--variants", default="all_gpu,offload,fsdp2",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (fsdp2 needs a GPU)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (4)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="first steps not counted (2: the first allocates the optimizer states and learns what "
                             "each phase needs, the second places the layers for it); with --report, recounts a "
                             "saved result without them")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a variant may take (900)")
    parser.add_argument("--scratch", type=Path, default=Path.cwd(), help="a directory on disk for models and runs")
    parser.add_argument("--out", type=Path, help="write the result as JSON here, or in this existing "
                        "directory as e2e-<shape>-<gpu>-<date>.json (default: benchmarks/results/)")
    parser.add_argument("--report", type=Path, help="print the table of a saved result and exit")
    parser.add_argument("--decode", default="auto", choices=["auto", "generate", "static"],
                        help="rollout.decode of every variant (auto: static with CUDA graphs on a GPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also time, per step and phase, the engines' worker tasks (gradient landing, the CPU "
                             "AdamW), the waits for them, the optimizer's calls and the decode's ms per token")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every variant, after the shape's own (repeatable), e.g. "
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report is not None:
        try:
            saved = json.loads(args.report.read_text())
            print(table(with_warmup(saved, args.warmup) if args.warmup is not None else saved))
        except (OSError, ValueError, KeyError) as error:
            print(f"ERROR: {args.report} is not an e2e_bench result: {error}", file=sys.stderr)
            return 2
        return 0
    args.warmup = 2 if args.warmup is None else args.warmup
    args.variants = [variant.strip() for variant in args.variants.split(",") if variant.strip()]
    unknown = [variant for variant in args.variants if variant not in VARIANTS]
    if unknown or not args.variants:
        print(f"ERROR: --variants: unknown {', '.join(unknown) or '(none given)'}; allowed: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ERROR: --device cuda, but no CUDA GPU is visible; use --device cpu --shape quick", file=sys.stderr)
        return 2
    if args.warmup < 0 or args.steps <= args.warmup:
        print(f"ERROR: --steps must be more than --warmup ({args.warmup}, the steps not counted), got {args.steps}",
              file=sys.stderr)
        return 2
    try:
        args.scratch.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"ERROR: --scratch {args.scratch}: cannot make the directory ({error.strerror}); name a writable "
              "directory on disk", file=sys.stderr)
        return 2
    if args.child and args.prepare:
        save_models(args.models, args.shape, args.device)
        return 0
    if args.child:
        from trainer.errors import UserError

        try:
            args.out.write_text(json.dumps(run_variant(args)))
        except UserError as error:  # what the trainer prints as one line (an out-of-memory on one sequence among them)
            print(f"ERROR: {error}", file=sys.stderr, flush=True)
            return 2
        return 0
    named = f"e2e-{args.shape}-{gpu_tag(args.device)}-{time.strftime('%Y-%m-%dT%H%M')}.json"
    out = args.out / named if args.out is not None and args.out.is_dir() else args.out or RESULTS / named
    # Beside a result the user names; in the scratch directory for one kept under benchmarks/results.
    result = run_shape(args, out, out.parent if args.out is not None else args.scratch)
    print(table(result))
    print(f"results: {out}")
    return 0 if all("error" not in run for run in result["variants"].values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
