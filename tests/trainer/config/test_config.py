"""The run config: loading, overrides, derived defaults, round trips and every kind of user error.

No torch here: the config module is what the daemon imports before any trainer exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic.fields import FieldInfo

from tests.support import REPO
from trainer.config import (
    ConfigError,
    ConfigProblem,
    RunConfig,
    Section,
    dump_config,
    load_config,
    load_config_with_notes,
    validate_config,
)
from trainer.config.live import (
    LIVE_SETTINGS,
    SETTING_NAMES,
    SHORT_NAMES,
    LiveSettings,
    SettingsRejected,
    apply_change,
    initial_live_settings,
)

EXAMPLES = REPO / "examples"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    return caught.value.problems


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A stand-in HuggingFace model directory: the config only checks that config.json is there."""
    write(tmp_path / "model" / "config.json", "{}")
    return tmp_path / "model"


# ------------------------------------------------------------------------------- loading and overrides


def test_defaults_validate() -> None:
    config = load_config()
    assert config.data.train_files == ["builtin:counting"]
    assert config.actor_rollout_ref.model.path == "builtin:tiny-qwen2"
    assert config.algorithm.adv_estimator == "gae"


def test_file_then_overrides(tmp_path: Path) -> None:
    config_file = write(tmp_path / "run.yaml", """
data:
  train_batch_size: 64
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 16
    optim: {lr: 3.0e-6}
""")
    config = load_config(config_file, [
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.model.override_config.num_hidden_layers=2",
        "actor_rollout_ref.model.override_config.rope_theta=1e6",
        "data.train_files=[builtin:counting, builtin:counting]",
        "trainer.experiment_name=007",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    ])
    assert config.data.train_batch_size == 64  # from the file, untouched by the overrides
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 16
    lr = config.actor_rollout_ref.actor.optim.lr
    assert isinstance(lr, float) and lr == 1e-05
    assert config.actor_rollout_ref.rollout.n == 2
    # Inside a free-form mapping nothing converts the values later: the YAML reading itself must.
    assert config.actor_rollout_ref.model.override_config == {"num_hidden_layers": 2, "rope_theta": 1e6}
    assert isinstance(config.actor_rollout_ref.model.override_config["rope_theta"], float)
    assert config.data.train_files == ["builtin:counting", "builtin:counting"]
    assert config.trainer.experiment_name == "007"  # a name as typed, not YAML's number 7
    assert config.actor_rollout_ref.actor.fsdp_config.param_offload is True


def test_exponent_floats_in_the_file_are_floats(tmp_path: Path) -> None:
    config_file = write(tmp_path / "run.yaml", "actor_rollout_ref:\n  model:\n    override_config:\n"
                                               "      rope_theta: 1e6\n      rms_norm_eps: 1e-5\n")
    override_config = load_config(config_file).actor_rollout_ref.model.override_config
    assert override_config == {"rope_theta": 1e6, "rms_norm_eps": 1e-5}
    assert all(isinstance(value, float) for value in override_config.values())


def test_a_section_left_empty_in_yaml_means_its_defaults(tmp_path: Path) -> None:
    config_file = write(tmp_path / "run.yaml", "critic:\n  # enable: false\ntrainer:\n")
    config = load_config(config_file)
    assert config.critic.cliprange_value == 0.5
    assert config.trainer.experiment_name == "run"


@pytest.mark.parametrize("text", ["", "# nothing yet\n"])
def test_an_empty_file_is_refused_rather_than_run_with_every_default(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path / "run.yaml", text))
    assert [str(problem) for problem in error.value.problems] == [
        f"--config: got '{tmp_path / 'run.yaml'}', which is empty (or only comments); allowed: a YAML mapping of "
        "sections (actor_rollout_ref, critic, reward_model, custom_reward_function, algorithm, data, trainer, "
        "dynamic_offload, telemetry, daemon); `{}` runs every default"]


def test_an_empty_mapping_is_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path / "run.yaml", "{}\n")) == load_config()


# ------------------------------------------------------------------------------- derived defaults


def test_critic_inherits_the_actor_model_and_batch_sizes(model_dir: Path) -> None:
    config = load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.ppo_epochs=2",
    ])
    assert config.critic.enable is True  # gae needs a critic
    assert config.critic.model.path == str(model_dir)
    assert config.critic.ppo_mini_batch_size == 8
    assert config.critic.ppo_micro_batch_size_per_gpu == 4
    assert config.critic.ppo_epochs == 2


def test_critic_keeps_its_own_values_when_set(model_dir: Path) -> None:
    config = load_config(None, [
        "data.train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=16",
        "critic.ppo_micro_batch_size_per_gpu=2",
        f"critic.model.path={model_dir}",
    ])
    assert config.critic.ppo_mini_batch_size == 16
    assert config.critic.ppo_micro_batch_size_per_gpu == 2
    assert config.critic.model.path == str(model_dir)
    assert config.actor_rollout_ref.model.path == "builtin:tiny-qwen2"


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], True),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"], False),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "critic.enable=true"], True),
])
def test_critic_enable_follows_the_advantage_estimator(overrides: list[str], expected: bool) -> None:
    assert load_config(None, overrides).critic.enable is expected


# ------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("source", ["defaults", "grpo.yaml"])
def test_dump_then_load_gives_the_same_config(tmp_path: Path, source: str) -> None:
    config = load_config(None if source == "defaults" else EXAMPLES / source,
                         ["actor_rollout_ref.actor.fsdp_config.offload_policy.embedding=cpu",
                          "actor_rollout_ref.model.override_config.num_hidden_layers=2"])
    dumped = dump_config(config)
    assert "enable: null" not in dumped  # derived defaults are written out, not left to the reader
    reloaded = load_config(write(tmp_path / "resolved.yaml", dumped))
    assert reloaded == config
    assert dump_config(reloaded) == dumped


# ------------------------------------------------------------------------ keys the run would ignore


def test_offload_placement_is_active_now_that_the_engine_exists() -> None:
    load_config(None, ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
                       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                       "critic.fsdp_config.offload_policy.embedding=cpu"])


def test_dynamic_offload_the_embedding_cache_and_the_block_classes_are_active() -> None:
    # The offload engine finds a model's blocks by wrap_policy.transformer_layer_cls_to_wrap: not an ignored key.
    config = load_config(None, ["actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true",
                                "critic.fsdp_config.dynamic_offload.enabled=true",
                                "dynamic_offload.min_transformer_layers_on_gpu=2",
                                "actor_rollout_ref.rollout.embedding_cache.enabled=true",
                                "critic.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]"])
    assert config.critic.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap == ["Qwen2DecoderLayer"]


# GRPO without KL terms builds neither a critic nor a reference; reward_model.enable is false by default.
GRPO_WITHOUT_KL = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]


# verl's keys verl runs with and ignores: a WARNING line each (this project's own keys: an error).
@pytest.mark.parametrize(("overrides", "keys", "phrase"), [
    ([*GRPO_WITHOUT_KL, "critic.fsdp_config.dynamic_offload.enabled=true"],
     ["critic.fsdp_config"], "this run trains no critic (critic.enable is unset, and "
     "algorithm.adv_estimator=grpo needs none)"),
    (["critic.enable=false", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
      "critic.fsdp_config.param_offload=true", "critic.fsdp_config.optimizer_offload=true"],
     ["critic.fsdp_config"], "got param_offload=true, optimizer_offload=true, but this run trains no critic "
     "(critic.enable is false)"),
    ([*GRPO_WITHOUT_KL, "actor_rollout_ref.ref.fsdp_config.offload_policy.transformer=cpu"],
     ["actor_rollout_ref.ref.fsdp_config"], "builds no reference policy"),
    (["actor_rollout_ref.ref.fsdp_config.param_offload=true"],  # PPO, but no KL term either
     ["actor_rollout_ref.ref.fsdp_config"], "builds no reference policy"),
    (["reward_model.model.fsdp_config.param_offload=true"],
     ["reward_model.model.fsdp_config"], "builds no reward model"),
    (["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=1000"],
     ["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params"], "which here are fixed: one per decoder layer"),
])
def test_a_verl_key_the_run_would_ignore_is_a_warning(overrides: list[str], keys: list[str], phrase: str) -> None:
    loaded = load_config_with_notes(None, overrides)
    assert [warning.path for warning in loaded.warnings] == keys
    for warning in loaded.warnings:
        assert phrase in warning.message
        assert " no effect (" in warning.message


def test_a_key_of_this_projects_the_run_would_ignore_is_an_error() -> None:
    [problem] = problems_of(None, ["dynamic_offload.min_transformer_layers_on_gpu=4"])
    assert problem.path == "dynamic_offload.min_transformer_layers_on_gpu"
    assert "no model this run builds has fsdp_config.dynamic_offload.enabled: true" in problem.message
    assert "it would have no effect; allowed: the default (" in problem.message


def test_an_ignored_key_says_how_to_make_it_count() -> None:
    [warning] = load_config_with_notes(None, ["reward_model.model.fsdp_config.offload_policy.embedding=cpu"]).warnings
    assert str(warning) == (
        "reward_model.model.fsdp_config: got offload_policy.embedding='cpu', but this run builds no reward model "
        "(reward_model.enable is false): it has no effect (leave it out, or set reward_model.enable=true)")


def test_the_same_keys_are_active_on_a_model_the_run_builds() -> None:
    config = load_config(None, ["actor_rollout_ref.actor.use_kl_loss=true",
                                "actor_rollout_ref.ref.fsdp_config.param_offload=true",
                                "actor_rollout_ref.ref.fsdp_config.offload_policy.transformer=gpu",
                                "critic.fsdp_config.param_offload=true",
                                "critic.fsdp_config.dynamic_offload.enabled=true"])
    assert config.use_reference and config.use_critic


@pytest.mark.parametrize("key", ["optimizer_offload=true", "offload_grad_dtype=bf16", "delayed_update=true",
                                 "merge_micro_batches=false"])
@pytest.mark.parametrize(("prefix", "enable", "what"), [
    ("actor_rollout_ref.ref.fsdp_config", "actor_rollout_ref.actor.use_kl_loss=true", "the reference policy"),
    ("reward_model.model.fsdp_config", "reward_model.enable=true", "the reward model"),
])
def test_optimizer_settings_of_a_frozen_model_are_errors(model_dir: Path, prefix: str, enable: str, what: str,
                                                         key: str) -> None:
    name, _, value = key.partition("=")
    default = {"offload_grad_dtype": "'fp32'", "merge_micro_batches": "true"}.get(name, "false")
    given = value if value in ('true', 'false') else repr(value)
    if name == "optimizer_offload":  # verl's own key, which verl runs with and ignores: a warning
        loaded = load_config_with_notes(None, [enable, f"reward_model.model.path={model_dir}", f"{prefix}.{key}"])
        assert [str(warning) for warning in loaded.warnings] == [
            f"{prefix}.{name}: got {given}, but {what} is frozen (no gradients, no optimizer): it has no effect (the "
            f"default: {default}; leave the key out)"]
        return
    problems = problems_of(None, [enable, f"reward_model.model.path={model_dir}", f"{prefix}.{key}"])
    # Only this one: the check that bf16 host gradients sit beside fp32 masters has no gradients to judge.
    assert [str(problem) for problem in problems] == [
        f"{prefix}.{name}: got {given}, but {what} is frozen "
        f"(no gradients, no optimizer): it would have no effect; allowed: the default ({default}; leave the key out)"]


def test_keys_left_at_their_defaults_on_a_model_not_built_are_fine(tmp_path: Path) -> None:
    # Written out explicitly (as a resolved config is), but equal to the defaults: nothing to say.
    config = load_config(None, [*GRPO_WITHOUT_KL, "critic.fsdp_config.param_offload=false",
                                "actor_rollout_ref.ref.fsdp_config.dynamic_offload.enabled=false",
                                "reward_model.model.fsdp_config.optimizer_offload=false",
                                "dynamic_offload.min_transformer_layers_on_gpu=0"])
    assert load_config(write(tmp_path / "resolved.yaml", dump_config(config))) == config


def test_ignored_keys_are_reported_with_the_other_problems() -> None:
    problems = problems_of(None, ["algorithm.adv_estimator=grpo", "critic.fsdp_config.param_offload=true",
                                  "data.train_batch_size=100", "dynamic_offload.min_transformer_layers_on_gpu=1",
                                  "actor_rollout_ref.actor.fsdp_config.delayed_update=true"])
    # verl's keys that verl runs with (GRPO with one response, the critic's placement without a critic): warnings.
    assert [problem.path for problem in problems] == [
        "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.fsdp_config.delayed_update",
        "dynamic_offload.min_transformer_layers_on_gpu"]


# --------------------------------------------------------------------------- dynamic offload's levels

MODEL_FSDP_PREFIXES = ["actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config",
                       "critic.fsdp_config", "reward_model.model.fsdp_config"]


def test_the_threshold_and_the_layer_minimum_are_run_wide() -> None:
    config = load_config(None, ["dynamic_offload.gpu_memory_threshold=0.7",
                                "dynamic_offload.min_transformer_layers_on_gpu=3",
                                "critic.fsdp_config.dynamic_offload.enabled=true"])
    assert (config.dynamic_offload.gpu_memory_threshold, config.dynamic_offload.min_transformer_layers_on_gpu) == (
        0.7, 3)
    assert list(type(config.critic.fsdp_config.dynamic_offload).model_fields) == ["enabled"]
    assert (load_config().dynamic_offload.gpu_memory_threshold,
            load_config().dynamic_offload.min_transformer_layers_on_gpu) == (0.85, 0)


@pytest.mark.parametrize("prefix", MODEL_FSDP_PREFIXES)
def test_a_level_under_a_model_is_read_as_the_run_wide_one(prefix: str) -> None:
    """The article puts the levels under a model's fsdp_config (§3.1): read as the run-wide keys."""
    config = load_config(None, [f"{prefix}.dynamic_offload.gpu_memory_threshold=0.8"])
    assert config.dynamic_offload.gpu_memory_threshold == 0.8


def test_the_articles_levels_under_the_actor_set_the_run_wide_ones(tmp_path: Path) -> None:
    article = write(tmp_path / "article.yaml", """
actor_rollout_ref:
  actor:
    fsdp_config:
      dynamic_offload: {enabled: true, gpu_memory_threshold: 0.85, min_transformer_layers_on_gpu: 4}
critic:
  fsdp_config:
    dynamic_offload: {enabled: true, gpu_memory_threshold: 0.85}
""")
    config = load_config(article)
    assert (config.dynamic_offload.gpu_memory_threshold, config.dynamic_offload.min_transformer_layers_on_gpu) == (
        0.85, 4)
    assert config.actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled
    assert config.critic.fsdp_config.dynamic_offload.enabled
    disagree = write(tmp_path / "disagree.yaml", """
dynamic_offload: {gpu_memory_threshold: 0.9}
critic:
  fsdp_config:
    dynamic_offload: {enabled: true, gpu_memory_threshold: 0.85}
""")
    assert [str(problem) for problem in problems_of(disagree)] == [
        "critic.fsdp_config.dynamic_offload.gpu_memory_threshold: got 0.85, but dynamic_offload.gpu_memory_threshold "
        "is 0.9: the two are one setting (dynamic_offload.gpu_memory_threshold is its canonical place); allowed: one "
        "of them, or the same value"]


def test_enabling_dynamic_offload_run_wide_says_it_is_per_model() -> None:
    [problem] = problems_of(None, ["dynamic_offload.enabled=true"])
    assert problem.path == "dynamic_offload.enabled"
    assert "enabled per model" in problem.message
    assert "actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true" in problem.message


# ----------------------------------------------------------------------------------- live settings

# Each live setting that a config sets too: its short name -> its config key, which is its canonical name.
CONFIG_KEY_OF_LIVE_SETTING = {
    "gpu_memory_threshold": "dynamic_offload.gpu_memory_threshold",
    "min_transformer_layers_on_gpu": "dynamic_offload.min_transformer_layers_on_gpu",
    "gpu_sample_interval_s": "telemetry.gpu_sample_interval_s",
    "pcie_sample_interval_s": "telemetry.pcie_sample_interval_s",
    "log_level": "daemon.log_level",
}


def config_field(dotted: str) -> FieldInfo:
    section: type[Section] = RunConfig
    *parents, name = dotted.split(".")
    for parent in parents:
        section = section.model_fields[parent].annotation
    return section.model_fields[name]


def live_field(name: str) -> FieldInfo:
    return next(field for key, field in LiveSettings.model_fields.items() if (field.alias or key) == name)


def test_every_live_setting_but_the_switch_is_named_by_its_config_key() -> None:
    assert set(SETTING_NAMES) == {*CONFIG_KEY_OF_LIVE_SETTING.values(), "dynamic_offload.enabled"}
    assert SHORT_NAMES == CONFIG_KEY_OF_LIVE_SETTING
    # One row of the table per LiveSettings field, and the field is validated under the row's name.
    assert {setting.attribute: setting.name for setting in LIVE_SETTINGS} == {
        key: field.alias for key, field in LiveSettings.model_fields.items()}


@pytest.mark.parametrize("setting", CONFIG_KEY_OF_LIVE_SETTING)
def test_a_live_setting_has_its_config_keys_bounds_default_and_docstring(setting: str) -> None:
    key = CONFIG_KEY_OF_LIVE_SETTING[setting]
    configured, live = config_field(key), live_field(key)
    assert live.annotation == configured.annotation
    # The same constraint objects, not equal copies: one definition of each bound.
    assert len(live.metadata) == len(configured.metadata)
    assert all(ours is theirs for ours, theirs in zip(live.metadata, configured.metadata, strict=True))
    assert (live.default, live.description) == (configured.default, configured.description)


@pytest.mark.parametrize(("setting", "value", "accepted"), [
    ("gpu_memory_threshold", 0.0, False), ("gpu_memory_threshold", 1e-9, True), ("gpu_memory_threshold", 1.0, True),
    ("gpu_memory_threshold", 1.0001, False), ("gpu_memory_threshold", -0.5, False),
    ("min_transformer_layers_on_gpu", -1, False), ("min_transformer_layers_on_gpu", 0, True),
    ("min_transformer_layers_on_gpu", 12, True), ("min_transformer_layers_on_gpu", 1.5, False),
    ("gpu_sample_interval_s", 0.049, False), ("gpu_sample_interval_s", 0.05, True),
    ("gpu_sample_interval_s", 60.0, True), ("gpu_sample_interval_s", 60.5, False),
    ("pcie_sample_interval_s", 0.5, False), ("pcie_sample_interval_s", 1.0, True),
    ("pcie_sample_interval_s", 600.0, True), ("pcie_sample_interval_s", 601.0, False),
    ("log_level", "debug", True), ("log_level", "verbose", False), ("log_level", "ERROR", False),
])
def test_the_config_and_the_live_settings_accept_the_same_values(setting: str, value: object, accepted: bool) -> None:
    section, key = CONFIG_KEY_OF_LIVE_SETTING[setting].split(".")
    raw = {section: {key: value},  # a layer minimum with no model to apply to would be an ignored key
           "actor_rollout_ref": {"actor": {"fsdp_config": {"dynamic_offload": {"enabled": True}}}}}
    try:
        validate_config(raw)
        by_config = True
    except ConfigError as error:
        assert [problem.path for problem in error.problems] == [f"{section}.{key}"]
        by_config = False
    try:
        apply_change(LiveSettings(), {setting: value})
        live = True
    except SettingsRejected as error:
        assert [problem.setting for problem in error.problems] == [f"{section}.{key}"]
        live = False
    assert (by_config, live) == (accepted, accepted)


def test_the_live_settings_start_from_the_run_wide_section_and_the_telemetry_and_daemon_ones() -> None:
    assert initial_live_settings(load_config()) == LiveSettings()  # the defaults agree
    config = load_config(None, ["dynamic_offload.gpu_memory_threshold=0.7",
                                "dynamic_offload.min_transformer_layers_on_gpu=3",
                                "actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true",
                                "telemetry.gpu_sample_interval_s=2", "telemetry.pcie_sample_interval_s=30",
                                "daemon.log_level=debug"])
    assert initial_live_settings(config).public() == {
        "dynamic_offload.gpu_memory_threshold": 0.7, "dynamic_offload.min_transformer_layers_on_gpu": 3,
        "dynamic_offload.enabled": True, "telemetry.gpu_sample_interval_s": 2.0,
        "telemetry.pcie_sample_interval_s": 30.0, "daemon.log_level": "debug"}


@pytest.mark.parametrize(("enabled_on", "builds_it"), [
    ("actor_rollout_ref.actor", []),
    ("critic", []),  # PPO with GAE: the critic is built
    ("actor_rollout_ref.ref", ["actor_rollout_ref.actor.use_kl_loss=true"]),
    ("reward_model.model", ["reward_model.enable=true", "reward_model.model.path={model}"]),
])
def test_dynamic_offload_starts_switched_on_when_any_model_enables_it(
        model_dir: Path, enabled_on: str, builds_it: list[str]) -> None:
    """Whichever model enables it: a run where only the critic did once started with dynamic offload paused."""
    overrides = [override.replace("{model}", str(model_dir)) for override in builds_it]
    assert not initial_live_settings(load_config(None, overrides)).dynamic_offload_enabled
    config = load_config(None, [*overrides, f"{enabled_on}.fsdp_config.dynamic_offload.enabled=true"])
    assert initial_live_settings(config).dynamic_offload_enabled


@pytest.mark.parametrize("example", ["quickstart.yaml", "grpo.yaml"])
def test_the_runnable_examples_load(example: str) -> None:
    load_config(EXAMPLES / example)


# ------------------------------------------------------------------------------------- bad configs

# (case id, YAML file text or None, overrides, the dotted key reported, a phrase of its message).
# "{tmp}" in a file or an override is replaced by a fresh folder that holds:
#   empty_dir/ (no config.json) and prompts.csv.
BAD_CONFIGS = [
    ("wrong type", None, ["data.train_batch_size=abc"],
     "data.train_batch_size", "got 'abc', not an integer; allowed: an integer >= 1"),
    ("boolean for a number", None, ["data.train_batch_size=true"],
     "data.train_batch_size", "a boolean"),
    ("fraction for an integer", None, ["data.train_batch_size=1.5"],
     "data.train_batch_size", "not a whole number"),
    ("unknown key", None, ["actor_rollout_ref.actor.optm.lr=1e-5"],
     "actor_rollout_ref.actor.optm", "did you mean 'optim'?"),
    ("unknown key in a file", "actor_rollout_ref:\n  rollout:\n    temprature: 0.7\n", [],
     "actor_rollout_ref.rollout.temprature", "did you mean 'temperature'?"),
    ("unknown section", "trainers:\n  total_epochs: 2\n", [],
     "trainers", "unknown section 'trainers' (did you mean 'trainer'?)"),
    ("threshold above 1", None, ["dynamic_offload.gpu_memory_threshold=1.5"],
     "dynamic_offload.gpu_memory_threshold", "got 1.5, out of range; allowed: a number > 0 and <= 1"),
    ("negative layer minimum", None, ["dynamic_offload.min_transformer_layers_on_gpu=-1"],
     "dynamic_offload.min_transformer_layers_on_gpu", "got -1, out of range; allowed: an integer >= 0"),
    ("top_p of 0", None, ["actor_rollout_ref.rollout.top_p=0"],
     "actor_rollout_ref.rollout.top_p", "> 0 and <= 1"),
    ("infinite learning rate", None, ["actor_rollout_ref.actor.optim.lr=inf"],
     "actor_rollout_ref.actor.optim.lr", "not a finite number"),
    ("betas not a pair", None, ["actor_rollout_ref.actor.optim.betas=[0.9]"],
     "actor_rollout_ref.actor.optim.betas", "two numbers"),
    ("bad enum", None, ["algorithm.adv_estimator=ppo"],
     "algorithm.adv_estimator", "got 'ppo', not one of the choices; allowed: 'gae' or 'grpo'"),
    ("bad placement", None, ["critic.fsdp_config.offload_policy.embedding=disk"],
     "critic.fsdp_config.offload_policy.embedding", "allowed: 'cpu' or 'gpu'"),
    ("value for a section", None, ["actor_rollout_ref.actor.fsdp_config.offload_policy=cpu"],
     "actor_rollout_ref.actor.fsdp_config.offload_policy", "is a section; allowed: a mapping of its keys"),
    ("run name with a slash", None, ["trainer.experiment_name=a/b"],
     "trainer.experiment_name", "cannot name a run folder"),
    ("missing model directory", None, ["actor_rollout_ref.model.path=/no/such/model"],
     "actor_rollout_ref.model.path", "'/no/such/model', which is not a directory"),
    ("model directory without config.json", None, ["actor_rollout_ref.model.path={tmp}/empty_dir"],
     "actor_rollout_ref.model.path", "a directory without config.json"),
    ("missing tokenizer directory", None, ["actor_rollout_ref.model.tokenizer_path=/no/such/tokenizer"],
     "actor_rollout_ref.model.tokenizer_path", "not a directory"),
    ("missing data file", None, ["data.train_files=[builtin:counting, /no/such/train.parquet]"],
     "data.train_files[1]", "'/no/such/train.parquet', which does not exist"),
    ("a directory as a data file", None, ["data.train_files={tmp}/empty_dir"],
     "data.train_files[0]", "which is a directory; allowed: .parquet, .jsonl, .json files"),
    ("a parquet directory as a data file", None, ["data.train_files={tmp}/shards.parquet"],
     "data.train_files[0]", "which is a directory; allowed: .parquet, .jsonl, .json files"),
    ("reward error policy without a reward function", None, ["custom_reward_function.on_error=zero"],
     "custom_reward_function.on_error", "no custom reward function is set (custom_reward_function.path)"),
    ("reward error policy not a choice", None, ["custom_reward_function.on_error=skip"],
     "custom_reward_function.on_error", "'skip'"),
    ("data file with a wrong suffix", None, ["data.val_files={tmp}/prompts.csv", "trainer.test_freq=5"],
     "data.val_files[0]", "a file format that cannot be read; allowed: .parquet, .jsonl, .json"),
    ("no training data", None, ["data.train_files=[]"],
     "data.train_files", "got an empty list"),
    ("unknown built-in dataset", None, ["data.train_files=builtin:countng"],
     "data.train_files[0]", "not a built-in dataset; allowed: .parquet, .jsonl, .json files"),
    ("unknown built-in model", None, ["actor_rollout_ref.model.path=builtin:tiny-llama"],
     "actor_rollout_ref.model.path", "not a built-in model; allowed: builtin:tiny-qwen2"),
    ("gae without a critic", None, ["critic.enable=false"],
     "critic.enable", "algorithm.adv_estimator=gae needs a critic"),
    ("mini-batch not dividing the batch", None,
     ["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=48"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "48, which does not divide data.train_batch_size (64)"),
    ("mini-batch larger than the batch", None, ["data.train_batch_size=16"],
     "actor_rollout_ref.actor.ppo_mini_batch_size", "256, which is larger than data.train_batch_size (16)"),
    ("micro-batch not dividing the mini-batch", None,
     ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"],
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "the mini-batch of 12 sequences"),
    ("critic mini-batch of its own", None, ["data.train_batch_size=256", "critic.ppo_mini_batch_size=100"],
     "critic.ppo_mini_batch_size", "100, which does not divide data.train_batch_size (256)"),
    ("reward model without a path", None, ["reward_model.enable=true"],
     "reward_model.model.path", "is not set, but reward_model.enable is true"),
    ("validation without data", None, ["trainer.test_freq=5"],
     "trainer.test_freq", "data.val_files is empty"),
    ("resume_path without a path", None, ["trainer.resume_mode=resume_path"],
     "trainer.resume_from_path", "is not set, but trainer.resume_mode is resume_path"),
    ("a global batch whose sequences do not divide among the ranks", None,
     ["trainer.n_gpus_per_node=2", "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
     "data.train_batch_size", "got 3, whose 3 sequences (x rollout.n 1) do not divide among the run's 2 ranks"),
    ("a delayed update split between the GPU and the host on several ranks", None,
     ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
      "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "actor_rollout_ref.actor.fsdp_config.delayed_update=true",
      "actor_rollout_ref.actor.fsdp_config.optimizer_update=both"],
     "actor_rollout_ref.actor.fsdp_config.optimizer_update", "got both with delayed_update true; on several ranks"),
    ("a delayed update on the GPU on several ranks", None,
     ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
      "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "actor_rollout_ref.actor.fsdp_config.delayed_update=true",
      "actor_rollout_ref.actor.fsdp_config.optimizer_update=gpu"],
     "actor_rollout_ref.actor.fsdp_config.optimizer_update", "got gpu with delayed_update true; on several ranks"),
    ("sequence_parallel_offload without sequence parallelism", None,
     ["actor_rollout_ref.actor.sequence_parallel_offload=true"],
     "actor_rollout_ref.actor.sequence_parallel_offload", "ulysses_sequence_parallel_size is 1"),
    ("a sequence-parallel degree above the ranks", None,
     ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
     "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "got 4, more than the run's 2 rank(s)"),
    ("a sequence-parallel degree that does not split the heads", None,
     ["trainer.n_gpus_per_node=3", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"],
     "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "the model's 4 attention heads do not divide by it"),
    ("a mini-batch that leaves no sequence to a data-parallel group", None,
     ["trainer.n_gpus_per_node=8", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     "actor_rollout_ref.actor.ppo_mini_batch_size",
     "got 1, which leaves no sequence per rank: 1 x rollout.n 1 // 4 data-parallel groups is 0"),
    ("bf16 host gradients of an fp32 model", None,
     ["actor_rollout_ref.actor.fsdp_config.offload_grad_dtype=bf16",
      "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"],
     "actor_rollout_ref.actor.fsdp_config.offload_grad_dtype",
     "got bf16 with optimizer_offload=true and model_dtype=fp32"),
    ("a delayed update of an fp32 actor", None, ["actor_rollout_ref.actor.fsdp_config.delayed_update=true"],
     "actor_rollout_ref.actor.fsdp_config.delayed_update",
     "got true with model_dtype=fp32 and optimizer_offload=false; the rollout reads the bf16 weights"),
    ("a delayed update of the critic", None,
     ["critic.enable=true", "critic.fsdp_config.delayed_update=true", "critic.fsdp_config.model_dtype=bf16",
      "critic.fsdp_config.optimizer_offload=true"],
     "critic.fsdp_config.delayed_update", "got true, but only the actor's update can run during the rollout"),
    ("missing reward function file", None, ["custom_reward_function.path=/no/such/score.py"],
     "custom_reward_function.path", "not a file"),
    ("override without '='", None, ["data.train_batch_size"],
     "data.train_batch_size", "not an override (no '='); allowed: key=value, +key=value (add a key)"),
    ("override through a value", None, ["data.train_batch_size.x=1"],
     "data.train_batch_size", "is a setting, not a section"),
    ("override through a value set in the file", "data:\n  train_batch_size: 8\n",
     ["data.train_batch_size.x=1"],
     "data.train_batch_size", "is a setting, not a section"),
    ("override through a section the file sets to a value", "trainer: 3\n", ["trainer.seed=1"],
     "trainer", "the config file sets trainer to 3"),
    ("YAML syntax error", "data:\n  train_batch_size: 4\n   bad: [\n", [],
     "--config", "is not valid YAML at line 3"),
    ("YAML key given twice", "data:\n  train_batch_size: 4\n  train_batch_size: 8\n", [],
     "--config", "key 'train_batch_size' appears twice (first on line 2)"),
    ("YAML list instead of a mapping", "- data\n- trainer\n", [],
     "--config", "holds a list; allowed: a mapping of sections"),
]


@pytest.mark.parametrize(("yaml_text", "overrides", "key", "phrase"),
                         [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS])
def test_a_bad_config_names_its_key_and_what_is_allowed(
        tmp_path: Path, yaml_text: str | None, overrides: list[str], key: str, phrase: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "shards.parquet").mkdir()
    write(tmp_path / "prompts.csv", "prompt\n1 2 3\n")
    config_file = write(tmp_path / "run.yaml", yaml_text) if yaml_text is not None else None
    problems = problems_of(config_file, [override.replace("{tmp}", str(tmp_path)) for override in overrides])
    assert [problem.path for problem in problems] == [key], problems
    assert phrase in problems[0].message
    assert "; allowed: " in problems[0].message  # every message says what would be accepted
    assert "\n" not in str(problems[0])


def test_a_missing_config_file_is_one_problem(tmp_path: Path) -> None:
    problems = problems_of(tmp_path / "nope.yaml")
    assert [str(problem) for problem in problems] == [
        f"--config: got '{tmp_path / 'nope.yaml'}', which does not exist; allowed: a YAML file"]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    config_file = write(tmp_path / "run.yaml", """
data:
  train_batch_size: abc                # schema: not an integer
  train_files: [/no/such/train.parquet]   # disk: missing
actor_rollout_ref:
  model: {path: /no/such/model}        # disk: missing
  actor:
    optm: {lr: 1.0e-5}                 # schema: unknown key
    ppo_mini_batch_size: 3             # fine on its own; cannot be judged against a bad batch size
algorithm:
  adv_estimator: ppo                   # schema: bad choice
""")
    problems = problems_of(config_file, ["actor_rollout_ref.rollout.top_p=0"])
    assert sorted(problem.path for problem in problems) == sorted([
        "data.train_batch_size",
        "data.train_files[0]",
        "actor_rollout_ref.model.path",
        "actor_rollout_ref.actor.optm",
        "algorithm.adv_estimator",
        "actor_rollout_ref.rollout.top_p",
    ])


def test_semantic_problems_are_all_reported_together(tmp_path: Path) -> None:
    problems = problems_of(None, ["algorithm.adv_estimator=grpo", "data.train_files=/no/such.jsonl",
                                  "reward_model.enable=true", "data.train_batch_size=100",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=64"])
    assert {problem.path for problem in problems} == {
        "data.train_files[0]", "reward_model.model.path", "actor_rollout_ref.actor.ppo_mini_batch_size"}


def test_every_malformed_override_is_reported_at_once() -> None:
    problems = problems_of(None, ["nonsense", "data.train_batch_size=8", "a..b=1"])
    assert [problem.path for problem in problems] == ["nonsense", "a..b"]


def test_the_error_text_is_one_line_per_problem() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["data.train_batch_size=abc", "algorithm.adv_estimator=ppo"])
    assert str(caught.value).splitlines() == [str(problem) for problem in caught.value.problems]
    assert len(caught.value.problems) == 2


# ----------------------------------------------------------------------------------------- examples


@pytest.mark.parametrize("alias", ["k1", "k2", "k3"])
def test_verl_names_of_the_kl_estimators_are_accepted(alias: str) -> None:
    """k1, k2, k3 are verl's names for kl, mse, low_var_kl; test_algorithms checks they compute the same."""
    config = load_config(None, [f"actor_rollout_ref.actor.kl_loss_type={alias}", f"algorithm.kl_penalty={alias}"])
    assert config.actor_rollout_ref.actor.kl_loss_type == alias
    assert config.algorithm.kl_penalty == alias


def test_an_unknown_kl_estimator_lists_the_aliases_too() -> None:
    problems = problems_of(None, ["algorithm.kl_penalty=k4"])
    assert [problem.path for problem in problems] == ["algorithm.kl_penalty"]
    assert "'low_var_kl' or 'k1' or 'k2' or 'k3'" in problems[0].message


def test_the_grpo_example_validates_as_it_is() -> None:
    config = load_config(EXAMPLES / "grpo.yaml")
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.rollout.n >= 4
    assert config.actor_rollout_ref.actor.use_kl_loss
    assert config.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert config.critic.enable is False
    assert config.actor_rollout_ref.model.path == "builtin:tiny-qwen2"
    assert config.data.train_files == ["builtin:counting"]


def test_the_7b_example_reports_its_placeholder_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # so a real ~/data/gsm8k on this machine cannot satisfy it
    problems = problems_of(EXAMPLES / "ppo_7b.yaml")
    assert {problem.path for problem in problems} == {
        "actor_rollout_ref.model.path", "critic.model.path", "data.train_files[0]", "data.val_files[0]"}
    assert any("/path/to/Qwen2.5-7B-Instruct" in problem.message for problem in problems)


def test_the_7b_example_validates_once_its_paths_are_filled_in(model_dir: Path, tmp_path: Path) -> None:
    train = write(tmp_path / "gsm8k" / "train.parquet", "")
    test = write(tmp_path / "gsm8k" / "test.parquet", "")
    config = load_config(EXAMPLES / "ppo_7b.yaml", [
        f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
        f"data.train_files=[{train}]", f"data.val_files=[{test}]"])
    assert config.critic.enable is True
    for fsdp in config.fsdp_configs().values():
        assert fsdp.model_dtype == "bf16"
        assert fsdp.param_offload
    assert config.actor_rollout_ref.model.enable_gradient_checkpointing
    assert config.actor_rollout_ref.actor.fsdp_config.optimizer_offload
    assert config.critic.fsdp_config.optimizer_offload
    assert config.actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled
    assert config.critic.fsdp_config.dynamic_offload.enabled
    assert (config.dynamic_offload.gpu_memory_threshold, config.dynamic_offload.min_transformer_layers_on_gpu) == (
        0.85, 4)
    assert (config.data.max_prompt_length, config.data.max_response_length) == (512, 1024)
    assert config.algorithm.use_kl_in_reward, "the KL penalty is what the offloaded reference is for"


def test_the_7b_example_on_several_ranks_warns_of_its_embedding_cache_alone(model_dir: Path, tmp_path: Path) -> None:
    """examples/README.md: of what ppo_7b.yaml turns on, only the embedding cache is one rank's (on several it has
    nothing to cache: a warning); its dynamic offload runs on several ranks (trainer/distributed/layer_moves.py)."""
    train = write(tmp_path / "gsm8k" / "train.parquet", "")
    test = write(tmp_path / "gsm8k" / "test.parquet", "")
    paths = [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
             f"data.train_files=[{train}]", f"data.val_files=[{test}]", "trainer.n_gpus_per_node=2"]
    warnings = load_config_with_notes(EXAMPLES / "ppo_7b.yaml", paths).warnings
    assert [warning.path for warning in warnings] == ["actor_rollout_ref.rollout.embedding_cache.enabled"]
    assert "works on one rank only, and this run has 2" in warnings[0].message
    config = load_config(EXAMPLES / "ppo_7b.yaml", [*paths, "actor_rollout_ref.rollout.embedding_cache.enabled=false"])
    assert config.actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled
    assert config.critic.fsdp_config.dynamic_offload.enabled


def test_the_schema_documents_every_field() -> None:
    """STYLE.md: every field has a one-line docstring in one place."""
    undocumented = []
    sections: list[type] = [RunConfig]
    seen = set()
    while sections:
        section = sections.pop()
        if section in seen:
            continue
        seen.add(section)
        for name, field in section.model_fields.items():
            if not field.description or "\n" in field.description:
                undocumented.append(f"{section.__name__}.{name}")
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                sections.append(annotation)
    assert len(seen) > 15  # the walk reached the nested sections
    assert undocumented == []


@pytest.mark.parametrize("where", ["cpu", "gpu", "both"])
def test_several_ranks_accept_an_offloaded_update_on_the_host_on_the_gpu_or_split(where: str) -> None:
    """optimizer_update cpu, gpu and both are what HostAdamW does on several ranks."""
    config = load_config(None, ["trainer.n_gpus_per_node=2",
                                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                                f"actor_rollout_ref.actor.fsdp_config.optimizer_update={where}"])
    assert config.actor_rollout_ref.actor.fsdp_config.optimizer_update == where


def test_several_ranks_accept_the_actors_delayed_update() -> None:
    """HostAdamW delays its host arithmetic into the next rollout on several ranks as one rank's engine does."""
    config = load_config(None, ["trainer.n_gpus_per_node=2",
                                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                                "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
                                "actor_rollout_ref.actor.fsdp_config.delayed_update=true"])
    assert config.actor_rollout_ref.actor.fsdp_config.delayed_update
