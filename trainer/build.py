"""Building a run from its config: the prompts, the models and where each one lives, and the reward.

One rank: the memory manager places each model's module groups (the offload engine). Several ranks: FSDP2 shards each
model over all of them (trainer/distributed/sharding.py), and the memory manager moves the local shards' layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.config import BUILTIN_PREFIX, KEYS, FSDPConfig, RunConfig
from trainer.config.messages import Role
from trainer.data import PromptRecord, sample_records
from trainer.data.checks import Seen, check_prompts, drop_overlong_prompts
from trainer.data.user_classes import read_records
from trainer.distributed.layer_moves import ShardedLayers
from trainer.distributed.ranks import Ranks, host_threads_per_rank
from trainer.distributed.shard_copies import watch_shard_copies
from trainer.distributed.sharding import Sharded, offload_summary, shard_model
from trainer.errors import RunSetupError
from trainer.memory import MemoryManager, Model, ModelMemory
from trainer.models import load_critic, load_policy, load_reward_model, load_tokenizer, torch_dtype
from trainer.models.fused_head import fused_head_blocker
from trainer.models.lora import LoraSettings, describe_adapter, with_adapter
from trainer.models.vision import freeze_vision_tower
from trainer.models.vision_language import is_vision_language, prompts_as_seen
from trainer.offload.copies import CopyLog
from trainer.offload.groups import parameter_groups
from trainer.rewards.manager import ModelReward, RewardFunction
from trainer.rewards.managers import build_rule_reward
from trainer.workers.actor import Actor
from trainer.workers.critic import Critic
from trainer.workers.reference import Reference
from trainer.workers.sequence_split import SequenceSplit

Log = Callable[[str], None]


def set_host_threads(config: RunConfig, ranks: Ranks, log: Log) -> None:
    """trainer.cpu_threads, or each rank's share of the node's cores."""
    if config.trainer.cpu_threads is not None:
        torch.set_num_threads(config.trainer.cpu_threads)
    elif ranks.distributed:
        # torchrun's command line starts each rank with OMP_NUM_THREADS=1, and the launcher used as a library
        # (verl train) with every core: the host's AdamW and gradient arithmetic of optimizer_offload would run
        # on one core, or each rank would claim all of them.
        threads = host_threads_per_rank(config.trainer.n_gpus_per_node)
        torch.set_num_threads(threads)
        if ranks.is_main:
            log(f"each rank computes on the host with {threads} threads, its share of this node's cores "
                f"({KEYS.trainer.cpu_threads} sets it)")


def load_prompts(config: RunConfig, tokenizer: PreTrainedTokenizerBase, log: Log
                 ) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The training and validation prompts, filtered by length where the config asks, each checked against the
    tokenizer: before any model is built, since the tokenizer alone is cheap and a model build is not."""
    data, model = config.data, config.actor_rollout_ref.model
    # The built-in rule scorers compare each response with the row's ground truth.
    builtin_scoring = not config.reward_model.enable and config.custom_reward_function.path is None
    source = model.tokenizer_path or model.path
    name = (f"{source}'s built-in {len(tokenizer)}-token tokenizer" if source.startswith(BUILTIN_PREFIX)
            else repr(source))
    files = ((KEYS.data.train_files, data.train_files), (KEYS.data.val_files, data.val_files))
    seen = prompts_as_seen(model.path, tokenizer)  # a vision-language model's prompts count their images' tokens
    most = {KEYS.data.train_files: data.train_max_samples, KEYS.data.val_files: data.val_max_samples}
    # Drawn before the length filter, as verl's dataset draws them.
    records = {key: _filtered(config, key, sample_records(
                   read_records(config, paths, tokenizer, require_ground_truth=builtin_scoring), most[key],
                   shuffle=data.shuffle, seed=config.prompt_order_seed), tokenizer, log, seen) if paths else []
               for key, paths in files}
    for files_key, loaded in records.items():
        check_prompts(loaded, tokenizer, files_key=files_key, max_length=data.max_prompt_length,
                      truncation=data.truncation, tokenizer_setting=KEYS.actor_rollout_ref.model.tokenizer_path,
                      tokenizer_name=name, template_kwargs=data.apply_chat_template_kwargs, seen=seen)
    return records[KEYS.data.train_files], records[KEYS.data.val_files]


def _filtered(config: RunConfig, files_key: str, records: list[PromptRecord], tokenizer: PreTrainedTokenizerBase,
              log: Log, seen: Seen | None = None) -> list[PromptRecord]:
    """data.filter_overlong_prompts: the records whose prompt fits data.max_prompt_length (as verl's dataset
    filters them at load); the count dropped goes to the log."""
    data = config.data
    if not data.filter_overlong_prompts:
        return records
    kept = drop_overlong_prompts(records, tokenizer, data.max_prompt_length, data.apply_chat_template_kwargs, seen)
    log(f"{KEYS.data.filter_overlong_prompts}: dropped {len(records) - len(kept)} of {len(records)} prompts of "
        f"{files_key} longer than {KEYS.data.max_prompt_length}={data.max_prompt_length} tokens")
    if not kept:
        raise RunSetupError(f"{KEYS.data.filter_overlong_prompts}: every prompt of {files_key} is longer than "
                            f"{KEYS.data.max_prompt_length}={data.max_prompt_length} tokens; raise it")
    return kept


@dataclass
class Models:
    """Every model of the run, built and placed, with its worker."""

    actor: Actor
    reference: Reference | None
    critic: Critic | None
    reward: RewardFunction
    actor_adapter: Any = None  # LoRA: peft's wrapper of the actor (the checkpoints hold its adapter)
    critic_adapter: Any = None
    sharded: dict[str, Sharded] = field(default_factory=dict)  # several ranks: how each model is sharded
    shard_copies: list[CopyLog] = field(default_factory=list)  # several ranks: FSDP2's copies up of CPU shards

    def trained(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """Each trained model with its optimizer, by the checkpoint's role names."""
        trained = {"actor": (self.actor.model, self.actor.optimizer)}
        if self.critic is not None:
            trained["critic"] = (self.critic.model, self.critic.optimizer)
        return trained

    def saved(self) -> dict[str, torch.nn.Module]:
        """What the checkpoints hold of each trained model: its weights, or its LoRA adapter (peft's wrapper)."""
        saved = {"actor": self.actor.model if self.actor_adapter is None else self.actor_adapter}
        if self.critic is not None:
            saved["critic"] = self.critic.model if self.critic_adapter is None else self.critic_adapter
        return saved

    def optimizer_of(self, role: str) -> torch.optim.Optimizer | None:
        """The optimizer that steps the model placed as `role`; None for a frozen one (or one not built yet)."""
        worker = {Role.ACTOR: self.actor, Role.CRITIC: self.critic}.get(role)
        return getattr(worker, "optimizer", None)


class ModelBuilder:
    """Builds the run's models from the config and places each one as it is built."""

    def __init__(self, config: RunConfig, tokenizer: PreTrainedTokenizerBase, memory: MemoryManager, ranks: Ranks,
                 *, total_steps: int, log: Log, warn: Log):
        self.config = config
        self.tokenizer = tokenizer
        self.memory = memory
        self.ranks = ranks
        self.total_steps = total_steps
        self.log, self.warn = log, warn
        self.sharded: dict[str, Sharded] = {}
        self.shard_copies: list[CopyLog] = []
        self._built: Models | None = None  # what ShardedLayers asks for its optimizer, once built

    def build(self) -> Models:
        """The actor (and with LoRA its adapter), the reference, the critic and the reward, each placed."""
        actor, actor_adapter, policy_split = self._actor()
        reference = self._reference(actor, actor_adapter, policy_split)
        critic, critic_adapter = self._critic() if self.config.use_critic else (None, None)
        self._built = Models(actor, reference, critic, self._reward(), actor_adapter, critic_adapter,
                             self.sharded, self.shard_copies)
        return self._built

    def _policy(self, fsdp_config: FSDPConfig, gradient_checkpointing: bool) -> torch.nn.Module:
        model_config = self.config.actor_rollout_ref.model
        return load_policy(model_config.path, self.tokenizer, dtype=torch_dtype(fsdp_config.model_dtype),
                           seed=self.config.trainer.seed, override_config=model_config.override_config,
                           gradient_checkpointing=gradient_checkpointing,
                           trust_remote_code=model_config.trust_remote_code)

    def _actor(self) -> tuple[Actor, Any, SequenceSplit | None]:
        config, model_config = self.config, self.config.actor_rollout_ref.model
        actor_config, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
        # With LoRA the adapter is in the model before the engine lays it out; peft's wrapper disables it for the
        # reference policy and saves it in the checkpoints.
        policy = self._policy(actor_config.fsdp_config, model_config.enable_gradient_checkpointing)
        if actor_config.freeze_vision_tower:
            freeze_vision_tower(policy, self.log)
        # Ulysses (trainer/workers/sequence_split.py): the policy's forwards run on this rank's sequence shards.
        split = self._sequence_split(policy, actor_config.ulysses_sequence_parallel_size,
                                     KEYS.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
                                     remove_padding=model_config.use_remove_padding)
        model, adapter = with_adapter(policy, LoraSettings.of(model_config, KEYS.actor_rollout_ref.model), role="actor",
                                      seed=config.trainer.seed)
        model = self._place(model, self._policy_placement(actor_config.fsdp_config), Role.ACTOR, split)
        actor = Actor(model, actor_config, temperature=rollout.temperature, rollout_n=rollout.n,
                      log_prob_micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
                      total_steps=self.total_steps, seed=config.trainer.seed, memory=self._memory(Role.ACTOR),
                      ranks=self.ranks, sequence_split=split, remove_padding=model_config.use_remove_padding,
                      log_prob_max_token_len=(rollout.log_prob_max_token_len_per_gpu
                                              if rollout.log_prob_use_dynamic_bsz else None),
                      rollout_correction=config.algorithm.rollout_correction,
                      fused_head=self._fused_head(model, split, "the actor"))
        if adapter is not None:
            self.log(describe_adapter(adapter, "actor"))
        return actor, adapter, split

    def _reference(self, actor: Actor, adapter: Any, split: SequenceSplit | None) -> Reference | None:
        """The reference policy, when a KL term needs one: its own frozen copy, or with LoRA the actor's base."""
        config = self.config
        if not config.use_reference:
            return None
        ref = config.actor_rollout_ref.ref
        if adapter is not None:
            unused = ref.fsdp_config != FSDPConfig()
            ignored = f" ({KEYS.actor_rollout_ref.ref.fsdp_config} is not used)" if unused else ""
            self.log("reference policy: the actor with its LoRA adapter disabled, no second copy of the "
                     f"weights{ignored}")
            model, memory = actor.model, self._memory(Role.ACTOR)
        else:
            model = self._policy(ref.fsdp_config, False).eval().requires_grad_(False)
            model = self._place(model, self._policy_placement(ref.fsdp_config), Role.REF, split)
            memory = self._memory(Role.REF)
        fused = actor.fused_head if adapter is not None else self._fused_head(model, split, "the reference")
        return Reference(model, ref, temperature=config.actor_rollout_ref.rollout.temperature,
                         remove_padding=config.actor_rollout_ref.model.use_remove_padding, memory=memory,
                         sequence_split=split, ranks=self.ranks, adapter=adapter, fused_head=fused)

    def _fused_head(self, model: torch.nn.Module, split: SequenceSplit | None, whose: str) -> bool:
        """model.use_fused_kernels for `model` (placed): on where its head can compute the log-probs fused; where it
        cannot (fused_head_blocker), one NOTE line and the log-probs from the logits."""
        key = KEYS.actor_rollout_ref.model.use_fused_kernels
        if not self.config.actor_rollout_ref.model.use_fused_kernels:
            return False
        blocker = fused_head_blocker(model, sequence_parallel=split is not None)
        if blocker is not None:
            self.log(f"NOTE: {key}=true: {blocker}; {whose}'s log-probs come from its logits (the unfused path)")
            return False
        if whose == "the actor" and self.config.scores_sum_pi_squared:
            self.log(f"NOTE: {key}=true: the old-log-prob pass computes each position's sum of squared probabilities "
                     "(calculate_sum_pi_squared), which only the logits give: that pass is not fused, the update is")
        return True

    def _critic(self) -> tuple[Critic, Any]:
        config, critic = self.config, self.config.critic
        seed = config.trainer.seed
        model = load_critic(critic.model.path, self.tokenizer, dtype=torch_dtype(critic.fsdp_config.model_dtype),
                            seed=seed,
                            override_config=critic.model.override_config
                            or config.actor_rollout_ref.model.override_config,
                            gradient_checkpointing=critic.model.enable_gradient_checkpointing,
                            trust_remote_code=critic.model.trust_remote_code)
        model, adapter = with_adapter(model, LoraSettings.of(critic.model, KEYS.critic.model), role="critic",
                                      seed=seed + 1)
        if adapter is not None:
            self.log(describe_adapter(adapter, "critic"))
        split = self._sequence_split(model, critic.ulysses_sequence_parallel_size,
                                     KEYS.critic.ulysses_sequence_parallel_size,
                                     remove_padding=critic.model.use_remove_padding)
        rollout = config.actor_rollout_ref.rollout
        worker = Critic(self._place(model, critic.fsdp_config, Role.CRITIC, split), critic, rollout_n=rollout.n,
                        forward_micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
                        total_steps=self.total_steps, memory=self._memory(Role.CRITIC), ranks=self.ranks,
                        sequence_split=split)
        return worker, adapter

    def _reward(self) -> RewardFunction:
        config = self.config
        if not config.reward_model.enable:
            return build_rule_reward(config, self.tokenizer, warn=self.warn)
        if config.reward_model.reward_manager != "naive":
            self.warn(f"{KEYS.reward_model.reward_manager}: {config.reward_model.reward_manager} does not score this "
                      f"run: the reward model does ({KEYS.reward_model.enable}), whose scores verl's managers pass "
                      "through as they are")
        network = config.reward_model.model
        tokenizer = load_tokenizer(network.tokenizer_path or network.path, trust_remote_code=network.trust_remote_code,
                                   setting=KEYS.reward_model.model.tokenizer_path)
        model = load_reward_model(network.path, tokenizer, dtype=torch_dtype(network.fsdp_config.model_dtype),
                                  seed=config.trainer.seed, trust_remote_code=network.trust_remote_code)
        return ModelReward(self._place(model, network.fsdp_config, Role.REWARD), self.tokenizer, tokenizer,
                           micro_batch_size=config.reward_model.micro_batch_size_per_gpu,
                           max_length=config.reward_model.max_length or (config.data.max_prompt_length
                                                                         + config.data.max_response_length),
                           memory=self._memory(Role.REWARD), remove_padding=network.use_remove_padding)

    def _sequence_split(self, model: torch.nn.Module, degree: int, setting: str, *,
                        remove_padding: bool) -> SequenceSplit | None:
        """The sequence split of `model`, of Ulysses `degree` (1 or the run's, as the config checked; set at
        `setting`): None for degree 1, whose forwards run whole sequences (its sp group's ranks repeat them). With
        `remove_padding` it splits each micro-batch's padding-free row; a vision-language model's forwards are
        padded whatever it says (its images are placed per padded row), split at its decoder."""
        if degree == 1:
            return None
        SequenceSplit.check_splittable(model, setting, degree)
        return SequenceSplit.of(self.ranks, self.tokenizer.pad_token_id,
                                remove_padding=remove_padding and not is_vision_language(model))

    def _policy_placement(self, fsdp_config: FSDPConfig) -> FSDPConfig:
        """actor.sequence_parallel_offload: the policy's embedding and head on the CPU (FSDP2's CPUOffloadPolicy
        over all ranks), so each rank keeps and copies only its own 1/world of their rows: no rank of a
        sequence-parallel group carries the whole vocabulary's copies."""
        if not self.config.actor_rollout_ref.actor.sequence_parallel_offload:
            return fsdp_config
        policy = fsdp_config.offload_policy.model_copy(update={"embedding": "cpu", "lm_head": "cpu"})
        return fsdp_config.model_copy(update={"offload_policy": policy})

    def _place(self, model: Model, fsdp_config: FSDPConfig, role: Role,
               sequence_split: SequenceSplit | None = None) -> Model:
        """One rank: the memory manager places the model's groups (the offload engine). Several: FSDP2 shards it
        over the ranks, CPU placement through its CPUOffloadPolicy (trainer/distributed/sharding.py); with a
        `sequence_split` its attention is Ulysses' first."""
        ranks = self.ranks
        if sequence_split is not None:
            sequence_split.prepare(model, KEYS.critic.ulysses_sequence_parallel_size if role == Role.CRITIC
                                   else KEYS.actor_rollout_ref.actor.ulysses_sequence_parallel_size)
            split = ("each micro-batch's padding-free row" if sequence_split.remove_padding else "every sequence")
            self.log(f"{role}: Ulysses sequence parallelism: each of the {ranks.sp_size} ranks of a group computes "
                     f"1/{ranks.sp_size} of {split} ({ranks.dp_size} data-parallel group(s) of the prompts); FSDP2 "
                     f"shards the model over all {ranks.world_size} ranks")
        if not ranks.distributed:
            return self.memory.place(model, fsdp_config, role)
        sharded = shard_model(model, fsdp_config, ranks, role=role, log=self.log)
        self.sharded[role] = sharded
        self.memory.sharded_summaries[role] = offload_summary(sharded.on_cpu, sharded.parts, ranks.device)
        copies = CopyLog(cuda=ranks.device.type == "cuda")
        watch_shard_copies(model, copies, parameter_groups(sharded.parts))
        self.shard_copies.append(copies)
        if sharded.parts.layers:
            layers = ShardedLayers(role, sharded.parts.layers, ranks.device,
                                   optimizer=lambda: self._built.optimizer_of(role) if self._built else None)
            self.memory.add_sharded(layers, dynamic=fsdp_config.dynamic_offload.enabled
                                    and not sharded.on_cpu["transformer"])
        return model

    def _memory(self, role: Role) -> ModelMemory | None:
        """The memory manager's side for a worker; None for a sharded model, which it does not place (the
        worker's optimizer is then torch's AdamW over the local shards, and errors propagate)."""
        return None if self.ranks.distributed else self.memory.for_role(role)
