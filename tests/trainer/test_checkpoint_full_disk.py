"""A full disk while a checkpoint is saved (issue 41's remaining faults, item 2): ENOSPC or EDQUOT from a write or
from the rename into place. The last good checkpoint stays intact (its manifest verifies), the partial one is
removed, one line names the directory, the free space and what to do; the run goes on to the next save, or stops
with a user error (exit 2) when it was the final save; a resume then starts from the last good checkpoint."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tests.trainer.test_sharded_checkpoint_disk import TwoRanks
from trainer import checkpoint as checkpoint_module
from trainer.checkpoint import (
    CheckpointWriteError,
    FinalCheckpointError,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    save_sharded_checkpoint,
)
from trainer.checkpoint_manifest import verify_checkpoint
from trainer.config import load_config
from trainer.config.run_files import LATEST_CHECKPOINT_FILE as LATEST
from trainer.faults import FULL_DISK_ENV
from trainer.loop import Trainer
from trainer.models import load_policy, load_tokenizer

TINY = "builtin:tiny-qwen2"
SMALL = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
         "num_key_value_heads": 1}
RUN = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=8",
    "data.max_response_length=4", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2",
]
ADVICE = ("free some space, keep fewer checkpoints (trainer.max_ckpt_to_keep) or write the checkpoints elsewhere "
          "(trainer.default_local_dir)")


@pytest.fixture(scope="module")
def actor() -> dict[str, torch.nn.Module]:
    tokenizer = load_tokenizer(TINY)
    return {"actor": load_policy(TINY, tokenizer, dtype=torch.float32, seed=1, override_config=SMALL)}


def refuse_rename(monkeypatch, code: int = errno.ENOSPC) -> None:
    """os.replace of a partial checkpoint into place fails as on a full disk (a directory that must grow)."""
    real = os.replace

    def replace(source, target):
        if ".partial-" in Path(source).name:
            raise OSError(code, os.strerror(code))
        return real(source, target)

    monkeypatch.setattr(checkpoint_module.os, "replace", replace)


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_rename_the_full_disk_refuses_keeps_the_last_good_checkpoint_and_removes_the_partial(actor, tmp_path,
                                                                                              monkeypatch):
    """It was: the OSError of the rename went up uncaught (a traceback, the run over) and the partial folder
    stayed."""
    good = save_checkpoint(tmp_path, 1, actor, {"step": 1})
    refuse_rename(monkeypatch)
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(tmp_path, 2, actor, {"step": 2}, keep=1)
    message = str(raised.value)
    assert message.startswith(f"could not write the checkpoint of step 2 to {str(tmp_path)!r} ([Errno 28] No space "
                              "left on device) after ")
    assert " was free then; " + ADVICE in message and "\n" not in message
    assert names(tmp_path) == ["global_step_1", LATEST]  # keep=1 removed nothing
    assert latest_checkpoint(tmp_path) == good and verify_checkpoint(good).ok


def test_a_re_save_whose_rename_fails_puts_the_complete_copy_back(actor, tmp_path, monkeypatch):
    """Re-saving a step after a resume swaps the old copy aside first: it was left aside (hidden, so no resume
    found it) when the second rename failed."""
    save_checkpoint(tmp_path, 1, actor, {"step": 1})
    refuse_rename(monkeypatch)
    with pytest.raises(CheckpointWriteError):
        save_checkpoint(tmp_path, 1, actor, {"step": 1})
    assert names(tmp_path) == ["global_step_1", LATEST]
    assert verify_checkpoint(tmp_path / "global_step_1").ok


def test_a_spent_quota_says_to_raise_the_quota(actor, tmp_path, monkeypatch):
    refuse_rename(monkeypatch, errno.EDQUOT)
    with pytest.raises(CheckpointWriteError, match=r"Disk quota exceeded\) after .* was free then; raise the disk "
                                                   r"quota or free some of it, keep fewer checkpoints"):
        save_checkpoint(tmp_path, 1, actor, {"step": 1})
    assert names(tmp_path) == []


def test_the_fault_hook_fails_the_write_of_the_step_it_names_only(actor, tmp_path, monkeypatch):
    """VERL_FAULT_FULL_DISK (the chaos soak's full disk): `write@2` fails step 2's save part way, as ENOSPC, and
    no other; without its file nothing fails."""
    marker = tmp_path / "full"
    monkeypatch.setenv(FULL_DISK_ENV, str(marker))
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, actor, {"step": 1})  # no file yet: no fault
    marker.write_text("write@2")
    with pytest.raises(CheckpointWriteError, match=r"\(\[Errno 28\] No space left on device \(injected: "
                                                   r"VERL_FAULT_FULL_DISK at manifest.json\)\) after [\d.]+ [KM]iB"):
        save_checkpoint(root, 2, actor, {"step": 2})
    save_checkpoint(root, 3, actor, {"step": 3})
    assert [step for step, _ in list_checkpoints(root)] == [1, 3]
    assert not [name for name in names(root) if name.startswith(".")]


def test_a_sharded_checkpoint_whose_rename_fails_is_one_error_on_every_rank(tmp_path, monkeypatch):
    """It was: rank 0's OSError went up alone while the other ranks waited at the barrier."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setenv(FULL_DISK_ENV, str(tmp_path / "full"))
    (tmp_path / "full").write_text("rename")
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointWriteError, match=r"^could not write the checkpoint of step 3 to .*No space left"):
        save_sharded_checkpoint(root, 3, {"actor": (model, optimizer)}, {"step": 3}, ranks=TwoRanks())
    assert names(root) == []


def test_a_run_whose_save_meets_a_full_disk_goes_on_and_a_failed_final_save_resumes_from_the_last_good(
        tmp_path, monkeypatch):
    """Through the trainer: step 2's save fails at the rename (one WARNING naming the directory, the free space and
    what to do; the run trains step 3 and saves it); a final save that fails is a FinalCheckpointError (exit 2),
    and the next run resumes from the last good checkpoint."""
    marker = tmp_path / "full"
    monkeypatch.setenv(FULL_DISK_ENV, str(marker))
    marker.write_text("rename@2")
    warnings: list[str] = []
    config = load_config(None, [*RUN, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=3",
                                "trainer.save_freq=1"])
    run = Trainer(config, log=lambda *_: None, warn=warnings.append)
    run.fit()
    directory = run.checkpointer.directory
    assert [step for step, _ in list_checkpoints(directory)] == [1, 3]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"CHECKPOINT NOT SAVED: could not write the checkpoint of step 2 to {str(directory)!r} ")
    assert f" was free then; {ADVICE}; training goes on" in warnings[0]
    assert all(verify_checkpoint(path).ok for _, path in list_checkpoints(directory))

    marker.write_text("write@4")
    config = load_config(None, [*RUN, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=4",
                                "trainer.save_freq=1"])
    with pytest.raises(FinalCheckpointError, match="the final checkpoint of step 4 was not saved: .*the latest "
                                                   "complete checkpoint: step 3$"):
        Trainer(config, log=lambda *_: None, warn=lambda *_: None).fit()
    assert [step for step, _ in list_checkpoints(directory)] == [1, 3]
    marker.unlink()
    logged: list[str] = []
    resumed = Trainer(config, log=logged.append, warn=lambda *_: None)
    resumed.resume()
    assert resumed.step == 3
    assert any(line.startswith("resumed from ") and line.endswith("global_step_3 at step 3") for line in logged)
