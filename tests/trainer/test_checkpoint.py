"""Atomic checkpoints: round trips, leftovers of crashed saves, pruning, re-saving, bad loads."""

import errno
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import trainer.checkpoint
from trainer.checkpoint import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointWriteError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
    save_weights,
)
from trainer.config.run_files import LATEST_CHECKPOINT_FILE as LATEST
from trainer.models import load_critic, load_policy, load_tokenizer
from trainer.randomness import rng_state, set_rng_state

TINY = "builtin:tiny-qwen2"
SMALL = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
         "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


def models(tokenizer, seed: int, **override) -> dict[str, torch.nn.Module]:
    config = {**SMALL, **override}
    return {
        "actor": load_policy(TINY, tokenizer, dtype=torch.float32, seed=seed, override_config=config),
        "critic": load_critic(TINY, tokenizer, dtype=torch.float32, seed=seed, override_config=config),
    }


def assert_same_weights(first: torch.nn.Module, second: torch.nn.Module) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert torch.equal(tensor, second_state[name]), name


def step_dirs(run_dir) -> list[str]:
    return sorted(path.name for path in Path(run_dir).iterdir())


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_round_trip_of_models_and_state(tokenizer, tmp_path):
    saved = models(tokenizer, seed=1)
    optimizer = torch.optim.AdamW(saved["actor"].parameters(), lr=0.1)
    saved["actor"](input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    optimizer.step()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    state = {"step": 3, "optimizer": optimizer.state_dict(), "rng": rng_state(), "sampler": {"epoch": 1}}
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))

    path = save_checkpoint(tmp_path, 3, saved, state)
    assert path == tmp_path / "global_step_3"
    loaded = models(tokenizer, seed=2)
    restored = load_checkpoint(path, loaded)
    for role in saved:
        assert_same_weights(loaded[role], saved[role])
    assert restored["step"] == 3 and restored["sampler"] == {"epoch": 1}
    new_optimizer = torch.optim.AdamW(loaded["actor"].parameters(), lr=0.1)
    new_optimizer.load_state_dict(restored["optimizer"])
    first_moment = next(iter(optimizer.state.values()))["exp_avg"]
    assert torch.equal(next(iter(new_optimizer.state.values()))["exp_avg"], first_moment)
    # The RNG states put back make the same draws as when they were saved.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(restored["rng"])
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == expected_draws[:2]
    assert torch.equal(draws[2], expected_draws[2])


def test_latest_file_holds_the_step(tokenizer, tmp_path):
    saved = models(tokenizer, seed=1)
    save_checkpoint(tmp_path, 4, saved, {"step": 4})
    assert (tmp_path / LATEST).read_text() == "4\n"
    save_checkpoint(tmp_path, 10, saved, {"step": 10})
    assert (tmp_path / LATEST).read_text() == "10\n"
    assert latest_checkpoint(tmp_path).name == "global_step_10"  # by number, not by name (10 < 4 as text)


def test_no_checkpoints(tmp_path):
    assert list_checkpoints(tmp_path) == []
    assert latest_checkpoint(tmp_path) is None
    remove_partial_checkpoints(tmp_path)  # nothing to do, and no error


def test_leftovers_of_a_crashed_save_are_ignored(tokenizer, tmp_path, dead_pid):
    saved = models(tokenizer, seed=1)
    complete = save_checkpoint(tmp_path, 3, saved, {"step": 3})
    root = tmp_path
    partial = root / f".global_step_5.partial-{dead_pid}"
    (partial / "actor").mkdir(parents=True)
    (partial / TRAINER_STATE).write_bytes(b"half")
    (root / "global_step_7" / "actor").mkdir(parents=True)  # weights, but no trainer_state.pt
    (root / "notes").mkdir()

    assert list_checkpoints(tmp_path) == [(3, complete)]
    assert latest_checkpoint(tmp_path) == complete
    remove_partial_checkpoints(tmp_path)
    assert not partial.exists()
    assert step_dirs(tmp_path) == ["global_step_3", "global_step_7", LATEST, "notes"]
    with pytest.raises(CheckpointError, match=f"global_step_7.*not a complete checkpoint.*{TRAINER_STATE}"):
        load_checkpoint(root / "global_step_7", saved)


def disk_bytes(root) -> int:
    """What the files and folders under `root` take on disk (whole blocks, as a disk fills)."""
    return sum(path.stat().st_blocks * 512 for path in [root, *root.rglob("*")])


def test_the_size_estimate_is_never_below_what_a_save_writes(tokenizer, tmp_path):
    # A trainer's state: optimizer states, the RNG states (Python's alone pickles to ~12 KB), counters.
    saved = models(tokenizer, seed=1)
    optimizer = torch.optim.AdamW(saved["actor"].parameters(), lr=0.1)
    saved["actor"](input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    optimizer.step()
    state = {"step": 1, "optimizer": optimizer.state_dict(), "rng": rng_state(), "sampler": {"epoch": 0}}
    estimate = trainer.checkpoint.checkpoint_bytes(saved, state)
    path = save_checkpoint(tmp_path, 1, saved, state)
    written = disk_bytes(path) + disk_bytes(tmp_path / LATEST)
    # Was 39 KiB below what was written (headers, names, pickled RNG states); an estimate that is over by
    # little still says truly how much room a save needs.
    assert written <= estimate < 2 * written


def test_the_size_estimate_counts_a_shared_storage_once(tokenizer):
    saved = models(tokenizer, seed=1, tie_word_embeddings=True)
    untied = models(tokenizer, seed=1)
    arena = torch.zeros(1 << 16)
    alone = trainer.checkpoint.checkpoint_bytes(saved, {"a": arena})
    assert trainer.checkpoint.checkpoint_bytes(saved, {"a": arena, "b": arena[:10]}) - alone < 1024
    assert trainer.checkpoint.checkpoint_bytes(untied, {}) > trainer.checkpoint.checkpoint_bytes(saved, {})


def test_a_checkpoint_the_disk_cannot_hold_is_refused_in_one_line_keeping_the_last_one(tokenizer, tmp_path,
                                                                                         monkeypatch):
    saved = models(tokenizer, seed=1)
    complete = save_checkpoint(tmp_path, 3, saved, {"step": 3})
    real = trainer.checkpoint.shutil.disk_usage
    monkeypatch.setattr(trainer.checkpoint.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(tmp_path, 5, saved, {"step": 5}, keep=1)
    message = str(error.value)
    assert message.startswith("not enough disk space for the checkpoint of step 5 in ")
    assert message.endswith(" and 0.98 KiB is free; free some space, keep fewer checkpoints "
                            "(trainer.max_ckpt_to_keep) or write the checkpoints elsewhere (trainer.default_local_dir)")
    assert "\n" not in message
    assert step_dirs(tmp_path) == ["global_step_3", LATEST]
    assert latest_checkpoint(tmp_path) == complete


def test_a_disk_filling_up_while_saving_leaves_no_partial_checkpoint(tokenizer, tmp_path, monkeypatch):
    saved = models(tokenizer, seed=1)
    save_checkpoint(tmp_path, 3, saved, {"step": 3})

    def full(*args, **kwargs):
        # What torch.save raised on an H200 machine whose disk filled up (2026-11-30).
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 34969626496 vs 34969626396")

    monkeypatch.setattr(trainer.checkpoint.torch, "save", full)
    with pytest.raises(CheckpointWriteError, match=r"^could not write the checkpoint of step 5 to .* \(\[enforce "
                                                   r"fail .*\) after [\d.]+ [KMG]iB of about [\d.]+ [KMG]iB; "
                                                   r"[\d.]+ [KMG]iB was free then$"):
        save_checkpoint(tmp_path, 5, saved, {"step": 5})
    assert step_dirs(tmp_path) == ["global_step_3", LATEST]


def test_the_disk_full_message_gives_the_free_space_when_the_write_failed(tokenizer, tmp_path, monkeypatch):
    """A disk of fixed size, filled by what the save writes: the free figure is the one the write ran into,
    not the one after the partial checkpoint was removed (which said the save had room)."""
    saved = models(tokenizer, seed=1)
    capacity = trainer.checkpoint.checkpoint_bytes(saved, {"step": 5}) + 10_000
    real = trainer.checkpoint.shutil.disk_usage

    def fixed_disk(path):
        used = sum(file.stat().st_size for file in tmp_path.rglob("*") if file.is_file())
        return real(path)._replace(free=capacity - used)

    def write_until_full(state, path, *args, **kwargs):
        free = fixed_disk(tmp_path).free
        Path(path).write_bytes(b"x" * (free - 100))  # what fitted before the device filled
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(trainer.checkpoint.shutil, "disk_usage", fixed_disk)
    monkeypatch.setattr(trainer.checkpoint.torch, "save", write_until_full)
    with pytest.raises(CheckpointWriteError) as error:
        save_checkpoint(tmp_path, 5, saved, {"step": 5})
    assert str(error.value).endswith("; 0.10 KiB was free then; free some space, keep fewer checkpoints "
                                     "(trainer.max_ckpt_to_keep) or write the checkpoints elsewhere "
                                     "(trainer.default_local_dir)")
    assert "No space left on device" in str(error.value)
    assert step_dirs(tmp_path) == []


def test_the_weights_alone_are_a_model_directory(tokenizer, tmp_path):
    actor = models(tokenizer, seed=1)["actor"]
    path = save_weights(tmp_path, 7, actor)
    assert path == tmp_path / "weights_step_7"
    assert sorted(file.name for file in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert_same_weights(loaded, actor)
    assert list_checkpoints(tmp_path) == [], "weights alone are no checkpoint to resume from"


@pytest.mark.parametrize("damaged", ["actor/model.safetensors", TRAINER_STATE])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tokenizer, tmp_path, damaged):
    """A failure that recurs at every try (a user error, exit code 2), not a crash to restart from."""
    saved = models(tokenizer, seed=1)
    path = save_checkpoint(tmp_path, 2, saved, {"step": 2, "rng": rng_state()})
    content = (path / damaged).read_bytes()
    (path / damaged).write_bytes(content[:len(content) // 2])
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, models(tokenizer, seed=2))
    assert str(error.value).startswith(f"{str(path / damaged)!r} is damaged (")
    assert str(error.value).endswith("; resume from an earlier checkpoint (trainer.resume_mode=resume_path, "
                                     "trainer.resume_from_path) or remove this one")


def test_keep_prunes_the_oldest(tokenizer, tmp_path):
    saved = models(tokenizer, seed=1)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, saved, {"step": step}, keep=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert step_dirs(tmp_path) == ["global_step_3", "global_step_4", LATEST]


def test_resaving_a_step_replaces_it(tokenizer, tmp_path):
    first, second = models(tokenizer, seed=1), models(tokenizer, seed=2)
    save_checkpoint(tmp_path, 5, first, {"version": 1})
    path = save_checkpoint(tmp_path, 5, second, {"version": 2})
    loaded = models(tokenizer, seed=3)
    assert load_checkpoint(path, loaded) == {"version": 2}
    assert_same_weights(loaded["actor"], second["actor"])
    assert step_dirs(tmp_path) == ["global_step_5", LATEST], "no stale copy may be left behind"


def test_a_crash_between_the_renames_of_a_resave_keeps_the_step(tokenizer, tmp_path, monkeypatch):
    """Re-saving moves the old copy aside, then the new one in: killed in between, the old copy is the
    only complete one, and the next start puts it back rather than losing the step."""
    first, second = models(tokenizer, seed=1), models(tokenizer, seed=2)
    save_checkpoint(tmp_path, 4, first, {"version": 0})
    save_checkpoint(tmp_path, 5, first, {"version": 1})
    real_replace = os.replace
    renames = []

    def killed_after_the_first_rename(source, target):
        renames.append((source, target))
        if len(renames) == 2:
            raise KeyboardInterrupt  # stands in for SIGKILL: nothing after the first rename runs
        real_replace(source, target)

    monkeypatch.setattr(trainer.checkpoint.os, "replace", killed_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 5, second, {"version": 2})
    monkeypatch.undo()
    pid = os.getpid()  # folders named with this process's pid count as another (dead) process's leftovers
    assert step_dirs(tmp_path) == [f".global_step_5.partial-{pid}", f".global_step_5.stale-{pid}",
                                   "global_step_4", LATEST]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4], "step 5 is only in the stale copy now"

    remove_partial_checkpoints(tmp_path)
    assert step_dirs(tmp_path) == ["global_step_4", "global_step_5", LATEST]
    loaded = models(tokenizer, seed=3)
    assert load_checkpoint(latest_checkpoint(tmp_path), loaded) == {"version": 1}
    assert_same_weights(loaded["actor"], first["actor"])


def test_a_stale_copy_beside_its_step_is_removed(tokenizer, tmp_path, dead_pid):
    saved = models(tokenizer, seed=1)
    save_checkpoint(tmp_path, 5, saved, {"version": 1})
    stale = tmp_path / f".global_step_5.stale-{dead_pid}"
    (stale / "actor").mkdir(parents=True)
    (stale / TRAINER_STATE).write_bytes(b"old")
    remove_partial_checkpoints(tmp_path)
    assert step_dirs(tmp_path) == ["global_step_5", LATEST]
    assert load_checkpoint(tmp_path / "global_step_5", models(tokenizer, seed=3)) == {"version": 1}


def test_the_folders_of_a_live_process_saving_into_the_run_are_left_alone(tmp_path, dead_pid):
    root = tmp_path
    live = os.getppid()  # alive: it started this test process
    kept = [root / f".global_step_5.partial-{live}", root / f".global_step_4.stale-{live}"]
    gone = [root / f".global_step_5.partial-{dead_pid}", root / f".global_step_4.stale-{dead_pid}"]
    for folder in kept + gone:
        folder.mkdir(parents=True)
    (root / "global_step_4").mkdir()  # its stale copy is mid-swap in the live process
    remove_partial_checkpoints(tmp_path)
    assert step_dirs(tmp_path) == sorted([folder.name for folder in kept] + ["global_step_4"])


def test_the_step_file_a_killed_save_left_is_removed_unless_its_process_lives(tmp_path, dead_pid):
    root = tmp_path
    root.mkdir(parents=True, exist_ok=True)
    gone, live = root / f".{LATEST}.tmp-{dead_pid}", root / f".{LATEST}.tmp-{os.getppid()}"
    gone.write_text("4\n")
    live.write_text("5\n")
    remove_partial_checkpoints(tmp_path)
    assert not gone.exists() and live.exists()


def test_loading_into_a_model_of_another_shape(tokenizer, tmp_path):
    path = save_checkpoint(tmp_path, 1, models(tokenizer, seed=1), {})
    wider = models(tokenizer, seed=1, hidden_size=32)
    with pytest.raises(CheckpointError, match=r"actor weights in .*global_step_1.* do not fit the model") as error:
        load_checkpoint(path, wider)
    assert "size mismatch" in str(error.value)
    deeper = models(tokenizer, seed=1, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"actor weights .* do not fit the model \(missing \d+, unexpected 0"):
        load_checkpoint(path, deeper)


def test_loading_a_role_the_checkpoint_lacks(tokenizer, tmp_path):
    saved = models(tokenizer, seed=1)
    path = save_checkpoint(tmp_path, 1, {"actor": saved["actor"]}, {})
    with pytest.raises(CheckpointError, match="no weights for the critic"):
        load_checkpoint(path, saved)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tokenizer, tmp_path, monkeypatch):
    saved = models(tokenizer, seed=1)
    previous = save_checkpoint(tmp_path, 1, saved, {"step": 1})

    def crash(*_args, **_kwargs):
        # torch.save runs once the weights are written: they are on disk when this raises.
        assert (tmp_path / f".global_step_2.partial-{os.getpid()}"
                / "actor" / "model.safetensors").is_file()
        raise OSError("disk full")

    monkeypatch.setattr(trainer.checkpoint.torch, "save", crash)
    with pytest.raises(CheckpointError, match=r"^could not write the checkpoint of step 2 to .* \(disk full\)"):
        save_checkpoint(tmp_path, 2, models(tokenizer, seed=2), {"step": 2})
    assert not list(tmp_path.glob(".global_step_2.partial-*"))
    monkeypatch.undo()

    assert not (tmp_path / "global_step_2").exists()
    assert list_checkpoints(tmp_path) == [(1, previous)]
    assert (tmp_path / LATEST).read_text() == "1\n"
    loaded = models(tokenizer, seed=3)
    assert load_checkpoint(latest_checkpoint(tmp_path), loaded) == {"step": 1}
    assert_same_weights(loaded["actor"], saved["actor"])
    remove_partial_checkpoints(tmp_path)
    assert step_dirs(tmp_path) == ["global_step_1", LATEST]
