"""Whole training steps on several ranks, by where the shards and AdamW live (issue 16's measure).

    python benchmarks/ranks_bench.py --shape ppo3b --ranks 2 --out r.json     # 3B-class PPO with a critic, 2 GPUs
    python benchmarks/ranks_bench.py --shape headline --ranks 2 --out r.json  # 7B GRPO + reference + reward model
    python benchmarks/ranks_bench.py --shape quick --ranks 2 --device cpu     # the smoke shape the suite runs (gloo)

Each variant is `python -m torch.distributed.run --standalone --nproc-per-node RANKS -m trainer` on the same
models (e2e_bench.py's shapes, drawn once and loaded from disk), data and seed: the rank group `verl train` starts.
The trained models (actor, critic) are placed as:

- `all_gpu`: every shard and AdamW on the GPUs (FSDP2, bf16);
- `optimizer_offload`: the shards on the GPUs as fp32 masters under FSDP2's MixedPrecisionPolicy, AdamW's states
  and arithmetic on the host (HostAdamW: one gradient copy down and one update up a step);
- `optimizer_offload_delayed`: `optimizer_offload` with the actor's `delayed_update` (the host computes the update
  during the next rollout, which samples with the weights from before it);
- `optimizer_offload_gpu`: `optimizer_offload` with `optimizer_update: gpu` (AdamW's states on the host, streamed up
  to the GPU and back a slice at a time, the update on the GPU where the shards are: no gradient or update crosses);
- `optimizer_offload_both`: `optimizer_offload` with `optimizer_update: both` (each step's parameters split between
  the host's arithmetic and the GPU's over streamed moments);
- `embedding_head_cpu`: `optimizer_offload` with the embedding's and the head's shards on the CPU too (their own
  FSDP2 units on CPUOffloadPolicy);
- `fsdp2_cpu_offload`: every unit on FSDP2's CPUOffloadPolicy (`param_offload` and `optimizer_offload`), the
  anchor a verl user has today at the same world size.

It prints each phase's seconds (verl's timing_s/*, the slowest rank's) as ratios against `all_gpu`, and the peak
GPU memory (the largest rank's); the JSON goes to --out (default benchmarks/results/ranks-<shape>-<time>.json).

`--ranks 1` is the world-size-1 check: each variant runs twice on one device, as `python -m trainer` (today's
path, what `verl train` starts for one rank) and as `<variant>+torchrun`, a rank group of one under the same
launcher as above. It prints, per variant, the launched step's seconds against the plain one's and the largest
difference of their losses step by step.

    python benchmarks/ranks_bench.py --shape ppo3b --ranks 1 --variants all_gpu --steps 6 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_bench import SHAPES, fsdp_overrides, overrides, phase_rows, steady_state  # noqa: E402
from benchmarks.environment import repository_first  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPOSITORY = Path(__file__).resolve().parents[1]
VARIANTS = ("all_gpu", "optimizer_offload", "optimizer_offload_delayed", "optimizer_offload_gpu",
            "optimizer_offload_both", "embedding_head_cpu", "fsdp2_cpu_offload")
PLACEMENTS: dict[str, dict[str, Any]] = {
    "all_gpu": {},
    "optimizer_offload": {"optimizer_offload": True},
    "optimizer_offload_delayed": {"optimizer_offload": True, "delayed_update": True},
    "optimizer_offload_gpu": {"optimizer_offload": True, "optimizer_update": "gpu"},
    "optimizer_offload_both": {"optimizer_offload": True, "optimizer_update": "both"},
    "embedding_head_cpu": {"optimizer_offload": True, "offload_policy": {"embedding": "cpu", "lm_head": "cpu"}},
    "fsdp2_cpu_offload": {"optimizer_offload": True, "param_offload": True},
}
"""Each variant's settings of the trained models' fsdp_config, beside model_dtype: bf16."""
KEPT = ("timing_s/", "perf/max_memory", "actor/pg_loss", "actor/skipped_steps", "critic/skipped_steps")
LOSSES = ("actor/pg_loss", "critic/vf_loss")
"""The losses the world-size-1 check compares step by step."""
LAUNCHED = "+torchrun"
"""The suffix of a variant's run as a rank group of one (--ranks 1)."""
REPEATED = "#"
"""Before the pass number of a variant's run after its first (--repeat): all_gpu#2."""


def variant_overrides(shape: str, variant: str, ranks: int, device: str, runs_dir: Path, models: Path,
                      steps: int) -> list[str]:
    """e2e_bench's all-GPU run of the shape on `ranks` ranks, with the variant's placement of the trained models."""
    spec = SHAPES[shape]
    # A rank's share of a mini-batch: e2e_bench's micro-batches of 8 where it holds as many.
    micro = min(8, spec["prompts"] * spec["n"] // ranks)
    rows = overrides(shape, "all_gpu", device, runs_dir, models, steps) + [
        f"trainer.n_gpus_per_node={ranks}", f"trainer.experiment_name={variant}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"]
    placement = {"model_dtype": "bf16", **PLACEMENTS[variant]}
    rows += fsdp_overrides("actor_rollout_ref.actor.fsdp_config", placement)
    if spec["algorithm"] == "gae":  # the critic: no delayed update (its values read it right after the rollout)
        critic = {key: value for key, value in placement.items() if key != "delayed_update"}
        rows += [*fsdp_overrides("critic.fsdp_config", critic), f"critic.ppo_micro_batch_size_per_gpu={micro}"]
    return rows


def rank_group_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment: the caller's, with the repository first on PYTHONPATH before what the caller's
    held (a device image's wheels), and no rank variables of an enclosing group."""
    environment = {**parent, "PYTHONPATH": repository_first(parent)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    return environment


def run_variant(args: argparse.Namespace, variant: str, models: Path, scratch: Path, log_path: Path, *,
                launched: bool = True) -> dict[str, Any]:
    """One variant's rank group (or, not `launched`, its one process as `verl train` starts it for one rank); its
    steady state, or its error with the end of its log."""
    runs_dir = scratch / "runs"
    config = scratch / "empty.yaml"
    config.write_text("{}\n")
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"] if launched else []
    command = [sys.executable, *launcher, "-m", "trainer", "--config", str(config),
               *variant_overrides(args.shape, variant, args.ranks, args.device, runs_dir, models, args.steps),
               *args.set]
    environment = rank_group_environment(os.environ)
    started = time.perf_counter()
    with log_path.open("w") as log_file:
        try:
            completed = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, env=environment,
                                       timeout=args.timeout)
        except subprocess.TimeoutExpired:
            completed = None
    wall = time.perf_counter() - started
    lines = log_path.read_text(errors="replace").strip().splitlines()
    # The trainer's one-line errors, else a rank's exception (the launcher's own summary after it says only
    # which rank failed), else the log's end.
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception): ", line)]
    tail = [line for line in lines if line.startswith("ERROR")][:3] or raised[:1] or lines[-12:]
    metrics = next(runs_dir.rglob("metrics.jsonl"), None)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics else []
    # A final checkpoint the disk could not hold (69 GiB at ppo3b with optimizer_offload, on a 64 GiB disk) comes
    # after every step was measured: the steps count, and the table says it was not saved.
    unsaved = [line for line in tail if "the final checkpoint of step" in line and "was not saved" in line]
    if completed is None or completed.returncode != 0 and not (unsaved and len(rows) == args.steps):
        why = (f"did not finish within --timeout {args.timeout:.0f} s" if completed is None
               else f"exit code {completed.returncode}")
        return {"error": "\n".join([*tail, f"{why} (log: {log_path})"]), "wall_s": wall}
    per_step = [{key: row[key] for key in row if key.startswith(KEPT)} for row in rows]
    placement = [line for line in log_path.read_text(errors="replace").splitlines() if "shard the model" in line]
    return {"wall_s": wall, "steps": len(rows), **steady_state(per_step, args.warmup),
            "peak_gpu_gib": max(row.get("perf/max_memory_allocated_gb", 0.0) for row in rows),
            "skipped_updates": sum(row.get(f"{role}/skipped_steps", 0) for row in rows
                                   for role in ("actor", "critic")),
            "losses": [row.get("actor/pg_loss") for row in rows], "per_step": per_step, "placement": placement,
            "loss_steps": [{key: row[key] for key in LOSSES if key in row} for row in rows],
            **({"final_checkpoint": unsaved[0].removeprefix("ERROR: ")[:200]} if unsaved else {})}


def run_order(variants: Sequence[str], ranks: int, repeat: int) -> list[tuple[str, str, bool]]:
    """The runs in the order they go, as (name, variant, launched under torchrun). One rank: each variant as one
    plain process, then as a rank group of one. --repeat passes over them, every other one in reverse (A B B A)."""
    once = [(variant + suffix, variant, launched) for variant in variants
            for suffix, launched in ((("", False), (LAUNCHED, True)) if ranks == 1 else (("", True),))]
    return [(name + (f"{REPEATED}{number}" if number > 1 else ""), variant, launched)
            for number in range(1, repeat + 1)
            for name, variant, launched in (once if number % 2 else once[::-1])]


def world_size_one(variants: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each variant's rank group of one against its plain process: step seconds (the mean over --repeat's runs,
    with their range) and the losses step by step."""
    lines = []
    for name in [name for name in variants if LAUNCHED not in name and REPEATED not in name]:
        plain = [run for key, run in variants.items() if key.split(REPEATED)[0] == name and "error" not in run]
        launched = [run for key, run in variants.items()
                    if key.split(REPEATED)[0] == name + LAUNCHED and "error" not in run]
        if not plain or not launched:
            continue
        steps = [[run["phases_s"]["step"] for run in runs] for runs in (plain, launched)]
        means = [sum(seconds) / len(seconds) for seconds in steps]
        spread = "".join(f" ({min(seconds):.3f}-{max(seconds):.3f} s over {len(seconds)} runs)" if len(seconds) > 1
                         else "" for seconds in steps[1:] + steps[:1])
        differences = [abs(a[key] - b[key]) for other in launched + plain[1:]
                       for a, b in zip(plain[0]["loss_steps"], other["loss_steps"], strict=False)
                       for key in a.keys() & b.keys()]
        lines.append(f"world size 1, {name}: step {means[1]:.3f} s under the launcher against {means[0]:.3f} s "
                     f"plain ({means[1] / means[0]:.3f}x){spread}; losses of {len(plain[0]['loss_steps'])} steps "
                     f"differ by at most {max(differences, default=float('nan')):.2e}")
    return lines


def table(result: dict[str, Any]) -> str:
    variants = result["variants"]
    settings = "".join(f"; {setting}" for setting in result.get("set", []))
    lines = [f"{result['device']} x {result['ranks']} ranks, shape {result['shape']}, steps {result['steps']} (the "
             f"first {result['warmup']} not counted){settings}", *phase_rows(variants, width=24)]
    for name, run in variants.items():
        if "error" in run:
            lines.append(f"{name}: FAILED: {' | '.join(run['error'].splitlines()[-3:])}")
        else:
            lines.append(f"{name}: peak GPU {run['peak_gpu_gib']:.2f} GiB a rank"
                         + (f"; UPDATES SKIPPED {run['skipped_updates']:.0f}" if run["skipped_updates"] else "")
                         + (f"; {run['final_checkpoint']}" if "final_checkpoint" in run else ""))
    return "\n".join(lines + world_size_one(variants))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="quick")
    parser.add_argument("--ranks", type=int, default=2,
                        help="ranks on this machine (GPUs with --device cuda); 1: each variant plain and as a rank "
                             "group of one, side by side")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1,
                        help="passes over the variants, every other one in reverse order (A B B A: the order's drift "
                             "cancels in a mean, and the spread of a variant's runs is the noise)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted (optimizer states, CUDA)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a variant may take")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every variant, after the shape's and the variant's (repeatable), "
                             "e.g. trainer.cpu_threads=8")
    parser.add_argument("--scratch", type=Path, default=None, help="where the models and runs go (a temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        return _refuse(f"--variants: got {args.variants!r}; allowed: some of {', '.join(VARIANTS)}")
    if args.ranks < 1:
        return _refuse(f"--ranks: got {args.ranks}; allowed: 1 (the world-size-1 check) or more")
    if args.repeat < 1:
        return _refuse(f"--repeat: got {args.repeat}; allowed: 1 or more")
    if args.steps <= args.warmup:
        return _refuse(f"--steps must be more than --warmup ({args.warmup}, the steps not counted), got {args.steps}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.ranks:
            return _refuse(f"--ranks {args.ranks} needs as many GPUs; this machine shows "
                           f"{torch.cuda.device_count()} (--device cpu runs gloo ranks)")
    stamp = time.strftime("%Y-%m-%dT%H%M%S")
    out = args.out or RESULTS / f"ranks-{args.shape}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"shape": args.shape, "spec": SHAPES[args.shape], "ranks": args.ranks, "set": args.set,
                              "device": args.device, "steps": args.steps, "warmup": args.warmup, "variants": {}}
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="ranks_bench_") as scratch:
        models = Path(scratch) / "models"
        # e2e_bench's child draws the shape's models on one device and saves them, in a process of its own.
        prepared = subprocess.run([sys.executable, str(Path(__file__).with_name("e2e_bench.py")), "--child",
                                   "--prepare", "--shape", args.shape, "--device", args.device, "--models",
                                   str(models), "--steps", str(args.steps), "--warmup", str(args.warmup)],
                                  capture_output=True, text=True)
        if prepared.returncode != 0:
            raise SystemExit(f"ERROR: the shape's models could not be made:\n{prepared.stderr[-3000:]}")
        for number, (name, variant, launched) in enumerate(run_order(variants, args.ranks, args.repeat)):
            print(f"[{name}]", flush=True)
            folder = Path(scratch) / f"run{number}"  # a name a config override may hold (no "#")
            folder.mkdir()
            result["variants"][name] = run_variant(args, variant, models, folder,
                                                   out.with_name(f"{out.stem}-{name}.log"), launched=launched)
            # Its checkpoints (69 GiB at ppo3b: fp32 masters and AdamW's states of two models) would leave the
            # next variant's no room: on a 128 GiB disk the fourth variant's final checkpoint failed.
            shutil.rmtree(folder, ignore_errors=True)
            out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"written {out}")
    return 0 if all("error" not in run for run in result["variants"].values()) else 1


def _refuse(message: str) -> int:
    print(f"ERROR: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
