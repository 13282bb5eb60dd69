"""Checkpoints under <root>/global_step_N/, written atomically; the root is the run's checkpoint folder
(trainer.checkpoint_dir: <run_dir>/checkpoints, or verl's trainer.default_local_dir).

A checkpoint is assembled in a hidden temporary folder and renamed into place in one step, so
a crash at any moment leaves either a complete checkpoint or none: never half of one.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from trainer.checkpoint_manifest import MANIFEST, first_nonfinite, write_manifest
from trainer.config import KEYS
from trainer.config.run_files import CHECKPOINTS_DIR, LATEST_CHECKPOINT_FILE
from trainer.errors import UserError
from trainer.faults import full_disk
from trainer.models.lora import ADAPTER_WEIGHTS, adapter_state_bytes, is_adapted, load_adapter, save_adapter
from trainer.offload.layout import format_bytes, storage_bytes
from trainer.offload.streamer import nested_tensors

TRAINER_STATE = "trainer_state.pt"
WEIGHTS = "model.safetensors"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_RESUME_EARLIER = (f"resume from an earlier checkpoint ({KEYS.trainer.resume_mode}=resume_path, "
                   f"{KEYS.trainer.resume_from_path}) or remove this one")


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says which and why."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, most often): nothing of it is left, the
    previous checkpoints are intact, and a later save may succeed."""


class FinalCheckpointError(CheckpointError):
    """The run's last checkpoint could not be written; the message says what was written instead."""


class NonFiniteCheckpointError(CheckpointError):
    """A checkpoint refused before a byte of it was written: a tensor holds a NaN or an infinity (the run has
    diverged), and resuming from it would only repeat the divergence. The checkpoints on disk are left as they
    were."""


def refuse_nonfinite(step: int, named: dict[str, Any]) -> None:
    """NonFiniteCheckpointError naming the first tensor of `named` (role -> state dict, or the trainer state)
    that is not finite."""
    name = first_nonfinite(named)
    if name is not None:
        raise NonFiniteCheckpointError(
            f"the checkpoint of step {step} was not written: {name} holds NaN or infinity (the run has diverged); "
            f"the checkpoints on disk are left as they were. Lower the learning rate "
            f"({KEYS.actor_rollout_ref.actor.optim.lr}) or check the reward")


def checkpoints_dir(run_dir: Path) -> Path:
    """The checkpoint folder of a run directory when trainer.default_local_dir does not move it."""
    return Path(run_dir) / CHECKPOINTS_DIR


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in the checkpoint folder `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def save_checkpoint(root: Path, step: int, models: dict[str, torch.nn.Module], state: dict[str, Any],
                    *, keep: int | None = None, tokenizer: Any = None) -> Path:
    """Write the models' weights and `state` (optimizers, RNG, data position...) for `step` into the checkpoint
    folder `root`; with `keep`, only the newest `keep` checkpoints stay. Each whole model's folder is a Hugging Face
    model directory (config.json, model.safetensors; the actor's with `tokenizer`'s files too), which transformers
    and vLLM load as they are."""
    root = Path(root)
    refuse_nonfinite(step, {**{role: model.state_dict() for role, model in models.items()}, "trainer_state": state})
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"global_step_{step}"
    partial = root / f".global_step_{step}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    needed = checkpoint_bytes(models, state) + _tokenizer_bytes(tokenizer)
    shortage = _no_room(root, step, needed, "it needs")
    if shortage is not None:
        raise CheckpointWriteError(shortage)
    try:
        partial.mkdir()
        for role, model in models.items():
            (partial / role).mkdir()
            _save_model(model, partial / role)
            _save_model_files(model, partial / role, tokenizer if role == "actor" else None)
        torch.save(state, partial / TRAINER_STATE)
        full_disk("write", step, partial / MANIFEST)  # the chaos soak's full disk (trainer/faults.py)
        write_manifest(partial)  # last: a checkpoint with a manifest is complete (trainer/checkpoint_manifest.py)
        _fsync_tree(partial)
        _move_into_place(partial, final, step)  # a rename too can meet a full disk (a directory that grows)
    except (OSError, RuntimeError) as error:
        # torch.save reports a full disk as a RuntimeError of its zip writer, not as an OSError.
        raise _write_failure(f"the checkpoint of step {step}", root, partial, needed, error) from None
    try:
        _write_atomically(root / LATEST_CHECKPOINT_FILE, f"{step}\n")
    except OSError as error:
        raise CheckpointWriteError(f"the checkpoint of step {step} is complete in {str(final)!r}, but "
                                   f"{LATEST_CHECKPOINT_FILE} could not be updated ({_one_line(error)})") from None
    if keep is not None:
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _save_model(model: torch.nn.Module, directory: Path) -> None:
    """A model's weights (model.safetensors), or a LoRA model's adapter in peft's format (adapter_config.json,
    adapter_model.safetensors: `PeftModel.from_pretrained(base_model, directory)` loads it)."""
    if is_adapted(model):
        save_adapter(model, directory)
    else:
        # save_model (not save_file) copes with tied weights such as a shared embedding and head.
        save_model(model, str(directory / WEIGHTS))


def _save_model_files(model: torch.nn.Module, directory: Path, tokenizer: Any) -> None:
    """What makes a whole model's weights a Hugging Face directory: its config.json (and generation_config.json),
    and `tokenizer`'s files when given. A LoRA adapter's folder is peft's already."""
    config = getattr(model, "config", None)
    if config is None or is_adapted(model):
        return
    config.to_json_file(str(directory / "config.json"))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.to_json_file(str(directory / "generation_config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def _tokenizer_bytes(tokenizer: Any) -> int:
    """At least what `tokenizer`'s files take: its vocabulary and merges as tokenizer.json writes them (indented),
    and the small files beside it; 0 without a tokenizer."""
    if tokenizer is None:
        return 0
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialized = len(backend.to_str(pretty=True).encode()) if backend is not None else 0
    return serialized + len(str(getattr(tokenizer, "chat_template", "") or "").encode()) + 4 * _FILE_BYTES


def save_weights(root: Path, step: int, model: torch.nn.Module) -> Path:
    """The policy's weights alone, as a HuggingFace directory (config.json and model.safetensors; a LoRA
    adapter in peft's format) under <root>/weights_step_N/: what a run keeps when its full checkpoint no
    longer fits."""
    root = Path(root)
    final = root / f"weights_step_{step}"
    partial = root / f".weights_step_{step}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    needed = _weights_bytes(model)
    try:
        partial.mkdir(parents=True)
        _save_model(model, partial)
        config = getattr(model, "config", None)
        if config is not None and not is_adapted(model):
            config.to_json_file(str(partial / "config.json"))
        _fsync_tree(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    except (OSError, RuntimeError) as error:
        raise _write_failure(f"the weights of step {step}", root, partial, needed, error) from None
    return final


def _no_room(root: Path, step: int, needed: int, whose: str) -> str | None:
    """The one-line refusal of a checkpoint of `needed` bytes that the free space in `root` cannot hold, or None;
    `whose` says what needs the bytes ("it needs", "its 2 ranks' shards need")."""
    free = shutil.disk_usage(root).free
    if needed <= free:
        return None
    return (f"not enough disk space for the checkpoint of step {step} in {str(root)!r}: {whose} about "
            f"{format_bytes(needed)} and {format_bytes(free)} is free; free some space, keep fewer checkpoints "
            f"({KEYS.trainer.max_ckpt_to_keep}) or write the checkpoints elsewhere ({KEYS.trainer.default_local_dir})")


def _write_failure(what: str, root: Path, partial: Path, needed: int, error: BaseException) -> CheckpointWriteError:
    """The error for a save that failed part way, once its partial folder is removed. The free space is the
    disk's when the write failed: measured after the removal it would be the space the save had found."""
    written = sum(path.stat().st_size for path in partial.rglob("*") if path.is_file()) if partial.is_dir() else 0
    free = shutil.disk_usage(root).free
    shutil.rmtree(partial, ignore_errors=True)
    return CheckpointWriteError(f"could not write {what} to {str(root)!r} ({_one_line(error)}) after "
                                f"{format_bytes(written)} of about {format_bytes(needed)}; {format_bytes(free)} was "
                                f"free then{_what_to_do(error)}")


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""The write failures that mean no room: the device is full, the user's quota is spent, a file size limit is met."""


def _what_to_do(error: BaseException) -> str:
    """What to do about a write the disk refused for want of room ("; free some space, ..."), else nothing."""
    if not (isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS):
        return ""
    room = "raise the disk quota or free some of it" if error.errno == errno.EDQUOT else "free some space"
    return (f"; {room}, keep fewer checkpoints ({KEYS.trainer.max_ckpt_to_keep}) or write the checkpoints elsewhere "
            f"({KEYS.trainer.default_local_dir})")


def _one_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# What the file formats add to the tensors' bytes, over-counted so the estimate is never below what
# a save writes: safetensors' JSON header (name, dtype, shape, offsets) per tensor; torch.save's zip
# record (local header, 64-byte alignment, central directory entry) and pickled rebuild call per
# storage; each file's and folder's last partly used disk block.
_SAFETENSORS_ENTRY_BYTES = 160
_ZIP_RECORD_BYTES = 512
_FILE_BYTES = 2 * 4096
_ZIP_FIXED_BYTES = 4096


def _local_shard_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """At least the bytes this rank's part of a model's DCP checkpoint takes: its local shards of the weights
    (a tied weight once) and of the AdamW states, and a file's overhead for each."""
    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's own shard

    weights = {local(tensor).data_ptr(): local(tensor) for tensor in model.state_dict().values()}
    states = [local(value) for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor)]
    return sum(int(tensor.nbytes) for tensor in (*weights.values(), *states)) + 4 * _FILE_BYTES


def checkpoint_bytes(models: dict[str, torch.nn.Module], state: dict[str, Any]) -> int:
    """At least the bytes a checkpoint of `models` and `state` takes on disk: each model's tensors
    (safetensors writes a tied weight once) with their headers, the storages `state` holds (torch.save
    writes a view's whole storage) with their zip records, and the pickled rest of `state` (RNG
    states, counters)."""
    weights = sum(_weights_bytes(model) for model in models.values())
    tensors = nested_tensors(state)
    storages = len({tensor.untyped_storage().data_ptr() for tensor in tensors})
    state_file = (storage_bytes(tensors) + storages * _ZIP_RECORD_BYTES + _ZIP_FIXED_BYTES
                  + len(pickle.dumps(_without_tensors(state), protocol=2)))
    # The checkpoint's folder and each model's, the state file and the step file.
    return weights + state_file + _FILE_BYTES * (len(models) + 3)


def _weights_bytes(model: torch.nn.Module) -> int:
    """A model's model.safetensors (a LoRA model's adapter file): its distinct tensors, and a header entry for
    each name."""
    if is_adapted(model):
        return adapter_state_bytes(model) + 2 * _FILE_BYTES
    state = model.state_dict()
    distinct = {tensor.data_ptr(): tensor for tensor in state.values()}.values()
    config = getattr(model, "config", None)
    # config.json and generation_config.json beside the weights (_save_model_files)
    files = 2 * _FILE_BYTES + len(config.to_json_string()) if config is not None else 0
    return (sum(int(tensor.nbytes) for tensor in distinct) + _FILE_BYTES + files
            + sum(len(name) + _SAFETENSORS_ENTRY_BYTES for name in state))


def _without_tensors(value: Any) -> Any:
    """`value` with each tensor replaced by None: what torch.save pickles besides the storages."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        return {key: _without_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_tensors(item) for item in value]
    return value


def load_checkpoint(path: Path, models: dict[str, torch.nn.Module]) -> dict[str, Any]:
    """Load the weights of `models` from `path` in place and return the saved state."""
    path = Path(path)
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(f"{str(path)!r} is not a complete checkpoint (no {TRAINER_STATE})")
    for role, model in models.items():
        if is_adapted(model):
            _load_adapter(path, role, model)
            continue
        weights = path / role / WEIGHTS
        if not weights.is_file():
            also = (", it holds a LoRA adapter: set the role's model.lora_rank as that run did"
                    if (path / role / ADAPTER_WEIGHTS).is_file() else "; was it written by a run with the same models?")
            raise CheckpointError(f"{str(path)!r} has no weights for the {role}{also}")
        device = next(model.parameters()).device
        try:
            missing, unexpected = load_model(model, str(weights), strict=False, device=str(device))
        except SafetensorError as error:
            raise CheckpointError(f"{str(weights)!r} is damaged ({_one_line(error)}); {_RESUME_EARLIER}") from None
        except RuntimeError as error:
            # Missing or extra tensors are returned, but a tensor of another shape makes torch raise.
            detail = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line),
                          str(error).strip())
            raise CheckpointError(f"the {role} weights in {str(path)!r} do not fit the model ({detail})") from None
        if missing or unexpected:
            raise CheckpointError(f"the {role} weights in {str(path)!r} do not fit the model "
                                  f"(missing {len(missing)}, unexpected {len(unexpected)} tensors)")
    return load_trainer_state(path)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The checkpoint's trainer state (optimizer schedules, data position, RNG...), without the weights."""
    path = Path(path)
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(f"{str(path)!r} is not a complete checkpoint (no {TRAINER_STATE})")
    try:
        # Our own file, holding numpy and Python RNG states that weights_only loading refuses.
        state: dict[str, Any] = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{str(path / TRAINER_STATE)!r} is damaged ({_one_line(error)}); "
                              f"{_RESUME_EARLIER}") from None
    return state


def _load_adapter(path: Path, role: str, model: torch.nn.Module) -> None:
    """Load a LoRA model's adapter from the checkpoint's folder of `role` (the base weights are the model's own)."""
    directory = path / role
    if not (directory / ADAPTER_WEIGHTS).is_file():
        also = (": it holds the whole model, written by a run without LoRA (set the role's model.lora_rank=0 to "
                "resume it)" if (directory / WEIGHTS).is_file() else "; was it written by a run with the same models?")
        raise CheckpointError(f"{str(path)!r} has no LoRA adapter for the {role}{also}")
    try:
        unfit = load_adapter(model, directory)
    except SafetensorError as error:
        raise CheckpointError(f"{str(directory / ADAPTER_WEIGHTS)!r} is damaged ({_one_line(error)}); "
                              f"{_RESUME_EARLIER}") from None
    except RuntimeError as error:
        raise CheckpointError(f"the {role}'s LoRA adapter in {str(path)!r} does not fit the model "
                              f"({_one_line(error)}): were lora_rank and target_modules the same?") from None
    if unfit:
        raise CheckpointError(f"the {role}'s LoRA adapter in {str(path)!r} does not fit the model ({len(unfit)} "
                              f"tensors differ, e.g. {unfit[0]!r}): were lora_rank and target_modules the same?")


def remove_partial_checkpoints(root: Path) -> None:
    """Clear what saves of dead processes left behind; called before a run looks for its latest checkpoint.

    - ``.global_step_N.partial-PID``: a save killed while writing: removed.
    - ``.global_step_N.stale-PID``: the previous copy of a step being saved again. A save killed between
      its two renames leaves this as the only complete copy of step N (``global_step_N`` is then missing):
      it is renamed back into place; otherwise it is removed.
    - ``.latest_checkpointed_iteration.txt.tmp-PID``: the step file of a save killed before its rename: removed.

    Folders of a process still alive are left alone: it may be saving into this run right now (a second
    trainer on the same run directory, or one still shutting down), and its own rename would then fail.
    A dead process's pid taken over by another process keeps its folders until a later start: only disk.
    """
    root = Path(root)
    if not root.is_dir():
        return
    leftovers = sorted((match.group("kind"), path, root / f"global_step_{match.group('step')}")
                       for path in root.iterdir()
                       if (match := _LEFTOVER.match(path.name)) and not _is_alive(int(match.group("pid"))))
    for kind, path, final in leftovers:
        if kind == "stale" and not final.exists() and (path / TRAINER_STATE).is_file():
            os.replace(path, final)
            _fsync_directory(root)
        else:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f".{LATEST_CHECKPOINT_FILE}.tmp-*"):
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and not _is_alive(int(pid)):
            path.unlink(missing_ok=True)


_LEFTOVER = re.compile(r"^\.global_step_(?P<step>\d+)\.(?P<kind>partial|stale)-(?P<pid>\d+)$")


def _is_alive(pid: int) -> bool:
    """Whether another process with this pid exists (this process's own folders are leftovers of an
    earlier process that had the same pid: it is not saving while it clears them)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OverflowError:
        return False  # no such pid can exist
    return True


def _move_into_place(partial: Path, final: Path, step: int) -> None:
    """Rename the complete `partial` folder to `final`; where that fails, `final` is as it was."""
    if final.exists():
        # Re-saving a step (after a resume redid it): swap, so a complete copy exists throughout.
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        os.replace(final, stale)
        try:
            full_disk("rename", step, final)
            os.replace(partial, final)
        except OSError:
            os.replace(stale, final)  # the complete copy goes back where a resume looks for it
            raise
        shutil.rmtree(stale, ignore_errors=True)
    else:
        full_disk("rename", step, final)
        os.replace(partial, final)
    _fsync_directory(final.parent)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())
    for directory in [root, *[path for path in root.rglob("*") if path.is_dir()]]:
        _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ------------------------------------------------------------------------------ several ranks

SHARDED = "dcp"
"""A role's folder in a checkpoint of several ranks: torch.distributed.checkpoint's shards of its weights and
AdamW states, by parameter name (DCP reshards them for any world size on loading)."""


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether `path` was written by several ranks (DCP shards) rather than one (safetensors)."""
    return (Path(path) / "actor" / SHARDED).is_dir()


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter `optimizer` steps, in the order of its state_dict's indices."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    ordered = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise CheckpointError("the optimizer steps a tensor that is not one of the model's parameters")
            ordered.append(names[id(parameter)])
    return ordered


def _optimizer_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """AdamW's states of every parameter, by parameter name (a sharded parameter's as DTensor shards)."""
    named = dict(zip(parameter_names(model, optimizer),
                     (parameter for group in optimizer.param_groups for parameter in group["params"]), strict=True))
    return {name: dict(optimizer.state[parameter]) for name, parameter in named.items()
            if optimizer.state.get(parameter)}


def _empty_optimizer_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            like: Any = None) -> dict[str, dict[str, Any]]:
    """Where DCP loads AdamW's states into: zeros shaped (and sharded) as each trainable parameter, on `like`'s
    device when given (CPU for one rank's optimizer, which casts them on loading), else the parameter's."""
    from trainer.distributed.host_adamw import host_zeros

    on_host = getattr(optimizer, "states_on_cpu", False)  # HostAdamW: the device never holds the moments
    states = {}
    for name, parameter in zip(parameter_names(model, optimizer),
                               (p for group in optimizer.param_groups for p in group["params"]), strict=True):
        def zeros(parameter=parameter) -> torch.Tensor:
            if like is not None:
                return torch.zeros(parameter.shape, dtype=torch.float32, device=like)
            return host_zeros(parameter) if on_host else torch.zeros_like(parameter, dtype=torch.float32)
        states[name] = {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros()}
    return states


def save_sharded_checkpoint(root: Path, step: int, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                            state: dict[str, Any], *, ranks, keep: int | None = None) -> Path:
    """Every rank's shards of `models` (weights and AdamW states, with torch.distributed.checkpoint) and rank 0's
    `state` for `step`, atomically as `save_checkpoint`: all ranks write into rank 0's partial folder, and rank 0
    renames it into place once every rank's part is written. Called by every rank; `ranks` is the run's Ranks."""
    from torch.distributed import checkpoint as dcp

    root = Path(root)
    local = {role: model.state_dict() for role, (model, _) in models.items()}
    problems = [problem for problem in ranks.gather_objects(_nonfinite_problem(step, local, state)) if problem]
    if problems:
        raise NonFiniteCheckpointError(problems[0])
    final = root / f"global_step_{step}"
    partial = root / ranks.broadcast_from_main(f".global_step_{step}.partial-{os.getpid()}")
    failure = shortage = None
    # Every rank's shards go under one folder (rank 0's; on several nodes a shared file system), so their sum
    # is what the disk must hold; tested before a byte is written, as on one rank.
    needed = sum(ranks.gather_objects(sum(_local_shard_bytes(model, optimizer) for model, optimizer in models.values())
                                      + (checkpoint_bytes({}, state) if ranks.is_main else 0)))
    if ranks.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shortage = _no_room(root, step, needed, f"its {ranks.world_size} ranks' shards need")
            if shortage is None:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
        except OSError as error:
            failure = _one_line(error)
    shortage, failure = ranks.broadcast_from_main((shortage, failure))
    if shortage is not None:
        raise CheckpointWriteError(shortage)
    if failure is None:
        try:
            for role, (model, optimizer) in models.items():
                dcp.save({"model": model.state_dict(), "optimizer": _optimizer_states(model, optimizer)},
                         checkpoint_id=partial / role / SHARDED)
            if ranks.is_main:
                torch.save(state, partial / TRAINER_STATE)
                full_disk("write", step, partial / MANIFEST)
                write_manifest(partial)  # dcp.save returns on every rank once all shards are written
                _fsync_tree(partial)
        except (OSError, RuntimeError) as error:  # DCP raises a CheckpointException (a RuntimeError) on every rank
            failure = _one_line(error)
    failures = [message for message in ranks.gather_objects(failure) if message is not None]
    if failures:
        if ranks.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(f"could not write the checkpoint of step {step} to {str(root)!r} ({failures[0]})")
    moved: CheckpointWriteError | None = None
    if ranks.is_main:
        try:
            _move_into_place(partial, final, step)  # a rename too can meet a full disk
        except OSError as error:
            moved = _write_failure(f"the checkpoint of step {step}", root, partial, needed, error)
        else:
            try:
                _write_atomically(root / LATEST_CHECKPOINT_FILE, f"{step}\n")
            except OSError as error:
                moved = CheckpointWriteError(f"the checkpoint of step {step} is complete in {str(final)!r}, but "
                                             f"{LATEST_CHECKPOINT_FILE} could not be updated ({_one_line(error)})")
            else:
                for _, old in list_checkpoints(root)[:-keep] if keep is not None else []:
                    shutil.rmtree(old, ignore_errors=True)
    # No rank goes on (and may be killed) before the checkpoint is in place, and every rank raises rank 0's failure.
    message = ranks.broadcast_from_main(None if moved is None else str(moved))
    if message is not None:
        raise CheckpointWriteError(message)
    return final


def _nonfinite_problem(step: int, local: dict[str, Any], state: dict[str, Any]) -> str | None:
    """This rank's refusal of non-finite shards (every rank checks its own and all agree on the first one)."""
    try:
        refuse_nonfinite(step, {**local, "trainer_state": state})
    except NonFiniteCheckpointError as error:
        return str(error)
    return None


def load_sharded_into_sharded(path: Path, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> None:
    """A checkpoint of any number of ranks into models sharded over this run's ranks (DCP reshards)."""
    from torch.distributed import checkpoint as dcp

    for role, (model, optimizer) in models.items():
        target = {"model": model.state_dict(), "optimizer": _empty_optimizer_states(model, optimizer)}
        dcp.load(target, checkpoint_id=_sharded_folder(path, role))
        _set_optimizer_states(model, optimizer, target["optimizer"])


def load_sharded_into_single(path: Path, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> None:
    """A checkpoint of several ranks into one process's whole models (DCP needs no process group there)."""
    from torch.distributed import checkpoint as dcp

    for role, (model, optimizer) in models.items():
        weights = {name: torch.empty(tensor.shape, dtype=tensor.dtype) for name, tensor in model.state_dict().items()}
        target = {"model": weights, "optimizer": _empty_optimizer_states(model, optimizer, like="cpu")}
        dcp.load(target, checkpoint_id=_sharded_folder(path, role), no_dist=True)
        model.load_state_dict(target["model"])
        names = parameter_names(model, optimizer)
        loaded = target["optimizer"]
        optimizer.load_state_dict({"state": {index: loaded[name] for index, name in enumerate(names)},
                                   "param_groups": optimizer.state_dict()["param_groups"]})


def load_single_into_sharded(path: Path, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                             optimizer_states: dict[str, dict[str, Any]]) -> None:
    """A one-rank checkpoint (safetensors weights, index-keyed AdamW states with their parameter names in
    `optimizer_states[role]`) into models sharded over this run's ranks: each rank reads the whole and keeps
    its shards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    from trainer.distributed.host_adamw import shard_like

    for role, (model, optimizer) in models.items():
        names = adapter_file_names(model.state_dict())  # LoRA: the model the run trains holds its layers
        adapted = bool(names) and (path / role / ADAPTER_WEIGHTS).is_file()
        weights = path / role / (ADAPTER_WEIGHTS if adapted else WEIGHTS)
        if not weights.is_file():
            raise CheckpointError(f"{str(path)!r} has no weights for the {role}")
        if adapted:
            # A LoRA run's one-rank checkpoint holds the adapter alone (peft's names); the frozen base weights are
            # the model's own, loaded from its path by every rank before it was sharded.
            full = {names[name]: tensor for name, tensor in load_file(str(weights)).items() if name in names}
            wanted = set(names.values())
        else:
            full = _with_tied_names(model, load_file(str(weights)))
            wanted = set(model.state_dict())
        missing = sorted(wanted - set(full))
        if missing:
            raise CheckpointError(f"the {role} weights in {str(path)!r} do not fit the model (no {missing[0]!r})")
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=not adapted))
        saved = optimizer_states[role]
        if "parameter_names" not in saved:
            raise CheckpointError(f"{str(path)!r} predates the parameter names a resume on several ranks needs; "
                                  f"resume it on one rank ({KEYS.trainer.n_gpus_per_node}=1)")
        by_name = dict(zip(saved["parameter_names"], (saved["optimizer"]["state"].get(index) for index in
                                                      range(len(saved["parameter_names"]))), strict=True))
        states = {}
        for name, parameter in zip(parameter_names(model, optimizer),
                                   (p for group in optimizer.param_groups for p in group["params"]), strict=True):
            one = by_name.get(name)
            if one is None:
                continue
            assert isinstance(parameter, DTensor)
            # Where the optimizer keeps its states: the parameter's device, or the CPU (HostAdamW's).
            device = torch.device("cpu") if getattr(optimizer, "states_on_cpu", False) else parameter.to_local().device

            def shard(tensor: torch.Tensor, parameter=parameter, device=device) -> torch.Tensor:
                spread = distribute_tensor(tensor.detach().to(torch.float32).cpu(), parameter.device_mesh,
                                           parameter.placements)
                return shard_like(spread.to_local().to(device), parameter)
            states[name] = {"step": one["step"].detach().float().cpu(), "exp_avg": shard(one["exp_avg"]),
                            "exp_avg_sq": shard(one["exp_avg_sq"])}
        _set_optimizer_states(model, optimizer, states)


def adapter_file_names(names: Iterable[str]) -> dict[str, str]:
    """Of a model's state-dict `names` (a model that holds a LoRA adapter's layers: the model peft wraps), each
    adapter tensor's name by its name in the adapter's file: peft saves `base_model.model.<name>` without the
    adapter's name (`...q_proj.lora_A.weight` for `...q_proj.lora_A.default.weight`, and `...score.weight` for the
    value head it trains whole, `...score.modules_to_save.default.weight`). Empty for a model without an adapter."""
    found = {}
    for name in names:
        saved = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
        if saved == name:
            saved = re.sub(r"(\.lora_[A-Za-z_]+)\.[^.]+\.", r"\1.", name)
        if saved != name:
            found[f"base_model.model.{saved}"] = name
    return found


def _with_tied_names(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors' save_model writes a tied weight (a head sharing the embedding) once: `weights` with each
    tied name given its twin's tensor."""
    by_parameter: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_parameter.setdefault(id(parameter), []).append(name)
    completed = dict(weights)
    for names in by_parameter.values():
        saved = next((name for name in names if name in weights), None)
        for name in names:
            if saved is not None and name not in completed:
                completed[name] = weights[saved]
    return completed


def _set_optimizer_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          states: dict[str, dict[str, Any]]) -> None:
    for name, parameter in zip(parameter_names(model, optimizer),
                               (p for group in optimizer.param_groups for p in group["params"]), strict=True):
        if name in states:
            optimizer.state[parameter] = states[name]


def _sharded_folder(path: Path, role: str) -> Path:
    folder = Path(path) / role / SHARDED
    if not folder.is_dir():
        raise CheckpointError(f"{str(path)!r} has no weights for the {role}; was it written by a run with the same "
                              "models?")
    return folder
