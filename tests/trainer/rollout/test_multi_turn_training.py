"""A multi-turn GRPO step through the real trainer with verl's gsm8k tool config: the tiny model's turns are read
as calls of verl's gsm8k tool (its word-level vocabulary cannot write <tool_call>), so the step's responses hold
tool turns between the model's, and every phase (old log-probs, reference, advantages, update) reads the loss mask
with its holes."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.config import load_config
from trainer.loop import Trainer
from trainer.rollout import multi_turn
from trainer.rollout.tool_calls import ToolCall

TOOL_CONFIG = Path(__file__).parents[1] / "config" / "assets" / "verl_examples" / "sglang_multiturn_config" \
    / "gsm8k_tool_config.yaml"


def gsm8k_multi_turn_data(path: Path, prompts: int = 2) -> Path:
    """Prompts in the layout of verl's gsm8k multi-turn data (examples/data_preprocess/gsm8k_multiturn_w_tool)."""
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{index} + {index}"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * index)},
         "extra_info": {"index": index, "tools_kwargs": {"calc_gsm8k_reward": {
             "create_kwargs": {"ground_truth": str(2 * index)}}}}}
        for index in range(prompts)]), path)
    return path


# verl's multi-turn scripts run the padding-free forward (use_remove_padding=True): the packed row holds the tool
# turns, the loss reads the model's tokens. That run also samples each turn in pieces.
@pytest.mark.parametrize("remove_padding", [False, True])
def test_a_multi_turn_grpo_step_with_the_gsm8k_tool_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           remove_padding: bool) -> None:
    calls: list[str] = []

    def every_turn_calls_the_tool(text: str) -> tuple[str, list[ToolCall]]:
        calls.append(text)
        return text, [ToolCall("calc_gsm8k_reward", {"answer": text})]

    monkeypatch.setattr(multi_turn, "parse_tool_calls", every_turn_calls_the_tool)
    data = gsm8k_multi_turn_data(tmp_path / "train.parquet")
    config = load_config(None, [
        "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
        f"data.train_files=[{data}]", "data.train_batch_size=2", "data.max_prompt_length=8",
        "data.max_response_length=24", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.device=cpu",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
        # and a turn's rows in pieces of at most 3 (vLLM's max_num_seqs): 4, then fewer, per turn
        f"actor_rollout_ref.rollout.max_num_seqs={3 if remove_padding else 256}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}", "trainer.total_training_steps=1",
        f"trainer.runs_dir={tmp_path}", "trainer.experiment_name=multi_turn"])
    trainer = Trainer(config, log=lambda *_: None)
    batches = []
    generate = trainer.generation.generate
    monkeypatch.setattr(trainer.generation, "generate", lambda *a, **k: batches.append(generate(*a, **k))
                        or batches[-1])
    trainer.fit()
    [row] = trainer.metrics_log.read()
    [batch] = batches
    assert len(calls) == 4  # each of the 2 x 2 responses: one call after its first turn, none after its last
    tool_tokens = (batch.response_real_mask - batch.response_mask).sum(dim=1)
    # Tool turns the loss leaves out (one that does not fit the response length is dropped, as in verl: the tool's
    # text repeats the answer, as long as the model's turn).
    assert bool((tool_tokens > 0).any())
    assert bool((batch.response_mask * batch.response_real_mask == batch.response_mask).all())
    assert batch.ref_log_probs is not None and bool((batch.ref_log_probs[batch.response_mask == 0] == 0).all())
    assert bool((batch.advantages[batch.response_mask == 0] == 0).all())
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean", "response_length/mean"):
        assert math.isfinite(row[key]), key
    assert row["response_length/mean"] == pytest.approx(float(batch.response_lengths.mean()))
