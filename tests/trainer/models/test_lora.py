"""LoRA through peft, as a user meets it: the adapter trains and the base stays as it was, the reference policy
is the base model, offloaded and resident runs agree, checkpoints resume the adapter and peft loads it."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from tests.trainer.test_training import TINY, computed_metrics
from trainer.checkpoint import CheckpointError, latest_checkpoint
from trainer.config import ConfigError, load_config
from trainer.loop import Trainer
from trainer.models import ModelLoadError, load_critic, load_policy, load_tokenizer
from trainer.models.lora import LoraSettings, apply_lora
from trainer.workers.actor import compute_log_probs

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.total_training_steps=2"]
OFFLOADED = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]


def lora_trainer(tmp_path, *overrides: str, name: str = "run") -> Trainer:
    config = load_config(None, [*TINY, *LORA, f"trainer.runs_dir={tmp_path}", f"trainer.experiment_name={name}",
                                *overrides])
    return Trainer(config, log=lambda *_: None)


def split_parameters(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(frozen, trainable) copies of the model's parameters, by name."""
    frozen = {name: parameter.detach().clone() for name, parameter in model.named_parameters()
              if not parameter.requires_grad}
    trainable = {name: parameter.detach().clone() for name, parameter in model.named_parameters()
                 if parameter.requires_grad}
    return frozen, trainable


def test_a_lora_run_trains_the_adapter_alone_and_builds_no_reference_model(tmp_path):
    trainer = lora_trainer(tmp_path)
    frozen, adapter = split_parameters(trainer.actor.model)
    assert adapter and all("lora_" in name for name in adapter)
    # use_kl_loss needs one: it is the actor without its adapter, no model of its own
    assert trainer.reference.model is trainer.actor.model and trainer.reference.adapter is not None
    optimized = {id(parameter) for group in trainer.actor.optimizer.param_groups for parameter in group["params"]}
    named = dict(trainer.actor.model.named_parameters())
    assert optimized == {id(named[name]) for name in adapter}

    trainer.fit()

    after = dict(trainer.actor.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in frozen.items())
    assert all(not torch.equal(after[name], value) for name, value in adapter.items())
    state = trainer.actor.optimizer.state
    assert {id(parameter) for parameter in state} == {id(after[name]) for name in adapter}
    assert computed_metrics(trainer)[-1]["actor/kl_loss"] > 0  # the adapter moved the policy off the reference


def test_the_reference_log_probs_are_the_base_models(tmp_path):
    trainer = lora_trainer(tmp_path)
    trainer.fit()  # the adapter is no longer a no-op
    batch = trainer.generation.generate(trainer.records[:4])
    base = load_policy("builtin:tiny-qwen2", trainer.tokenizer, dtype=torch.float32, seed=trainer.config.trainer.seed,
                       override_config=trainer.config.actor_rollout_ref.model.override_config)
    expected = compute_log_probs(base, batch, micro_batch_size=4, temperature=1.0)

    torch.testing.assert_close(trainer.reference.compute_log_probs(batch), expected)
    adapted = trainer.actor.compute_log_probs(batch)
    assert not torch.allclose(adapted, expected)  # and the adapter is back on afterwards


@pytest.mark.parametrize("placement", [
    OFFLOADED,
    [*OFFLOADED, "actor_rollout_ref.model.enable_gradient_checkpointing=true",
     "actor_rollout_ref.actor.fsdp_config.offload_policy.embedding=gpu"],
], ids=["offloaded", "offloaded-checkpointed"])
def test_offloaded_lora_gives_the_numbers_of_resident_lora(tmp_path, placement):
    resident = lora_trainer(tmp_path, "trainer.total_training_steps=3", name="resident")
    resident.fit()
    offloaded = lora_trainer(tmp_path, "trainer.total_training_steps=3", *placement, name="offloaded")
    assert all(unit.offloaded for unit in offloaded.memory.engine("actor").transformer_units)
    offloaded.fit()

    expected = resident.actor.model.state_dict()
    for name, value in offloaded.actor.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=name)
    resident_rows, offloaded_rows = computed_metrics(resident), computed_metrics(offloaded)
    for row, expected_row in zip(offloaded_rows, resident_rows, strict=True):
        assert row.keys() == expected_row.keys()
        for key, value in expected_row.items():
            if not key.startswith("offload/"):  # where the layers are: what differs by design
                assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_offloaded_lora_keeps_masters_gradients_and_states_for_the_adapter_only(tmp_path):
    """bf16 weights on the CPU with the optimizer there: the frozen base has its bf16 arena alone, no fp32 master,
    no host gradient, no AdamW state; the summary counts the adapter."""
    lora = lora_trainer(tmp_path, *OFFLOADED, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", name="lora")
    full = lora_trainer(tmp_path, *OFFLOADED, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
                        "actor_rollout_ref.model.lora_rank=0", name="full")
    lora.fit()
    engine = lora.memory.engine("actor")
    adapter = [parameter for parameter in lora.actor.model.parameters() if parameter.requires_grad]
    adapter_elements = sum(parameter.numel() for parameter in adapter)
    assert all(parameter.dtype == torch.float32 for parameter in adapter)
    assert all(parameter.dtype == torch.bfloat16 for parameter in lora.actor.model.parameters()
               if not parameter.requires_grad)

    host = engine.host_bytes()
    # Each entry is 256-byte aligned: a small margin over the adapter's own bytes.
    assert adapter_elements * 4 <= host["masters"] < adapter_elements * 4 + 14 * 512
    assert host["optimizer"] == 2 * adapter_elements * 4
    assert host["gradients"] < 2 * adapter_elements * 4 + 14 * 512
    full_host = full.memory.engine("actor").host_bytes()
    assert full_host["masters"] > 2 * host["masters"] and full_host["gradients"] > 2 * host["gradients"]
    # What was allocated: one host gradient per adapter weight, none for the frozen ones.
    gradients = [view for unit in engine.units for view in unit.grad_views or [] if view is not None]
    assert sum(view.numel() for view in gradients) == adapter_elements
    arenas = {view.untyped_storage().data_ptr(): view.untyped_storage().nbytes() for view in gradients}
    assert sum(arenas.values()) < adapter_elements * 4 + 14 * 512

    summary = "\n".join(engine.summary_lines())
    assert f"Trainable: {adapter_elements:,} of " in summary


@pytest.mark.parametrize("rank", [8, 0], ids=["lora", "full"])
def test_a_layer_kept_on_the_device_copies_only_its_adapter_again_after_an_update(tmp_path, rank):
    """optimizer_offload keeps the masters on the host and a copy of each layer on the device, refreshed after
    every update: with LoRA only the adapter's bytes cross the bus again, not the frozen layer's."""
    trainer = lora_trainer(tmp_path, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                           f"actor_rollout_ref.model.lora_rank={rank}")
    engine = trainer.memory.engine("actor")
    (layer,) = engine.transformer_units
    assert layer.kind == "hooked" and layer.placement == "gpu"
    trained = sum(entry.parameter.numel() * 4 for entry in layer.entries if entry.parameter.requires_grad)
    copied = []
    for _ in range(3):
        trainer.train_step([trainer.records[index] for index in trainer.sampler.next_batch()])
        copied.append(engine.copied_bytes()[("h2d", "transformer")])
    # The first copy is the whole layer; then each of a step's two updates (two mini-batches) refreshes it.
    refreshed = trained if rank else layer.nbytes
    assert copied[0] == layer.nbytes + refreshed
    assert [after - before for before, after in zip(copied, copied[1:], strict=False)] == [2 * refreshed] * 2


def test_a_checkpoint_holds_the_adapter_in_peft_format_and_resumes_it(tmp_path):
    straight = lora_trainer(tmp_path, "trainer.total_training_steps=3", *OFFLOADED, name="straight")
    straight.fit()
    first = lora_trainer(tmp_path, "trainer.total_training_steps=2", *OFFLOADED, name="resumed")
    first.fit()
    folder = latest_checkpoint(first.checkpointer.directory) / "actor"
    assert sorted(path.name for path in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8

    second = lora_trainer(tmp_path, "trainer.total_training_steps=3", *OFFLOADED, name="resumed")
    second.fit()
    assert second.step == 3
    expected = straight.actor.model.state_dict()
    for name, value in second.actor.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=name)
    assert computed_metrics(second) == computed_metrics(straight)

    # A user loads the exported adapter onto the base model with peft alone.
    base = load_policy("builtin:tiny-qwen2", straight.tokenizer, dtype=torch.float32, seed=straight.config.trainer.seed,
                       override_config=straight.config.actor_rollout_ref.model.override_config)
    loaded = PeftModel.from_pretrained(base, str(latest_checkpoint(straight.checkpointer.directory) / "actor"))
    batch = straight.generation.generate(straight.records[:2])
    torch.testing.assert_close(compute_log_probs(loaded, batch, micro_batch_size=2, temperature=1.0),
                               straight.actor.compute_log_probs(batch))


def test_resuming_a_full_checkpoint_with_lora_names_the_setting(tmp_path):
    lora_trainer(tmp_path, "actor_rollout_ref.model.lora_rank=0", "trainer.total_training_steps=1").fit()
    with pytest.raises(CheckpointError, match="written by a run without LoRA .*lora_rank=0"):
        lora_trainer(tmp_path, "trainer.total_training_steps=2").fit()


def test_a_critic_with_lora_trains_its_adapter_and_value_head(tmp_path):
    trainer = lora_trainer(tmp_path, "algorithm.adv_estimator=gae", "critic.model.lora_rank=4",
                           "trainer.total_training_steps=1")
    frozen, trainable = split_parameters(trainer.critic.model)
    assert any("score" in name for name in trainable)
    assert all("lora_" in name or "score.modules_to_save" in name for name in trainable)
    trainer.fit()
    after = dict(trainer.critic.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in frozen.items())
    assert all(not torch.equal(after[name], value) for name, value in trainable.items())
    assert (latest_checkpoint(trainer.checkpointer.directory) / "critic" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------------------------------ errors


def tiny(role: str = "actor"):
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    load = load_policy if role == "actor" else load_critic
    return load("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=0)


def settings(**changes) -> LoraSettings:
    values = dict(rank=8, alpha=16, target_modules="all-linear", exclude_modules=None,
                  setting="actor_rollout_ref.model")
    return LoraSettings(**{**values, **changes})


@pytest.mark.parametrize(("changes", "message"), [
    ({"target_modules": ["q_proj", "qproj"]},
     r"^actor_rollout_ref\.model\.target_modules: got \['q_proj', 'qproj'\], but the model has no module 'qproj'; "
     r"its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj$"),
    ({"target_modules": r".*\.attn\..*"}, r"target_modules: got '.*', a regex that matches no module name"),
    ({"target_modules": ["norm"]}, r"target_modules: got \['norm'\]: Target module Qwen2RMSNorm.* is not supported"),
    ({"exclude_modules": ["v_prj"]}, r"exclude_modules: got \['v_prj'\], but the model has no module 'v_prj'"),
    ({"target_modules": ["q_proj"], "exclude_modules": ["q_proj"]}, r"No modules were targeted"),
])
def test_target_modules_that_do_not_fit_the_model_are_one_line_errors(changes, message):
    with pytest.raises(ModelLoadError, match=message) as raised:
        apply_lora(tiny(), settings(**changes), role="actor", seed=0)
    assert "\n" not in str(raised.value)


def test_the_critics_value_head_is_refused_as_a_target():
    with pytest.raises(ModelLoadError, match="value head 'score' trains whole"):
        apply_lora(tiny("critic"), settings(target_modules=["q_proj", "score"], setting="critic.model"),
                   role="critic", seed=0)


def test_bad_lora_keys_are_named_all_at_once():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["actor_rollout_ref.model.lora_rank=-1", "actor_rollout_ref.model.target_modules=[]",
                           "critic.model.lora_alpha=32", "actor_rollout_ref.model.lora_alpha=-1"])
    problems = sorted(str(problem) for problem in raised.value.problems)
    assert problems == [
        "actor_rollout_ref.model.lora_alpha: got -1, out of range; allowed: an integer >= 0",
        "actor_rollout_ref.model.lora_rank: got -1, out of range; allowed: an integer >= 0",
        "actor_rollout_ref.model.target_modules: got []; allowed: all-linear, a list of module names (e.g. "
        "[q_proj, v_proj]) or a regex matching whole module names",
    ]  # critic.model.lora_alpha without an adapter runs, as in verl: a WARNING line, not one of the errors


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_adapter_files_names_map_to_the_models_own(tmp_path, role):
    """checkpoint.adapter_file_names (what a one-rank LoRA checkpoint resumed on several ranks loads by): every tensor
    peft saves, the value head it trains whole included, names one of the model's, and nothing else does."""
    from safetensors.torch import load_file

    from trainer.checkpoint import adapter_file_names
    from trainer.models.lora import save_adapter

    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    build = load_policy if role == "actor" else load_critic
    model = build("builtin:tiny-qwen2", tokenizer, seed=1, override_config={"num_hidden_layers": 1},
                  dtype=torch.float32)
    adapted = apply_lora(model, LoraSettings(rank=4, alpha=8, target_modules="all-linear", exclude_modules=None,
                                             setting="x"), role=role, seed=1)
    save_adapter(adapted, tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    names = adapter_file_names(adapted.get_base_model().state_dict())
    assert sorted(names) == sorted(saved)
    state = adapted.get_base_model().state_dict()
    assert all(torch.equal(saved[key], state[name]) for key, name in names.items())
    assert not adapter_file_names(build("builtin:tiny-qwen2", tokenizer, seed=1, dtype=torch.float32,
                                        override_config={"num_hidden_layers": 1}).state_dict())
