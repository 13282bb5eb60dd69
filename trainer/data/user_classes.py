"""verl's data classes of one's own: a dataset class (data.custom_cls) and a sampler (data.sampler), loaded and
built as verl builds them (verl/trainer/main_ppo.py: create_rl_dataset, create_rl_sampler), a curriculum sampler
updated after each step with the step's batch, as verl's trainer updates it (ray_trainer.py: fit).

A dataset's items are rows in verl's layout (data_source, the prompt's messages as raw_prompt or under
data.prompt_key, reward_model, extra_info), read into PromptRecords as the data files' rows are.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from trainer.config import KEYS, RunConfig
from trainer.config.environment import FILE_PREFIX, PACKAGE_PREFIX
from trainer.data.records import DataError, PromptRecord, check_ground_truths, load_records, record_of_row
from trainer.data.sampler import PromptSampler
from trainer.errors import RunSetupError, UserError


class UserClassError(UserError):
    """A user's dataset class or sampler cannot be loaded or built; the message is one line naming the key."""


def load_user_class(path: str, name: str, key: str) -> Any:
    """The object `name` of `path` (a Python file, file://FILE, or pkg://module as verl's load_extern_object reads
    them); any failure one line naming `key`."""
    try:
        if path.startswith(PACKAGE_PREFIX):
            module = importlib.import_module(path.removeprefix(PACKAGE_PREFIX).replace("/", "."))
        else:
            file = Path(path.removeprefix(FILE_PREFIX)).expanduser()
            spec = importlib.util.spec_from_file_location(f"user_class_{uuid.uuid4().hex}", file)
            if spec is None or spec.loader is None or not file.is_file():
                raise UserClassError(f"{key}: got {path!r}, which is not a Python file; allowed: a .py file, or "
                                     "pkg://a.module")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except UserClassError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises, said in one line
        raise UserClassError(f"{key}: importing {path!r} raised {_one_line(error)}") from None
    if not hasattr(module, name):
        raise UserClassError(f"{key}: {path!r} has no {name!r}; set the name key to a class it defines")
    return getattr(module, name)


# ------------------------------------------------------------------------------------------ the dataset


def read_records(config: RunConfig, files: Sequence[str], tokenizer: Any, *,
                 require_ground_truth: bool) -> list[PromptRecord]:
    """The prompts of `files`: read by data.custom_cls where it is set, else as verl's parquet or JSONL."""
    data = config.data
    if data.custom_cls.path is None or data.custom_cls.name is None or not files:
        return load_records(files, data.prompt_key, require_ground_truth=require_ground_truth,
                            image_key=data.image_key)
    records = dataset_records(config, files, tokenizer)
    if require_ground_truth:
        check_ground_truths(records)
    return records


def dataset_records(config: RunConfig, files: Sequence[str], tokenizer: Any) -> list[PromptRecord]:
    """Each item of the user's dataset, built as verl builds it: cls(data_files=, tokenizer=, processor=None,
    config=data as an OmegaConf DictConfig), and max_samples=-1 (all) where the class takes it."""
    custom = config.data.custom_cls
    assert custom.path is not None and custom.name is not None
    dataset_class = load_user_class(custom.path, custom.name, KEYS.data.custom_cls.path)
    name_key = KEYS.data.custom_cls.name
    if not (isinstance(dataset_class, type) and issubclass(dataset_class, torch.utils.data.Dataset)):
        raise UserClassError(f"{name_key}: {custom.name!r} of {custom.path!r} is not a torch.utils.data.Dataset "
                             "subclass (verl requires one)")
    arguments: dict[str, Any] = {"data_files": list(files), "tokenizer": tokenizer, "processor": None,
                                 "config": OmegaConf.create(config.data.model_dump(mode="json"))}
    if "max_samples" in inspect.signature(dataset_class).parameters:
        arguments["max_samples"] = -1
    try:
        dataset = dataset_class(**arguments)
        items = [dataset[index] for index in range(len(dataset))]
    except Exception as error:  # noqa: BLE001 - the user's class, said in one line
        raise UserClassError(f"{name_key}: {custom.name}(data_files=..., tokenizer=..., processor=None, config=...) "
                             f"raised {_one_line(error)}") from None
    if not items:
        raise DataError(f"{name_key}: {custom.name} of {list(files)} has no items")
    return [_record(item, f"{custom.name} item {index}", config.data.prompt_key) for index, item in enumerate(items)]


def _record(item: Any, where: str, prompt_key: str) -> PromptRecord:
    if not isinstance(item, dict):
        raise DataError(f"{where}: must be a dict in verl's layout (data_source, prompt, reward_model, "
                        f"extra_info), got {type(item).__name__}")
    row = {key: _plain(value) for key, value in item.items() if not isinstance(value, torch.Tensor)}
    if "raw_prompt" in row:  # verl's RLHFDataset puts the prompt's messages there
        row[prompt_key] = row["raw_prompt"]
    return record_of_row(row, where, prompt_key)


def _plain(value: Any) -> Any:
    """numpy's arrays and scalars (a pandas row's) as lists and Python numbers."""
    if isinstance(value, np.ndarray):
        return [_plain(item) for item in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


# ------------------------------------------------------------------------------------------ the sampler


class UserSampler:
    """A user's sampler (data.sampler) in the place of PromptSampler: batches of data.train_batch_size of the
    indices it yields, drop-last, a fresh pass over it each epoch, drawn lazily (a curriculum's update(batch) after
    a step orders the batches after it, as verl's loader with no workers draws them).

    A checkpoint keeps the epoch, the batches taken in it and, where the sampler has them, its own state_dict (as
    verl's StatefulDataLoader keeps a stateful sampler's); a resume restores that state and skips the batches
    already taken in the epoch. On several ranks rank 0's sampler orders the run, and its update sees rank 0's
    share of the step."""

    def __init__(self, sampler: Any, batch_size: int, name: str,
                 agree: Callable[[list[int]], list[int]] | None = None):
        self.sampler, self.batch_size, self.name = sampler, batch_size, name
        self.agree = agree
        self.epoch = 0
        self.position = 0
        self._iterator: Iterator[Any] | None = None
        if self.steps_per_epoch < 1:
            raise UserClassError(f"{KEYS.data.sampler.class_name}: {name} yields {len(sampler)} indices, fewer than "
                                 f"one batch of {KEYS.data.train_batch_size}={batch_size}")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sampler) // self.batch_size

    def next_batch(self) -> list[int]:
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
            self._iterator = None
        if self._iterator is None:
            self._iterator = iter(self.sampler)
            for _ in range(self.position * self.batch_size):  # a resume: the batches taken before the save
                next(self._iterator)
        batch = [int(next(self._iterator)) for _ in range(self.batch_size)]
        self.position += 1
        # Several ranks: rank 0's sampler orders the run (verl's one driver samples), whatever the others drew.
        return batch if self.agree is None else self.agree(batch)

    def update(self, batch: Any) -> None:
        """A curriculum sampler's update with the step's batch, in verl's DataProto layout (StepBatch)."""
        if callable(getattr(self.sampler, "update", None)):
            self.sampler.update(batch=StepBatch(batch))

    def state_dict(self) -> dict[str, Any]:
        own = self.sampler.state_dict() if callable(getattr(self.sampler, "state_dict", None)) else None
        return {"epoch": self.epoch, "position": self.position, "sampler": self.name, "sampler_state": own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sampler") != self.name:
            raise ValueError(f"the checkpoint's prompt order was {state.get('sampler', 'data.shuffle')}'s, this run's "
                             f"is {self.name}'s: resume with the same {KEYS.data.sampler}")
        if state["sampler_state"] is not None and callable(getattr(self.sampler, "load_state_dict", None)):
            self.sampler.load_state_dict(state["sampler_state"])
        self.epoch, self.position, self._iterator = state["epoch"], state["position"], None


class StepBatch:
    """A step's batch as verl's curriculum samplers read it (a DataProto's batch, non_tensor_batch and meta_info,
    by verl's names)."""

    _TENSORS = {"prompts": "prompt_ids", "responses": "response_ids", "response_mask": "response_mask",
                "input_ids": "input_ids", "attention_mask": "attention_mask", "old_log_probs": "old_log_probs",
                "ref_log_prob": "ref_log_probs", "values": "values", "token_level_scores": "token_level_scores",
                "token_level_rewards": "token_level_rewards", "advantages": "advantages", "returns": "returns",
                "rollout_log_probs": "rollout_log_probs"}

    def __init__(self, batch: Any):
        self.batch = {name: getattr(batch, field) for name, field in self._TENSORS.items()
                      if getattr(batch, field) is not None}
        records = batch.records
        self.non_tensor_batch = {
            "data_source": np.array([record.data_source for record in records], dtype=object),
            "reward_model": np.array([{"ground_truth": record.ground_truth} for record in records], dtype=object),
            "extra_info": np.array([record.extra_info for record in records], dtype=object),
            "uid": np.array([str(int(index)) for index in batch.group_index], dtype=object)}
        self.meta_info: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.non_tensor_batch["uid"])


def prompt_sampler(config: RunConfig, records: Sequence[PromptRecord],
                   agree: Callable[[list[int]], list[int]] | None = None) -> PromptSampler | UserSampler:
    """The order prompts are taken in: data.sampler's, built as verl builds it (cls(data_source=, data_config=)),
    or data.shuffle's. `agree`: rank 0's batch on every rank (Ranks.broadcast_from_main), for a user's sampler,
    whose order may follow what each rank's update saw."""
    data = config.data
    try:
        if data.sampler.class_path is None or data.sampler.class_name is None:
            return PromptSampler(len(records), data.train_batch_size, shuffle=data.shuffle,
                                 seed=config.prompt_order_seed)
    except ValueError as error:
        raise RunSetupError(str(error)) from None
    sampler_class = load_user_class(data.sampler.class_path, data.sampler.class_name, KEYS.data.sampler.class_path)
    try:
        sampler = sampler_class(data_source=list(records), data_config=OmegaConf.create(data.model_dump(mode="json")))
        len(sampler)
    except Exception as error:  # noqa: BLE001 - the user's class, said in one line
        raise UserClassError(f"{KEYS.data.sampler.class_name}: {data.sampler.class_name}(data_source=..., "
                             f"data_config=...) raised {_one_line(error)}") from None
    return UserSampler(sampler, data.train_batch_size, data.sampler.class_name, agree=agree)


def _one_line(error: BaseException) -> str:
    detail = " ".join(str(error).split())
    return f"{type(error).__name__}: {detail[:300]}" if detail else type(error).__name__
