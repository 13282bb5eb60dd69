"""Prompt records in verl's dataset layout, read from and written to parquet or JSONL.

One row per prompt: ``data_source`` (str), ``prompt`` (chat messages ``[{"role", "content"}]`` or,
as our extension, a plain string), ``ability`` (optional), ``reward_model`` (``{"style": "rule",
"ground_truth": ...}``) and ``extra_info`` (optional dict). Every problem with a file is a
``DataError`` whose message is one line naming the file, the row and the column.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trainer.config import BUILTIN_PREFIX, DATA_FILE_SUFFIXES, KEYS
from trainer.errors import UserError

PARQUET_SUFFIX = ".parquet"
JSONL_SUFFIXES = tuple(suffix for suffix in DATA_FILE_SUFFIXES if suffix != PARQUET_SUFFIX)

Prompt = str | list[dict[str, str]]


class DataError(UserError):
    """A data file cannot be used; the message is one line that says where and why."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and what its responses are scored against."""

    prompt: Prompt
    data_source: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)
    """Where the record was read ("data file 'train.jsonl' line 3"), for error messages."""
    images: tuple[Any, ...] = field(default=(), compare=False)
    """The row's images (data.image_key: {'bytes': PNG} or paths), one per <image> in the prompt; () for a text row."""


def load_records(files: Iterable[str], prompt_key: str = "prompt", *,
                 require_ground_truth: bool = False, image_key: str = "images") -> list[PromptRecord]:
    """All records of ``files`` in order; ``builtin:NAME`` stands for a built-in dataset.

    `require_ground_truth`: every row must carry ``reward_model.ground_truth`` (the built-in rule
    scorers compare the response with it; without it every response would score 0).
    """
    records: list[PromptRecord] = []
    for file in files:
        if file.startswith(BUILTIN_PREFIX):
            records += _builtin_records(file)
        else:
            records += _read_file(file, prompt_key, image_key)
    if require_ground_truth:
        check_ground_truths(records)
    return records


def sample_records(records: list[PromptRecord], max_samples: int, *, shuffle: bool, seed: int) -> list[PromptRecord]:
    """At most `max_samples` of `records` (-1 or more than there are: all of them), as verl's RLHFDataset takes them:
    with `shuffle`, numpy's default_rng(seed).choice of that many without replacement, in the order drawn; else the
    first ones. verl draws unseeded when data.seed is null; here the seed is always set (data.seed, else
    trainer.seed), so that a resumed run reads the same prompts."""
    if max_samples < 0 or max_samples >= len(records):
        return records
    if not shuffle:
        return records[:max_samples]
    import numpy as np  # torch's dependency; verl draws with numpy, so the same seed takes the same rows

    chosen = np.random.default_rng(seed).choice(len(records), size=max_samples, replace=False)
    return [records[int(index)] for index in chosen]


def check_ground_truths(records: Iterable[PromptRecord]) -> None:
    """Every record carries reward_model.ground_truth, which the built-in rule scorers compare each response with."""
    for record in records:
        if record.ground_truth is None:
            raise DataError(f"{record.source}: reward_model.ground_truth is missing, but the built-in scorer "
                            f"for data_source {record.data_source!r} compares each response with it; "
                            "allowed: reward_model: {'style': 'rule', 'ground_truth': ...}, or score with "
                            f"{KEYS.custom_reward_function.path} or a reward model ({KEYS.reward_model.enable})")


def write_records(records: Iterable[PromptRecord], path: str | Path) -> None:
    """Write ``records`` in verl's layout: parquet for a ``.parquet`` path, JSONL for .jsonl or .json.

    Parquet stores ``extra_info`` as one struct column, so a key that only some rows have
    comes back as None in the others; JSONL keeps every row as written.
    """
    path = Path(path)
    rows = [_to_row(record) for record in records]
    if path.suffix == PARQUET_SUFFIX:
        _write_parquet(rows, path)
    elif path.suffix in JSONL_SUFFIXES:
        with path.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        raise DataError(f"cannot write {str(path)!r}: unknown format; allowed: "
                        f"{PARQUET_SUFFIX}, {', '.join(JSONL_SUFFIXES)}")


# ------------------------------------------------------------------------------------- reading


def _builtin_records(file: str) -> list[PromptRecord]:
    # builtin.py builds PromptRecords, so it imports this module and not the other way round.
    from trainer.data.builtin import BUILTIN_DATASETS

    name = file.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_DATASETS:
        allowed = ", ".join(BUILTIN_PREFIX + known for known in BUILTIN_DATASETS)
        raise DataError(f"{file!r} is not a built-in dataset; allowed: {allowed}")
    return BUILTIN_DATASETS[name]()


def _read_file(file: str, prompt_key: str, image_key: str = "images") -> list[PromptRecord]:
    path = Path(file).expanduser()
    name = f"data file {file!r}"
    if path.is_dir():
        raise DataError(f"{name} is a directory; allowed: {', '.join(DATA_FILE_SUFFIXES)} files (list each "
                        "file of a folder of shards)")
    if path.suffix not in (PARQUET_SUFFIX, *JSONL_SUFFIXES):
        raise DataError(f"{name} has an unknown format; allowed: {', '.join(DATA_FILE_SUFFIXES)} files "
                        f"or {BUILTIN_PREFIX}NAME")
    if not path.is_file():
        raise DataError(f"{name} does not exist")
    if path.stat().st_size == 0:
        raise DataError(f"{name} is empty (0 bytes)")
    rows = _parquet_rows(path, name, prompt_key) if path.suffix == PARQUET_SUFFIX else _jsonl_rows(path, name)
    records = [record_of_row(row, where, prompt_key, image_key) for where, row in rows]
    if not records:
        raise DataError(f"{name} has no rows")
    return records


def _parquet_rows(path: Path, name: str, prompt_key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{name} is not a readable parquet file ({_one_line(error)})") from None
    for column in (prompt_key, "data_source"):
        if column not in table.column_names:
            raise DataError(f"{name} has no column {column!r} (columns: {', '.join(table.column_names)}); "
                            + _COLUMN_HINTS[column])
    # Row numbers count from 0, as pandas and pyarrow index them.
    return ((f"{name} row {index}", row) for index, row in enumerate(table.to_pylist()))


def _jsonl_rows(path: Path, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DataError(f"{name} is not UTF-8 text ({_one_line(error)})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: must be a JSON object (one row per line), got {_type_name(row)}")
        yield where, row


_COLUMN_HINTS = {
    "prompt": f"set {KEYS.data.prompt_key} to the column that holds the prompt",
    "data_source": "every row needs the name of its dataset, which picks the reward function",
}


def record_of_row(row: dict[str, Any], where: str, prompt_key: str, image_key: str = "images") -> PromptRecord:
    """One row in verl's layout (`where` names it in errors) as a PromptRecord."""
    for column in (prompt_key, "data_source"):
        if column not in row:
            hint = _COLUMN_HINTS["prompt" if column == prompt_key else column]
            raise DataError(f"{where} has no key {column!r} (keys: {', '.join(row)}); {hint}")
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        got = "an empty string" if data_source == "" else _type_name(data_source)
        raise DataError(f"{where}: data_source must be a non-empty string, got {got}")
    return PromptRecord(
        prompt=_check_prompt(row[prompt_key], where, prompt_key),
        data_source=data_source,
        ground_truth=_ground_truth(row.get("reward_model"), where),
        extra_info=_extra_info(row.get("extra_info"), where),
        source=where,
        images=_images(row.get(image_key), where, image_key),
    )


def _images(images: Any, where: str, image_key: str) -> tuple[Any, ...]:
    """A row's images as verl's geo3k layout holds them (a list, or one); None: no images."""
    if images is None:
        return ()
    images = images if isinstance(images, list | tuple) else [images]
    for image in images:
        if not isinstance(image, dict | bytes | str):
            raise DataError(f"{where}: {image_key} holds {_type_name(image)}; allowed: a list of {{'bytes': PNG or "
                            "JPEG bytes}, bytes or paths")
    return tuple(images)


def _check_prompt(prompt: Any, where: str, prompt_key: str) -> Prompt:
    problem = f"{where}: {prompt_key} must be a string or a list of {{role, content}} messages, got "
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(problem + "an empty string")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(problem + ("an empty list" if isinstance(prompt, list) else _type_name(prompt)))
    messages = []
    for index, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(f"{problem}{_type_name(message)} as message {index}")
        # Parquet stores messages as one struct type, so a key only some messages carry is None in the rest.
        message = {key: value for key, value in message.items() if value is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(f"{problem}message {index} with {key} {_describe(message.get(key))}")
        messages.append(message)
    return messages


def _ground_truth(reward_model: Any, where: str) -> Any:
    if reward_model is None:
        return None
    if not isinstance(reward_model, dict):
        raise DataError(f"{where}: reward_model must be a dict like "
                        f"{{'style': 'rule', 'ground_truth': ...}}, got {_type_name(reward_model)}")
    # verl's style "model" rows are scored by a reward model and need no ground truth; any other row
    # that names a reward_model but no ground truth (`{}`) would be scored against None.
    if "ground_truth" not in reward_model and reward_model.get("style") != "model":
        raise DataError(f"{where}: reward_model has no 'ground_truth' (got {_excerpt(reward_model)}); allowed: "
                        "{'style': 'rule', 'ground_truth': ...}, or {'style': 'model'} for a reward model")
    return reward_model.get("ground_truth")


def _extra_info(extra_info: Any, where: str) -> dict[str, Any]:
    if extra_info is None:
        return {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: extra_info must be a dict or absent, got {_type_name(extra_info)}")
    return extra_info


def _excerpt(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    return "missing" if value is None else f"{value!r} ({_type_name(value)})"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# ------------------------------------------------------------------------------------- writing


def _to_row(record: PromptRecord) -> dict[str, Any]:
    return {
        "data_source": record.data_source,
        "prompt": record.prompt,
        "reward_model": {"style": "rule", "ground_truth": record.ground_truth},
        # Parquet cannot store a struct without fields, so an empty extra_info is written as null.
        "extra_info": record.extra_info or None,
    }


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        table = pa.Table.from_pylist(rows)
    except pa.ArrowException as error:
        raise DataError(f"cannot write {str(path)!r} as parquet: the rows do not share one type per column "
                        f"({_one_line(error)}); write JSONL instead") from None
    pq.write_table(table, path)
