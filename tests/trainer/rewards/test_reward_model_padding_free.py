"""reward_model.model.use_remove_padding: the reward model's forward over one padding-free row per micro-batch gives
the padded forward's scores (trainer/rewards/manager.py ModelReward), in a real step too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from trainer.config import load_config
from trainer.data import PromptRecord
from trainer.errors import RunSetupError
from trainer.loop import Trainer
from trainer.models import load_tokenizer
from trainer.models.tiny import seeded_init, tiny_qwen2_config
from trainer.rewards.manager import ModelReward
from trainer.rollout.batch import RolloutBatch

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
RESPONSES = ["1 2 3", "4", "5 6 7 8 9 0", "+ =", "3 3"]


def reward_model() -> Qwen2ForSequenceClassification:
    config = tiny_qwen2_config(TOKENIZER, {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64},
                               num_labels=1)
    config._attn_implementation = "sdpa"
    return seeded_init(Qwen2ForSequenceClassification, config, 5).eval()


def batch() -> RolloutBatch:
    rows = [TOKENIZER.convert_tokens_to_ids(text.split()) + [TOKENIZER.eos_token_id] for text in RESPONSES]
    width = max(len(row) for row in rows)
    prompt_ids = torch.tensor([TOKENIZER.convert_tokens_to_ids(["1", "+", "1"])] * len(rows))
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
        response_ids=torch.tensor([row + [TOKENIZER.pad_token_id] * (width - len(row)) for row in rows]),
        response_mask=torch.tensor([[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows]),
        group_index=torch.arange(len(rows)),
        records=[PromptRecord(prompt=[{"role": "user", "content": "1 + 1"}], data_source="d") for _ in rows])


@pytest.mark.parametrize("micro_batch_size", [2, 5])
def test_the_padding_free_forward_gives_the_padded_scores(micro_batch_size: int) -> None:
    model = reward_model()
    padded = ModelReward(model, TOKENIZER, TOKENIZER, micro_batch_size=micro_batch_size, max_length=32)
    packed = ModelReward(model, TOKENIZER, TOKENIZER, micro_batch_size=micro_batch_size, max_length=32,
                         remove_padding=True)
    rows: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(tuple(kwargs["input_ids"].shape)),
                                             with_kwargs=True)
    try:
        expected, got = padded(batch()), packed(batch())
    finally:
        handle.remove()
    assert got.shape == (5,) and len(set(got.tolist())) == 5, "five different sequences, five different scores"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The texts are the chat template's "1 + 1 " and the response's words (decoded without its EOS).
    lengths = [3 + len(text.split()) for text in RESPONSES]
    pieces = [lengths[first:first + micro_batch_size] for first in range(0, 5, micro_batch_size)]
    assert rows[len(pieces):] == [(1, sum(piece)) for piece in pieces], "one row of the real tokens per micro-batch"


def test_a_model_without_a_score_head_is_refused_naming_the_key() -> None:
    model = reward_model()
    model.classifier = model.score
    del model.score
    with pytest.raises(RunSetupError, match="reward_model.model.use_remove_padding: true, but .* no `score` head"):
        ModelReward(model, TOKENIZER, TOKENIZER, micro_batch_size=2, max_length=32, remove_padding=True)


def test_verls_padding_free_switch_on_the_reward_model_is_accepted() -> None:
    config = load_config(None, ["reward_model.model.use_remove_padding=true"])
    assert config.reward_model.model.use_remove_padding is True


def test_a_step_scored_padding_free_gets_the_padded_forwards_scores(tmp_path: Path) -> None:
    directory = tmp_path / "reward_model"
    reward_model().save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    aro = "actor_rollout_ref"
    config = load_config(None, [
        f"{aro}.model.override_config={{num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}}",
        "data.train_batch_size=2", f"{aro}.actor.ppo_mini_batch_size=2", f"{aro}.actor.ppo_micro_batch_size_per_gpu=4",
        "data.max_prompt_length=8", "data.max_response_length=4", "trainer.device=cpu", "trainer.save_freq=-1",
        "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo", f"{aro}.rollout.n=2",
        f"trainer.runs_dir={tmp_path / 'runs'}", "reward_model.enable=true", f"reward_model.model.path={directory}",
        "reward_model.model.use_remove_padding=true", "reward_model.micro_batch_size_per_gpu=4"])
    trainer = Trainer(config, log=lambda *_: None, warn=lambda *_: None)
    reward = trainer.models.reward
    assert isinstance(reward, ModelReward) and reward.head is not None, "the run's reward model is padding-free"
    assert reward.max_length == 8 + 4  # reward_model.max_length null: the data limits' sum
    scored: list[RolloutBatch] = []
    score = trainer.score
    trainer.score = lambda batch: (scored.append(batch), score(batch))[1]  # type: ignore[method-assign]
    trainer.fit()
    [batch] = scored
    padded = ModelReward(reward.model, TOKENIZER, TOKENIZER, micro_batch_size=3, max_length=12)
    torch.testing.assert_close(batch.token_level_scores.sum(dim=1), padded(batch), rtol=1e-5, atol=1e-5)
    [row] = trainer.metrics_log.read()
    assert row["critic/score/mean"] == pytest.approx(padded(batch).mean().item(), abs=1e-5)


def test_reward_model_max_length_cuts_its_inputs(tmp_path: Path) -> None:
    """verl's reward_model.max_length (refused until 2026-12-08): the most tokens the reward model reads of a prompt
    and its response."""
    directory = tmp_path / "reward_model"
    reward_model().save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    config = load_config(None, ["trainer.device=cpu", "reward_model.enable=true",
                                f"reward_model.model.path={directory}", "reward_model.max_length=6",
                                f"trainer.runs_dir={tmp_path / 'runs'}",
                                "actor_rollout_ref.model.override_config={num_hidden_layers: 1}"])
    reward = Trainer(config, log=lambda *_: None, warn=lambda *_: None).models.reward
    assert isinstance(reward, ModelReward) and reward.max_length == 6  # the tokenizer's cut in ModelReward.score
