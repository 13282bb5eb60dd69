"""The rules of a config beyond its schema: how fields fit together. Every rule is listed in one tuple
(`all_rules`) and run in one pass (`check_semantics`), those that read the disk and the environment
(environment.py) and those of several ranks (ranks.py) included, so that every problem is named at once.

A config the schema refused still gets every rule that does not read a refused value
(`checks_despite_schema_errors`): each refused key holds a RefusedValue, and a rule that reads one is skipped.
"""

from __future__ import annotations

import copy
import itertools
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from trainer.config import environment, ranks
from trainer.config.errors import ConfigProblem, dotted, ignored, meant_key
from trainer.config.fields import Section, show
from trainer.config.placement import DynamicOffloadConfig, FSDPConfig, WrapPolicy
from trainer.config.ranks import data_parallel_size
from trainer.config.schema import (
    FROZEN_ROLES,
    FSDP_PREFIX,
    CriticModelConfig,
    CustomRewardFunction,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RolloutConfig,
    RunConfig,
)

Rule = Callable[[RunConfig], list[ConfigProblem]]


def check_semantics(config: RunConfig) -> list[ConfigProblem]:
    """Problems no single field can see: files, paths, and how fields fit together."""
    return [problem for rule in all_rules() for problem in rule(config)]


def all_rules() -> tuple[Rule, ...]:
    """Every check beyond the schema, each small enough that one refused value skips little (see
    checks_despite_schema_errors): the disk and the environment first, then how fields fit together."""
    return (environment.check_actor_model_paths, environment.check_critic_model_paths,
            environment.check_reward_model_paths, environment.check_train_files, environment.check_val_files,
            environment.check_reward_function_file, environment.trackers_installed,
            _check_batch_sizes, _check_token_budgets, _grpo_needs_several_responses, _gae_needs_a_critic,
            _clip_range_is_positive,
            _resume_path_is_set, _validation_needs_data, ranks.check_devices, ranks.check_launch, _check_offload,
            _settings_of_models_not_built, _training_settings_of_frozen_models, _settings_not_built_yet,
            _layer_minimum_without_dynamic_offload, _reward_error_policy_without_a_function,
            environment.actor_peft_installed, _actor_lora_keys, environment.critic_peft_installed, _critic_lora_keys,
            _checkpoint_counts_agree, _critic_warmup_needs_a_critic, _validation_only_needs_data,
            _scheduler_names_agree, _passk_needs_several_responses)


def checks_despite_schema_errors(raw: dict[str, Any], errors: Sequence[ErrorDetails]) -> list[ConfigProblem]:
    """The checks beyond the schema of a config that failed it, so that every problem shows in one round.

    The refused values are dropped and the rest validated again; in that config each refused key holds a
    RefusedValue, and a check that reads one is skipped, since it would judge a default the user did not
    write. A key misspelt (an unknown key close to a known one) refuses the key it was likely meant for.
    Problems at or under a dropped key are left out: the schema has named them.
    """
    patched = copy.deepcopy(raw)
    dropped: list[str] = []
    refused: list[list[str]] = []
    for error in errors:
        field_path = [str(part) for part in itertools.takewhile(lambda part: isinstance(part, str), error["loc"])]
        if field_path and _drop(patched, field_path):
            dropped.append(dotted(field_path))
            refused.append(field_path)
        if error["type"] == "extra_forbidden" and field_path:
            refused += [field_path[:-1] + [meant] for meant in meant_key(field_path)]
    try:
        config = RunConfig.model_validate(patched)
    except ValidationError:
        return []
    for field_path in refused:
        config = typing.cast(RunConfig, _refuse(config, field_path))
    problems = []
    for rule in all_rules():
        try:
            problems += rule(config)
        except RefusedValueRead:
            continue
    return [problem for problem in problems if not any(_is_under(problem.path, key) for key in dropped)]


class RefusedValueRead(Exception):
    """A check read a value the schema refused."""


class RefusedValue:
    """Stands in a config for a value the schema refused: any use of it (a comparison, arithmetic, truth,
    text, an attribute) raises RefusedValueRead, so a check never judges the default in its place."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RefusedValueRead

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __neg__ = __abs__ = _refuse
    __str__ = __format__ = __iter__ = __len__ = __contains__ = __index__ = __int__ = __float__ = _refuse
    __fspath__ = __getitem__ = _refuse

    def __getattr__(self, name: str) -> Any:
        raise RefusedValueRead

    def __repr__(self) -> str:
        return "<refused by the schema>"


def _refuse(section: Section, field_path: Sequence[str]) -> Section:
    """`section` with the field at `field_path` (or the deepest section field on the way) a RefusedValue."""
    name = field_path[0]
    if name not in type(section).model_fields:
        return section
    value = getattr(section, name)
    if len(field_path) > 1 and isinstance(value, Section):
        return section.model_copy(update={name: _refuse(value, field_path[1:])})
    return section.model_copy(update={name: RefusedValue()})


def _drop(raw: dict[str, Any], field_path: Sequence[str]) -> bool:
    node: Any = raw
    for part in field_path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and field_path[-1] in node:
        del node[field_path[-1]]
        return True
    return False


def _is_under(path: str, key: str) -> bool:
    return path == key or path.startswith((key + ".", key + "["))


# ------------------------------------------------------------------------ the algorithm and batches


def _check_batch_sizes(config: RunConfig) -> list[ConfigProblem]:
    problems = []
    world, sp = data_parallel_size(config), config.sequence_parallel_size
    batch = config.data.train_batch_size
    n = config.actor_rollout_ref.rollout.n
    actor = config.actor_rollout_ref.actor
    # With use_dynamic_bsz the token budget forms the micro-batches: their size in sequences is not used.
    sections = [("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                 actor.use_dynamic_bsz)]
    critic = config.critic
    # A critic size left unset inherits the actor's: only its own values are reported under critic.
    if config.use_critic and (critic.ppo_mini_batch_size or critic.ppo_micro_batch_size_per_gpu):
        sections.append(("critic", critic.ppo_mini_batch_size or actor.ppo_mini_batch_size,
                         critic.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu,
                         actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz))
    for prefix, mini, micro, by_tokens in sections:
        if batch % mini:
            why = "is larger than" if mini > batch else "does not divide"
            problems.append(ConfigProblem(f"{prefix}.ppo_mini_batch_size", f"got {mini}, which {why} "
                                          f"data.train_batch_size ({batch}); allowed: a divisor of {batch}, "
                                          f"e.g. {_largest_divisor(batch, mini)}"))
        elif not by_tokens and mini % world == 0 and (mini * n // world) % micro:
            # Each data-parallel group's share of the mini-batch is what its micro-batches split.
            sequences = mini * n // world
            per_rank = "" if world == 1 else f" / {world} data-parallel groups" if sp > 1 else f" / {world} ranks"
            problems.append(ConfigProblem(
                f"{prefix}.ppo_micro_batch_size_per_gpu",
                f"got {micro}, which does not divide the mini-batch of {sequences} sequences "
                f"(ppo_mini_batch_size {mini} x rollout.n {n}{per_rank}); allowed: a divisor of {sequences}, "
                f"e.g. {_largest_divisor(sequences, micro)}"))
    return problems


def _check_token_budgets(config: RunConfig) -> list[ConfigProblem]:
    """Each token budget in use holds the longest sequence a batch can have (verl asserts it at run time)."""
    data = config.data
    longest = data.max_prompt_length + data.max_response_length
    problems = {}
    for key, budget in _token_budgets_in_use(config):
        if budget < longest and key not in problems:
            problems[key] = ConfigProblem(key, f"got {budget}, smaller than the longest sequence a batch can hold "
                                          f"(data.max_prompt_length {data.max_prompt_length} + "
                                          f"data.max_response_length {data.max_response_length} = {longest} "
                                          f"tokens); allowed: at least {longest}")
    return list(problems.values())


def _token_budgets_in_use(config: RunConfig) -> list[tuple[str, int]]:
    """(the key that sets it, tokens) of every micro-batch token budget the run uses."""
    actor_prefix, actor = "actor_rollout_ref.actor", config.actor_rollout_ref.actor
    inherited = (f"{actor_prefix}.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu)
    budgets = [inherited] if actor.use_dynamic_bsz else []
    scorers: list[tuple[str, RolloutConfig | RefConfig]] = [("actor_rollout_ref.rollout",
                                                            config.actor_rollout_ref.rollout)]
    if config.use_reference:
        scorers.append(("actor_rollout_ref.ref", config.actor_rollout_ref.ref))
    for prefix, section in scorers:
        enabled = section.log_prob_use_dynamic_bsz
        if actor.use_dynamic_bsz if enabled is None else enabled:
            budget = section.log_prob_max_token_len_per_gpu
            budgets.append(inherited if budget is None else (f"{prefix}.log_prob_max_token_len_per_gpu", budget))
    critic = config.critic
    if config.use_critic and (actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz):
        update = ("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu)
        forward = critic.forward_max_token_len_per_gpu
        budgets += [update, update if forward is None else ("critic.forward_max_token_len_per_gpu", forward)]
    return budgets


def _largest_divisor(number: int, at_most: int) -> int:
    return max(divisor for divisor in range(1, min(number, at_most) + 1) if number % divisor == 0)


def _grpo_needs_several_responses(config: RunConfig) -> list[ConfigProblem]:
    n = config.actor_rollout_ref.rollout.n
    if config.algorithm.adv_estimator == "grpo" and n < 2:
        return [ConfigProblem("actor_rollout_ref.rollout.n", f"got {n}, but algorithm.adv_estimator=grpo compares "
                              "responses to the same prompt; allowed: n >= 2")]
    return []


def _passk_needs_several_responses(config: RunConfig) -> list[ConfigProblem]:
    """Pass@k learns from each group's best response's margin over its runner-up: verl refuses a group of one."""
    n = config.actor_rollout_ref.rollout.n
    if config.algorithm.adv_estimator == "grpo_passk" and n < 2:
        return [ConfigProblem("actor_rollout_ref.rollout.n", f"got {n}, but algorithm.adv_estimator=grpo_passk gives "
                              "each prompt's best response its margin over the second best (verl refuses a group of "
                              "one); allowed: n >= 2")]
    return []


def _gae_needs_a_critic(config: RunConfig) -> list[ConfigProblem]:
    if config.algorithm.adv_estimator == "gae" and config.critic.enable is False:
        return [ConfigProblem("critic.enable", "got false, but algorithm.adv_estimator=gae needs a critic; "
                              "allowed: true, or algorithm.adv_estimator=grpo")]
    return []


def _clip_range_is_positive(config: RunConfig) -> list[ConfigProblem]:
    actor = config.actor_rollout_ref.actor
    low, _ = actor.clip_range
    if low >= 1.0:
        key = "clip_ratio_low" if actor.clip_ratio_low is not None else "clip_ratio"
        return [ConfigProblem(f"actor_rollout_ref.actor.{key}", f"got {low}, which lets the policy ratio be "
                              f"clipped at 0 or below; allowed: 0 < {key} < 1")]
    return []


def _resume_path_is_set(config: RunConfig) -> list[ConfigProblem]:
    if config.trainer.resume_mode == "resume_path" and not config.trainer.resume_from_path:
        return [ConfigProblem("trainer.resume_from_path", "is not set, but trainer.resume_mode is resume_path; "
                              "allowed: a global_step_N checkpoint directory")]
    return []


def _validation_needs_data(config: RunConfig) -> list[ConfigProblem]:
    if config.trainer.test_freq > 0 and not config.data.val_files:
        return [ConfigProblem("trainer.test_freq", f"got {config.trainer.test_freq}, but data.val_files is empty; "
                              "allowed: -1 (no validation), or set data.val_files")]
    return []


# ---------------------------------------------------------------- keys that contradict or have no effect


def _checkpoint_counts_agree(config: RunConfig) -> list[ConfigProblem]:
    """max_ckpt_to_keep is this project's count; verl's per-model counts map onto it (checkpoints_to_keep)."""
    trainer = config.trainer
    problems = []
    if not config.use_critic and trainer.max_critic_ckpt_to_keep is not None:
        problems.append(ignored("trainer.max_critic_ckpt_to_keep", trainer.max_critic_ckpt_to_keep, None,
                                 "this run trains no critic"))
    if trainer.max_ckpt_to_keep is None:
        return problems
    for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        count = getattr(trainer, key)
        if count is not None and count != trainer.max_ckpt_to_keep:
            problems.append(ConfigProblem(f"trainer.{key}", f"got {count}, but trainer.max_ckpt_to_keep is "
                                          f"{trainer.max_ckpt_to_keep} and one checkpoint holds every model; "
                                          "allowed: one of the two, or the same count"))
    return problems


def _critic_warmup_needs_a_critic(config: RunConfig) -> list[ConfigProblem]:
    warmup = config.trainer.critic_warmup
    if warmup == 0 or config.use_critic:
        return []
    return [ignored("trainer.critic_warmup", warmup, 0, "this run trains no critic (algorithm.adv_estimator="
                     f"{config.algorithm.adv_estimator}, critic.enable={show(config.critic.enable)})")]


def _validation_only_needs_data(config: RunConfig) -> list[ConfigProblem]:
    if config.trainer.val_only and not config.data.val_files:
        return [ConfigProblem("trainer.val_only", "got true, but data.val_files is empty: there is nothing to "
                              "validate; allowed: false, or set data.val_files")]
    return []


def _scheduler_names_agree(config: RunConfig) -> list[ConfigProblem]:
    """warmup_style is verl's older name of lr_scheduler_type: both given and differing is a contradiction."""
    problems = []
    default = OptimConfig().lr_scheduler_type
    for prefix, optim in (("actor_rollout_ref.actor.optim", config.actor_rollout_ref.actor.optim),
                          ("critic.optim", config.critic.optim)):
        if optim.warmup_style is not None and optim.lr_scheduler_type not in (default, optim.warmup_style):
            problems.append(ConfigProblem(f"{prefix}.warmup_style", f"got {optim.warmup_style!r}, but "
                                          f"{prefix}.lr_scheduler_type is {optim.lr_scheduler_type!r} (warmup_style "
                                          "is verl's older name of it); allowed: one of the two"))
    return problems


# Keys that this run would not act on: an error, not a warning, since whoever reads the config would believe
# them. Only keys set away from their defaults are named, so a default config is clean, and so is a resolved
# one (every default written out).


def _reward_error_policy_without_a_function(config: RunConfig) -> list[ConfigProblem]:
    function, default = config.custom_reward_function, CustomRewardFunction().on_error
    if function.on_error == default or (function.path is not None and not config.reward_model.enable):
        return []
    why = ("the reward model scores this run (reward_model.enable is true)" if config.reward_model.enable
           else "no custom reward function is set (custom_reward_function.path)")
    return [ignored("custom_reward_function.on_error", function.on_error, default, why)]



def _actor_lora_keys(config: RunConfig) -> list[ConfigProblem]:
    return _lora_keys("actor_rollout_ref.model", config.actor_rollout_ref.model, ModelConfig())


def _critic_lora_keys(config: RunConfig) -> list[ConfigProblem]:
    return _lora_keys("critic.model", config.critic.model, CriticModelConfig())


def _lora_keys(prefix: str, model: ModelConfig | CriticModelConfig,
               default: ModelConfig | CriticModelConfig) -> list[ConfigProblem]:
    """LoRA's other keys act only with an adapter (lora_rank > 0; that it needs peft: environment.py)."""
    if model.lora_rank > 0:
        return []
    return [ignored(f"{prefix}.{key}", getattr(model, key), getattr(default, key),
                     f"{prefix}.lora_rank is 0 (no LoRA adapter)", f", or set {prefix}.lora_rank (e.g. 8) to train an "
                     "adapter")
            for key in ("lora_alpha", "target_modules", "exclude_modules")
            if hasattr(model, key) and getattr(model, key) != getattr(default, key)]


# ------------------------------------------------------------------------------------- placement


_TRAINING_ONLY_KEYS = ("optimizer_offload", "optimizer_update", "offload_grad_dtype", "delayed_update",
                       "merge_micro_batches")


def _fsdp_configs_by_role(config: RunConfig) -> dict[str, FSDPConfig]:
    """Every model's placement config, whether or not the run builds that model."""
    return {"actor": config.actor_rollout_ref.actor.fsdp_config, "ref": config.actor_rollout_ref.ref.fsdp_config,
            "critic": config.critic.fsdp_config, "reward_model": config.reward_model.model.fsdp_config}


def _keys_changed(section: Section, default: Section, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, value, default) of each leaf of `section` whose value differs from `default`'s."""
    changed = []
    for name in type(section).model_fields:
        value, default_value = getattr(section, name), getattr(default, name)
        if isinstance(value, Section):
            changed += _keys_changed(value, default_value, f"{prefix}{name}.")
        elif value != default_value:
            changed.append((prefix + name, value, default_value))
    return changed


def _settings_of_models_not_built(config: RunConfig) -> list[ConfigProblem]:
    critic = ("critic.enable is false" if config.critic.enable is False else
              f"critic.enable is unset, and algorithm.adv_estimator={config.algorithm.adv_estimator} needs none")
    not_built = {
        "ref": ("this run builds no reference policy (neither actor_rollout_ref.actor.use_kl_loss nor "
                "algorithm.use_kl_in_reward is true)", ", or set one of them to true to build it"),
        "critic": (f"this run trains no critic ({critic})", ", or set critic.enable=true"),
        "reward_model": ("this run builds no reward model (reward_model.enable is false)",
                         ", or set reward_model.enable=true"),
    }
    built = config.fsdp_configs()
    problems = []
    for role, fsdp in _fsdp_configs_by_role(config).items():
        if role not in built:
            why, remedy = not_built[role]
            problems += [ignored(f"{FSDP_PREFIX[role]}.{key}", value, default, why, remedy)
                         for key, value, default in _keys_changed(fsdp, FSDPConfig())]
    return problems


def _training_settings_of_frozen_models(config: RunConfig) -> list[ConfigProblem]:
    problems = []
    default = FSDPConfig()
    for role, fsdp in config.fsdp_configs().items():
        if role not in FROZEN_ROLES:
            continue
        what = "the reference policy" if role == "ref" else "the reward model"
        for key in _TRAINING_ONLY_KEYS:
            if getattr(fsdp, key) != getattr(default, key):
                problems.append(ignored(f"{FSDP_PREFIX[role]}.{key}", getattr(fsdp, key), getattr(default, key),
                                         f"{what} is frozen (no gradients, no optimizer)"))
    return problems


def _settings_not_built_yet(config: RunConfig) -> list[ConfigProblem]:
    """Sharding keys the run would ignore: on several ranks FSDP2's units are fixed, one per decoder layer and per
    group (trainer/distributed/sharding.py), and one rank shards nothing. (wrap_policy's
    transformer_layer_cls_to_wrap is not one: the offload engine and the sharding find a model's blocks by it.)"""
    problems = []
    default = WrapPolicy().min_num_params
    for role, fsdp in config.fsdp_configs().items():
        if fsdp.wrap_policy.min_num_params != default:
            problems.append(ignored(f"{FSDP_PREFIX[role]}.wrap_policy.min_num_params", fsdp.wrap_policy.min_num_params,
                                     default, "wrapping by size shapes FSDP's units, which here are fixed: one "
                                     "per decoder layer and per group (embedding, head, final norm) on several "
                                     "ranks, none on one"))
    return problems


def _layer_minimum_without_dynamic_offload(config: RunConfig) -> list[ConfigProblem]:
    """The layer minimum bounds dynamic offload only (the threshold also bounds per-phase placement)."""
    minimum, default = config.dynamic_offload.min_transformer_layers_on_gpu, DynamicOffloadConfig()
    if minimum == default.min_transformer_layers_on_gpu or any(
            fsdp.dynamic_offload.enabled for fsdp in config.fsdp_configs().values()):
        return []
    return [ignored("dynamic_offload.min_transformer_layers_on_gpu", minimum, default.min_transformer_layers_on_gpu,
                     "no model this run builds has fsdp_config.dynamic_offload.enabled: true",
                     ", or enable dynamic offload on a model, e.g. "
                     "actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true")]


def _check_offload(config: RunConfig) -> list[ConfigProblem]:
    problems = []
    for role, fsdp in config.fsdp_configs().items():
        if role in FROZEN_ROLES:
            continue  # no gradients at all: _training_settings_of_frozen_models names the key
        if fsdp.offload_grad_dtype == "bf16" and not (fsdp.optimizer_offload and fsdp.model_dtype == "bf16"):
            problems.append(ConfigProblem(
                f"{FSDP_PREFIX[role]}.offload_grad_dtype",
                f"got bf16 with optimizer_offload={str(fsdp.optimizer_offload).lower()} and model_dtype="
                f"{fsdp.model_dtype}; bf16 gradients beside fp32 masters need optimizer_offload: true and "
                "model_dtype: bf16 (otherwise gradients already have the model's dtype); allowed: fp32, or set both"))
        if fsdp.delayed_update and role != "actor":
            problems.append(ConfigProblem(
                f"{FSDP_PREFIX[role]}.delayed_update",
                "got true, but only the actor's update can run during the rollout (the critic's next use is the "
                "values right after it, its CPU update already overlaps the actor's); allowed: false"))
        elif fsdp.delayed_update and not (fsdp.model_dtype == "bf16" and fsdp.optimizer_offload):
            problems.append(ConfigProblem(
                f"{FSDP_PREFIX[role]}.delayed_update",
                f"got true with model_dtype={fsdp.model_dtype} and optimizer_offload="
                f"{str(fsdp.optimizer_offload).lower()}; the rollout reads the bf16 weights while the CPU update "
                "changes the fp32 masters, so it needs model_dtype: bf16 and optimizer_offload: true; allowed: "
                "false, or set those"))
        if fsdp.optimizer_update != "auto" and not fsdp.optimizer_offload:
            problems.append(ConfigProblem(
                f"{FSDP_PREFIX[role]}.optimizer_update",
                f"got {fsdp.optimizer_update} with optimizer_offload=false; it says where an offloaded optimizer's "
                "update runs, and without optimizer_offload the optimizer runs where the parameters are; allowed: "
                "auto, or set optimizer_offload: true"))
    return problems
