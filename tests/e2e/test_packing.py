"""verl's use_remove_padding and use_dynamic_bsz through the real `verl train`: a run with both gives the
first step's gradient norms of the padded run with fixed micro-batches, and a budget that cannot hold a
sequence is one error line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.runs import QUICKSTART, VERL

SMALL = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.device=cpu",
         "trainer.total_training_steps=1", "trainer.save_freq=-1"]
# Prompts of up to 8 tokens and responses of up to 8: 32 tokens hold two to four sequences.
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
          "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32",
          "critic.ppo_max_token_len_per_gpu=32"]


def verl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VERL), *args], cwd=cwd, capture_output=True, text=True, timeout=180)


def first_step(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, dict]:
    result = verl("train", "--config", QUICKSTART, *SMALL, f"trainer.experiment_name={name}", *overrides,
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / name
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return row, yaml.safe_load((run / "config.yaml").read_text())


@pytest.mark.slow
def test_a_padding_free_run_by_token_budget_gives_the_padded_runs_gradients(tmp_path):
    padded, _ = first_step(tmp_path, "padded")
    packed, config = first_step(tmp_path, "packed", *PACKED)
    # The same rollout (nothing trained before it), the same gradient of each whole mini-batch.
    assert packed["critic/score/mean"] == padded["critic/score/mean"]
    assert packed["actor/grad_norm"] == pytest.approx(padded["actor/grad_norm"], rel=1e-4)
    assert packed["critic/grad_norm"] == pytest.approx(padded["critic/grad_norm"], rel=1e-4)
    # The log-prob and value budgets follow the actor's and the critic's, as verl's interpolations.
    rollout = config["actor_rollout_ref"]["rollout"]
    assert (rollout["log_prob_use_dynamic_bsz"], rollout["log_prob_max_token_len_per_gpu"]) == (True, 32)
    assert (config["critic"]["use_dynamic_bsz"], config["critic"]["forward_max_token_len_per_gpu"]) == (True, 32)


def test_a_budget_that_cannot_hold_a_sequence_is_one_error_line(tmp_path):
    result = verl("train", "--config", QUICKSTART, *SMALL, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12", cwd=tmp_path)
    assert result.returncode == 2
    assert ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu: got 12, smaller than the longest sequence a batch "
            "can hold (data.max_prompt_length 8 + data.max_response_length 8 = 16 tokens); allowed: at least 16"
            in result.stderr)
    assert "Traceback" not in result.stderr
