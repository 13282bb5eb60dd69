"""Checkpoints carry their own integrity (issue 41, item 1): a manifest of sizes and checksums, verified on resume
with a fall-back to the newest checkpoint that verifies; no checkpoint of non-finite tensors is ever written."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from trainer.checkpoint import NonFiniteCheckpointError, list_checkpoints, save_checkpoint
from trainer.checkpoint_manifest import MANIFEST, first_nonfinite, verify_checkpoint
from trainer.config import load_config
from trainer.loop import Trainer

TINY = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=8",
    "data.max_response_length=4", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2",
]


def make_trainer(tmp_path, *overrides: str, warnings: list[str] | None = None,
                 lines: list[str] | None = None) -> Trainer:
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.experiment_name=run", *overrides])
    return Trainer(config, log=(lines.append if lines is not None else lambda *_: None),
                   warn=(warnings.append if warnings is not None else lambda *_: None))


def nan_in_place(path) -> None:
    """The probe's damage: the last 4 bytes of a safetensors file (inside its last tensor) overwritten with a
    float32 NaN, the file's size unchanged."""
    data = bytearray(path.read_bytes())
    data[-4:] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))


def test_a_checkpoint_damaged_without_changing_its_size_is_caught_and_resume_falls_back(tmp_path):
    """Probe 1: one file of the latest checkpoint overwritten with same-length NaN bytes loaded silently (and the
    run crashed in generation). Now resume names the file and resumes from the newest checkpoint that verifies."""
    make_trainer(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1").fit()
    directory = tmp_path / "run" / "checkpoints"
    (_, first), (_, latest) = list_checkpoints(directory)
    weights = latest / "actor" / "model.safetensors"
    size = weights.stat().st_size
    nan_in_place(weights)
    assert weights.stat().st_size == size
    assert verify_checkpoint(first).ok
    assert "checksum differs" in (verify_checkpoint(latest).problem or "")

    warnings: list[str] = []
    resumed = make_trainer(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1", warnings=warnings)
    resumed.resume()
    assert resumed.step == 1
    assert len(warnings) == 1
    assert str(weights) in warnings[0] and "step 2 is damaged" in warnings[0]
    assert "newest one that verifies, step 1" in warnings[0]


def test_a_named_damaged_checkpoint_is_refused(tmp_path):
    """resume_mode=resume_path keeps its meaning: the damaged checkpoint named is refused, not replaced."""
    make_trainer(tmp_path, "trainer.total_training_steps=1").fit()
    latest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    nan_in_place(latest / "actor" / "model.safetensors")
    resumed = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={latest}")
    with pytest.raises(Exception, match="checksum differs"):
        resumed.resume()


def test_a_checkpoint_without_a_manifest_loads_with_a_note(tmp_path):
    """Checkpoints written before the manifest existed load as before."""
    make_trainer(tmp_path, "trainer.total_training_steps=1").fit()
    latest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    (latest / MANIFEST).unlink()
    lines: list[str] = []
    resumed = make_trainer(tmp_path, "trainer.total_training_steps=1", lines=lines)
    resumed.resume()
    assert resumed.step == 1
    assert any("predates checkpoint manifests" in line for line in lines)


def test_the_manifest_lists_every_file_with_its_size(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path, 1, {"actor": model}, {"step": 1})
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert set(files) == {"actor/model.safetensors", "trainer_state.pt"}
    assert files["trainer_state.pt"]["bytes"] == (path / "trainer_state.pt").stat().st_size
    (path / "trainer_state.pt").write_bytes((path / "trainer_state.pt").read_bytes()[:-1])  # truncated
    assert "bytes, the manifest says" in (verify_checkpoint(path).problem or "")


def test_a_checkpoint_of_non_finite_weights_is_refused_and_none_is_written(tmp_path):
    """Probe 3: weights that diverged were saved and resumed silently; now the save is refused before writing."""
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path, 1, {"actor": model}, {"step": 1})
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    with pytest.raises(NonFiniteCheckpointError, match=r"actor\.weight holds NaN or infinity"):
        save_checkpoint(tmp_path, 2, {"actor": model}, {"step": 2})
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["global_step_1", "latest_checkpointed_iteration.txt"]


def test_first_nonfinite_walks_nested_states():
    state = {"optimizer": {"state": {0: {"exp_avg": torch.tensor([1.0, float("nan")]), "step": torch.tensor(3)}}},
             "kl": 0.1, "positions": torch.tensor([1, 2])}
    assert first_nonfinite(state) == "optimizer.state.0.exp_avg"
    assert first_nonfinite({"a": torch.ones(2), "b": [torch.zeros(1)]}) is None


def test_when_no_checkpoint_verifies_the_run_starts_again_from_step_0_saying_so(tmp_path):
    """Found by the chaos soak: the only checkpoint damaged refused the resume (exit 2, not restarted). Step 0 is
    the state every run can rebuild, so the run starts again from there, with one WARNING."""
    make_trainer(tmp_path, "trainer.total_training_steps=1").fit()
    latest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    nan_in_place(latest / "actor" / "model.safetensors")
    warnings: list[str] = []
    resumed = make_trainer(tmp_path, "trainer.total_training_steps=1", warnings=warnings)
    resumed.resume()
    assert resumed.step == 0
    assert len(warnings) == 1 and "every checkpoint" in warnings[0] and "starting again from step 0" in warnings[0]
