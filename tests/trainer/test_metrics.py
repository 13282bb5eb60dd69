"""metrics.jsonl on a disk that fills up: lines appended whole, partial lines dropped at resume."""

from __future__ import annotations

import errno
import json
import os

import psutil
import pytest
import torch
from transformers import PretrainedConfig

import trainer.loop
import trainer.metrics
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.metrics import MetricsLog, decoder_flops, device_peak_flops
from trainer.models import load_policy, load_tokenizer


def full_disk_after(monkeypatch, fitting: int) -> None:
    """os.write as on a device with `fitting` bytes left: it writes what fits, then fails with ENOSPC."""
    real = os.write
    left = [fitting]

    def write(descriptor: int, data: bytes) -> int:
        if left[0] == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real(descriptor, bytes(data[:left[0]]))
        left[0] -= written
        return written

    monkeypatch.setattr(trainer.metrics.os, "write", write)


def test_a_line_the_disk_cannot_take_leaves_no_partial_line_and_is_written_later(tmp_path, monkeypatch):
    warnings: list[str] = []
    log = MetricsLog(tmp_path / "metrics.jsonl", warn=warnings.append)
    log.append(1, {"critic/score/mean": 0.5})
    full_disk_after(monkeypatch, fitting=10)
    log.append(2, {"critic/score/mean": 0.25})  # raised JSONDecodeError at every later resume
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n"), "no half-written line"
    assert log.failures == 1
    assert len(warnings) == 1 and "could not write step 2" in warnings[0] and "No space left" in warnings[0]
    monkeypatch.undo()  # space again
    log.append(3, {"critic/score/mean": 0.125})
    assert [row["step"] for row in log.read()] == [1, 2, 3]
    assert len(warnings) == 1


@pytest.mark.parametrize("tail", [b'{"step": 3, "critic/score/me', b'{"step": 3, "critic/score/mean": 0.1}',
                                  b'{"step": 3, "x": "\xc3'])
def test_a_partial_last_line_is_dropped_at_resume_with_a_warning(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n' + tail)
    warnings: list[str] = []
    log = MetricsLog(path, warn=warnings.append)
    log.truncate_after(2)
    assert path.read_bytes() == b'{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
    assert len(warnings) == 1 and "dropped 1 partial or garbled line(s)" in warnings[0]
    log.append(3, {"a": 3.0})
    assert [row["step"] for row in log.read()] == [1, 2, 3]


def test_resume_cuts_the_file_short_without_needing_free_space(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, warn=lambda message: None)
    for step in (1, 2, 3):
        log.append(step, {"a": float(step)})

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    full_disk_after(monkeypatch, fitting=0)
    for write in ("write_bytes", "write_text"):  # a rewrite of the file would need room for its copy
        monkeypatch.setattr(trainer.metrics.Path, write, no_space)
    log.truncate_after(1)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


# ----------------------------------------------------------------- verl's metrics of a real run

TINY_RUN = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=8",
    "data.max_response_length=6", "trainer.device=cpu", "trainer.total_training_steps=2", "trainer.save_freq=1",
    "trainer.test_freq=1", "data.val_files=[builtin:counting]", "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.use_kl_loss=true",  # a reference policy, so timing_s/ref
    "trainer.val_before_train=false",  # every line a training step's (step 0's validation: test_verl_keys_training)
]


def run_metrics(tmp_path) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(load_config(None, [*TINY_RUN, f"trainer.runs_dir={tmp_path}"]), log=lambda *_: None)
    trainer.fit()
    return trainer, trainer.metrics_log.read()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return run_metrics(tmp_path_factory.mktemp("cpu_run"))


def test_a_run_reports_its_global_step_and_the_time_of_testing_and_checkpoints(cpu_run):
    _, rows = cpu_run
    assert [row["training/global_step"] for row in rows] == [row["step"] for row in rows] == [1, 2]
    assert all(row["timing_s/testing"] > 0 for row in rows), "test_freq=1 validates after every step"
    # A save follows its step's line: the checkpoint of step 1 is timed in step 2's metrics.
    assert "timing_s/save_checkpoint" not in rows[0]
    assert rows[1]["timing_s/save_checkpoint"] > 0


def test_timing_per_token_is_each_phases_milliseconds_over_the_tokens_it_processed(cpu_run):
    _, rows = cpu_run
    for row in rows:
        phases = {key.removeprefix("timing_per_token_ms/") for key in row if key.startswith("timing_per_token_ms/")}
        assert phases == {"gen", "ref", "values", "adv", "update_critic", "update_actor"}
        assert row["timing_per_token_ms/gen"] == pytest.approx(
            row["timing_s/gen"] * 1000 / row["perf/total_num_response_tokens"])
        for phase in phases - {"gen"}:
            assert row[f"timing_per_token_ms/{phase}"] == pytest.approx(
                row[f"timing_s/{phase}"] * 1000 / row["perf/total_num_tokens"]), phase


def test_cpu_memory_used_is_the_hosts_used_memory(cpu_run):
    _, rows = cpu_run
    memory = psutil.virtual_memory()
    for row in rows:
        assert 0 < row["perf/cpu_memory_used_gb"] < memory.total / 1024**3
        assert row["perf/cpu_memory_used_gb"] == pytest.approx(memory.used / 1024**3, rel=0.5)


def test_on_a_cpu_the_mfu_figures_are_left_out(cpu_run):
    _, rows = cpu_run
    assert not [key for row in rows for key in row if key.startswith("perf/mfu/")]


def test_mfu_is_the_phases_flops_per_second_over_the_devices_peak(tmp_path, monkeypatch):
    peak = 1e12
    monkeypatch.setattr(trainer.loop, "device_peak_flops", lambda device: peak)
    run, rows = run_metrics(tmp_path)
    for row in rows:
        flops = {key: row[f"perf/mfu/{key}"] * row[f"timing_s/{phase}"] * peak
                 for key, phase in (("actor", "update_actor"), ("actor_infer", "old_log_prob"),
                                    ("critic", "update_critic"))}
        # The same sequences: an update is forward and backward (3 forwards) per epoch (ppo_epochs=2, the
        # critic's too), the log-probs one forward; the critic has the actor's backbone and config.
        assert flops["actor"] == pytest.approx(2 * 3 * flops["actor_infer"])
        assert flops["critic"] == pytest.approx(2 * 3 * flops["actor_infer"])
        assert 0 < row["perf/mfu/actor"] < 1
        # 8 sequences of 14 tokens at most: attention's share lies between that of 8 equal lengths and that
        # of as many 14-token sequences as the tokens fill.
        tokens, config = int(row["perf/total_num_tokens"]), run.actor.model.config
        longest = [14] * (tokens // 14) + [tokens % 14]
        assert (decoder_flops(config, [tokens / 8] * 8, backward=False) * (1 - 1e-9) <= flops["actor_infer"]
                <= decoder_flops(config, longest, backward=False) * (1 + 1e-9))


def test_decoder_flops_count_every_weight_matrix_and_attention(tmp_path):
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=1,
                        override_config={"num_hidden_layers": 2, "num_key_value_heads": 1})
    config = model.config
    assert not config.tie_word_embeddings
    matrices = sum(parameter.numel() for parameter in model.parameters() if parameter.dim() == 2)
    head_dim = config.hidden_size // config.num_attention_heads
    lengths = [3, 10]
    attention = 4 * (9 + 100) * head_dim * config.num_attention_heads * config.num_hidden_layers
    assert decoder_flops(config, lengths, backward=False) == 2 * matrices * 13 + attention
    assert decoder_flops(config, lengths, backward=True) == 3 * (2 * matrices * 13 + attention)
    assert decoder_flops(PretrainedConfig(), lengths, backward=False) is None, "a model type it cannot count"


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H200", 989e12), ("NVIDIA H20", 148e12),
                                            ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                            ("NVIDIA A100-SXM4-80GB", 312e12), ("Some Future GPU", None)])
def test_the_peak_is_the_devices_dense_bf16_peak(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops(torch.device("cuda", 0)) == peak
    assert device_peak_flops(torch.device("cpu")) is None
