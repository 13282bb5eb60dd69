"""What verl accepts runs here (issue 38): verl's engine keys run the built-in rollout and are said in one NOTE line,
rules verl runs with are WARNING lines, every rule runs in one pass, Megatron is one refusal line, and the keys
verl (or the article) writes elsewhere are read where they belong. No torch here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainer.config import ConfigError, ConfigProblem, LoadedConfig, Note, load_config, load_config_with_notes
from trainer.config.aliases import entry_for
from trainer.config.exit_codes import EXIT_USAGE

ROLLOUT = "actor_rollout_ref.rollout"
GRPO = ["algorithm.adv_estimator=grpo", f"{ROLLOUT}.n=4"]


def loaded(*overrides: str, config_name: str | None = None) -> LoadedConfig:
    return load_config_with_notes(None, list(overrides), config_name)


def problems_of(*overrides: str, config_name: str | None = None) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        loaded(*overrides, config_name=config_name)
    return caught.value.problems


def notes_by_key(result: LoadedConfig) -> dict[str, Note]:
    return {note.key: note for note in result.notes}


# ---------------------------------------------------------------------------------- the engine keys


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_a_named_engine_runs_the_built_in_rollout_and_the_note_says_so(engine: str) -> None:
    result = loaded(f"{ROLLOUT}.name={engine}")
    assert result.config.actor_rollout_ref.rollout.name == engine
    note = notes_by_key(result)[f"{ROLLOUT}.name"]
    assert note.value == engine and note.why.startswith(f"the built-in rollout runs instead of {engine}'s engine")
    assert loaded(f"{ROLLOUT}.name=hf").notes == [], "the built-in rollout by its own name: nothing to say"


@pytest.mark.parametrize(("ranks", "says"), [
    (4, "the rollout runs data-parallel on the run's 4 ranks instead: each decodes its share of the prompts"),
    (1, "the rollout decodes on the run's one rank instead"),
])
def test_a_tensor_parallel_rollout_runs_data_parallel_and_the_note_says_so(ranks: int, says: str) -> None:
    result = loaded(f"{ROLLOUT}.tensor_model_parallel_size=2", f"trainer.n_gpus_per_node={ranks}",
                    "data.train_batch_size=1024")
    assert result.config.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert notes_by_key(result)[f"{ROLLOUT}.tensor_model_parallel_size"].why.startswith(says)


def test_engine_tuning_keys_are_noted_only_away_from_verls_default() -> None:
    result = loaded(f"{ROLLOUT}.enable_chunked_prefill=true", f"{ROLLOUT}.load_format=dummy",
                    f"{ROLLOUT}.enable_prefix_caching=false", f"{ROLLOUT}.layered_summon=true",
                    f"{ROLLOUT}.free_cache_engine=true", f"+{ROLLOUT}.engine_kwargs.vllm.swap_space=8")
    assert [(note.key, note.value) for note in result.notes] == [
        (f"{ROLLOUT}.enable_prefix_caching", False), (f"{ROLLOUT}.layered_summon", True),
        (f"{ROLLOUT}.engine_kwargs.vllm.swap_space", 8)]
    assert {note.why for note in result.notes} == {entry_for(f"{ROLLOUT}.layered_summon").why}


def test_keeping_the_cache_engine_is_noted_as_not_built() -> None:
    [note] = loaded(f"{ROLLOUT}.free_cache_engine=false").notes
    assert note.key == f"{ROLLOUT}.free_cache_engine" and "frees its cache after every rollout" in note.why


def test_the_reward_models_serving_keys_are_accepted_and_noted() -> None:
    result = loaded("reward_model.rollout.name=vllm", "reward_model.rollout.tensor_model_parallel_size=4",
                    "reward_model.rollout.prompt_length=4096", "reward_model.num_workers=8")
    assert {note.key for note in result.notes} == {
        "reward_model.num_workers", "reward_model.rollout.name", "reward_model.rollout.tensor_model_parallel_size",
        "reward_model.rollout.prompt_length"}
    assert all("scores in the trainer process" in note.why for note in result.notes)


def test_the_batch_pieces_keys_are_this_projects() -> None:
    rollout = load_config(None, [f"{ROLLOUT}.max_num_seqs=64", f"{ROLLOUT}.max_num_batched_tokens=4096"])\
        .actor_rollout_ref.rollout
    assert (rollout.max_num_seqs, rollout.max_num_batched_tokens) == (64, 4096)
    defaults = load_config().actor_rollout_ref.rollout
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.max_model_len) == (256, 8192, None), \
        "verl's defaults (its generated ppo_trainer.yaml)"


def test_a_model_length_that_cuts_responses_is_noted_and_one_that_leaves_none_refused() -> None:
    lengths = ["data.max_prompt_length=512", "data.max_response_length=1024"]
    [note] = loaded(*lengths, f"{ROLLOUT}.max_model_len=1024").notes
    assert note.key == f"{ROLLOUT}.max_model_len"
    assert "a response stops at 1024 tokens of prompt and response" in note.why
    assert "for a prompt over 0 tokens" in note.why  # 1024 - 1024: every response may be cut
    assert loaded(*lengths, f"{ROLLOUT}.max_model_len=1536").notes == [], "room for the longest: nothing is cut"
    [problem] = problems_of(*lengths, f"{ROLLOUT}.max_model_len=512")
    assert problem.path == f"{ROLLOUT}.max_model_len"
    assert "would leave no room for a response" in problem.message and "allowed: more than 512" in problem.message


def test_what_verl_itself_refuses_is_refused() -> None:
    assert [problem.path for problem in problems_of(f"{ROLLOUT}.mode=sync")] == [f"{ROLLOUT}.mode"]
    assert [problem.path for problem in problems_of(f"{ROLLOUT}.pipeline_model_parallel_size=2")] == [
        f"{ROLLOUT}.pipeline_model_parallel_size"]
    assert "verl's mark of a value" in problems_of(f"{ROLLOUT}.name=???")[0].message


# ------------------------------------------------------------------------------------------- Megatron


def test_megatron_is_one_refusal_line_however_many_of_its_keys_are_set() -> None:
    problems = problems_of("actor_rollout_ref.actor.strategy=megatron", "critic.strategy=megatron",
                           "+actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                           "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
                           "data.train_batch_size=3")
    assert [problem.path for problem in problems] == ["actor_rollout_ref.actor.strategy"]
    assert "Megatron-LM is another training engine" in problems[0].message
    assert "(and 3 more Megatron settings: " in problems[0].message and "critic.strategy" in problems[0].message


def test_verls_megatron_config_name_is_the_refusal_line() -> None:
    [problem] = problems_of("+actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                            config_name="ppo_megatron_trainer.yaml")
    assert problem.path == "--config-name" and "Megatron-LM is another training engine" in problem.message
    [problem] = problems_of(config_name="ppo_megatron_trainer")
    assert problem.path == "--config-name"
    assert loaded(config_name="ppo_trainer").config == load_config()
    [problem] = problems_of(config_name="my_own_trainer")
    assert problem.path == "--config-name" and "allowed: ppo_trainer" in problem.message


# -------------------------------------------------------------------------- rules no stricter than verl


def warnings_of(*overrides: str) -> dict[str, str]:
    return {warning.path: warning.message for warning in loaded(*overrides).warnings}


def test_grpo_with_one_response_per_prompt_runs_with_a_warning_that_every_advantage_is_zero() -> None:
    config, _, warnings = loaded("algorithm.adv_estimator=grpo", f"{ROLLOUT}.n=1")
    assert config.actor_rollout_ref.rollout.n == 1
    [warning] = warnings
    assert warning.path == f"{ROLLOUT}.n" and "every advantage is 0" in warning.message


def test_a_references_placement_without_a_reference_runs_with_a_warning() -> None:
    warnings = warnings_of("actor_rollout_ref.ref.fsdp_config.param_offload=true",
                           "actor_rollout_ref.ref.fsdp_config.offload_policy.embedding=gpu")
    assert warnings == {"actor_rollout_ref.ref.fsdp_config": (
        "got param_offload=true, offload_policy.embedding='gpu', but this run builds no reference policy (neither "
        "actor_rollout_ref.actor.use_kl_loss nor algorithm.use_kl_in_reward is true): they have no effect (leave them "
        "out, or set one of them to true to build it)")}, "one line for the model"


def test_the_reward_models_padding_free_switch_runs() -> None:
    config, notes, _ = loaded("reward_model.model.use_remove_padding=true")
    assert config.reward_model.model.use_remove_padding and notes == []


def test_a_lower_clip_of_verls_cispo_examples_runs_as_set_without_a_warning() -> None:
    """CISPO's examples set clip_ratio_low=10 on purpose (no lower end to the clip): verl runs it, and so does this."""
    config, _, warnings = loaded("actor_rollout_ref.actor.clip_ratio_low=10",
                                 "actor_rollout_ref.actor.clip_ratio_high=0.2")
    assert config.actor_rollout_ref.actor.clip_range == (10.0, 0.2) and not warnings


def test_every_rule_runs_in_the_same_pass_when_a_choice_it_reads_is_invalid() -> None:
    """adv_estimator decides whether a critic is built: the batch-size rule that reads it runs with each of the
    estimators, and what it finds with all of them is reported beside the invalid value."""
    problems = problems_of("algorithm.adv_estimator=no_such_estimator", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                           "critic.enable=false")
    assert [problem.path for problem in problems] == ["algorithm.adv_estimator",
                                                      "actor_rollout_ref.actor.ppo_mini_batch_size"]


# ------------------------------------------------------------------------ keys read where they belong


@pytest.mark.parametrize(("written", "dtype"), [("bfloat16", "bf16"), ("float32", "fp32"), ("bf16", "bf16")])
def test_a_dtype_by_torchs_name_is_the_models_dtype(written: str, dtype: str) -> None:
    policy = load_config(None, [f"actor_rollout_ref.model.torch_dtype={written}"]).actor_rollout_ref
    assert (policy.actor.fsdp_config.model_dtype, policy.ref.fsdp_config.model_dtype) == (dtype, dtype)
    assert load_config(None, [f"critic.model.dtype={written}"]).critic.fsdp_config.model_dtype == dtype


def test_the_policys_fsdp_config_sets_the_actors_and_the_references_but_an_optimizers_setting_the_actors_alone(
        ) -> None:
    config, notes, warnings = loaded("+actor_rollout_ref.fsdp_config.param_offload=true",
                                     "+actor_rollout_ref.fsdp_config.optimizer_offload=true")
    policy = config.actor_rollout_ref
    assert policy.actor.fsdp_config.param_offload and policy.ref.fsdp_config.param_offload
    assert policy.actor.fsdp_config.optimizer_offload and not policy.ref.fsdp_config.optimizer_offload
    assert warnings == [], "no reference is built, but the key is the policy's: no warning for its reference"


def test_the_policys_key_and_the_actors_that_disagree_are_one_error_naming_both() -> None:
    [problem] = problems_of("+actor_rollout_ref.fsdp_config.param_offload=true",
                            "actor_rollout_ref.actor.fsdp_config.param_offload=false")
    assert str(problem) == (
        "actor_rollout_ref.fsdp_config.param_offload: got true, but actor_rollout_ref.actor.fsdp_config.param_offload "
        "is false: the two are one setting (actor_rollout_ref.actor.fsdp_config is its canonical place); allowed: one "
        "of them, or the same value")


@pytest.mark.parametrize(("overrides", "expected"), [
    # 8 ranks over the Ulysses degree 2: 4 data-parallel ranks (verl's fsdp_workers divide so)
    ((["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
       "actor_rollout_ref.actor.ppo_micro_batch_size=64", f"{ROLLOUT}.log_prob_micro_batch_size=32",
       "data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]),
     {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16,
      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8}),
    # the reward model's, over the world size
    (["trainer.n_gpus_per_node=4", "reward_model.micro_batch_size=64", "data.train_batch_size=256",
      "actor_rollout_ref.actor.ppo_mini_batch_size=64"], {"reward_model.micro_batch_size_per_gpu": 16}),
])
def test_verls_sizes_over_all_gpus_are_divided_as_verl_divides_them(overrides: list[str],
                                                                     expected: dict[str, Any]) -> None:
    config = load_config(None, overrides)
    for key, value in expected.items():
        section: Any = config
        for part in key.split("."):
            section = getattr(section, part)
        assert section == value, key


def test_a_size_over_all_gpus_smaller_than_the_ranks_is_refused() -> None:
    [problem] = problems_of("trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ppo_micro_batch_size=4")
    assert problem.path == "actor_rollout_ref.actor.ppo_micro_batch_size"
    assert "divided among the 8 data-parallel ranks; allowed: an integer >= 8" in problem.message


def test_verls_infrastructure_keys_are_accepted_and_say_they_have_no_effect() -> None:
    result = loaded("ray_kwargs.ray_init.num_cpus=8", "trainer.default_hdfs_dir=hdfs://cluster/checkpoints",
                    "actor_rollout_ref.actor.fsdp_config.fsdp_size=8", "trainer.use_legacy_worker_impl=disable")
    notes = notes_by_key(result)
    assert sorted(notes) == ["actor_rollout_ref.actor.fsdp_config.fsdp_size", "ray_kwargs.ray_init.num_cpus",
                             "trainer.default_hdfs_dir", "trainer.use_legacy_worker_impl"]
    assert all("no effect here" in note.why for note in notes.values())
    assert "written to local disk only" in notes["trainer.default_hdfs_dir"].why


def test_verls_prefix_grouper_is_accepted_as_the_speed_up_it_is() -> None:
    result = loaded("actor_rollout_ref.actor.use_prefix_grouper=true")
    note = notes_by_key(result)["actor_rollout_ref.actor.use_prefix_grouper"]
    assert note.value is True and "no effect on the numbers" in note.why


@pytest.mark.parametrize("model", ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model",
                                   "reward_model.model"])
def test_fsdps_mixed_precision_that_verls_scripts_add_is_noted(model: str) -> None:
    # verl's engine config has it (default None) though its generated file does not: `+...mixed_precision.*=...`
    result = loaded(f"+{model}.fsdp_config.mixed_precision.param_dtype=bf16")
    [note] = result.notes
    assert note.key.endswith("fsdp_config.mixed_precision.param_dtype") and note.value == "bf16"
    assert "no effect here: each model computes in its fsdp_config.model_dtype" in note.why
    [problem] = problems_of(f"+{model}.fsdp_config.mixed_precisio.param_dtype=bf16")
    assert "got the unknown key 'mixed_precisio'" in problem.message


def test_several_nodes_without_an_endpoint_pass_the_check_and_the_run_is_refused_at_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from daemon import cli

    for name in ("PET_RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "check_command", lambda config: 0)  # the data and model checks: not what is shown
    assert cli.main(["train", "--check", "trainer.nnodes=4"]) == 0
    checked = capsys.readouterr().err.splitlines()
    [warning] = [line for line in checked if line.startswith(("WARNING", "ERROR"))]
    assert warning.startswith("WARNING: trainer.rdzv_endpoint: is not set, but trainer.nnodes is 4: each node's")
    assert cli.main(["train", "trainer.nnodes=4"]) == EXIT_USAGE
    started = capsys.readouterr().err.splitlines()
    assert [line for line in started if line.startswith("ERROR")] == [
        "ERROR: trainer.rdzv_endpoint: is not set, but trainer.nnodes is 4; allowed: host:port of node 0, the same "
        "on every node (or set $PET_RDZV_ENDPOINT, or MASTER_ADDR and MASTER_PORT)"]
    assert not (tmp_path / "runs").exists()
