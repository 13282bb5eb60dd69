"""The GPU sampler: a daemon thread reading NVML and psutil, off the trainer's hot path.

Every `gpu_interval_s` it reads, per GPU (every GPU of the host, or the `gpu_indices` that the node's
ranks use), utilization, memory, power, temperature and the
compute processes (their memory, marked "trainer" when the pid is a trainer child or one of
its descendants), plus host CPU, host memory and the RSS of the daemon and the trainer.
PCIe throughput is read on its own slower cadence (`pcie_interval_s`): NVML samples it over
~20 ms per call and direction, too long for every tick; events carry the latest reading.

Without NVML (no driver, no GPU) events say ``"nvml": false`` with an empty GPU list and the
host part filled. An NVML error mid-run (GPU lost, driver reloaded) does the same and NVML is
initialized again after `nvml_retry_s`; a field a GPU does not support is null.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import psutil

log = logging.getLogger("verl.daemon.gpu")

_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED, in case the module lacks the constant


class GpuSampler:
    """Samples on a thread (`start`/`stop`) or on demand (`tick`, `sample`): `publish` gets each event's data."""

    def __init__(self, publish: Callable[[dict[str, Any]], None], *, gpu_interval_s: float, pcie_interval_s: float,
                 trainer_pids: Callable[[], Collection[int]] = tuple, nvml: Any = None,
                 clock: Callable[[], float] = time.monotonic, nvml_retry_s: float = 30.0,
                 gpu_indices: Collection[int] | None = None):
        self._publish = publish
        self.gpu_interval_s = gpu_interval_s
        self.pcie_interval_s = pcie_interval_s
        self._trainer_pids = trainer_pids
        self._nvml = nvml
        self._clock = clock
        self._nvml_retry_s = nvml_retry_s
        self._gpu_indices = None if gpu_indices is None else set(gpu_indices)  # None: every GPU of the host
        self.nvml_up = False
        self._said_unavailable = False
        self._devices: list[dict[str, Any]] = []  # index, handle, uuid, name: read once per NVML init
        self._pcie: dict[int, tuple[float | None, float | None]] = {}
        self._next_gpu = self._next_pcie = self._nvml_retry_at = clock()
        self._daemon_process = psutil.Process()
        self._processes: dict[int, psutil.Process] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement
        self._init_nvml()

    # --------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="verl-gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.nvml_up:
            self._shutdown_nvml()

    def set_intervals(self, *, gpu_interval_s: float | None = None, pcie_interval_s: float | None = None) -> None:
        """New cadences, effective at once (a live setting)."""
        now = self._clock()
        if gpu_interval_s is not None:
            self.gpu_interval_s = gpu_interval_s
            self._next_gpu = min(self._next_gpu, now + gpu_interval_s)
        if pcie_interval_s is not None:
            self.pcie_interval_s = pcie_interval_s
            self._next_pcie = min(self._next_pcie, now + pcie_interval_s)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            try:
                delay = self.tick()
            except Exception:  # the sampler must outlive any surprise from a driver or psutil
                log.exception("GPU sampler failed; trying again in %.1f s", self.gpu_interval_s)
                delay = self.gpu_interval_s
            self._wake.wait(max(delay, 0.0))
            self._wake.clear()

    # ----------------------------------------------------------------------------------- sampling

    def tick(self) -> float:
        """Do whatever is due now (fast sample, PCIe sample, NVML retry); seconds until the next thing is due."""
        now = self._clock()
        if not self.nvml_up and now >= self._nvml_retry_at:
            self._init_nvml()
        if now >= self._next_gpu:
            self._next_gpu = now + self.gpu_interval_s
            self._publish(self.sample())
        if self.nvml_up and now >= self._next_pcie:
            self._next_pcie = now + self.pcie_interval_s
            self.sample_pcie()
        due = [self._next_gpu] + ([self._next_pcie] if self.nvml_up else [self._nvml_retry_at])
        return min(due) - self._clock()

    def sample(self) -> dict[str, Any]:
        """One "gpu" event's data (see the module docstring); PCIe values are the latest slow reading."""
        trainer_processes = self._trainer_processes()
        gpus: list[dict[str, Any]] = []
        if self.nvml_up:
            trainer_pids = {process.pid for process in trainer_processes}
            try:
                gpus = [self._read_gpu(device, trainer_pids) for device in self._devices]
            except self._nvml.NVMLError as error:
                self._nvml_failed(error)
                gpus = []
        return {"nvml": self.nvml_up, "gpus": gpus, "host": self._read_host(trainer_processes)}

    def sample_pcie(self) -> None:
        """Read PCIe TX/RX throughput of every GPU (slow: ~20 ms per call)."""
        nvml = self._nvml
        try:
            for device in self._devices:
                tx = self._optional(nvml.nvmlDeviceGetPcieThroughput, device["handle"], nvml.NVML_PCIE_UTIL_TX_BYTES)
                rx = self._optional(nvml.nvmlDeviceGetPcieThroughput, device["handle"], nvml.NVML_PCIE_UTIL_RX_BYTES)
                # NVML reports KB/s.
                self._pcie[device["index"]] = (None if tx is None else tx * 1024.0,
                                               None if rx is None else rx * 1024.0)
        except nvml.NVMLError as error:
            self._nvml_failed(error)

    def _read_gpu(self, device: dict[str, Any], trainer_pids: set[int]) -> dict[str, Any]:
        nvml, handle = self._nvml, device["handle"]
        utilization = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
        power_milliwatts = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
        processes = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        tx, rx = self._pcie.get(device["index"], (None, None))
        return {
            "index": device["index"], "uuid": device["uuid"], "name": device["name"],
            "utilization_ratio": None if utilization is None else utilization.gpu / 100.0,
            "memory_used_bytes": None if memory is None else int(memory.used),
            "memory_total_bytes": None if memory is None else int(memory.total),
            "power_watts": None if power_milliwatts is None else power_milliwatts / 1000.0,
            "temperature_celsius": self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            "pcie_tx_bytes_per_second": tx, "pcie_rx_bytes_per_second": rx,
            "processes": [{"pid": process.pid,
                           "memory_bytes": None if process.usedGpuMemory is None else int(process.usedGpuMemory),
                           "role": "trainer" if process.pid in trainer_pids else "other"}
                          for process in processes],
        }

    def _optional(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)`, or None for a field this GPU does not support; other NVML errors propagate."""
        try:
            return function(*args)
        except self._nvml.NVMLError as error:
            if getattr(error, "value", None) == getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", _NOT_SUPPORTED):
                return None
            raise

    def _read_host(self, trainer_processes: list[psutil.Process]) -> dict[str, Any]:
        memory = psutil.virtual_memory()
        trainer_rss = None
        for process in trainer_processes:
            try:
                trainer_rss = (trainer_rss or 0) + process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return {"cpu_ratio": psutil.cpu_percent(interval=None) / 100.0, "memory_used_bytes": int(memory.used),
                "memory_total_bytes": int(memory.total), "daemon_rss_bytes": self._daemon_process.memory_info().rss,
                "trainer_rss_bytes": trainer_rss}

    def _trainer_processes(self) -> list[psutil.Process]:
        """The trainer children and their descendants (torchrun's ranks), psutil objects cached by pid."""
        found: dict[int, psutil.Process] = {}
        for pid in self._trainer_pids():
            process = self._processes.get(pid)
            try:
                if process is None or not process.is_running():
                    process = psutil.Process(pid)
                found[pid] = process
                for child in process.children(recursive=True):
                    found[child.pid] = self._processes.get(child.pid, child)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self._processes = found
        return list(found.values())

    # --------------------------------------------------------------------------------------- NVML

    def _init_nvml(self) -> None:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nvml = self._nvml
            nvml.nvmlInit()
            devices = []
            for index in range(nvml.nvmlDeviceGetCount()):
                if self._gpu_indices is not None and index not in self._gpu_indices:
                    continue  # a GPU of this host that none of the node's ranks uses
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                devices.append({"index": index, "handle": handle, "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                                "name": _text(nvml.nvmlDeviceGetName(handle))})
        except Exception as error:  # NVMLError, or a missing library / module: no GPU telemetry
            self._nvml_failed(error)
            return
        self._devices = devices
        self._pcie = {}
        self.nvml_up = True
        self._next_pcie = self._clock()
        log.info("NVML up: %d GPU(s)", len(devices))

    def _nvml_failed(self, error: Exception) -> None:
        if self.nvml_up:
            log.warning("NVML failed (%s); GPU telemetry is off until it comes back", error)
            self._shutdown_nvml()
        elif not self._said_unavailable:
            self._said_unavailable = True
            log.info("NVML unavailable (%s): no GPU telemetry, host telemetry only", error)
        self.nvml_up = False
        self._devices = []
        self._nvml_retry_at = self._clock() + self._nvml_retry_s

    def _shutdown_nvml(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # already gone
            pass


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode() if isinstance(value, bytes) else value
