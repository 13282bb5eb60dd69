"""Per-step metrics under verl's names, their timing, and the run's metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from trainer.rollout.batch import RolloutBatch


def reduce_metrics(metrics: Mapping[str, list[float]]) -> dict[str, float]:
    """Mean of each metric's micro-batch values."""
    return {key: sum(values) / len(values) for key, values in metrics.items() if values}


def _summary(name: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{name}/mean": values.mean().item(), f"{name}/max": values.max().item(),
            f"{name}/min": values.min().item()}


def _masked_values(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return tensor[mask.bool()]


def data_metrics(batch: RolloutBatch, *, response_length: int, prompt_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one step's batch."""
    mask = batch.response_mask
    response_lengths = batch.response_lengths
    prompt_lengths = batch.prompt_mask.sum(dim=1).float()
    metrics = {
        **_summary("critic/score", batch.token_level_scores.sum(dim=1)),
        **_summary("critic/rewards", batch.token_level_rewards.sum(dim=1)),
        **_summary("critic/advantages", _masked_values(batch.advantages, mask)),
        **_summary("critic/returns", _masked_values(batch.returns, mask)),
        **_summary("response_length", response_lengths),
        "response_length/clip_ratio": (response_lengths >= response_length).float().mean().item(),
        **_summary("prompt_length", prompt_lengths),
        "prompt_length/clip_ratio": (prompt_lengths >= prompt_length).float().mean().item(),
    }
    if batch.values is not None:
        values = _masked_values(batch.values, mask)
        returns = _masked_values(batch.returns, mask)
        metrics.update(_summary("critic/values", values))
        # 1 - Var(returns - values) / Var(returns): how much of the return the critic explains.
        variance = returns.var(unbiased=False)
        explained = 1.0 - (returns - values).var(unbiased=False) / (variance + 1e-5)
        metrics["critic/vf_explained_var"] = explained.item()
    return metrics


def memory_metrics(device: torch.device, peaks: tuple[int, int] | None = None) -> dict[str, float]:
    """Peak accelerator memory this step, and the process's resident memory, in GiB (verl's keys).
    `peaks`: the step's peak (allocated, reserved) bytes where something reset the device's peak
    statistics during the step (the memory manager does at each phase, MemoryManager.step_peaks)."""
    gib = 1024**3
    allocated = reserved = 0.0
    out_of_memory_errors = 0
    if device.type == "cuda":
        if peaks is None:
            peaks = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        allocated, reserved = peaks[0] / gib, peaks[1] / gib
        # Cumulative over the process: the daemon turns it into verl_trainer_oom_total across restarts.
        out_of_memory_errors = torch.cuda.memory_stats(device).get("num_ooms", 0)
        torch.cuda.reset_peak_memory_stats(device)
    # ru_maxrss is in KiB on Linux.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return {"perf/max_memory_allocated_gb": allocated, "perf/max_memory_reserved_gb": reserved,
            "perf/cpu_memory_peak_gb": peak_rss, "perf/num_ooms": out_of_memory_errors}


def throughput_metrics(batch: RolloutBatch, step_seconds: float) -> dict[str, float]:
    response_tokens = batch.response_mask.sum().item()
    tokens = batch.prompt_mask.sum().item() + response_tokens
    return {"perf/total_num_tokens": tokens, "perf/total_num_response_tokens": response_tokens,
            "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / step_seconds if step_seconds > 0 else math.nan}


class StepTimer:
    """Wall time of each named phase of a step, as timing_s/<phase>."""

    def __init__(self, synchronize=None, on_phase=None):
        self._synchronize = synchronize or (lambda: None)
        self._on_phase = on_phase or (lambda name: None)
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._on_phase(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            # Kernels run asynchronously on a GPU: wait for them so the phase is charged its own work.
            self._synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": seconds for name, seconds in self.seconds.items()}


class MetricsLog:
    """metrics.jsonl: one JSON object per step, with "step" first.

    On resume the lines after the checkpoint's step are dropped, since those steps run again:
    the file then reads as if the run had never stopped.
    """

    def __init__(self, path: Path):
        self.path = path

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temporary, self.path)

    def append(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{key: _json_number(value) for key, value in sorted(metrics.items())}}
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _json_number(value: float) -> float | None:
    # JSON has no NaN or infinity; null keeps the line parseable by every reader.
    value = float(value)
    return value if math.isfinite(value) else None
