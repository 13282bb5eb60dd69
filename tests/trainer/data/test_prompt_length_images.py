"""data.max_prompt_length counts a vision-language prompt as the model sees it: each <image> written as its image's
vision tokens (as verl's dataset counts a prompt through the processor), at start, in the trainer and in --check."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from trainer.check import check_run
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.models import load_tokenizer
from trainer.rollout.prompts import PromptTooLong, prompt_token_ids

PROMPT = [{"role": "user", "content": "<image> : ="}]


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def write_rows(path: Path, sizes: list[tuple[int, int]]) -> Path:
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "arithmetic", "prompt": PROMPT, "images": [{"bytes": png(*size)}],
         "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": index}}
        for index, size in enumerate(sizes)]), path)
    return path


def text_length() -> int:
    """The prompt's tokens with <image> as its one token, as the check counted it before."""
    return len(prompt_token_ids(PROMPT, load_tokenizer("builtin:tiny-qwen2-vl")))


def config_of(tmp_path: Path, sizes: list[tuple[int, int]], max_prompt_length: int, *overrides: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_rows(tmp_path / "train.parquet", sizes)
    return load_config(None, [
        "actor_rollout_ref.model.path=builtin:tiny-qwen2-vl", f"data.train_files=[{data}]", "data.image_key=images",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"data.max_prompt_length={max_prompt_length}", "data.max_response_length=2", "trainer.device=cpu",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", f"trainer.runs_dir={tmp_path}", *overrides])


# The tiny model's processor: 56 x 56 pixels are 4 x 4 patches of 14, merged 2 x 2 into 4 tokens; 112 x 112 into 16;
# 56 x 112 into 8. An image is written <|vision_start|>, its tokens, <|vision_end|>: its tokens + 2 in place of one.
SMALL, TALL, LARGE = (56, 56), (56, 112), (112, 112)


def test_filtering_drops_the_prompts_whose_image_tokens_do_not_fit(tmp_path: Path) -> None:
    fits_small = text_length() - 1 + 2 + 4
    trainer = Trainer(config_of(tmp_path, [SMALL, LARGE, TALL, SMALL], fits_small,
                                "data.filter_overlong_prompts=true"), log=lambda *_: None)
    # Only the two rows of 56 x 56 images fit; as text all four would (each is text_length() <= fits_small).
    assert [record.extra_info["index"] for record in trainer.records] == [0, 3]


def test_the_tall_image_counts_its_eight_tokens(tmp_path: Path) -> None:
    fits_tall = text_length() - 1 + 2 + 8
    trainer = Trainer(config_of(tmp_path, [SMALL, LARGE, TALL], fits_tall, "data.filter_overlong_prompts=true"),
                      log=lambda *_: None)
    assert [record.extra_info["index"] for record in trainer.records] == [0, 2]


def test_a_prompt_over_the_length_with_its_image_tokens_is_refused_at_start(tmp_path: Path) -> None:
    tokens = text_length() - 1 + 2 + 16
    with pytest.raises(PromptTooLong, match=rf"row 1: the prompt has {tokens} tokens \(its images' vision tokens "
                                            rf"included\), more than data.max_prompt_length={tokens - 1}"):
        Trainer(config_of(tmp_path, [SMALL, LARGE], tokens - 1), log=lambda *_: None)
    # Exactly its length fits, and the run starts.
    Trainer(config_of(tmp_path / "fits", [SMALL, LARGE], tokens), log=lambda *_: None)


def test_the_check_counts_the_image_tokens_too(tmp_path: Path) -> None:
    length = text_length() - 1 + 2 + 4
    assert check_run(config_of(tmp_path, [SMALL], length)) == []
    [problem] = check_run(config_of(tmp_path / "over", [LARGE], length))
    assert f"the prompt has {length + 12} tokens (its images' vision tokens included)" in problem
    [problem] = check_run(config_of(tmp_path / "all", [LARGE], length, "data.filter_overlong_prompts=true"))
    assert "data.train_files: every prompt is longer than data.max_prompt_length" in problem
