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
- ``noted``: accepted whatever its value, and named in one NOTE line at start (``verl train``) when it is given
  away from verl's default (or the values in `accepts`, which are what happens here anyway): it had no effect. A
  pattern notes keys of verl's file; a key written out in full is noted even where verl's file lacks it (vLLM's
  own knobs).
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
    PER_GPU = "per_gpu"
    """verl's deprecated micro-batch size over all GPUs: divided among the data-parallel ranks (the world size over
    the model's Ulysses degree; the reward model's: the world size), as verl divides it, it is the canonical
    per-GPU size."""
    EACH = "each"
    """A key of several models at once (the policy's: actor and reference): its value is each of the canonical keys'
    (`canonical` and `also`), as MOVED reads one; a setting of a trained model only (an optimizer's) goes to the
    actor alone."""


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
    """For a default_only key: the values accepted instead of verl's default alone (any other is refused); for a
    noted one: the values that are what happens here anyway (not noted)."""
    also: tuple[str, ...] = ()
    """For a key read as several (Reading.EACH): the canonical keys beside `canonical`."""

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.written)


def mapped(written: str, canonical: str, why: str, reading: Reading = Reading.MOVED) -> Alias:
    return Alias(written, canonical, Action.MAPPED, why, reading)


def mapped_to_each(written: str, canonicals: tuple[str, ...], why: str) -> Alias:
    return Alias(written, canonicals[0], Action.MAPPED, why, Reading.EACH, also=canonicals[1:])


def default_only(written: str, why: str, accepts: tuple[Any, ...] = ()) -> Alias:
    return Alias(written, None, Action.DEFAULT_ONLY, why, accepts=accepts)


def noted(written: str, why: str, accepts: tuple[Any, ...] = ()) -> Alias:
    return Alias(written, None, Action.NOTED, why, accepts=accepts)


def refused(written: str, canonical: str, why: str) -> Alias:
    return Alias(written, canonical, Action.REFUSED, why)


_ENGINE = ("a vLLM, SGLang or TensorRT-LLM engine setting, with no effect here: the rollout is built in (it decodes "
           "with the actor's own weights in the trainer process)")
_SERVED_REWARD_MODEL = ("verl's serving of the reward model by a rollout engine, with no effect here: the same "
                        "sequence-classification model scores in the trainer process")
_MIXED_PRECISION = ("FSDP's mixed-precision settings, with no effect here: each model computes in its "
                    "fsdp_config.model_dtype")
_SHARDING_TUNING = ("an FSDP tuning setting of verl's workers, with no effect here: each model is sharded (FSDP2) over "
                    "all the run's ranks, one unit per decoder layer and per group")
_SHARDING = ("it shapes sharding or parallelism over several GPUs, which is fixed here: each model is sharded "
             "(FSDP2) over all the run's ranks, one unit per decoder layer and per group (embedding, final norm, "
             "head), and sequence parallelism is the actor's and critic's ulysses_sequence_parallel_size")
_KERNELS = "it is a kernel, compile or memory option of verl's FSDP workers that is not built here"
_ENTROPY = ("the entropy here is always computed chunk by chunk and recomputed in the backward (the logits and one "
            "logsumexp per position kept, never a float32 [B, R, V] copy: trainer/algorithms/functional.py), which "
            "is what entropy_checkpointing and entropy_from_logits_with_chunking ask for; either value runs it")
_NO_RAY = "a Ray setting, with no effect here: there is no Ray, the trainer is one process, supervised by the daemon"
_PROFILER = ("verl's profiler, with no effect here: it is not built (timings: timing_s/* in metrics.jsonl; every "
             "offload copy is timed with CUDA events)")
_STRATEGY = ("the models here train with this project's offload engine (FSDP-style per-group placement); "
             "Megatron is not an engine here")
_ULYSSES = "verl's newer place of the model's Ulysses degree (verl's example scripts set the model's own key)"
_FSDP_STRATEGIES = ("fsdp", "fsdp2")

_POLICY = ("the article's key of the policy as a whole: the actor, the rollout (which samples with the actor's "
           "weights) and the reference")
_DTYPE = ("the article's (and transformers') name of the model's dtype, verl's fsdp_config.model_dtype (bfloat16 "
          "or bf16, float32 or fp32)")
_PER_GPU = ("verl's deprecated size over all GPUs: divided among the data-parallel ranks, as verl divides it (both "
            "given: one error)")
_RUN_WIDE = ("the article's place of a run-wide level of dynamic offload (GPU memory in use is one number for all "
             "models); two models that give different values are one error naming both")

ALIASES: tuple[Alias, ...] = (
    # ------------------------------------------------------------------------ mapped, applied in this order
    # The article's keys (§3.2, §4.1, §4.3), read as the keys they name, before verl's below read those further.
    mapped("actor_rollout_ref.ulysses_sequence_parallel_size",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size", _POLICY),
    mapped("actor_rollout_ref.fsdp_config.sequence_parallel_offload",
           "actor_rollout_ref.actor.sequence_parallel_offload", _POLICY),
    mapped("actor_rollout_ref.actor.fsdp_config.sequence_parallel_offload",
           "actor_rollout_ref.actor.sequence_parallel_offload",
           "the policy's sequence_parallel_offload, written beside the actor's other placement keys"),
    mapped_to_each("actor_rollout_ref.fsdp_config.*",
                   ("actor_rollout_ref.actor.fsdp_config.*", "actor_rollout_ref.ref.fsdp_config.*"),
                   _POLICY + " (an optimizer's setting: the actor's alone)"),
    mapped_to_each("actor_rollout_ref.model.dtype", ("actor_rollout_ref.actor.fsdp_config.model_dtype",
                                                     "actor_rollout_ref.ref.fsdp_config.model_dtype"), _DTYPE),
    mapped_to_each("actor_rollout_ref.model.torch_dtype", ("actor_rollout_ref.actor.fsdp_config.model_dtype",
                                                           "actor_rollout_ref.ref.fsdp_config.model_dtype"), _DTYPE),
    mapped("critic.model.dtype", "critic.fsdp_config.model_dtype", _DTYPE),
    mapped("critic.model.torch_dtype", "critic.fsdp_config.model_dtype", _DTYPE),
    mapped("reward_model.model.dtype", "reward_model.model.fsdp_config.model_dtype", _DTYPE),
    mapped("reward_model.model.torch_dtype", "reward_model.model.fsdp_config.model_dtype", _DTYPE),
    mapped("reward_model.fsdp_config.*", "reward_model.model.fsdp_config.*",
           "the article's place of the reward model's fsdp_config (§4.1), beside critic.fsdp_config; the canonical "
           "one is beside the reward model's path, as verl puts it"),
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
    mapped("reward_manager.name", "reward_model.reward_manager",
           "verl's newer place of the reward manager's name (its scripts set reward_model.reward_manager)"),
    # verl's deprecated sizes over all GPUs (its tuning examples set them), divided as verl divides them.
    mapped("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
           _PER_GPU, Reading.PER_GPU),
    mapped("actor_rollout_ref.rollout.log_prob_micro_batch_size",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", _PER_GPU, Reading.PER_GPU),
    mapped("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
           _PER_GPU, Reading.PER_GPU),
    mapped("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu", _PER_GPU, Reading.PER_GPU),
    mapped("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu", _PER_GPU, Reading.PER_GPU),
    # The article's levels of dynamic offload, per model (§3.1), read as the run-wide ones.
    mapped("*.fsdp_config.dynamic_offload.gpu_memory_threshold", "dynamic_offload.gpu_memory_threshold", _RUN_WIDE),
    mapped("*.fsdp_config.dynamic_offload.min_transformer_layers_on_gpu",
           "dynamic_offload.min_transformer_layers_on_gpu", _RUN_WIDE),
    # ------------------------------------------------------------------------------------ refused: moved keys
    refused("dynamic_offload.enabled", "*.fsdp_config.dynamic_offload.enabled",
            "dynamic offload is enabled per model (which models' layers may move)"),
    # ------------------------------------------------------------------------------ default_only: verl's keys
    default_only("*._target_", "it names the class verl's Hydra instantiates; this project builds its own"),
    noted("*profiler*", _PROFILER),
    default_only("*.megatron*", "Megatron is not an engine here (HuggingFace models with this project's offload "
                                "engine)"),
    default_only("actor_rollout_ref.actor.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("actor_rollout_ref.ref.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("critic.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("reward_model.strategy", _STRATEGY, _FSDP_STRATEGIES),
    default_only("*strategy", _STRATEGY),
    default_only("actor_rollout_ref.actor.use_remove_padding", "the padding-free forward here is set once for the "
                 "actor and the reference: set actor_rollout_ref.model.use_remove_padding", (False,)),
    default_only("*lora_*", "LoRA here is actor_rollout_ref.model's and critic.model's lora_rank, lora_alpha and "
                            "target_modules"),
    default_only("*micro_batch_size", "it is verl's deprecated size over all GPUs; set the *_micro_batch_size_per_gpu "
                                      "key"),
    noted("critic.forward_micro_batch_size*", "the critic's forward micro-batch size, with no effect here: its values "
                                              "are computed in micro-batches of "
                                              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    noted("reward_model.rollout.*", _SERVED_REWARD_MODEL),
    noted("reward_model.num_workers", _SERVED_REWARD_MODEL),
    default_only("*rollout_n", "it mirrors actor_rollout_ref.rollout.n; set that"),
    default_only("*.rollout.prompt_length", "it mirrors data.max_prompt_length; set that"),
    default_only("*.rollout.response_length", "it mirrors data.max_response_length; set that"),
    default_only("data.tool_config_path", "it mirrors actor_rollout_ref.rollout.multi_turn.tool_config_path; set that"),
    # Worker counts and engine options of verl's serving, first: the patterns after them refuse the rest.
    noted("actor_rollout_ref.rollout.agent.num_workers", "verl's agent-loop worker processes: the rollout here runs "
                                                         "in the trainer process"),
    noted("actor_rollout_ref.rollout.skip_tokenizer_init", "a vLLM engine option: the built-in rollout uses the "
                                                           "actor's tokenizer"),
    default_only("actor_rollout_ref.rollout.agent.*", "verl's agent loop is not built"),
    default_only("actor_rollout_ref.rollout.skip_*", "replaying dumped rollouts is not built"),
    # verl itself refuses these (its RolloutConfig raises on mode=sync and on a pipeline-parallel rollout).
    default_only("actor_rollout_ref.rollout.mode", "verl removed its sync rollout mode (it raises on mode=sync)",
                 ("async",)),
    default_only("*rollout.pipeline_model_parallel_size", "verl's vLLM, SGLang and TensorRT-LLM rollouts raise "
                                                          "NotImplementedError on a pipeline-parallel degree above 1",
                 (1,)),
    noted("actor_rollout_ref.rollout.free_cache_engine", "keeping the rollout's KV cache between steps is not built: "
          "the static decode frees its cache after every rollout, which is free_cache_engine: true", (True,)),
    # SGLang's server mode of verl's gsm8k_multiturn_grpo_server config (its older rollout's keys, not in verl's
    # generated file): named, so that they are noted, not unknown keys.
    noted("actor_rollout_ref.rollout.sglang_rollout_mode", _ENGINE),
    noted("actor_rollout_ref.rollout.server", _ENGINE),
    noted("actor_rollout_ref.rollout.*", _ENGINE),
    noted("reward_model.ulysses_sequence_parallel_size", "no effect here: the reward model scores whole sequences on "
                                                         "every rank (no sequence parallelism)"),
    noted("*.fsdp_config.fsdp_size", _SHARDING_TUNING),
    noted("*.fsdp_config.reshard_after_forward", _SHARDING_TUNING),
    noted("*.fsdp_config.forward_prefetch", _SHARDING_TUNING),
    noted("*.fsdp_config.use_orig_params", _SHARDING_TUNING),
    noted("*.fsdp_config.seed", _SHARDING_TUNING),
    noted("*.fsdp_config.full_determinism", _SHARDING_TUNING),
    noted("*.fsdp_config.forward_only", _SHARDING_TUNING),
    # verl's engine config has mixed_precision (default None) that its generated file leaves out: named, so that
    # verl's scripts' `+...fsdp_config.mixed_precision.param_dtype=bf16` is noted, not an unknown key.
    *(noted(f"{model}.fsdp_config.mixed_precision", _MIXED_PRECISION) for model in (
        "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model.model")),
    noted("*.fsdp_config.mixed_precision*", _MIXED_PRECISION),
    noted("*.fsdp_config.dtype", "FSDP's mixed-precision dtype, with no effect here: each model computes in its "
                                 "fsdp_config.model_dtype"),
    noted("*.fsdp_config.use_torch_compile", "verl's model-engine switch of the entropy's compile; this project reads "
                                             "actor_rollout_ref.actor.use_torch_compile (the reference and the critic "
                                             "compute no entropy)"),
    default_only("*.fsdp_config.entropy_*", _ENTROPY, (True, False)),
    default_only("*.fsdp_config.*", _SHARDING),
    default_only("*ulysses_sequence_parallel_size", _SHARDING),
    default_only("actor_rollout_ref.hybrid_engine", "the actor and the rollout always share one set of weights here"),
    noted("*.checkpoint.*", "what verl's checkpoints hold and how they are written, with no effect here: a "
                            "checkpoint always holds the models, their optimizers and the trainer's state, written at "
                            "once and atomically"),
    noted("*.optim.total_training_steps", "verl injects it at run time: no effect here (the schedule reads "
                                          "trainer.total_training_steps)"),
    default_only("*.optim.*", "the optimizer here is AdamW (torch's, or the offload engine's CPU AdamW), clipped at "
                              "grad_clip and scheduled by the optim keys it has"),
    default_only("actor_rollout_ref.actor.loss_scale_factor", "the loss here is aggregated by loss_agg_mode alone"),
    default_only("*router_replay.*", "mixture-of-experts router replay is not built"),
    default_only("*mtp*", "multi-token prediction is not built"),
    noted("actor_rollout_ref.ref.use_torch_compile", "the reference computes no entropy, which is what verl compiles "
                                                     "(the actor's update does: actor.use_torch_compile)"),
    default_only("actor_rollout_ref.actor.use_fused_kernels", "verl's actor repeats "
                 "actor_rollout_ref.model.use_fused_kernels, which this project reads for the actor, its old "
                 "log-probs and the reference"),
    noted("*fused_kernel_options.impl_backend", "verl's Triton kernel is not built: the fused head runs its torch "
          "implementation (trainer/algorithms/fused_head.py), tile by tile", accepts=("torch",)),
    noted("reward_model.model.use_fused_kernels", "a reward model scores sequences with its value head: it has no "
          "vocabulary head to fuse"),
    noted("*use_liger", "Liger's kernels are not used: the models run transformers' own code (the decode compiles its "
                        "fused rotary and MLP pieces on a GPU)"),
    default_only("*entropy_*", _ENTROPY, (True, False)),
    default_only("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "the sum of squared probabilities is "
                 "computed here in the old-log-prob pass, without an autograd graph and a chunk of logits at a time: "
                 "there is nothing to recompute, and either value runs the same", (True, False)),
    default_only("*tiled_mlp.*", _KERNELS),
    noted("*activation_offload", "verl's activation offload, with no effect here: activations stay on the compute "
                                 "device (enable_gradient_checkpointing recomputes them instead)"),
    noted("*use_shm", "loading the model through shared memory (/dev/shm), with no effect here: it loads from its "
                      "directory"),
    default_only("*calculate_entropy", "the actor's entropy is always computed here (actor/entropy, as verl's "
                                       "old-log-prob pass reports it), with its gradient only for entropy_coeff",
                 (True, False)),
    noted("*use_prefix_grouper", "verl's shared-prefix forward (a prompt computed once for its group's responses), "
                                 "a speed-up with no effect on the numbers: here each sequence runs its own forward"),
    noted("*data_loader_seed", "no effect here: the order of sequences in mini-batches follows trainer.seed (and "
                               "actor.shuffle)"),
    noted("critic.shuffle", "no effect here: the critic's mini-batches follow the actor's order"),
    default_only("*external_lib", "model code comes from transformers, or the model directory with "
                                  "trust_remote_code"),
    default_only("*hf_config_path", "the model's config.json is read from its own directory"),
    default_only("reward_model.model.input_tokenizer", "responses are decoded with the actor's tokenizer"),
    default_only("reward_model.model.override_config", "the reward model is built from its directory as it is"),
    default_only("reward_model.use_reward_loop", "the reward here is verl's legacy in-process one (a rule-based "
                 "manager, or one sequence-classification model in the trainer process); either value runs it",
                 (True, False)),
    noted("reward_model.launch_reward_fn_async", "the rule-based reward runs in the trainer process between the "
          "rollout and the log-probs (no Ray task to overlap it with them); the scores are the same"),
    default_only("reward_model.*", "verl's reward loop, resource pools and sandbox are not built (a reward model "
                                   "here is one sequence-classification model in the trainer process)"),
    default_only("reward_manager.*", "a reward manager class of one's own is not loaded here: the managers are "
                                     "verl's registered ones (reward_model.reward_manager: naive, dapo, prime, batch, "
                                     "remote)"),
    default_only("data.tokenizer", "the prompts are tokenized with actor_rollout_ref.model.tokenizer_path"),
    default_only("data.reward_fn_key", "each row's scorer is picked by its data_source column"),
    noted("data.validation_shuffle", "no effect here: validation prompts are taken in the order of their files"),
    noted("data.filter_overlong_prompts_workers", "no effect here: filtering runs once, in the trainer process"),
    noted("data.dataloader_num_workers", "no effect here: prompts are read once, in the trainer process"),
    noted("data.trust_remote_code", "no effect here: the tokenizer follows actor_rollout_ref.model.trust_remote_code"),
    noted("data.return_*", "what verl's dataset hands its rollout, with no effect here: the rollout takes the chat "
                           "messages and templates them itself"),
    noted("data.image_patch_size", "no effect here: the images are cut in patches of the model's own processor "
                                   "(its image processor's patch_size)"),
    default_only("data.video_key", "videos in the prompts are not built (images are: data.image_key)"),
    default_only("data.datagen.*", "dynamic data generation is not built"),
    # balance_batch does nothing here, whichever way it is set: no batch crosses ranks to be balanced.
    default_only("trainer.balance_batch", "each data-parallel rank trains on the rollouts it sampled from its own "
                                          "share of the prompts; no batch is exchanged between ranks, so there is "
                                          "none to balance", (True, False)),
    noted("trainer.esi_redundant_time", "no effect here: it plans saves before a cloud instance's expiry; save with "
                                        "trainer.save_freq"),
    noted("trainer.default_hdfs_dir", "no effect here: checkpoints are written to local disk only "
                                      "(trainer.default_local_dir)"),
    noted("trainer.del_local_ckpt_after_load", "no effect here: checkpoints are kept after a resume (retention: "
                                               "max_ckpt_to_keep)"),
    noted("trainer.ray_*", _NO_RAY),
    noted("trainer.use_legacy_worker_impl", "which of verl's worker implementations runs, with no effect here: "
                                            "there is no Ray, the trainer is one process, supervised by the daemon"),
    noted("ray_kwargs.*", _NO_RAY),
    noted("transfer_queue.*", _NO_RAY),
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
