"""verl's actor_rollout_ref.model.lora_adapter_path: the policy's LoRA starts from a saved adapter (its own rank and
modules, its weights), trainable, the base frozen; a directory that holds none is one error naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, load_config, load_config_with_notes
from trainer.models import load_policy, load_tokenizer
from trainer.models.loading import ModelLoadError
from trainer.models.lora import LoraSettings, save_adapter, with_adapter

pytest.importorskip("peft")

KEY = "actor_rollout_ref.model"


def policy() -> torch.nn.Module:
    return load_policy("builtin:tiny-qwen2", load_tokenizer("builtin:tiny-qwen2"), dtype=torch.float32, seed=3,
                       override_config={"num_hidden_layers": 1})


def settings(rank: int = 0, adapter_path: str | None = None) -> LoraSettings:
    return LoraSettings(rank=rank, alpha=16, target_modules=["q_proj"], exclude_modules=None, setting=KEY,
                        adapter_path=adapter_path)


def lora_b(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters() if "lora_B" in name}


def test_a_saved_adapter_is_where_the_policy_starts_and_it_trains(tmp_path: Path) -> None:
    _, trained = with_adapter(policy(), settings(rank=4), role="actor", seed=1)
    assert trained is not None
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.25)  # a trained adapter: peft starts lora_B at zero
    save_adapter(trained, tmp_path)
    # lora_rank 0 beside the path, as verl's scripts may leave it: the saved adapter's own rank (4) is built.
    model, loaded = with_adapter(policy(), settings(rank=0, adapter_path=str(tmp_path)), role="actor", seed=2)
    assert loaded is not None
    saved = lora_b(loaded)
    assert saved and all(tensor.shape[1] == 4 and torch.all(tensor == 0.25) for tensor in saved.values())
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


def test_a_directory_without_an_adapter_is_one_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"^{KEY}\.lora_adapter_path: got '{tmp_path}', which is not a saved "
                                             "LoRA adapter"):
        with_adapter(policy(), settings(adapter_path=str(tmp_path)), role="actor", seed=1)


def test_verls_lora_adapter_path_loads_beside_its_lora_rank_with_nothing_to_say(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    config, notes, warnings = load_config_with_notes(None, [f"{KEY}.lora_adapter_path={tmp_path}",
                                                            f"{KEY}.lora_rank=64", f"{KEY}.lora_alpha=32"])
    assert config.actor_rollout_ref.model.lora_adapter_path == str(tmp_path)
    assert LoraSettings.of(config.actor_rollout_ref.model, KEY) is not None
    assert (notes, warnings) == ([], [])
    without = load_config_with_notes(None, [f"{KEY}.lora_alpha=32"])
    assert [warning.path for warning in without.warnings] == [f"{KEY}.lora_alpha"], "no adapter: alpha is not read"


def test_a_path_without_a_saved_adapter_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_with_notes(None, [f"{KEY}.lora_adapter_path={tmp_path}"])
    [problem] = caught.value.problems
    assert problem.path == f"{KEY}.lora_adapter_path" and "no adapter_config.json in it" in problem.message


SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
RUN = ["actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
       "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-2",
       "data.max_prompt_length=8", "data.max_response_length=4", "trainer.device=cpu",
       "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=true",
       "trainer.total_training_steps=1"]


def test_a_run_from_a_saved_adapter_starts_from_it_and_trains_it(tmp_path: Path) -> None:
    from trainer.loop import Trainer

    base = load_policy("builtin:tiny-qwen2", load_tokenizer("builtin:tiny-qwen2"), dtype=torch.float32, seed=3,
                       override_config=SMALL)
    _, trained = with_adapter(base, settings(rank=4), role="actor", seed=1)
    assert trained is not None
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.25)
    save_adapter(trained, tmp_path / "adapter")
    config = load_config(None, [*RUN, f"{KEY}.lora_adapter_path={tmp_path / 'adapter'}",
                                f"trainer.runs_dir={tmp_path / 'runs'}"])
    trainer = Trainer(config, log=lambda *_: None)
    start = lora_b(trainer.actor.model)
    assert start and all(torch.all(tensor == 0.25) for tensor in start.values())
    assert trainer.reference.adapter is not None  # the reference is the base: the adapter disabled
    trainer.fit()
    after = lora_b(trainer.actor.model)
    assert any(not torch.equal(after[name], value) for name, value in start.items())
    kl = [row["actor/kl_loss"] for row in trainer.metrics_log.read() if "actor/kl_loss" in row]
    assert kl and kl[-1] > 0  # the saved adapter already moved the policy off the base
