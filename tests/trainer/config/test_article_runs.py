"""The article's configuration ("verl CPU offloading实战") trains as it is, with only the model path changed to the
built-in tiny model, on the CPU: its §2.2 to §4.2 on one rank, and the whole of examples/ppo_qwen2_7b.yaml (§4.3's
two ranks sharing each sequence included) on two. The start of each run prints the article's offload summary.
(What each snippet sets: test_article.py.)"""

from __future__ import annotations

import json
import math
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.trainer.config.test_article import (
    EXAMPLE,
    SECTION_3_1,
    SECTION_3_2,
    SECTION_4_1,
    SECTION_4_2,
    TINY,
    placed,
)
from tests.trainer.distributed.test_ranks import rank_environment, trainer_command

# One short PPO step (the article's algorithm: verl's default, GAE with a critic) on a handful of prompts.
SMALL = [TINY, "trainer.device=cpu", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=8",
         "data.max_response_length=4", "trainer.total_training_steps=1", "trainer.save_freq=-1"]
ARTICLE_WORDS = ("FSDP Offload Summary", "OFFLOADED to CPU", "Total GPU Memory Saved")


def run(config: Path, ranks: int, runs_dir: Path, name: str) -> tuple[str, list[dict]]:
    """The trainer on `ranks` CPU ranks with `config` as it is: its log, its metrics."""
    command = [*trainer_command(ranks, config), *SMALL, f"trainer.n_gpus_per_node={ranks}",
               f"trainer.runs_dir={runs_dir}", f"trainer.experiment_name={name}"]
    finished = subprocess.run(command, env=rank_environment(), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-4000:]
    log = (runs_dir / name / "logs" / "trainer.log").read_text(encoding="utf-8")
    metrics = [json.loads(line) for line in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    return log, metrics


def trained(metrics: list[dict]) -> dict:
    [step] = [row for row in metrics if row["step"] == 1 and "actor/pg_loss" in row]
    assert all(math.isfinite(step[key]) for key in ("actor/pg_loss", "critic/vf_loss", "critic/score/mean"))
    return step


@pytest.mark.slow
def test_the_articles_snippets_train_on_one_rank(tmp_path: Path) -> None:
    """§2.2 to §4.2 verbatim (§4.3's degree of 2 needs two ranks, as verl's device mesh does)."""
    config = tmp_path / "article.yaml"
    config.write_text("actor_rollout_ref:\n" + "".join(textwrap.indent(text, "  ") for text in (
        SECTION_3_2, placed(SECTION_3_1, "actor"), SECTION_4_2)) + SECTION_4_1, encoding="utf-8")
    log, metrics = run(config, 1, tmp_path / "runs", "one")
    trained(metrics)
    assert all(words in log for words in ARTICLE_WORDS), log[:3000]
    assert "actor: Embedding: OFFLOADED to CPU" in log and "actor: LM head: OFFLOADED to CPU" in log
    assert "actor: Transformer (2 layers): KEPT on the compute device, the CPU" in log
    assert "critic: Embedding: OFFLOADED to CPU" in log


@pytest.mark.slow
def test_the_articles_whole_config_trains_on_two_ranks(tmp_path: Path) -> None:
    log, metrics = run(EXAMPLE, 2, tmp_path / "runs", "two")
    trained(metrics)
    assert all(words in log for words in ARTICLE_WORDS), log[:3000]
    assert "actor: Ulysses sequence parallelism: each of the 2 ranks of a group computes 1/2" in log, \
        "§4.3: the two ranks share each sequence"
