"""The rules of a config beyond its schema: how fields fit together. Every rule is listed in one tuple
(`all_rules`) and run in one pass (`check_semantics`), those that read the disk and the environment
(environment.py) and those of several ranks (ranks.py) included, so that every problem is named at once. Where
verl runs a setting a rule would refuse, the rule says a ConfigWarning instead (a WARNING line at start; GRPO with
one response per prompt): no rule is stricter than verl where verl runs.

A config the schema refused still gets every rule (refused.py: each refused key holds a RefusedValue, and a rule
that reads one runs again with each value a refused choice allows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import environment, ranks
from trainer.config.errors import ConfigProblem, ConfigWarning, ignored, warned, warned_of_section
from trainer.config.fields import Section, show
from trainer.config.placement import TRAINING_ONLY_KEYS, DynamicOffloadConfig, FSDPConfig, WrapPolicy
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
from trainer.config.tool_files import check_tool_files

Rule = Callable[[RunConfig], list[ConfigProblem]]


def check_semantics(config: RunConfig) -> list[ConfigProblem]:
    """Problems no single field can see: files, paths, and how fields fit together (ConfigWarnings among them:
    settings that run, said at start)."""
    return [problem for rule in all_rules() for problem in rule(config)]


def all_rules() -> tuple[Rule, ...]:
    """Every check beyond the schema, each small enough that one refused value skips little (see
    checks_despite_schema_errors): the disk and the environment first, then how fields fit together."""
    return (environment.check_actor_model_paths, environment.check_critic_model_paths,
            environment.check_reward_model_paths, environment.check_train_files, environment.check_val_files,
            environment.check_reward_function_file, environment.check_user_classes, environment.trackers_installed,
            _check_batch_sizes, _check_token_budgets, _group_estimators_need_several_responses, _gae_needs_a_critic,
            _model_length_holds_a_prompt,
            _resume_path_is_set, _validation_needs_data, ranks.check_devices, ranks.check_launch, _check_offload,
            _settings_of_models_not_built, _training_settings_of_frozen_models, _settings_not_built_yet,
            _layer_minimum_without_dynamic_offload, _reward_error_policy_without_a_function,
            environment.actor_peft_installed, _actor_lora_keys, environment.critic_peft_installed, _critic_lora_keys,
            environment.check_lora_adapter_path,
            _checkpoint_counts_agree, _critic_warmup_needs_a_critic, _validation_only_needs_data,
            _scheduler_names_agree,
            _reward_kwargs_of_the_manager, _overlong_buffer_fits, _batch_manager_needs_a_function,
            _bypass_loss_needs_bypass_mode, _passk_needs_several_responses, check_tool_files,
            _critic_checkpoints_as_the_actor)


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
        elif not by_tokens and mini * n // world and (mini * n // world) % micro:
            # Each data-parallel group's share of the mini-batch is what its micro-batches split (verl's normalized
            # ppo_mini_batch_size, rounded down; none at all is ranks.py's problem).
            sequences = mini * n // world
            per_rank = "" if world == 1 else f" // {world} data-parallel groups" if sp > 1 else f" // {world} ranks"
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


# What each estimator that compares the responses to a prompt makes of a lone response's advantage.
_LONE_RESPONSE_ADVANTAGE = {
    "grpo": "0 (every advantage is 0: the scores train nothing; only a KL or entropy term moves the actor)",
    "grpo_vectorized": "its own score (the group's mean is taken as 0 and its std as 1)",
    "rloo": "its own score (no other response to leave out)",
    "rloo_vectorized": "0, so the policy gets no gradient from the advantages",
    "opo": "its own score (no group baseline)",
    "gpg": "its own score, scaled (no group baseline)",
    "reinforce_plus_plus_baseline": "its own score whitened over the batch (no group baseline)",
    "optimal_token_baseline": "its reward-to-go (no baseline)",
    "tir_optimal_token_baseline": "its reward-to-go (no baseline)",
}


def _group_estimators_need_several_responses(config: RunConfig) -> list[ConfigProblem]:
    """A warning: verl runs an estimator that compares a prompt's responses with one response per prompt (grpo_passk,
    which raises in verl, is refused by _passk_needs_several_responses)."""
    n, name = config.actor_rollout_ref.rollout.n, config.algorithm.adv_estimator
    if n > 1 or name not in _LONE_RESPONSE_ADVANTAGE:
        return []
    return [ConfigWarning("actor_rollout_ref.rollout.n", f"got {n}, but algorithm.adv_estimator={name} compares the "
                          f"responses to each prompt: each response's advantage is {_LONE_RESPONSE_ADVANTAGE[name]}, "
                          "as in verl; set n >= 2 for a baseline from its group (verl's GRPO examples use 5)")]


def _model_length_holds_a_prompt(config: RunConfig) -> list[ConfigProblem]:
    """rollout.max_model_len cuts responses (trainer/config/notes.py says so); a prompt must leave room for one."""
    max_model_len, prompt = config.actor_rollout_ref.rollout.max_model_len, config.data.max_prompt_length
    if max_model_len is not None and max_model_len <= prompt:
        longest = prompt + config.data.max_response_length
        return [ConfigProblem("actor_rollout_ref.rollout.max_model_len", f"got {max_model_len}, but a prompt of "
                              f"data.max_prompt_length ({prompt}) tokens would leave no room for a response (verl's "
                              f"engines raise on it); allowed: more than {prompt}, e.g. {longest} (prompt and "
                              "response), or null")]
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


def _bypass_loss_needs_bypass_mode(config: RunConfig) -> list[ConfigProblem]:
    """verl's bypass_mode loss reads the rollout correction that bypass mode hands it (verl fails at the first update
    without it)."""
    if (config.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
            and not config.algorithm.rollout_correction.bypass_mode):
        return [ConfigProblem("actor_rollout_ref.actor.policy_loss.loss_mode", "got 'bypass_mode', but "
                              "algorithm.rollout_correction.bypass_mode is false (the loss corrects against the "
                              "rollout's log-probs, which bypass mode makes the old ones); allowed: another loss mode, "
                              "or algorithm.rollout_correction.bypass_mode=true")]
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
        problems.append(warned("trainer.max_critic_ckpt_to_keep", trainer.max_critic_ckpt_to_keep, None,
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
    return [warned("trainer.critic_warmup", warmup, 0, "this run trains no critic (algorithm.adv_estimator="
                   f"{config.algorithm.adv_estimator}, critic.enable={show(config.critic.enable)})")]


def _critic_checkpoints_as_the_actor(config: RunConfig) -> list[ConfigProblem]:
    """A critic that keeps its activations beside an actor that recomputes them: its update needs far more memory for
    the same sequences (verl's default checkpoints both; this project's defaults neither)."""
    if not (config.use_critic and config.actor_rollout_ref.model.enable_gradient_checkpointing
            and not config.critic.model.enable_gradient_checkpointing):
        return []
    return [ConfigWarning("critic.model.enable_gradient_checkpointing", "false, but "
                          "actor_rollout_ref.model.enable_gradient_checkpointing is true: the critic's update keeps "
                          "every layer's activations of the sequences the actor's recomputes (for one 4096-token "
                          "response of a 3B model about 19 GiB against 1 GiB); set it true, as verl's default is")]


def _validation_only_needs_data(config: RunConfig) -> list[ConfigProblem]:
    if config.trainer.val_only and not config.data.val_files:
        return [ConfigProblem("trainer.val_only", "got true, but data.val_files is empty: there is nothing to "
                              "validate; allowed: false, or set data.val_files")]
    return []


def _scheduler_names_agree(config: RunConfig) -> list[ConfigProblem]:
    """warmup_style is verl's older name of lr_scheduler_type: both given and differing, it wins (a warning)."""
    problems: list[ConfigProblem] = []
    default = OptimConfig().lr_scheduler_type
    for prefix, optim in (("actor_rollout_ref.actor.optim", config.actor_rollout_ref.actor.optim),
                          ("critic.optim", config.critic.optim)):
        if optim.warmup_style is not None and optim.lr_scheduler_type not in (default, optim.warmup_style):
            problems.append(ConfigWarning(f"{prefix}.warmup_style", f"got {optim.warmup_style!r}, but "
                                          f"{prefix}.lr_scheduler_type is {optim.lr_scheduler_type!r}: warmup_style, "
                                          "verl's older name of it, wins, as in verl; set one of the two"))
    return problems


# Keys that this run would not act on: an error where the key is this project's own, since whoever reads the config
# would believe it; a warning where it is verl's and verl runs with it (and ignores it too). Only keys set away from
# their defaults are named, so a default config is clean, and so is a resolved one (every default written out).


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
    """LoRA's other keys act only with an adapter (lora_rank > 0; that it needs peft: environment.py); a saved
    one (lora_adapter_path) brings its own, and verl's scripts set them beside it: nothing to say."""
    if model.lora_rank > 0 and model.lora_alpha == 0:
        # verl runs it (peft scales the adapter's output by 0): the adapter never changes the model.
        return [ConfigWarning(f"{prefix}.lora_alpha", f"got 0, but {prefix}.lora_rank is {model.lora_rank}: the "
                              "adapter's output is scaled by lora_alpha / lora_rank = 0: it adds nothing to the layers "
                              "it wraps, however it trains; set it (verl's default 16) for an adapter that acts")]
    if model.lora_rank > 0 or getattr(model, "lora_adapter_path", None) is not None:
        return []
    return [warned(f"{prefix}.{key}", getattr(model, key), getattr(default, key),
                   f"{prefix}.lora_rank is 0 (no LoRA adapter)", f", or set {prefix}.lora_rank (e.g. 8) to train an "
                   "adapter")
            for key in ("lora_alpha", "target_modules", "exclude_modules")
            if hasattr(model, key) and getattr(model, key) != getattr(default, key)]


# ------------------------------------------------------------------------------------- placement


_TRAINING_ONLY_KEYS = TRAINING_ONLY_KEYS
_VERL_TRAINING_KEYS = ("optimizer_offload",)


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
            changed = [(key, value) for key, value, _ in _keys_changed(fsdp, FSDPConfig())]
            if changed:
                problems.append(warned_of_section(FSDP_PREFIX[role], changed, why, remedy))
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
                # verl's own key (optimizer_offload) runs there, ignored: a warning; this project's, an error.
                say = warned if key in _VERL_TRAINING_KEYS else ignored
                problems.append(say(f"{FSDP_PREFIX[role]}.{key}", getattr(fsdp, key), getattr(default, key),
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
            problems.append(warned(f"{FSDP_PREFIX[role]}.wrap_policy.min_num_params", fsdp.wrap_policy.min_num_params,
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


# ------------------------------------------------------------------------------------- reward managers

_MANAGER_KWARGS = {"naive": (), "prime": (), "remote": (), "dapo": ("max_resp_len", "overlong_buffer_cfg")}
"""The reward_kwargs each manager takes (verl's constructors: any other is their TypeError); batch passes any key to
its function."""


def _reward_kwargs_of_the_manager(config: RunConfig) -> list[ConfigProblem]:
    manager = config.reward_model.reward_manager
    taken = _MANAGER_KWARGS.get(manager)
    if taken is None:
        return []
    allowed = (f"{', '.join(taken)}, or leave the key out" if taken
               else "leave the key out (dapo takes max_resp_len and overlong_buffer_cfg; batch passes any key to its "
                    "function)")
    return [ConfigProblem(f"reward_model.reward_kwargs.{name}", f"got {show(value)}, but the {manager} reward manager "
                          f"(reward_model.reward_manager) takes no such argument; allowed: {allowed}")
            for name, value in config.reward_model.reward_kwargs.given().items() if name not in taken]


def _overlong_buffer_fits(config: RunConfig) -> list[ConfigProblem]:
    keywords = config.reward_model.reward_kwargs
    buffer, prefix = keywords.overlong_buffer_cfg, "reward_model.reward_kwargs"
    if config.reward_model.reward_manager != "dapo" or not buffer.enable:
        return []
    if keywords.max_resp_len is None:
        return [ConfigProblem(f"{prefix}.max_resp_len", "is not set, but overlong_buffer_cfg.enable is true and the "
                              "buffer ends at it; allowed: the responses' length limit (verl's scripts give "
                              f"data.max_response_length: {config.data.max_response_length})")]
    if buffer.len < 1 or buffer.len > keywords.max_resp_len:
        return [ConfigProblem(f"{prefix}.overlong_buffer_cfg.len", f"got {buffer.len}, but the buffer's penalty grows "
                              f"over its tokens up to max_resp_len {keywords.max_resp_len}; allowed: an integer >= 1 "
                              f"and <= {keywords.max_resp_len}")]
    return []


def _batch_manager_needs_a_function(config: RunConfig) -> list[ConfigProblem]:
    if config.reward_model.reward_manager != "batch" or config.custom_reward_function.path is not None:
        return []
    return [ConfigProblem("reward_model.reward_manager", "got 'batch', but custom_reward_function.path is not set: the "
                          "batch manager calls a function of one's own with the whole batch (data_sources, "
                          "solution_strs, ground_truths, extra_infos); allowed: set custom_reward_function.path, or "
                          "'naive', 'dapo', 'prime' or 'remote' (which score each response with the built-in scorers)")]
