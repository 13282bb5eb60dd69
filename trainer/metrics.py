"""Per-step metrics under verl's names, their timing, and the run's metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import PretrainedConfig

from trainer.rollout.batch import RolloutBatch


def reduce_metrics(metrics: Mapping[str, list[float]]) -> dict[str, float]:
    """Mean of each metric's micro-batch values; a count (`skipped_steps`: one value per optimizer update, 1 for
    each skipped) is summed."""
    return {key: (sum(values) if key.endswith("skipped_steps") else sum(values) / len(values))
            for key, values in metrics.items() if values}


def _summary(name: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{name}/mean": values.mean().item(), f"{name}/max": values.max().item(),
            f"{name}/min": values.min().item()}


def _masked_values(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return tensor[mask.bool()]


def data_metrics(batch: RolloutBatch, *, response_length: int, prompt_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one step's batch."""
    mask = batch.training_mask  # verl's response_mask after rollout correction's rejection
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
    # verl's perf/cpu_memory_used_gb is the host's used memory (psutil's "used"), not this process's: a run
    # that offloads to the CPU shares the host with its pinned arenas and every other process.
    return {"perf/max_memory_allocated_gb": allocated, "perf/max_memory_reserved_gb": reserved,
            "perf/cpu_memory_peak_gb": peak_rss, "perf/cpu_memory_used_gb": psutil.virtual_memory().used / gib,
            "perf/num_ooms": out_of_memory_errors}


def throughput_metrics(batch: RolloutBatch, step_seconds: float) -> dict[str, float]:
    response_tokens = batch.response_mask.sum().item()
    tokens = batch.prompt_mask.sum().item() + response_tokens
    return {"perf/total_num_tokens": tokens, "perf/total_num_response_tokens": response_tokens,
            "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / step_seconds if step_seconds > 0 else math.nan}


# The phases verl charges per token, and which tokens: generation the response tokens it decoded, the
# phases that read whole sequences every prompt and response token (verl's compute_timing_metrics).
_PER_RESPONSE_TOKEN = ("gen",)
_PER_TOKEN = ("ref", "values", "adv", "update_critic", "update_actor")


def timing_per_token_metrics(batch: RolloutBatch, seconds: Mapping[str, float]) -> dict[str, float]:
    """timing_per_token_ms/<phase>: the phase's milliseconds per token it processed, for the phases that ran."""
    response_tokens = int(batch.response_mask.sum().item())
    tokens = int(batch.prompt_mask.sum().item()) + response_tokens
    counts = {**dict.fromkeys(_PER_RESPONSE_TOKEN, response_tokens), **dict.fromkeys(_PER_TOKEN, tokens)}
    return {f"timing_per_token_ms/{phase}": seconds[phase] * 1000 / count
            for phase, count in counts.items() if phase in seconds and count > 0}


# Dense decoders with a SwiGLU MLP: their FLOPs follow from the config fields decoder_flops reads. Others
# (mixtures of experts, other MLPs) have no MFU figures rather than wrong ones.
_DENSE_DECODERS = ("qwen2", "qwen3", "llama", "mistral")


def decoder_flops(config: PretrainedConfig, sequence_lengths: Sequence[int], *, backward: bool) -> float | None:
    """FLOPs of a forward pass (`backward`: forward and backward) over sequences of these lengths, counted as
    verl's FlopsCounter does: 2 per parameter per token forward (the embedding and the head counted as
    matrices), plus attention's scores and weighted sum over each sequence's length squared; a backward pass
    costs twice its forward. None for a model type it cannot count."""
    if config.model_type not in _DENSE_DECODERS:
        return None
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    query, key_value = heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = 3 * hidden * config.intermediate_size + hidden * (2 * query + 2 * key_value)
    parameters = layers * per_layer + 2 * config.vocab_size * hidden
    forward = (2 * parameters * sum(sequence_lengths)
               + 4 * sum(length * length for length in sequence_lengths) * head_dim * heads * layers)
    return 3.0 * forward if backward else float(forward)


# Dense (no sparsity) bf16 tensor-core peak FLOP/s, by a part of the device name torch reports; the more
# specific name first ("NVIDIA H200" also holds "H20", an "H100 PCIe" is not an SXM H100).
_PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("H20", 148e12),
                    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12))


def device_peak_flops(device: torch.device) -> float | None:
    """The device's bf16 peak FLOP/s; None on a CPU or a GPU not in the table, whose MFU is then left out."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in _PEAK_BF16_FLOPS if part in name), None)


def mfu_metrics(batch: RolloutBatch, seconds: Mapping[str, float], *, peak_flops: float | None,
                actor: tuple[PretrainedConfig, int], critic: tuple[PretrainedConfig, int] | None) -> dict[str, float]:
    """verl's model FLOPs utilisation of the actor's update (perf/mfu/actor), its old-log-prob pass
    (perf/mfu/actor_infer) and the critic's update (perf/mfu/critic): the FLOPs of the phase's passes over
    the batch's real tokens, per second of the phase, over the device's peak. `actor`, `critic`: the
    model's config and its ppo_epochs. Left out where the peak or the model's FLOPs are unknown."""
    if peak_flops is None:
        return {}
    lengths = (batch.prompt_mask.sum(dim=1) + batch.response_lengths).tolist()
    passes = [("perf/mfu/actor", "update_actor", actor, True), ("perf/mfu/actor_infer", "old_log_prob", actor, False)]
    if critic is not None:
        passes.append(("perf/mfu/critic", "update_critic", critic, True))
    metrics = {}
    for key, phase, (config, epochs), backward in passes:
        flops = decoder_flops(config, lengths, backward=backward)
        if flops is not None and seconds.get(phase, 0.0) > 0:
            metrics[key] = flops * (epochs if backward else 1) / seconds[phase] / peak_flops
    return metrics


def step_figures(batch: RolloutBatch, timer: StepTimer, *, peak_flops: float | None,
                 actor: tuple[PretrainedConfig, int], critic: tuple[PretrainedConfig, int] | None,
                 response_length: int, prompt_length: int, device: torch.device,
                 peaks: tuple[int, int] | None) -> dict[str, float]:
    """A step's timings, per-token timings, MFU, data, throughput and memory figures under verl's names. MFU of the
    old-log-prob pass counts only where it ran (an on-policy update takes its log-probs in its own forwards)."""
    seconds = timer.seconds
    scored = seconds if batch.old_log_probs is not None else {
        phase: time for phase, time in seconds.items() if phase != "old_log_prob"}
    return {**timer.metrics(), **timing_per_token_metrics(batch, seconds),
            **mfu_metrics(batch, scored, peak_flops=peak_flops, actor=actor, critic=critic),
            **data_metrics(batch, response_length=response_length, prompt_length=prompt_length),
            **throughput_metrics(batch, seconds["step"]), **memory_metrics(device, peaks=peaks)}


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
    the file then reads as if the run had never stopped. Each line is appended whole or not at all;
    a line that cannot be written (a full disk) does not stop training: `warn` says so, `failures`
    counts it, and it is written before the next one. A partial last line (left by an older version,
    or another writer) is dropped with a warning when the file is read.
    """

    def __init__(self, path: Path, warn: Callable[[str], None] = print):
        self.path = path
        self.warn = warn
        self.failures = 0  # appends that could not be written
        self._pending: list[bytes] = []  # lines not written yet, oldest first

    def truncate_after(self, step: int) -> None:
        """Drop the lines of the steps after `step`, and any line that is not whole."""
        self._pending = [line for line in self._pending if json.loads(line)["step"] <= step]
        if not self.path.exists():
            return
        lines = self.path.read_bytes().splitlines(keepends=True)
        keep = [record is not None and record["step"] <= step for record in self._records(lines)]
        if all(keep):
            return
        first_dropped = keep.index(False)
        if not any(keep[first_dropped:]):
            # Cutting the file short needs no free space: a resume on a full disk still works.
            os.truncate(self.path, sum(len(line) for line in lines[:first_dropped]))
            return
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_bytes(b"".join(line for line, kept in zip(lines, keep, strict=True) if kept))
        os.replace(temporary, self.path)

    def append(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{key: _json_number(value) for key, value in sorted(metrics.items())}}
        self._pending.append((json.dumps(record) + "\n").encode("utf-8"))
        try:
            while self._pending:
                _append_whole(self.path, self._pending[0])
                self._pending.pop(0)
        except OSError as error:
            self.failures += 1
            self.warn(f"could not write step {step} to {self.path} ({error.strerror or error}); training goes on and "
                      f"the {len(self._pending)} unwritten line(s) are written with the next step "
                      f"({self.failures} failed write(s) so far)")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [record for record in self._records(self.path.read_bytes().splitlines(keepends=True))
                if record is not None]

    def _records(self, lines: list[bytes]) -> list[dict[str, Any] | None]:
        """Each line's record, None (with a warning) for one that is not a whole JSON line: cut short by a
        full disk (no newline at its end), or garbled."""
        records = [_record(line) for line in lines]
        bad = [number for number, record in enumerate(records, start=1) if record is None]
        if bad:
            self.warn(f"dropped {len(bad)} partial or garbled line(s) of {self.path} (line {', '.join(map(str, bad))}"
                      f"; a write cut short, e.g. by a full disk): {lines[bad[0] - 1][:80]!r}")
        return records


def _append_whole(path: Path, line: bytes) -> None:
    """Append `line` in one piece: a write cut short (a full disk writes what fits, then fails) is taken
    back, so the file never ends in half a line."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(descriptor).st_size
        try:
            written = 0
            while written < len(line):
                written += os.write(descriptor, line[written:])
        except OSError:
            os.ftruncate(descriptor, start)
            raise
    finally:
        os.close(descriptor)


def _record(line: bytes) -> dict[str, Any] | None:
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes cut inside a character
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def _json_number(value: float) -> float | None:
    # JSON has no NaN or infinity; null keeps the line parseable by every reader.
    value = float(value)
    return value if math.isfinite(value) else None


# How a step's metric combines over the ranks, by its name: each rank measures its share of the batch.
_SUMMED = ("reward/errors", "perf/total_num_tokens", "perf/total_num_response_tokens", "perf/num_ooms",
           "perf/oom_recoveries", "perf/cpu_memory_peak_gb", "checkpoint/failures", "offload/moves_to_cpu",
           "offload/moves_to_gpu", "offload/phase_swaps")
_TOKEN_WEIGHTED = ("critic/advantages/", "critic/returns/", "critic/values/")


def rank_reduction(key: str) -> str:
    """How `key` combines over the ranks: "sum" (counts, tokens, every process's memory), "max" (a maximum,
    a rank's device memory, the host's memory in use, the step's timings: the step waits for the slowest rank),
    "min", or "mean" (weighted by each rank's sequences, or tokens for the token-level summaries)."""
    if key in _SUMMED:
        return "sum"
    if key.endswith("skipped_steps"):  # the ranks step one optimizer together: each counts the same updates
        return "max"
    if key.startswith("rollout_corr/") and key.endswith(("_max", "_min")):  # verl's names of rollout correction's
        return key[-3:]
    if (key.endswith("/max") or key.startswith(("timing_s/", "perf/max_memory_")) or key in (
            "perf/time_per_step", "perf/cpu_memory_used_gb", "checkpoint/failing", "rollout/kv_cache_gb",
            "rollout/graph_pool_gb")):
        return "max"
    if key.endswith("/min"):
        return "min"
    return "mean"


def combine_rank_metrics(per_rank: Sequence[tuple[Mapping[str, float], float, float]]) -> dict[str, float]:
    """One step's run-wide metrics from every rank's (metrics, sequences, response tokens), under the same keys
    (a key some rank lacks combines over the ranks that have it)."""
    keys = list(dict.fromkeys(key for metrics, _, _ in per_rank for key in metrics))
    combined = {}
    for key in keys:
        present = [(metrics[key], sequences, tokens) for metrics, sequences, tokens in per_rank if key in metrics]
        values = [value for value, _, _ in present]
        how = rank_reduction(key)
        if how == "sum":
            combined[key] = float(sum(values))
        elif how == "max":
            combined[key] = float(max(values))
        elif how == "min":
            combined[key] = float(min(values))
        else:
            weights = [tokens if key.startswith(_TOKEN_WEIGHTED) else sequences for _, sequences, tokens in present]
            total = sum(weights)
            combined[key] = (float(sum(value * weight for value, weight in zip(values, weights, strict=True)) / total)
                             if total > 0 else float(sum(values) / len(values)))
    return combined
