"""verl's geo3k layout: a row's images column (data.image_key) read with its prompt."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data import DataError, load_records


def write(path: Path, images: object, column: str = "images") -> Path:
    pq.write_table(pa.Table.from_pylist([{"data_source": "arithmetic", "prompt": "<image> =", column: images,
                                          "reward_model": {"style": "rule", "ground_truth": "1"}}]), path)
    return path


def test_the_images_column_comes_with_its_prompt(tmp_path: Path) -> None:
    [record] = load_records([str(write(tmp_path / "train.parquet", [{"bytes": b"\x89PNG...", "path": None}]))])
    assert [image["bytes"] for image in record.images] == [b"\x89PNG..."]


def test_the_column_is_the_one_image_key_names(tmp_path: Path) -> None:
    file = str(write(tmp_path / "train.parquet", ["a.png", "b.png"], column="pictures"))
    assert load_records([file], image_key="pictures")[0].images == ("a.png", "b.png")
    assert load_records([file])[0].images == ()  # no `images` column: a text row


def test_an_image_of_another_type_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"row 0: images holds .*allowed: a list of \{'bytes'"):
        load_records([str(write(tmp_path / "train.parquet", [7]))])
