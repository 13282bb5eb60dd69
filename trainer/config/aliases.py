"""The one table of keys that verl (or the article "verl CPU offloading实战", or an older version of this project)
writes and this schema spells differently or does not have: the key or fnmatch pattern as written, the canonical
key it is read as (or where it lives now), why, and what loading does with it:

- ``mapped``: read as its canonical key (trainer/config/verl.py applies these, in the table's order, before the
  schema reads the config). How depends on its `Reading`: moved to the canonical place (both places given with
  different values: one error naming both), or repeating the canonical key's value, or verl's boolean
  offload_policy spread over the module groups.
- ``default_only``: one of verl's keys with no counterpart here, accepted at verl's default value (from
  verl_ppo_trainer.yaml, verl's generated file as it ships) or at the values in `accepts`, refused at any other
  with its why-line. A key in neither the schema nor verl's file is left to the schema, which reports it as
  unknown (with its did-you-mean), so a misspelt key is never taken for one of verl's.
- ``noted``: accepted whatever its value, and named in one NOTE line at start (``verl train``). A pattern notes
  keys of verl's file; a key written out in full is noted even where verl's file lacks it (vLLM's own knobs).
- ``refused``: a key that moved: refused, naming where it lives now.

A dotted key takes the line of the first entry whose pattern matches it. docs/verl.md is written from this table
(``python -m trainer.config.docs``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Action(StrEnum):
    """What loading does with a key the table holds."""

    MAPPED = "mapped"
    DEFAULT_ONLY = "default_only"
    NOTED = "noted"
    REFUSED = "refused"


class Reading(StrEnum):
    """How a mapped key is read as its canonical key."""

    MOVED = "moved"
    """Its value is the canonical key's; both given with different values is one error naming both. A `*` in the
    canonical key stands for what the `*` in the written one matched."""
    SAME_AS = "same_as"
    """It repeats the canonical key's value (the reference's Ulysses degree is the actor's): accepted at that value,
    refused at any other."""
    OFFLOAD_SWITCH = "offload_switch"
    """verl's boolean offload_policy: true puts every module group on the CPU and, for a model that trains, its
    optimizer too; false (verl's default) changes nothing."""


@dataclass(frozen=True)
class Alias:
    """One entry of the table."""

    written: str
    """The dotted key, or an fnmatch pattern of dotted keys, as it is written."""
    canonical: str | None
    """The key it is read as (mapped), or where it lives now (refused); None: there is none."""
    action: Action
    why: str
    """One line: why it is read so, or why a value other than verl's default cannot be honoured."""
    reading: Reading = Reading.MOVED
    """For a mapped key: how it is read."""
    accepts: tuple[Any, ...] = ()
    """For a default_only key: the values accepted instead of verl's default alone (any other is refused)."""

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.written)


def mapped(written: str, canonical: str, why: str, reading: Reading = Reading.MOVED) -> Alias:
    return Alias(written, canonical, Action.MAPPED, why, reading)


def default_only(written: str, why: str, accepts: tuple[Any, ...] = ()) -> Alias:
    return Alias(written, None, Action.DEFAULT_ONLY, why, accepts=accepts)


def noted(written: str, why: str) -> Alias:
    return Alias(written, None, Action.NOTED, why)


def refused(written: str, canonical: str, why: str) -> Alias:
    return Alias(written, canonical, Action.REFUSED, why)


_ENGINE = "the rollout here is built in (it decodes with the actor's own weights in the trainer process): " \
          "a vLLM or SGLang engine setting has nothing to act on"
_SHARDING = ("it shapes sharding or parallelism over several GPUs, which is fixed here: each model is sharded "
             "(FSDP2) over all the run's ranks, one unit per decoder layer and per group (embedding, final norm, "
             "head), and sequence parallelism is the actor's and critic's ulysses_sequence_parallel_size")
_KERNELS = "it is a kernel, compile or memory option of verl's FSDP workers that is not built here"
_NO_RAY = "there is no Ray here: the trainer is one process, supervised by the daemon"
_PROFILER = ("verl's profiler is not built here (timings: timing_s/* in metrics.jsonl; every offload copy is timed "
             "with CUDA events)")
_STRATEGY = ("the models here train with this project's offload engine (FSDP-style per-group placement); "
             "Megatron is not an engine here")
_ULYSSES = "verl's newer place of the model's Ulysses degree (verl's example scripts set the model's own key)"
_FSDP_STRATEGIES = ("fsdp", "fsdp2")

ALIASES: tuple[Alias, ...] = (
    # ------------------------------------------------------------------------ mapped, applied in this order
    mapped("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size", _ULYSSES),
    mapped("critic.model.fsdp_config.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size",
           _ULYSSES),
    mapped("critic.fsdp_config.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size", _ULYSSES),
    mapped("critic.model.fsdp_config.*", "critic.fsdp_config.*",
           "verl's place of the critic's fsdp_config; the canonical one is beside critic.model, as for the actor "
           "and the reference"),
    mapped("*.fsdp_config.offload_policy", "*.fsdp_config.offload_policy",
           "verl's FSDP2 switch (true or false) spread over this project's per-group placement",
           Reading.OFFLOAD_SWITCH),
    mapped("actor_rollout_ref.ref.ulysses_sequence_parallel_size",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
           "the reference runs with the actor's sequence-parallel degree", Reading.SAME_AS),
    mapped("actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
           "the reference runs with the actor's sequence-parallel degree", Reading.SAME_AS),
    # ------------------------------------------------------------------------------------ refused: moved keys
    # The levels of dynamic offload were per model until they became run-wide.
    refused("*.fsdp_config.dynamic_offload.gpu_memory_threshold", "dynamic_offload.gpu_memory_threshold",
            "the threshold is run-wide now (GPU memory in use is one number for all models)"),
    refused("*.fsdp_config.dynamic_offload.min_transformer_layers_on_gpu",
            "dynamic_offload.min_transformer_layers_on_gpu",
            "the layer minimum is run-wide now (it applies to each dynamically offloaded model)"),
    refused("dynamic_offload.enabled", "*.fsdp_config.dynamic_offload.enabled",
            "dynamic offload is enabled per model (which models' layers may move)"),
    # ------------------------------------------------------------------------------ default_only: verl's keys
    default_only("*._target_", "it names the class verl's Hydra instantiates; this project builds its own"),
    default_only("*profiler*", _PROFILER),
    default_only("*.megatron*", "Megatron is not an engine here (HuggingFace models with this project's offload "
                                "engine)"),
    default_only("actor_rollout_ref.actor.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("actor_rollout_ref.ref.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("critic.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("reward_model.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("*strategy", _STRATEGY),
    # The reward model's padded forward is accepted with verl's padding-free switch off.
    default_only("actor_rollout_ref.actor.use_remove_padding", "the padding-free forward here is set once for the "
                 "actor and the reference: set actor_rollout_ref.model.use_remove_padding", (False,)),
    default_only("reward_model.model.use_remove_padding", "the reward model's forward is padded here (the "
                 "padding-free forward covers the actor, the reference and the critic)", (False,)),
    default_only("*lora_*", "LoRA here is actor_rollout_ref.model's and critic.model's lora_rank, lora_alpha and "
                            "target_modules"),
    default_only("*micro_batch_size", "it is verl's deprecated size over all GPUs; set the *_micro_batch_size_per_gpu "
                                      "key"),
    default_only("critic.forward_micro_batch_size_per_gpu", "the critic's values here are computed in "
                                                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    default_only("*rollout_n", "it mirrors actor_rollout_ref.rollout.n; set that"),
    default_only("*.rollout.prompt_length", "it mirrors data.max_prompt_length; set that"),
    default_only("*.rollout.response_length", "it mirrors data.max_response_length; set that"),
    default_only("actor_rollout_ref.rollout.val_kwargs.*", "validation here decodes greedily, one response per "
                                                           "prompt (verl's default val_kwargs)"),
    default_only("actor_rollout_ref.rollout.multi_turn.*", "multi-turn and tool-calling rollouts are not built"),
    default_only("*tool_config_path", "multi-turn and tool-calling rollouts are not built"),
    default_only("actor_rollout_ref.rollout.agent.*", "verl's agent loop is not built"),
    default_only("reward_model.rollout.*", "a generative reward model (served by a rollout engine) is not built"),
    default_only("actor_rollout_ref.rollout.skip_*", "replaying dumped rollouts is not built"),
    default_only("actor_rollout_ref.rollout.*", _ENGINE),
    default_only("reward_model.ulysses_sequence_parallel_size", "the reward model scores whole sequences on every "
                                                                "rank (no sequence parallelism)"),
    default_only("*.fsdp_config.*", _SHARDING),
    default_only("*ulysses_sequence_parallel_size", _SHARDING),
    default_only("actor_rollout_ref.hybrid_engine", "the actor and the rollout always share one set of weights here"),
    default_only("*.checkpoint.*", "a checkpoint here always holds the models, their optimizers and the trainer's "
                                   "state, written at once and atomically"),
    default_only("*.optim.*", "the optimizer here is AdamW (torch's, or the offload engine's CPU AdamW), clipped at "
                              "grad_clip and scheduled by the optim keys it has"),
    default_only("*.policy_loss.*", "the policy loss here is PPO's clipped loss (with dual-clip clip_ratio_c); "
                                    "verl's other loss modes are not built"),
    default_only("actor_rollout_ref.actor.tau_*", "the policy loss here is PPO's clipped loss; verl's other loss "
                                                  "modes are not built"),
    default_only("actor_rollout_ref.actor.loss_scale_factor", "the loss here is aggregated by loss_agg_mode alone"),
    default_only("*router_replay.*", "mixture-of-experts router replay is not built"),
    default_only("*mtp*", "multi-token prediction is not built"),
    default_only("*use_torch_compile", _KERNELS),
    default_only("*fused_kernel*", _KERNELS),
    default_only("*use_liger", _KERNELS),
    default_only("*entropy_*", _KERNELS),
    default_only("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "the sum of squared probabilities is "
                 "computed here in the old-log-prob pass, without an autograd graph and a chunk of logits at a time: "
                 "there is nothing to recompute, and either value runs the same", (True, False)),
    default_only("*tiled_mlp.*", _KERNELS),
    default_only("*activation_offload", _KERNELS),
    default_only("*use_shm", _KERNELS),
    default_only("*calculate_entropy", _KERNELS),
    default_only("*use_prefix_grouper", _KERNELS),
    default_only("*freeze_vision_tower", "vision-language models are not built"),
    default_only("*data_loader_seed", "the order of sequences in mini-batches follows trainer.seed (and "
                                      "actor.shuffle)"),
    default_only("critic.shuffle", "the critic's mini-batches here follow the actor's order"),
    default_only("*external_lib", "model code comes from transformers, or the model directory with "
                                  "trust_remote_code"),
    default_only("*hf_config_path", "the model's config.json is read from its own directory"),
    default_only("*custom_chat_template", "prompts use the tokenizer's own chat template"),
    default_only("reward_model.model.input_tokenizer", "responses are decoded with the actor's tokenizer"),
    default_only("reward_model.model.override_config", "the reward model is built from its directory as it is"),
    default_only("reward_model.max_length", "reward-model inputs here are cut at data.max_prompt_length + "
                                            "data.max_response_length"),
    default_only("reward_model.*", "verl's reward loop, resource pools and sandbox are not built (a reward model "
                                   "here is one sequence-classification model in the trainer process)"),
    default_only("reward_manager.*", "the reward here is verl's naive manager: each response scored by its data "
                                     "source's function, or custom_reward_function"),
    default_only("algorithm.rollout_correction.*", "rollout-correction importance weights are not built (the "
                                                   "rollout samples with the actor's own weights)"),
    default_only("algorithm.*pf_ppo*", "policy-filtration PPO is not built"),
    default_only("data.tokenizer", "the prompts are tokenized with actor_rollout_ref.model.tokenizer_path"),
    default_only("data.*max_samples", "each data file is read whole"),
    default_only("data.reward_fn_key", "each row's scorer is picked by its data_source column"),
    default_only("data.validation_shuffle", "validation prompts are taken in the order of their files"),
    default_only("data.filter_overlong_prompts_workers", "filtering runs once, in the trainer process"),
    default_only("data.dataloader_num_workers", "prompts are read once, in the trainer process"),
    default_only("data.trust_remote_code", "the tokenizer follows actor_rollout_ref.model.trust_remote_code"),
    default_only("data.return_*", "the rollout takes the chat messages and templates them itself"),
    default_only("data.apply_chat_template_kwargs", "prompts use the tokenizer's chat template with its defaults"),
    default_only("data.image_*", "vision-language models are not built"),
    default_only("data.video_key", "vision-language models are not built"),
    default_only("data.custom_cls.*", "a custom dataset class is not built (data files in verl's parquet layout or "
                                      "JSONL)"),
    default_only("data.sampler.*", "a custom sampler (curriculum) is not built"),
    default_only("data.datagen.*", "dynamic data generation is not built"),
    # balance_batch does nothing here, whichever way it is set: no batch crosses ranks to be balanced.
    default_only("trainer.balance_batch", "each data-parallel rank trains on the rollouts it sampled from its own "
                                          "share of the prompts; no batch is exchanged between ranks, so there is "
                                          "none to balance", (True, False)),
    default_only("trainer.log_val_generations", "validation generations are not logged"),
    default_only("trainer.*_data_dir", "dumping generations to files is not built"),
    default_only("trainer.esi_redundant_time", "it plans saves before a cloud instance's expiry; save with "
                                               "trainer.save_freq"),
    default_only("trainer.default_hdfs_dir", "checkpoints are written to local disk only (trainer.default_local_dir)"),
    default_only("trainer.del_local_ckpt_after_load", "checkpoints are kept after a resume (retention: "
                                                      "max_ckpt_to_keep)"),
    default_only("trainer.ray_*", _NO_RAY),
    default_only("trainer.use_legacy_worker_impl", _NO_RAY),
    default_only("ray_kwargs.*", _NO_RAY),
    default_only("transfer_queue.*", _NO_RAY),
)


def entry_for(key: str) -> Alias | None:
    """The table's entry for a dotted key: the first whose pattern matches it (None: the table has none)."""
    return next((alias for alias in ALIASES if alias.matches(key)), None)


def why(key: str) -> str | None:
    """The why-line of a dotted key (None: no entry matches it)."""
    alias = entry_for(key)
    return alias.why if alias is not None else None


def entries(action: Action) -> tuple[Alias, ...]:
    """The entries of one action, in the table's order."""
    return tuple(alias for alias in ALIASES if alias.action is action)


def moved_to(key: str) -> Alias | None:
    """The refused entry of a key that moved (None: it did not)."""
    alias = entry_for(key)
    return alias if alias is not None and alias.action is Action.REFUSED else None
