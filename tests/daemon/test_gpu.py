"""The GPU sampler, with a fake pynvml (this machine has no GPU) and without NVML at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from collections import Counter
from types import SimpleNamespace

import pytest

from daemon.gpu import GpuSampler

GPU_KEYS = {"index", "uuid", "name", "utilization_ratio", "memory_used_bytes", "memory_total_bytes", "power_watts",
            "temperature_celsius", "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second", "processes"}
HOST_KEYS = {"cpu_ratio", "memory_used_bytes", "memory_total_bytes", "daemon_rss_bytes", "trainer_rss_bytes"}


class NVMLError(Exception):
    def __init__(self, value: int):
        self.value = value
        super().__init__(f"NVML error {value}")


def fake_pynvml(gpus: int = 2, trainer_pid: int = 4242) -> types.ModuleType:
    """A pynvml with the calls the sampler makes; `calls` counts them, `fail` makes one raise."""
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.NVML_ERROR_NOT_SUPPORTED, module.NVML_ERROR_GPU_IS_LOST = 3, 15
    module.NVML_TEMPERATURE_GPU, module.NVML_PCIE_UTIL_TX_BYTES, module.NVML_PCIE_UTIL_RX_BYTES = 0, 0, 1
    module.calls = Counter()
    module.fail = {}  # function name -> error value raised while set

    def nvml_function(name, result):
        def function(*args):
            module.calls[name] += 1
            if name in module.fail:
                raise NVMLError(module.fail[name])
            return result(*args)
        setattr(module, name, function)

    nvml_function("nvmlInit", lambda: None)
    nvml_function("nvmlShutdown", lambda: None)
    nvml_function("nvmlDeviceGetCount", lambda: gpus)
    nvml_function("nvmlDeviceGetHandleByIndex", lambda index: f"handle-{index}")
    nvml_function("nvmlDeviceGetUUID", lambda handle: f"GPU-{handle[-1]}")
    nvml_function("nvmlDeviceGetName", lambda handle: b"NVIDIA H200")  # old releases return bytes
    nvml_function("nvmlDeviceGetUtilizationRates", lambda handle: SimpleNamespace(gpu=93, memory=40))
    nvml_function("nvmlDeviceGetMemoryInfo", lambda handle: SimpleNamespace(used=60 << 30, total=141 << 30,
                                                                            free=81 << 30))
    nvml_function("nvmlDeviceGetPowerUsage", lambda handle: 300_500)  # milliwatts
    nvml_function("nvmlDeviceGetTemperature", lambda handle, sensor: 55)
    nvml_function("nvmlDeviceGetComputeRunningProcesses", lambda handle: [
        SimpleNamespace(pid=trainer_pid, usedGpuMemory=50 << 30), SimpleNamespace(pid=1, usedGpuMemory=None)])
    nvml_function("nvmlDeviceGetPcieThroughput", lambda handle, counter: 1000 + counter)  # KB/s
    return module


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sampler_with(nvml, clock=None, events=None, **options) -> GpuSampler:
    events = [] if events is None else events
    return GpuSampler(events.append, gpu_interval_s=options.pop("gpu_interval_s", 1.0),
                      pcie_interval_s=options.pop("pcie_interval_s", 10.0), nvml=nvml,
                      clock=clock or FakeClock(), **options)


def test_without_nvml_events_say_so_and_still_carry_the_host() -> None:
    module = fake_pynvml()
    module.fail["nvmlInit"] = 12  # NVML_ERROR_LIB_NOT_FOUND: no driver on this machine
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(20 << 20); time.sleep(30)"])
    try:
        time.sleep(0.3)
        sampler = sampler_with(module, trainer_pids=lambda: [child.pid])
        data = sampler.sample()
    finally:
        child.kill()
        child.wait()
    assert sampler.nvml_up is False
    assert data["nvml"] is False and data["gpus"] == []
    host = data["host"]
    assert set(host) == HOST_KEYS
    assert 0.0 <= host["cpu_ratio"] <= 1.0
    assert 0 < host["memory_used_bytes"] < host["memory_total_bytes"]
    assert host["daemon_rss_bytes"] > 10 << 20  # this test process
    assert host["trainer_rss_bytes"] > 20 << 20  # the child and its 20 MiB buffer


def test_with_no_trainer_running_its_rss_is_null() -> None:
    data = sampler_with(fake_pynvml(), trainer_pids=lambda: []).sample()
    assert data["host"]["trainer_rss_bytes"] is None


def test_the_real_pynvml_without_a_driver_reports_nvml_down() -> None:
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this machine has an NVIDIA driver: NVML would answer")
    sampler = GpuSampler(lambda data: None, gpu_interval_s=1.0, pcie_interval_s=10.0)
    assert sampler.nvml_up is False and sampler.sample()["nvml"] is False


def test_a_sample_has_the_event_shape_with_units_converted(monkeypatch) -> None:
    module = fake_pynvml(trainer_pid=os.getpid())
    monkeypatch.setitem(sys.modules, "pynvml", module)  # found by the sampler's own `import pynvml`
    sampler = GpuSampler(lambda data: None, gpu_interval_s=1.0, pcie_interval_s=10.0, nvml=None,
                         trainer_pids=lambda: [os.getpid()])
    data = sampler.sample()
    assert data["nvml"] is True and len(data["gpus"]) == 2
    first = data["gpus"][0]
    assert set(first) == GPU_KEYS
    assert first == {
        "index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "utilization_ratio": 0.93,
        "memory_used_bytes": 60 << 30, "memory_total_bytes": 141 << 30, "power_watts": 300.5,
        "temperature_celsius": 55, "pcie_tx_bytes_per_second": None, "pcie_rx_bytes_per_second": None,
        "processes": [{"pid": os.getpid(), "memory_bytes": 50 << 30, "role": "trainer"},
                      {"pid": 1, "memory_bytes": None, "role": "other"}],
    }
    assert data["gpus"][1]["uuid"] == "GPU-1"
    assert set(data["host"]) == HOST_KEYS
    # Handles and names are read once, at init, not per sample.
    sampler.sample()
    assert module.calls["nvmlDeviceGetHandleByIndex"] == 2 and module.calls["nvmlDeviceGetName"] == 2


def test_pcie_is_read_on_its_own_slower_cadence_only() -> None:
    module, clock, events = fake_pynvml(gpus=2), FakeClock(), []
    sampler = sampler_with(module, clock, events, gpu_interval_s=1.0, pcie_interval_s=10.0)
    for second in range(26):
        clock.now = float(second)
        sampler.tick()
    assert len(events) == 26
    assert module.calls["nvmlDeviceGetUtilizationRates"] == 26 * 2
    assert module.calls["nvmlDeviceGetPcieThroughput"] == 3 * 2 * 2  # t = 0, 10, 20; two GPUs; TX and RX
    assert events[0]["gpus"][0]["pcie_tx_bytes_per_second"] is None  # before the first slow reading
    assert events[1]["gpus"][0]["pcie_tx_bytes_per_second"] == 1000 * 1024.0
    assert events[1]["gpus"][1]["pcie_rx_bytes_per_second"] == 1001 * 1024.0


def test_tick_says_how_long_to_sleep_and_interval_changes_take_effect_at_once() -> None:
    module, clock, events = fake_pynvml(gpus=1), FakeClock(), []
    sampler = sampler_with(module, clock, events, gpu_interval_s=5.0, pcie_interval_s=60.0)
    assert sampler.tick() == pytest.approx(5.0)
    clock.now = 1.0
    sampler.set_intervals(gpu_interval_s=0.5, pcie_interval_s=2.0)
    assert sampler.tick() == pytest.approx(0.5)
    for now in (1.5, 2.0, 2.5, 3.0):
        clock.now = now
        sampler.tick()
    assert len(events) == 5
    assert module.calls["nvmlDeviceGetPcieThroughput"] == 2 * 2  # t = 0 and t = 3 (due at 1 + 2)


def test_an_unsupported_field_is_null_and_the_rest_still_reads() -> None:
    module = fake_pynvml(gpus=1)
    module.fail["nvmlDeviceGetPowerUsage"] = module.NVML_ERROR_NOT_SUPPORTED
    data = sampler_with(module).sample()
    assert data["nvml"] is True
    assert data["gpus"][0]["power_watts"] is None and data["gpus"][0]["utilization_ratio"] == 0.93


def test_an_nvml_error_mid_run_turns_gpu_telemetry_off_then_back_on() -> None:
    module, clock, events = fake_pynvml(gpus=1), FakeClock(), []
    sampler = sampler_with(module, clock, events, gpu_interval_s=1.0, nvml_retry_s=5.0)
    sampler.tick()
    module.fail["nvmlDeviceGetUtilizationRates"] = module.NVML_ERROR_GPU_IS_LOST
    clock.now = 1.0
    sampler.tick()
    module.fail.clear()
    for now in (2.0, 3.0, 6.0, 7.0):  # NVML is tried again 5 s after the failure
        clock.now = now
        sampler.tick()
    assert [event["nvml"] for event in events] == [True, False, False, False, True, True]
    assert all(event["gpus"] == [] for event in events[1:4])
    assert all(set(event["host"]) == HOST_KEYS for event in events)
    assert module.calls["nvmlInit"] == 2 and module.calls["nvmlShutdown"] == 1


def test_the_thread_publishes_until_stopped() -> None:
    events = []
    sampler = GpuSampler(events.append, gpu_interval_s=0.05, pcie_interval_s=10.0, nvml=fake_pynvml(gpus=1))
    sampler.start()
    deadline = time.monotonic() + 5
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.stop()
    count = len(events)
    time.sleep(0.2)
    assert count >= 3 and len(events) == count
    assert events[-1]["nvml"] is True
