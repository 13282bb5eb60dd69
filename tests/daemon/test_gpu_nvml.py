"""The sampler against a real NVIDIA driver: the GPU figures a user sees in the monitor."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from daemon.gpu import GpuSampler

pytestmark = pytest.mark.gpu


def test_real_nvml_reports_every_gpu_and_the_trainers_memory():
    # A child process that holds GPU memory stands in for the trainer.
    holder = subprocess.Popen([sys.executable, "-c",
                               "import torch, time; x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); "
                               "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        events = []
        sampler = GpuSampler(events.append, gpu_interval_s=0.2, pcie_interval_s=1.0,
                             trainer_pids=lambda: [holder.pid])
        sampler.sample_pcie()
        sample = sampler.sample()
        assert sampler.nvml_up and sample["nvml"] is True
        gpu = sample["gpus"][0]
        assert gpu["uuid"].startswith("GPU-") and gpu["memory_total_bytes"] > 10 * 2**30
        assert 0.0 <= gpu["utilization_ratio"] <= 1.0
        assert gpu["power_watts"] > 0 and gpu["temperature_celsius"] > 0
        trainer = [process for process in gpu["processes"] if process["pid"] == holder.pid]
        assert trainer and trainer[0]["role"] == "trainer" and trainer[0]["memory_bytes"] >= 2**30
        assert gpu["pcie_tx_bytes_per_second"] is not None
        started = time.perf_counter()
        sampler.sample()
        # The fast sample stays cheap: the ~20 ms PCIe reads are on their own cadence.
        assert time.perf_counter() - started < 0.05 * max(1, len(sample["gpus"]))
    finally:
        holder.kill()
        holder.wait()

