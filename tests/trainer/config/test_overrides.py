"""Command-line overrides in Hydra's grammar, as verl's launch scripts write them, and the one-pass report
of schema and cross-field problems. No torch here."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest

from trainer.config import ConfigError, ConfigProblem, load_config

ARO = "actor_rollout_ref"

# (override lines, {dotted attribute of the loaded config: the value it must have}). Written from verl's
# documented keys (ppo_trainer.yaml) and the lines of its example scripts; env: VERL_TEST_USER=alice.
GOOD = [
    (["data.train_batch_size=64", f"{ARO}.actor.ppo_mini_batch_size=32"],
     {"data.train_batch_size": 64, f"{ARO}.actor.ppo_mini_batch_size": 32}),
    ([f"{ARO}.actor.optim.lr=1e-6"], {f"{ARO}.actor.optim.lr": 1e-6}),
    ([f"{ARO}.actor.optim.lr=3e-6"], {f"{ARO}.actor.optim.lr": 3e-6}),
    (["critic.optim.lr=1e-5", "critic.enable=True"], {"critic.optim.lr": 1e-5, "critic.enable": True}),
    ([f"{ARO}.actor.use_kl_loss=True", f"{ARO}.actor.kl_loss_coef=0.001", f"{ARO}.actor.kl_loss_type=low_var_kl"],
     {f"{ARO}.actor.use_kl_loss": True, f"{ARO}.actor.kl_loss_coef": 0.001, f"{ARO}.actor.kl_loss_type": "low_var_kl"}),
    (["algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=5"],
     {"algorithm.adv_estimator": "grpo", f"{ARO}.rollout.n": 5}),
    (["algorithm.use_kl_in_reward=False"], {"algorithm.use_kl_in_reward": False}),
    (["trainer.project_name=verl_examples", "trainer.experiment_name=gsm8k"],
     {"trainer.project_name": "verl_examples", "trainer.experiment_name": "gsm8k"}),
    # a name stays as typed, whatever Hydra reads it as
    (["trainer.experiment_name=1e3"], {"trainer.experiment_name": "1e3"}),
    (["trainer.experiment_name=007"], {"trainer.experiment_name": "007"}),
    # lists, with and without quotes and spaces
    (["data.train_files=[builtin:counting,builtin:counting]"],
     {"data.train_files": ["builtin:counting", "builtin:counting"]}),
    (["data.train_files=['builtin:counting', \"builtin:counting\"]"],
     {"data.train_files": ["builtin:counting", "builtin:counting"]}),
    (["data.train_files=builtin:counting"], {"data.train_files": ["builtin:counting"]}),
    (["data.val_files=[]"], {"data.val_files": []}),
    ([f"{ARO}.actor.optim.betas=[0.9,0.95]"], {f"{ARO}.actor.optim.betas": (0.9, 0.95)}),
    # quoted strings: a comma or a space inside is part of the value
    (["trainer.project_name='a,b'"], {"trainer.project_name": "a,b"}),
    (['trainer.project_name="my project"'], {"trainer.project_name": "my project"}),
    # + adds a key the file does not set; ++ adds or overrides; ~ goes back to the default
    (["+data.seed=7"], {"data.seed": 7}),
    ([f"++{ARO}.rollout.temperature=0.7"], {f"{ARO}.rollout.temperature": 0.7}),
    (["data.train_batch_size=2048", "++data.train_batch_size=512"], {"data.train_batch_size": 512}),
    (["data.train_batch_size=2048", "~data.train_batch_size"], {"data.train_batch_size": 1024}),
    (["data.train_batch_size=2048", "~data.train_batch_size=2048"], {"data.train_batch_size": 1024}),
    (["~data.train_batch_size"], {"data.train_batch_size": 1024}),
    (["critic.fsdp_config.param_offload=true", "~critic.fsdp_config"], {"critic.fsdp_config.param_offload": False}),
    # free-form mappings take any key, + included, and a dict value
    ([f"+{ARO}.model.override_config.attention_dropout=0.0"],
     {f"{ARO}.model.override_config": {"attention_dropout": 0.0}}),
    ([f"{ARO}.model.override_config={{num_hidden_layers:2,rope_theta:1e6}}"],
     {f"{ARO}.model.override_config": {"num_hidden_layers": 2, "rope_theta": 1e6}}),
    # interpolation: environment variables (with a default) and other keys, defaults included
    (["trainer.experiment_name=${oc.env:VERL_TEST_USER}"], {"trainer.experiment_name": "alice"}),
    (["trainer.experiment_name=run_${oc.env:VERL_TEST_USER}_1"], {"trainer.experiment_name": "run_alice_1"}),
    (["trainer.experiment_name=${oc.env:VERL_TEST_UNSET,fallback}"], {"trainer.experiment_name": "fallback"}),
    (["data.train_batch_size=${oc.env:VERL_TEST_UNSET,512}"], {"data.train_batch_size": 512}),
    (["trainer.project_name='${oc.env:VERL_TEST_USER}'"], {"trainer.project_name": "alice"}),
    ([f"{ARO}.actor.ppo_mini_batch_size=${{data.train_batch_size}}"], {f"{ARO}.actor.ppo_mini_batch_size": 1024}),
    (["data.max_response_length=${data.max_prompt_length}", "data.max_prompt_length=100"],
     {"data.max_response_length": 100}),
    (["trainer.total_training_steps=null"], {"trainer.total_training_steps": None}),
    (["trainer.total_training_steps=int(5)"], {"trainer.total_training_steps": 5}),
]

# (override lines, the dotted key reported, a phrase of its message): one problem each.
BAD = [
    (["data.train_batch_size"], "data.train_batch_size", "not an override (no '=')"),
    (["data.train_files=[a,"], "data.train_files", "which is not an override ("),
    (["a..b=1"], "a..b", "which is not an override ("),
    (["data.train_batch_size=${oops"], "data.train_batch_size", "which is not an override ("),
    (["data.train_batch_size=8,16"], "data.train_batch_size", "a sweep over several values"),
    (["data.train_batch_size@pkg=8"], "data.train_batch_size", "'@package'"),
    (["+data.nonexistent=1"], "data.nonexistent", "got the unknown key 'nonexistent'"),
    (["data.train_batch_sise=1"], "data.train_batch_sise", "did you mean 'train_batch_size'?"),
    (["~data.train_batch_sise"], "data.train_batch_sise", "did you mean 'train_batch_size'?"),
    (["~trainer.nope.deeper"], "trainer.nope", "got the unknown key 'nope'"),
    (["data.train_batch_size=64", "+data.train_batch_size=32"], "data.train_batch_size",
     "already set to 64 (by the config file or an earlier override), and + adds a key that is not set"),
    (["data.train_batch_size=64", "~data.train_batch_size=32"], "data.train_batch_size",
     "~key=value deletes the key only while it has that value"),
    (["data.train_batch_size.x=1"], "data.train_batch_size", "is a setting, not a section"),
    (["trainer.experiment_name=${oc.env:VERL_TEST_UNSET}"], "trainer.experiment_name",
     "cannot be resolved (Environment variable 'VERL_TEST_UNSET' not found)"),
    (["trainer.experiment_name=${trainer.no_such_key}"], "trainer.experiment_name",
     "cannot be resolved (Interpolation key 'trainer.no_such_key' not found)"),
    (["data.train_batch_size=${oc.env:VERL_TEST_USER}"], "data.train_batch_size", "got 'alice', not an integer"),
    (["data.train_files=[builtin:counting,/no/such.parquet]"], "data.train_files[1]", "which does not exist"),
]


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_TEST_USER", "alice")
    monkeypatch.delenv("VERL_TEST_UNSET", raising=False)


def problems_of(path: Path | None, overrides: list[str]) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    return caught.value.problems


@pytest.mark.parametrize(("overrides", "expected"), GOOD, ids=[" ".join(case[0]) for case in GOOD])
def test_an_override_line_sets_what_it_says(overrides: list[str], expected: dict[str, Any]) -> None:
    config = load_config(None, overrides)
    assert {key: operator.attrgetter(key)(config) for key in expected} == expected


@pytest.mark.parametrize(("overrides", "key", "phrase"), BAD, ids=[" ".join(case[0]) for case in BAD])
def test_a_bad_override_is_one_line_naming_it(overrides: list[str], key: str, phrase: str) -> None:
    problems = problems_of(None, overrides)
    assert [problem.path for problem in problems] == [key], problems
    assert phrase in problems[0].message
    assert "; allowed: " in problems[0].message
    assert "\n" not in str(problems[0])


def test_every_bad_override_line_is_reported_at_once() -> None:
    problems = problems_of(None, ["data.train_batch_size", "data.max_prompt_length=64", "data.x=[",
                                  "+data.seed=1", "+data.seed=2", "data.train_batch_size=1,2"])
    assert [problem.path for problem in problems] == ["data.train_batch_size", "data.x", "data.seed",
                                                      "data.train_batch_size"]


def test_plus_adds_a_key_the_file_does_not_set_and_refuses_one_it_does(tmp_path: Path) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text("data:\n  train_batch_size: 512\n", encoding="utf-8")
    assert load_config(config_file, ["+data.max_prompt_length=64"]).data.max_prompt_length == 64
    problems = problems_of(config_file, ["+data.train_batch_size=2048"])
    assert [problem.path for problem in problems] == ["data.train_batch_size"]
    assert load_config(config_file, ["++data.train_batch_size=2048"]).data.train_batch_size == 2048
    assert load_config(config_file, ["~data.train_batch_size"]).data.train_batch_size == 1024


def test_interpolations_in_the_file_resolve_too(tmp_path: Path) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text("trainer:\n  experiment_name: ${oc.env:VERL_TEST_USER}\n"
                           "data:\n  max_response_length: ${data.max_prompt_length}\n", encoding="utf-8")
    config = load_config(config_file, ["data.max_prompt_length=96"])
    assert (config.trainer.experiment_name, config.data.max_response_length) == ("alice", 96)


# ------------------------------------------------------------------------ schema and cross-field in one pass


def test_schema_and_cross_field_problems_come_in_one_report() -> None:
    problems = problems_of(None, ["data.max_prompt_length=abc", "critic.enable=false",
                                  "trainer.n_gpus_per_node=3", "trainer.test_freq=5"])
    assert {problem.path for problem in problems} == {
        "data.max_prompt_length", "critic.enable", "data.train_batch_size",
        # verl's rule: a rank's share of the mini-batch, 256 // 3 = 85 sequences, takes whole micro-batches of 8
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "trainer.test_freq"}


def test_a_cross_field_check_that_reads_a_refused_value_is_skipped() -> None:
    """The batch-size rule would judge the default batch size (1024) in place of the refused 'abc'."""
    problems = problems_of(None, ["data.train_batch_size=abc", f"{ARO}.actor.ppo_mini_batch_size=2048",
                                  "critic.enable=false"])
    assert [problem.path for problem in problems] == ["data.train_batch_size", "critic.enable"]


def test_a_misspelt_key_skips_the_checks_of_the_key_it_was_meant_for() -> None:
    problems = problems_of(None, ["data.train_batch_sise=4096", f"{ARO}.actor.ppo_mini_batch_size=2048"])
    assert [problem.path for problem in problems] == ["data.train_batch_sise"]
