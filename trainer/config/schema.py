"""The run configuration: one typed tree, validated at load.

Keys follow verl's names (``actor_rollout_ref.actor.optim.lr``, ``data.train_batch_size``, ...).
Every field has its default and a one-line docstring here and nowhere else; the rest of the
code reads typed attributes, never ``dict.get(key, default)``.

This module must not import torch: the daemon imports it to validate a config before it
starts the trainer process.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import itertools
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from trainer.config.hub import HubModelNotCached, resolve_model_path
from trainer.config.sequence_parallel import model_heads, sequence_parallel_problems

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-qwen2",)
BUILTIN_DATASETS = ("counting",)
DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")

Placement = Literal["cpu", "gpu"]
LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
# verl also accepts k1, k2 and k3 (Schulman's names) for kl, mse and low_var_kl: trainer.algorithms.kl_penalty
# maps them, and a test keeps this list equal to the estimators it knows.
KLEstimator = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]

# The values a config sets and the live settings (trainer.config.live.LiveSettings) may change while the run goes
# on: each bound is written here once, and both the schema and the live settings take these types.
MemoryThreshold = Annotated[float, Field(gt=0.0, le=1.0)]
LayerMinimum = Annotated[int, Field(ge=0)]
GpuSampleInterval = Annotated[float, Field(ge=0.05, le=60.0)]
PcieSampleInterval = Annotated[float, Field(ge=1.0, le=600.0)]
LogLevel = Literal["debug", "info", "warning", "error"]
# verl's experiment trackers (trainer.logger); trainer/tracking.py runs them. Each but console and file needs a
# library of the `trackers` extra, named here by the module it imports.
TrackerBackend = Literal["console", "wandb", "tensorboard", "mlflow", "swanlab", "file"]
TRACKER_MODULES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "swanlab": "swanlab"}
TRACKERS_EXTRA = "pip install 'verl-offload[trackers]'"


# ------------------------------------------------------------------------------ field helpers
# Used by the validators below (defaults are validated as the classes are defined) and by the messages.


def describe_allowed(annotation: Any, field: FieldInfo | None) -> str:
    """What a field takes, in words: "an integer >= 1", "a number > 0 and <= 1", "'gae' or 'grpo'"."""
    annotation = _unwrap_optional(annotation)
    if typing.get_origin(annotation) is Literal:
        return " or ".join(repr(choice) for choice in typing.get_args(annotation))
    if typing.get_origin(annotation) in (list, tuple):
        return "a list of strings" if typing.get_args(annotation) == (str,) else "a list"
    noun = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(annotation, "")
    bounds = []
    for constraint in field.metadata if field is not None else ():
        for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(constraint, getattr(annotated_types, name.capitalize())):
                bounds.append(f"{symbol} {getattr(constraint, name):g}")
    return " ".join(filter(None, [noun, " and ".join(bounds)])) or "a value of the right type"


def _show(value: Any) -> str:
    """A value as the user typed it in YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unwrap_optional(annotation: Any) -> Any:
    arguments = [argument for argument in typing.get_args(annotation) if argument is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(arguments) == 1:
        return arguments[0]
    return annotation


def _section_type(annotation: Any) -> type[Section] | None:
    annotation = _unwrap_optional(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(_unwrap_optional(annotation)) is dict


def _number_type(annotation: Any) -> bool:
    return _unwrap_optional(annotation) in (int, float)


class Section(BaseModel):
    """A config section: unknown keys are errors, field docstrings are the documentation."""

    # coerce_numbers_to_str: `experiment_name: 7` or `trainer.experiment_name=7` means the name "7".
    # allow_inf_nan=False: YAML reads `.inf` and `.nan` as floats, and no setting here wants them.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_yaml_values(cls, value: Any, info: ValidationInfo) -> Any:
        """An empty YAML section (`critic:` with every key commented out) reads as null: treat it as {}.

        Pydantic's lax mode would read `true` as 1 for a number; a boolean given for a number is a mistake.
        """
        field = cls.model_fields[info.field_name or ""]  # "*" validators always run for a field
        annotation = field.annotation
        if value is None and _section_type(annotation) is not None:
            return {}
        if isinstance(value, bool) and _number_type(annotation):
            allowed = describe_allowed(annotation, field)
            raise ValueError(f"got {_show(value)}, a boolean; allowed: {allowed}")
        return value


# ---------------------------------------------------------------------------------------- offload


class OffloadPolicy(Section):
    embedding: Placement | None = None
    """Where the token embedding lives; unset follows param_offload (cpu when it is true)."""
    lm_head: Placement | None = None
    """Where the output head (lm_head, value head or score head) lives; unset follows param_offload."""
    transformer: Placement | None = None
    """Where the transformer blocks live; unset follows param_offload."""
    norm: Placement | None = None
    """Where the final norm lives; unset follows param_offload."""


class DynamicOffload(Section):
    """Per model: whether dynamic offload may move this model's transformer layers.

    How far it moves them is run-wide (the top-level dynamic_offload section, DynamicOffloadConfig).
    """

    enabled: bool = False
    """Let dynamic offload move this model's transformer layers to the CPU (at dynamic_offload's levels)."""


class DynamicOffloadConfig(Section):
    """The run-wide levels of dynamic offload (the top-level dynamic_offload section), for every model whose
    fsdp_config.dynamic_offload.enabled is true. Both are live settings too (`verl set`, PATCH /v1/settings).

    Run-wide, with no per-model copy: the device memory in use is one number for the whole GPU, whichever
    model's layers fill it, and all of a run's models share that one budget.
    """

    gpu_memory_threshold: MemoryThreshold = 0.85
    """Fraction of GPU memory in use (0 to 1] above which transformer layers move off the GPU."""
    min_transformer_layers_on_gpu: LayerMinimum = 0
    """Fewest transformer layers each dynamically offloaded model keeps on the GPU."""


class WrapPolicy(Section):
    transformer_layer_cls_to_wrap: list[str] | None = None
    """Class names of the transformer blocks; unset detects them from the model."""
    min_num_params: int = Field(0, ge=0)
    """Wrap any module with at least this many parameters (0 wraps by layer class only)."""


class FSDPConfig(Section):
    param_offload: bool = False
    """Keep all parameters on the CPU and stream them to the GPU (offload_policy refines it)."""
    optimizer_offload: bool = False
    """Keep fp32 master weights and optimizer states on the CPU (optimizer_update says where the update runs)."""
    optimizer_update: Literal["auto", "cpu", "gpu", "both"] = "auto"
    """Where offloaded AdamW runs: gpu (streamed), cpu (host), both (at once), auto (both on a GPU, else cpu)."""
    offload_policy: OffloadPolicy = OffloadPolicy()
    """Placement of each module group: embedding, lm_head, transformer, norm."""
    dynamic_offload: DynamicOffload = DynamicOffload()
    """Whether this model's transformer layers move off the GPU under memory pressure (levels: dynamic_offload)."""
    wrap_policy: WrapPolicy = WrapPolicy()
    """How the model is split into units for sharding and offload."""
    model_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the parameters (bf16 trains without fp32 master weights)."""
    offload_grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of CPU gradients beside fp32 masters (bf16: half their host memory; on ranks, half the bytes down)."""
    delayed_update: bool = False
    """The actor's CPU update runs during the next rollout, which samples with the weights before it."""
    merge_micro_batches: bool = True
    """While the update streams layers from the CPU, run each mini-batch as one micro-batch (the same gradient)."""

    def placement(self, group: str) -> Placement:
        """Where a module group lives once param_offload and offload_policy are combined."""
        explicit: Placement | None = getattr(self.offload_policy, group)
        if explicit is not None:
            return explicit
        return "cpu" if self.param_offload else "gpu"


# ----------------------------------------------------------------------------------------- models


class ModelConfig(Section):
    path: str = "builtin:tiny-qwen2"
    """A local HuggingFace model directory, a hub id (Org/Name) in the local HF cache, or builtin:tiny-qwen2."""
    tokenizer_path: str | None = None
    """A local tokenizer directory or a cached hub id; unset uses the model's."""
    override_config: dict[str, Any] = {}
    """Keys set on the model's HF config before it is built (e.g. num_hidden_layers)."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory."""
    lora_rank: int = Field(0, ge=0)
    """Rank of a LoRA adapter (peft) trained on the frozen policy; 0 trains every weight (verl's key)."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scaling numerator: the adapter's output is scaled by lora_alpha / lora_rank."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get an adapter: all-linear (every linear layer but the output head), a list of names, or a regex."""
    exclude_modules: str | list[str] | None = None
    """Modules of target_modules left without an adapter: a list of names, or a regex; unset excludes none."""
    use_remove_padding: bool = False
    """Padding-free forward (real tokens packed in one row) for the actor's and reference's log-probs and update."""

    @field_validator("target_modules", "exclude_modules", mode="before")
    @classmethod
    def _lora_modules(cls, value: Any, info: ValidationInfo) -> Any:
        return _module_names(value, info)


def _module_names(value: Any, info: ValidationInfo) -> Any:
    """target_modules and exclude_modules: a non-empty string, or a non-empty list of non-empty strings."""
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(item, str) and item.strip() for item in value):
        return list(value)
    choices = "all-linear, " if info.field_name == "target_modules" else "null, "
    raise ValueError(f"got {_show(value)}; allowed: {choices}a list of module names (e.g. [q_proj, v_proj]) or a "
                     "regex matching whole module names")


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate of AdamW."""
    lr_warmup_steps: int = Field(-1, ge=-1)
    """Linear warm-up steps; -1 uses lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Warm-up as a fraction of the run's training steps (used when lr_warmup_steps is -1)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up: constant, or cosine decay to min_lr_ratio * lr (verl's names)."""
    warmup_style: Literal["constant", "cosine"] | None = None
    """verl's older name of lr_scheduler_type; when set it wins, as in verl (both set and differing: an error)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the cosine schedule as a fraction of lr."""
    num_cycles: float = Field(0.5, gt=0.0)
    """Cosine waves over the steps after warm-up (verl's; 0.5 decays once from lr to the floor)."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    @property
    def schedule(self) -> Literal["constant", "cosine"]:
        """The schedule after warm-up: warmup_style when it is set (verl's deprecated name wins), else
        lr_scheduler_type."""
        return self.lr_scheduler_type if self.warmup_style is None else self.warmup_style

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, betas: Any) -> Any:
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise ValueError(f"got {_show(betas)}; allowed: two numbers [beta1, beta2], each 0 <= beta < 1")
        return betas

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"got {_show(list(betas))}, out of range; allowed: each 0 <= beta < 1")
        return betas


class ActorConfig(Section):
    ppo_mini_batch_size: int = Field(256, ge=1)
    """Prompts per optimizer step (each carries rollout.n responses)."""
    ppo_micro_batch_size_per_gpu: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate up to the mini-batch."""
    use_dynamic_bsz: bool = False
    """Form update micro-batches by token budget (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size_per_gpu."""
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1)
    """Most real tokens (prompt and response) in one update micro-batch, with use_dynamic_bsz."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    shuffle: bool = False
    """Shuffle sequences before splitting them into mini-batches."""
    clip_ratio: float = Field(0.2, gt=0.0)
    """PPO clip range epsilon (both sides unless clip_ratio_low/high are set)."""
    clip_ratio_low: float | None = Field(None, gt=0.0)
    """Lower clip range; unset uses clip_ratio."""
    clip_ratio_high: float | None = Field(None, gt=0.0)
    """Upper clip range; unset uses clip_ratio."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages (Ye et al. 2020)."""
    entropy_coeff: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the actor loss (GRPO style)."""
    kl_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the KL loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss (k1, k2, k3 are verl's names for kl, mse, low_var_kl)."""
    loss_agg_mode: LossAggregation = "token-mean"
    """How token losses are averaged."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the gradient norm to this value."""
    ulysses_sequence_parallel_size: int = Field(1, ge=1)
    """Ulysses degree S of the actor and reference: S ranks split each sequence (also verl's fsdp_config key)."""
    sequence_parallel_offload: bool = False
    """The policy's embedding and head on the CPU, each rank keeping and copying its 1/world shard (needs S > 1)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer of the actor."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """Placement and dtype of the actor."""

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high) clip range of the policy ratio."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high


class EmbeddingCache(Section):
    enabled: bool = False
    """Keep the most frequent tokens' embedding rows on the GPU while the embedding is on the CPU."""
    cache_size: int = Field(8192, ge=1)
    """Rows kept on the GPU."""
    warmup_steps: int = Field(10, ge=0)
    """Steps over which token frequencies are counted before the cache is filled."""


class RolloutConfig(Section):
    name: Literal["hf"] = "hf"
    """Generation engine: hf, the built-in rollout on the actor's own weights (verl's vllm and sglang: refused)."""
    tensor_model_parallel_size: int = 1
    """verl's key: 1 only (the rollout decodes with the actor's weights, in the trainer process, on one device)."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """Fraction of GPU memory in use while decoding (resident weights and states + KV cache); unset: no budget."""
    n: int = Field(1, ge=1)
    """Responses sampled per prompt."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the k most likely tokens; -1 or 0 disables."""
    do_sample: bool = True
    """Sample; false decodes greedily."""
    decode: Literal["auto", "generate", "static"] = "auto"
    """static (preallocated cache, CUDA graphs on a GPU), generate (transformers'), auto: static on a GPU if it fits."""
    enforce_eager: bool = False
    """verl's key: true runs the static decode's per-token step eagerly instead of in CUDA graphs."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Sequences per forward when computing log-probs and values."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Form old-log-prob micro-batches by token budget; unset uses actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = Field(None, ge=1)
    """Most real tokens in one old-log-prob micro-batch; unset uses actor.ppo_max_token_len_per_gpu."""
    embedding_cache: EmbeddingCache = EmbeddingCache()
    """GPU cache of frequent embedding rows."""

    @field_validator("name", mode="before")
    @classmethod
    def _built_in_engine(cls, name: Any) -> Any:
        if name == "???":
            raise ValueError("got '???', verl's mark of a value a config must give; allowed: 'hf'")
        if name in ("vllm", "sglang", "trtllm"):
            raise ValueError(f"got {name!r}, but the rollout here is built in (it decodes with the actor's own "
                             f"weights in the trainer process, so no weights are synced to a {name} server); "
                             "allowed: 'hf'")
        return name

    @field_validator("tensor_model_parallel_size", mode="before")
    @classmethod
    def _one_rollout_device(cls, size: Any) -> Any:
        if isinstance(size, int) and not isinstance(size, bool) and size != 1:
            raise ValueError(f"got {size}, but the rollout decodes with the actor's own weights on the trainer's "
                             "one device (no tensor-parallel inference engine; the offload engine streams what "
                             "does not fit); allowed: 1")
        return size


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Sequences per forward of the reference policy."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Form reference micro-batches by token budget; unset uses actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = Field(None, ge=1)
    """Most real tokens in one reference micro-batch; unset uses actor.ppo_max_token_len_per_gpu."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """Placement and dtype of the reference policy."""


class ActorRolloutRefConfig(Section):
    model: ModelConfig = ModelConfig()
    """The policy model (actor, rollout and reference share it)."""
    actor: ActorConfig = ActorConfig()
    """PPO/GRPO actor update."""
    rollout: RolloutConfig = RolloutConfig()
    """Response sampling."""
    ref: RefConfig = RefConfig()
    """Frozen reference policy for the KL terms."""
    nccl_timeout: int = Field(600, ge=1)
    """verl's key: seconds a collective of several ranks waits for a rank that is gone before the group fails."""


class CriticModelConfig(Section):
    path: str | None = None
    """Model directory of the critic; unset uses the actor's model."""
    tokenizer_path: str | None = None
    """Tokenizer directory; unset uses the actor's tokenizer."""
    override_config: dict[str, Any] = {}
    """Keys set on the critic's HF config before it is built."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory."""
    lora_rank: int = Field(0, ge=0)
    """Rank of a LoRA adapter on the critic's frozen backbone (its value head trains whole); 0 trains every weight."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scaling numerator: the adapter's output is scaled by lora_alpha / lora_rank."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get an adapter: all-linear (every linear layer but the value head), a list of names, or a regex."""
    use_remove_padding: bool = False
    """Padding-free forward (real tokens packed in one row) for the critic's values and update."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _lora_modules(cls, value: Any, info: ValidationInfo) -> Any:
        return _module_names(value, info)


class CriticConfig(Section):
    enable: bool | None = None
    """Train a value model; unset enables it when algorithm.adv_estimator is gae."""
    model: CriticModelConfig = CriticModelConfig()
    """The value model (a causal LM backbone with a one-output head)."""
    optim: OptimConfig = OptimConfig(lr=1e-5)
    """Optimizer of the critic."""
    ppo_mini_batch_size: int | None = Field(None, ge=1)
    """Prompts per critic optimizer step; unset uses the actor's."""
    ppo_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Sequences per critic forward/backward; unset uses the actor's."""
    use_dynamic_bsz: bool | None = None
    """Form the critic's micro-batches by token budget; unset uses actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = Field(32768, ge=1)
    """Most real tokens in one critic update micro-batch, with use_dynamic_bsz."""
    forward_max_token_len_per_gpu: int | None = Field(None, ge=1)
    """Most real tokens in one micro-batch of values, with use_dynamic_bsz; unset uses ppo_max_token_len_per_gpu."""
    ppo_epochs: int | None = Field(None, ge=1)
    """Passes over each batch; unset uses the actor's."""
    cliprange_value: float = Field(0.5, gt=0.0)
    """Clip range of the value update."""
    loss_agg_mode: LossAggregation = "token-mean"
    """How token value losses are averaged."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the gradient norm to this value."""
    ulysses_sequence_parallel_size: int = Field(1, ge=1)
    """Ulysses degree of the critic: 1 or the actor's (also verl's critic.model.fsdp_config key)."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """Placement and dtype of the critic."""


class RewardModelNetwork(Section):
    path: str | None = None
    """Directory of a sequence-classification model with one output (num_labels=1)."""
    tokenizer_path: str | None = None
    """Its tokenizer directory; unset uses the reward model's own."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """Placement and dtype of the reward model."""


class RewardModelConfig(Section):
    enable: bool = False
    """Score responses with a reward model instead of the rule-based scorers."""
    model: RewardModelNetwork = RewardModelNetwork()
    """The reward model."""
    micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Sequences per reward-model forward."""


class CustomRewardFunction(Section):
    path: str | None = None
    """A Python file defining the scoring function; unset uses the built-in scorers."""
    name: str = "compute_score"
    """Function in that file: (data_source, solution_str, ground_truth, extra_info) -> float."""
    on_error: Literal["raise", "zero"] = "raise"
    """When the function raises: raise stops the run (exit 2), zero scores the response 0 (counted: reward/errors)."""


class KLControl(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed keeps kl_coef; adaptive steers it towards target_kl (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0.0)
    """(Initial) coefficient of the KL penalty in the reward."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon in samples."""
    target_kl: float = Field(0.1, gt=0.0)
    """KL the adaptive controller aims at."""


class AlgorithmConfig(Section):
    adv_estimator: Literal["gae", "grpo"] = "gae"
    """Advantage estimator: gae (PPO with a critic) or grpo (group-normalized, no critic)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """Subtract a KL(actor || reference) penalty from the token rewards."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator of the in-reward penalty (k1, k2, k3 are verl's names for kl, mse, low_var_kl)."""
    kl_ctrl: KLControl = KLControl()
    """Coefficient controller of the in-reward penalty."""


class DataConfig(Section):
    train_files: list[str] = ["builtin:counting"]
    """Training prompts: verl parquet or JSONL files, or builtin:counting."""
    val_files: list[str] = []
    """Validation prompts, scored every trainer.test_freq steps."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or plain text)."""
    max_prompt_length: int = Field(512, ge=1)
    """Longest prompt in tokens."""
    max_response_length: int = Field(512, ge=1)
    """Most tokens generated per response."""
    train_batch_size: int = Field(1024, ge=1)
    """Prompts per training step."""
    val_batch_size: int | None = Field(256, ge=1)
    """Prompts per validation generation batch; null: all of them in one batch (verl's meaning)."""
    shuffle: bool = True
    """Shuffle prompts every epoch."""
    seed: int | None = 1
    """Seed of the prompt order; null uses trainer.seed."""
    truncation: Literal["error", "left", "right"] = "error"
    """What to do with a prompt longer than max_prompt_length (unless filter_overlong_prompts drops it)."""
    filter_overlong_prompts: bool = False
    """Drop the prompts longer than max_prompt_length tokens when the data is loaded (counted in the log)."""
    return_raw_chat: bool = True
    """verl's key; either value runs the same here: the rollout always applies the chat template to the messages."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class TrainerConfig(Section):
    project_name: str = "verl_offload"
    """Project the run belongs to (shown in logs and telemetry)."""
    experiment_name: str = "run"
    """Name of the run; its files go to <runs_dir>/<experiment_name>/."""
    runs_dir: str = "runs"
    """Folder that holds the run directories."""
    total_epochs: int = Field(1, ge=1)
    """Passes over the training prompts."""
    total_training_steps: int | None = Field(None, ge=1)
    """Steps to train; wins over total_epochs when set."""
    save_freq: int = Field(-1, ge=-1)
    """Checkpoint every this many steps (-1: only at the end)."""
    max_ckpt_to_keep: int | None = Field(None, ge=1)
    """Keep only the newest this many checkpoints; unset keeps all (or verl's max_*_ckpt_to_keep)."""
    max_actor_ckpt_to_keep: int | None = Field(None, ge=1)
    """verl's key: checkpoints kept for the actor; one checkpoint holds both models, so the larger count wins."""
    max_critic_ckpt_to_keep: int | None = Field(None, ge=1)
    """verl's key: checkpoints kept for the critic; one checkpoint holds both models, so the larger count wins."""
    default_local_dir: str | None = None
    """verl's key: the folder of the global_step_N checkpoints; unset: <runs_dir>/<experiment_name>/checkpoints."""
    test_freq: int = Field(-1, ge=-1)
    """Validate every this many steps (-1: never; needs data.val_files)."""
    val_before_train: bool = True
    """Validate once before the first step (a fresh run with data.val_files); metrics at step 0."""
    val_only: bool = False
    """Only validate (as val_before_train does), then stop without training."""
    critic_warmup: int = Field(0, ge=0)
    """Steps at the start of a run that update the critic only; the actor's updates start after them."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto resumes from the run's latest complete checkpoint; resume_path from resume_from_path."""
    resume_from_path: str | None = None
    """A checkpoint directory (global_step_N) to resume from with resume_mode resume_path."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: auto takes the GPU when there is one."""
    cpu_threads: int | None = Field(None, ge=1)
    """Threads of the trainer's CPU work (torch intra-op); unset: all cores, or a rank's share; cores - 1 spares one."""
    seed: int = 1
    """Seed of model init, sampling and everything else random."""
    nnodes: int = Field(1, ge=1)
    """Nodes of the run: one `verl train` on each, all given the same trainer.rdzv_endpoint."""
    n_gpus_per_node: int = Field(1, ge=1)
    """GPUs (ranks) per node; above 1 they run under torch.distributed's elastic launcher (device cpu: gloo ranks)."""
    node_rank: int = Field(0, ge=0)
    """This node's place in trainer.nnodes (0: global rank 0); unset: NODE_RANK, PET_NODE_RANK or SLURM_NODEID."""
    rdzv_endpoint: str | None = None
    """host:port of node 0 where the nodes meet; unset: PET_RDZV_ENDPOINT or MASTER_ADDR:MASTER_PORT."""
    logger: list[TrackerBackend] = ["console"]
    """Trackers for each step's metrics, one or a list of: console, wandb, tensorboard, mlflow, swanlab, file."""

    @field_validator("logger", mode="before")
    @classmethod
    def _one_tracker_is_a_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list | tuple):
            names = " or ".join(repr(name) for name in typing.get_args(TrackerBackend))
            raise ValueError(f"got {_show(value)}; allowed: a tracker's name ({names}) or a list of them")
        return value

    @field_validator("logger")
    @classmethod
    def _trackers_installed(cls, backends: list[str]) -> list[str]:
        """Each tracker once, in the order given; one asked for whose library is missing is refused here,
        before the run starts, rather than when the trainer gets to it."""
        backends = list(dict.fromkeys(backends))
        missing = [name for name in backends
                   if name in TRACKER_MODULES and importlib.util.find_spec(TRACKER_MODULES[name]) is None]
        if missing:
            raise ValueError(f"got {_show(backends)}, but {' and '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not installed; install the trackers "
                             f"extra: {TRACKERS_EXTRA}")
        return backends

    @field_validator("experiment_name")
    @classmethod
    def _usable_as_folder_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"got {name!r}, which cannot name a run folder; allowed: letters, digits, "
                             "'.', '_' and '-', starting with a letter or digit")
        return name

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.experiment_name

    @property
    def checkpoint_dir(self) -> Path:
        """Where the global_step_N checkpoints go: default_local_dir when set (it wins), else the run's folder."""
        if self.default_local_dir is not None:
            return Path(self.default_local_dir).expanduser()
        return self.run_dir / "checkpoints"


class TelemetryConfig(Section):
    host: str = "127.0.0.1"
    """Address the API binds; anything but loopback exposes it beyond this machine (token still needed)."""
    port: int = Field(0, ge=0, le=65535)
    """API port; 0 picks a free one (printed at start and kept in the runtime file)."""
    public_metrics: bool = False
    """Serve /metrics without the token, for a Prometheus that cannot send it."""
    gpu_sample_interval_s: GpuSampleInterval = 1.0
    """Seconds between GPU samples (utilization, memory, power, temperature)."""
    pcie_sample_interval_s: PcieSampleInterval = 10.0
    """Seconds between PCIe throughput samples (each NVML call blocks ~20 ms)."""
    history_seconds: int = Field(900, ge=10, le=86400)
    """How far back the daemon keeps samples for monitors that attach late."""
    allowed_origins: list[str] = []
    """Extra browser origins allowed to open the WebSocket stream (the API's own is always allowed)."""


class DaemonConfig(Section):
    max_restarts: int = Field(3, ge=0)
    """Restart a crashed trainer at most this many times, resuming from its latest checkpoint."""
    restart_backoff_s: float = Field(1.0, ge=0.0, le=600.0)
    """Wait before the first restart; doubles with each further one."""
    restart_backoff_max_s: float = Field(60.0, ge=0.0, le=3600.0)
    """Longest wait between restarts."""
    stop_timeout_s: float = Field(300.0, gt=0.0)
    """On stop, how long the trainer may take to reach a safe point and checkpoint before it is killed."""
    force_stop_grace_s: float = Field(10.0, ge=0.0, le=3600.0)
    """A SIGTERM/SIGINT this long after the first kills the trainer without a checkpoint; sooner, the same stop."""
    hang_timeout_s: float | None = Field(None, gt=0.0)
    """Restart a trainer silent this long (stacks to logs/trainer.log); unset: 5x the median step, >= 600 s."""
    state_dir: str | None = None
    """Where runtime files live; unset uses $VERL_STATE_DIR, else $XDG_STATE_HOME/verl, else ~/.local/state/verl."""
    log_level: LogLevel = "info"
    """Least severe log lines kept by the daemon and the trainer."""


class RunConfig(Section):
    """The whole run."""

    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    """Policy model, its update, rollout and reference."""
    critic: CriticConfig = CriticConfig()
    """Value model (PPO with GAE)."""
    reward_model: RewardModelConfig = RewardModelConfig()
    """Learned reward model."""
    custom_reward_function: CustomRewardFunction = CustomRewardFunction()
    """A user-supplied rule-based scorer."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantage estimator and KL penalty."""
    data: DataConfig = DataConfig()
    """Prompts and lengths."""
    trainer: TrainerConfig = TrainerConfig()
    """Length of the run, checkpoints, device."""
    dynamic_offload: DynamicOffloadConfig = DynamicOffloadConfig()
    """Run-wide threshold and layer minimum of dynamic offload (which models it moves: their fsdp_config)."""
    telemetry: TelemetryConfig = TelemetryConfig()
    """The daemon's API: address, token use, sampling."""
    daemon: DaemonConfig = DaemonConfig()
    """Supervision of the trainer process."""

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is None:
            return self.algorithm.adv_estimator == "gae"
        return self.critic.enable

    @property
    def prompt_order_seed(self) -> int:
        """data.seed, or trainer.seed when it is null."""
        return self.trainer.seed if self.data.seed is None else self.data.seed

    @property
    def checkpoints_to_keep(self) -> int | None:
        """How many checkpoints a save keeps (None: all): max_ckpt_to_keep, else the larger of verl's per-model
        counts given for the models this run trains. One checkpoint holds every model and resumes them together,
        so no model keeps fewer than it was given (and a count left unset does not keep every checkpoint)."""
        trainer = self.trainer
        if trainer.max_ckpt_to_keep is not None:
            return trainer.max_ckpt_to_keep
        counts = [trainer.max_actor_ckpt_to_keep] + ([trainer.max_critic_ckpt_to_keep] if self.use_critic else [])
        return max((count for count in counts if count is not None), default=None)

    @property
    def use_reference(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def sequence_parallel_size(self) -> int:
        """The run's Ulysses degree S: the ranks that share each sequence (the data splits over world size / S
        groups). The actor's (the reference runs with it) or the critic's, whichever is set above 1: the other
        is 1 or the same (checked at load), and a model of degree 1 runs whole sequences of its group's samples."""
        sizes = [self.actor_rollout_ref.actor.ulysses_sequence_parallel_size]
        if self.use_critic:
            sizes.append(self.critic.ulysses_sequence_parallel_size)
        return max(sizes)

    def fsdp_configs(self) -> dict[str, FSDPConfig]:
        """The placement config of every model the run builds, by role."""
        configs = {"actor": self.actor_rollout_ref.actor.fsdp_config}
        if self.use_reference:
            configs["ref"] = self.actor_rollout_ref.ref.fsdp_config
        if self.use_critic:
            configs["critic"] = self.critic.fsdp_config
        if self.reward_model.enable:
            configs["reward_model"] = self.reward_model.model.fsdp_config
        return configs


# ------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config: where, what was given, what is allowed."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """A config that cannot run; carries every problem found, not just the first."""

    def __init__(self, problems: Sequence[ConfigProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))


def validate_config(raw: dict[str, Any]) -> RunConfig:
    """Turn a plain dict into a RunConfig, or raise ConfigError naming every problem."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as error:
        errors = error.errors()
        problems = [_describe_pydantic_error(item) for item in errors]
        problems += _checks_despite_schema_errors(raw, errors)
        raise ConfigError(problems) from None
    problems = check_semantics(config)
    if problems:
        raise ConfigError(problems)
    return resolve_defaults(config)


def resolve_defaults(config: RunConfig) -> RunConfig:
    """Fill the "unset means same as the actor" fields so the saved config is explicit."""
    actor = config.actor_rollout_ref.actor
    critic = config.critic.model_copy(
        update={
            "enable": config.use_critic,
            "ppo_mini_batch_size": config.critic.ppo_mini_batch_size or actor.ppo_mini_batch_size,
            "ppo_micro_batch_size_per_gpu": config.critic.ppo_micro_batch_size_per_gpu
            or actor.ppo_micro_batch_size_per_gpu,
            "ppo_epochs": config.critic.ppo_epochs or actor.ppo_epochs,
            "model": config.critic.model.model_copy(
                update={"path": config.critic.model.path or config.actor_rollout_ref.model.path}
            ),
            **_token_budget_defaults(config.critic, "use_dynamic_bsz", actor.use_dynamic_bsz,
                                     "forward_max_token_len_per_gpu", config.critic.ppo_max_token_len_per_gpu),
        }
    )
    scorers = {name: section.model_copy(update=_token_budget_defaults(
        section, "log_prob_use_dynamic_bsz", actor.use_dynamic_bsz,
        "log_prob_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu))
        for name, section in (("rollout", config.actor_rollout_ref.rollout), ("ref", config.actor_rollout_ref.ref))}
    return config.model_copy(update={"critic": critic,
                                     "actor_rollout_ref": config.actor_rollout_ref.model_copy(update=scorers)})


def _token_budget_defaults(section: Section, switch: str, switch_default: bool, budget: str,
                           budget_default: int) -> dict[str, Any]:
    """verl's interpolations of the dynamic-batch keys (e.g. ${actor.use_dynamic_bsz}) for those left unset."""
    return {switch: switch_default if getattr(section, switch) is None else getattr(section, switch),
            budget: budget_default if getattr(section, budget) is None else getattr(section, budget)}


def dump_config(config: RunConfig) -> str:
    """The config as YAML, every field explicit: what the trainer process is started with."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


FSDP_PREFIX = {
    "actor": "actor_rollout_ref.actor.fsdp_config",
    "ref": "actor_rollout_ref.ref.fsdp_config",
    "critic": "critic.fsdp_config",
    "reward_model": "reward_model.model.fsdp_config",
}
# The models that never train: an optimizer or gradient setting of theirs has nothing to act on.
FROZEN_ROLES = ("ref", "reward_model")
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


# ------------------------------------------------------------------------------ semantic checks


def check_semantics(config: RunConfig) -> list[ConfigProblem]:
    """Problems no single field can see: files, paths, and how fields fit together."""
    return [problem for rule in _rules() for problem in rule(config)]


def _rules() -> tuple[Callable[[RunConfig], list[ConfigProblem]], ...]:
    """Every check beyond the schema, each small enough that one refused value skips little (see
    _checks_despite_schema_errors): the disk first, then how fields fit together."""
    return (_check_actor_model_paths, _check_critic_model_paths, _check_reward_model_paths, _check_train_files,
            _check_val_files, _check_reward_function_file,
            _check_batch_sizes, _check_token_budgets, _grpo_needs_several_responses, _gae_needs_a_critic,
            _clip_range_is_positive,
            _resume_path_is_set, _validation_needs_data, _check_devices, _check_launch, _check_offload,
            _settings_of_models_not_built, _training_settings_of_frozen_models, _settings_not_built_yet,
            _layer_minimum_without_dynamic_offload, _reward_error_policy_without_a_function,
            _actor_lora_keys, _critic_lora_keys, _checkpoint_counts_agree, _critic_warmup_needs_a_critic,
            _validation_only_needs_data, _scheduler_names_agree)


def _checkpoint_counts_agree(config: RunConfig) -> list[ConfigProblem]:
    """max_ckpt_to_keep is this project's count; verl's per-model counts map onto it (checkpoints_to_keep)."""
    trainer = config.trainer
    problems = []
    if not config.use_critic and trainer.max_critic_ckpt_to_keep is not None:
        problems.append(_ignored("trainer.max_critic_ckpt_to_keep", trainer.max_critic_ckpt_to_keep, None,
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
    return [_ignored("trainer.critic_warmup", warmup, 0, "this run trains no critic (algorithm.adv_estimator="
                     f"{config.algorithm.adv_estimator}, critic.enable={_show(config.critic.enable)})")]


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
    return [_ignored("custom_reward_function.on_error", function.on_error, default, why)]


def _ignored(key: str, value: Any, default: Any, why: str, remedy: str = "") -> ConfigProblem:
    """A key set to `value` that the run would not act on, `why`, and what to do instead of setting it."""
    return ConfigProblem(key, f"got {_show(value)}, but {why}: it would have no effect; allowed: the default "
                         f"({_show(default)}; leave the key out){remedy}")


def _actor_lora_keys(config: RunConfig) -> list[ConfigProblem]:
    return _lora_keys("actor_rollout_ref.model", config.actor_rollout_ref.model, ModelConfig())


def _critic_lora_keys(config: RunConfig) -> list[ConfigProblem]:
    return _lora_keys("critic.model", config.critic.model, CriticModelConfig())


def _lora_keys(prefix: str, model: ModelConfig | CriticModelConfig,
               default: ModelConfig | CriticModelConfig) -> list[ConfigProblem]:
    """An adapter needs peft; LoRA's other keys act only with an adapter (lora_rank > 0)."""
    if model.lora_rank > 0:
        if importlib.util.find_spec("peft") is not None:
            return []
        return [ConfigProblem(f"{prefix}.lora_rank", f"got {model.lora_rank}, but LoRA needs peft, which is not "
                              "installed; allowed: 0, or install the lora extra (pip install 'verl-offload[lora]')")]
    return [_ignored(f"{prefix}.{key}", getattr(model, key), getattr(default, key),
                     f"{prefix}.lora_rank is 0 (no LoRA adapter)", f", or set {prefix}.lora_rank (e.g. 8) to train an "
                     "adapter")
            for key in ("lora_alpha", "target_modules", "exclude_modules")
            if hasattr(model, key) and getattr(model, key) != getattr(default, key)]


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
            problems += [_ignored(f"{FSDP_PREFIX[role]}.{key}", value, default, why, remedy)
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
                problems.append(_ignored(f"{FSDP_PREFIX[role]}.{key}", getattr(fsdp, key), getattr(default, key),
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
            problems.append(_ignored(f"{FSDP_PREFIX[role]}.wrap_policy.min_num_params", fsdp.wrap_policy.min_num_params,
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
    return [_ignored("dynamic_offload.min_transformer_layers_on_gpu", minimum, default.min_transformer_layers_on_gpu,
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


def _checks_despite_schema_errors(raw: dict[str, Any], errors: Sequence[ErrorDetails]) -> list[ConfigProblem]:
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
            dropped.append(_dotted(field_path))
            refused.append(field_path)
        if error["type"] == "extra_forbidden" and field_path:
            refused += [field_path[:-1] + [meant] for meant in _meant_key(field_path)]
    try:
        config = RunConfig.model_validate(patched)
    except ValidationError:
        return []
    for field_path in refused:
        config = typing.cast(RunConfig, _refuse(config, field_path))
    problems = []
    for rule in _rules():
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


def _meant_key(field_path: Sequence[str]) -> list[str]:
    """The known key an unknown one at `field_path` likely misspells, if any."""
    parent = field_at(field_path[:-1]) if len(field_path) > 1 else None
    section = RunConfig if len(field_path) == 1 else _section_type(parent.annotation) if parent else None
    if section is None:
        return []
    return difflib.get_close_matches(field_path[-1], list(section.model_fields), n=1)


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


def _check_actor_model_paths(config: RunConfig) -> list[ConfigProblem]:
    model = config.actor_rollout_ref.model
    return _check_model_candidates([("actor_rollout_ref.model.path", model.path, True),
                                    ("actor_rollout_ref.model.tokenizer_path", model.tokenizer_path, False)])


def _check_critic_model_paths(config: RunConfig) -> list[ConfigProblem]:
    if not config.use_critic:
        return []
    model = config.critic.model
    return _check_model_candidates([("critic.model.path", model.path, True),
                                    ("critic.model.tokenizer_path", model.tokenizer_path, False)])


def _check_reward_model_paths(config: RunConfig) -> list[ConfigProblem]:
    if not config.reward_model.enable:
        return []
    model = config.reward_model.model
    if model.path is None:
        return [ConfigProblem("reward_model.model.path", "is not set, but reward_model.enable is true; allowed: "
                              "the directory of a sequence-classification model with one output (num_labels=1)")]
    return _check_model_candidates([("reward_model.model.path", model.path, True),
                                    ("reward_model.model.tokenizer_path", model.tokenizer_path, False)])


def _check_model_candidates(candidates: Sequence[tuple[str, str | None, bool]]) -> list[ConfigProblem]:
    """(key, value, whether it names a model rather than a tokenizer) -> the problems of the values set."""
    problems = [_check_model_path(key, value, is_model) for key, value, is_model in candidates if value is not None]
    return [problem for problem in problems if problem is not None]


def _check_model_path(key: str, value: str, is_model: bool) -> ConfigProblem | None:
    what = "model" if is_model else "tokenizer"
    builtins = ", ".join(BUILTIN_PREFIX + model for model in BUILTIN_MODELS)
    if value.startswith(BUILTIN_PREFIX):
        if value.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
            return ConfigProblem(key, f"got {value!r}, which is not a built-in model; allowed: {builtins}, "
                                 f"or a local HuggingFace {what} directory")
        return None
    try:
        directory = Path(resolve_model_path(value)).expanduser()
    except HubModelNotCached as error:
        return ConfigProblem(key, f"got {error}")
    if not directory.is_dir():
        return ConfigProblem(key, f"got {value!r}, which is not a directory (models are never downloaded); "
                             f"allowed: a local HuggingFace {what} directory, a hub model id in the local cache, "
                             f"or {builtins}")
    if is_model and not (directory / "config.json").is_file():
        where = "" if str(directory) == value else f" (its cached snapshot {str(directory)!r})"
        return ConfigProblem(key, f"got {value!r}{where}, a directory without config.json; allowed: a model "
                             "directory written by save_pretrained")
    return None


def _check_train_files(config: RunConfig) -> list[ConfigProblem]:
    if not config.data.train_files:
        return [ConfigProblem("data.train_files", f"got an empty list; allowed: {_DATA_FILES_ALLOWED}")]
    return _check_data_file_list("train_files", config.data.train_files)


def _check_val_files(config: RunConfig) -> list[ConfigProblem]:
    return _check_data_file_list("val_files", config.data.val_files)


def _check_data_file_list(key: str, files: Sequence[str]) -> list[ConfigProblem]:
    problems = [_check_data_file(f"data.{key}[{index}]", value) for index, value in enumerate(files)]
    return [problem for problem in problems if problem is not None]


def _check_reward_function_file(config: RunConfig) -> list[ConfigProblem]:
    function = config.custom_reward_function
    if function.path is not None and not Path(function.path).expanduser().is_file():
        return [ConfigProblem("custom_reward_function.path", f"got {function.path!r}, which is not a file; "
                              f"allowed: a Python file that defines {function.name}")]
    return []


_DATA_FILES_ALLOWED = (f"{', '.join(DATA_FILE_SUFFIXES)} files (verl's parquet layout or JSONL), "
                       f"or {', '.join(BUILTIN_PREFIX + name for name in BUILTIN_DATASETS)}")


def _check_data_file(key: str, value: str) -> ConfigProblem | None:
    if value.startswith(BUILTIN_PREFIX):
        if value.removeprefix(BUILTIN_PREFIX) not in BUILTIN_DATASETS:
            return ConfigProblem(key, f"got {value!r}, which is not a built-in dataset; "
                                 f"allowed: {_DATA_FILES_ALLOWED}")
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        return ConfigProblem(key, f"got {value!r}, which is a directory; allowed: {_DATA_FILES_ALLOWED} "
                             "(list each file of a folder of shards)")
    if path.suffix not in DATA_FILE_SUFFIXES:
        return ConfigProblem(key, f"got {value!r}, a file format that cannot be read; "
                             f"allowed: {_DATA_FILES_ALLOWED}")
    if not path.is_file():
        return ConfigProblem(key, f"got {value!r}, which does not exist; allowed: an existing file")
    return None


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


def _check_devices(config: RunConfig) -> list[ConfigProblem]:
    devices = world_size(config)
    problems = _check_sequence_parallel(config)
    if devices > 1 and not problems:  # the data-parallel degree is known once S fits the ranks
        problems += _batch_sizes_for_ranks(config)
    if devices > 1:
        problems += _single_rank_features(config)
    return problems


NODE_RANK_ENVIRONMENT = ("NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID")
"""Where trainer.node_rank comes from when the config leaves it unset (torchrun's names, then Slurm's)."""
RDZV_ENDPOINT_ENVIRONMENT = "PET_RDZV_ENDPOINT"
"""torchrun's name for --rdzv-endpoint; else MASTER_ADDR and MASTER_PORT (or PET_MASTER_ADDR/PET_MASTER_PORT)."""


def launch_keys_from_environment(raw: dict[str, Any], environment: Mapping[str, str]) -> list[ConfigProblem]:
    """Fill trainer.node_rank and trainer.rdzv_endpoint of a several-node run from the environment where the
    config leaves them out, as torchrun and Slurm users expect; a key the config sets always wins. A value
    read here is written into the resolved config, so every process of the run sees the same one."""
    trainer = raw.get("trainer")
    if not isinstance(trainer, dict) or not _several_nodes(trainer.get("nnodes")):
        return []
    problems = []
    if "node_rank" not in trainer:
        name = next((name for name in NODE_RANK_ENVIRONMENT if environment.get(name, "").strip()), None)
        if name is not None:
            value = environment[name].strip()
            if value.isdigit():
                trainer["node_rank"] = int(value)
            else:
                problems.append(ConfigProblem("trainer.node_rank", f"got {value!r} from ${name}; allowed: a whole "
                                              "number from 0 (or set trainer.node_rank)"))
    if "rdzv_endpoint" not in trainer:
        address = environment.get("MASTER_ADDR") or environment.get("PET_MASTER_ADDR")
        port = environment.get("MASTER_PORT") or environment.get("PET_MASTER_PORT")
        if environment.get(RDZV_ENDPOINT_ENVIRONMENT):
            trainer["rdzv_endpoint"] = environment[RDZV_ENDPOINT_ENVIRONMENT].strip()
        elif address and port:
            trainer["rdzv_endpoint"] = f"{address.strip()}:{port.strip()}"
    return problems


def _several_nodes(nnodes: Any) -> bool:
    try:
        return int(nnodes) > 1
    except (TypeError, ValueError):
        return False


def parse_endpoint(endpoint: str) -> tuple[str, int] | None:
    """("host", port) of "host:port" (an IPv6 host in brackets: "[::1]:29500"), or None when it is not one."""
    host, separator, port = endpoint.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not separator or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _check_launch(config: RunConfig) -> list[ConfigProblem]:
    trainer = config.trainer
    problems = []
    if trainer.node_rank >= trainer.nnodes:
        problems.append(ConfigProblem("trainer.node_rank", f"got {trainer.node_rank}, but trainer.nnodes is "
                                      f"{trainer.nnodes}; allowed: 0 to {trainer.nnodes - 1}"))
    if trainer.rdzv_endpoint is not None and parse_endpoint(trainer.rdzv_endpoint) is None:
        problems.append(ConfigProblem("trainer.rdzv_endpoint", f"got {trainer.rdzv_endpoint!r}; allowed: "
                                      "host:port of node 0, e.g. node0.cluster:29500"))
    elif trainer.rdzv_endpoint is None and trainer.nnodes > 1:
        problems.append(ConfigProblem("trainer.rdzv_endpoint", f"is not set, but trainer.nnodes is "
                                      f"{trainer.nnodes}; allowed: host:port of node 0, the same on every node "
                                      f"(or set ${RDZV_ENDPOINT_ENVIRONMENT}, or MASTER_ADDR and MASTER_PORT)"))
    return problems


def world_size(config: RunConfig) -> int:
    """The run's ranks: trainer.nnodes x trainer.n_gpus_per_node (CPU ranks with trainer.device: cpu)."""
    return config.trainer.nnodes * config.trainer.n_gpus_per_node


def data_parallel_size(config: RunConfig) -> int:
    """The groups the prompts split over: the world size over the Ulysses degree (its ranks share sequences)."""
    return max(1, world_size(config) // config.sequence_parallel_size)


def _check_sequence_parallel(config: RunConfig) -> list[ConfigProblem]:
    """Ulysses' degrees against the ranks and the models' heads (trainer/config/sequence_parallel.py), the one
    degree of the run, and the settings that go with it."""
    actor, critic = config.actor_rollout_ref.actor, config.critic
    actor_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    critic_key = "critic.ulysses_sequence_parallel_size"
    model = config.actor_rollout_ref.model
    policy_override = "actor_rollout_ref.model.override_config"
    degrees = [(actor_key, actor.ulysses_sequence_parallel_size, model.path, model.override_config, policy_override)]
    if config.use_critic:
        degrees.append((critic_key, critic.ulysses_sequence_parallel_size, critic.model.path or model.path,
                        critic.model.override_config or model.override_config,
                        "critic.model.override_config" if critic.model.override_config else policy_override))
    problems = []
    for key, size, path, override_config, override_key in degrees:
        heads = model_heads(path, override_config, BUILTIN_PREFIX) if size > 1 else None
        if heads is not None:
            problems += [ConfigProblem(problem.path, problem.message) for problem in
                         sequence_parallel_problems(size, world_size=world_size(config), heads=heads, key=key)]
        implementation = override_config.get("attn_implementation")
        if size > 1 and implementation not in (None, "sdpa"):
            # Ulysses wraps SDPA only (trainer/distributed/ulysses.py: WRAPPABLE).
            problems.append(ConfigProblem(f"{override_key}.attn_implementation", f"got {implementation!r}, but {key} "
                                          f"is {size}: Ulysses' all-to-all wraps SDPA attention only; allowed: sdpa "
                                          "(or leave the key out), or the degree 1"))
    sizes = {size for _, size, *_ in degrees if size > 1}
    if len(sizes) > 1:
        problems.append(ConfigProblem(critic_key, f"got {critic.ulysses_sequence_parallel_size}, but {actor_key} is "
                                      f"{actor.ulysses_sequence_parallel_size}: a run has one sequence-parallel "
                                      "degree (its (dp, sp) mesh); allowed: 1 or the actor's"))
    if actor.sequence_parallel_offload:
        problems += _sequence_parallel_offload_problems(config)
    return problems


def _sequence_parallel_offload_problems(config: RunConfig) -> list[ConfigProblem]:
    """sequence_parallel_offload puts the policy's embedding and head on the CPU, sharded over every rank."""
    actor = config.actor_rollout_ref.actor
    key = "actor_rollout_ref.actor.sequence_parallel_offload"
    if actor.ulysses_sequence_parallel_size == 1:
        return [ConfigProblem(key, "got true, but actor_rollout_ref.actor.ulysses_sequence_parallel_size is 1: "
                              "it offloads each sequence-parallel rank's own shard of the embedding and head; "
                              "allowed: false, or a degree above 1 (to offload them on one rank, set "
                              "fsdp_config.offload_policy.embedding and lm_head to cpu)")]
    problems = []
    for role in ("actor", "ref"):
        policy = config.fsdp_configs().get(role)
        for group in ("embedding", "lm_head"):
            if policy is not None and getattr(policy.offload_policy, group) == "gpu":
                problems.append(ConfigProblem(f"{FSDP_PREFIX[role]}.offload_policy.{group}", f"got gpu, but {key} "
                                              f"is true, which keeps the policy's {group} on the CPU; allowed: cpu "
                                              "or unset, or sequence_parallel_offload false"))
    return problems


def _batch_sizes_for_ranks(config: RunConfig) -> list[ConfigProblem]:
    """verl's semantics: data.train_batch_size and ppo_mini_batch_size count prompts of the whole run, divided
    among the data-parallel ranks (the *_micro_batch_size_per_gpu keys count per rank), so each divides by the
    world size."""
    world, sp = data_parallel_size(config), config.sequence_parallel_size
    groups = (f"{world} data-parallel groups ({world_size(config)} ranks over the sequence-parallel degree {sp}"
              if sp > 1 else f"{world} ranks (trainer.nnodes x trainer.n_gpus_per_node")
    sizes = [("data.train_batch_size", config.data.train_batch_size),
             ("actor_rollout_ref.actor.ppo_mini_batch_size", config.actor_rollout_ref.actor.ppo_mini_batch_size)]
    if config.use_critic and config.critic.ppo_mini_batch_size is not None:
        sizes.append(("critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size))
    return [ConfigProblem(key, f"got {size}, which does not divide among the run's {groups}; it counts the prompts "
                               f"of all of them); allowed: a multiple of {world}, e.g. "
                               f"{max(world, size - size % world)}")
            for key, size in sizes if size % world]


def _single_rank_features(config: RunConfig) -> list[ConfigProblem]:
    """What works on one rank only: the embedding cache (one rank's rollout looks rows up on the host). Several
    ranks update an offloaded optimizer with HostAdamW (on the host: optimizer_update auto or cpu, delayed_update
    and bf16 host gradients too; on the GPU over moments streamed up, gpu, or split between the two, both: neither
    delayed), and move their shards' decoder layers with dynamic offload themselves
    (trainer/distributed/layer_moves.py). (Token-budget
    micro-batches work on several: every rank splits its share into as many, packing.plan_micro_batches; so does
    the static decoder: every rank decodes until every rank's rows have finished; and LoRA: FSDP2 shards the model
    with its adapter's layers.)"""
    world = world_size(config)
    why = f"works on one rank only, and this run has {world} (trainer.nnodes x trainer.n_gpus_per_node)"
    problems = []
    if config.actor_rollout_ref.rollout.embedding_cache.enabled:
        # Several ranks' rollout reads an embedding gathered whole onto each GPU (FSDP2's all-gather of the unit,
        # or the whole weights held for the rollout): no row is looked up on the host, so there is nothing to cache.
        problems.append(ConfigProblem("actor_rollout_ref.rollout.embedding_cache.enabled",
                                      f"got true, which {why}: several ranks' rollout gathers the whole embedding "
                                      "onto each GPU, so no row is looked up on the host; allowed: false"))
    for role, fsdp in config.fsdp_configs().items():
        if fsdp.optimizer_update in ("gpu", "both") and fsdp.delayed_update and fsdp.optimizer_offload:
            problems.append(ConfigProblem(
                f"{FSDP_PREFIX[role]}.optimizer_update", f"got {fsdp.optimizer_update} with delayed_update true; on "
                "several ranks the update on the GPU changes the shards the rollout reads, so it cannot wait for the "
                "rollout to end; allowed: auto or cpu (the host's update, delayed), or delayed_update false"))
    return problems


# ------------------------------------------------------------------------------------------- YAML


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two fixes for config files.

    - ``1e-5`` is a float (YAML 1.2 reads it so; PyYAML follows YAML 1.1, which wants ``1.0e-5``), so a
      learning rate written the usual way stays a number inside free-form keys such as override_config.
    - A key given twice in one mapping is an error: PyYAML would keep the last one without a word.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` legitimately repeats the keys it merges.
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first on line {first_line[key] + 1})",
                    key_node.start_mark)
            if isinstance(key, typing.Hashable):
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError([ConfigProblem("--config", f"got {str(path)!r}, which {why}; "
                                         "allowed: a YAML file")])
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)  # noqa: S506 (a safe loader)
    except UnicodeDecodeError:
        raise ConfigError([ConfigProblem("--config", f"got {str(path)!r}, which is not UTF-8 text; "
                                         "allowed: a YAML file")]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(error, "problem", None) or "not valid YAML"
        raise ConfigError([ConfigProblem("--config", f"{str(path)!r} is not valid YAML{where}: {reason}; "
                                         "allowed: a YAML mapping of sections")]) from None
    if raw is None:
        # Most likely the wrong file, or one not written yet: a run with every default is not what was meant.
        raise ConfigError([ConfigProblem("--config", f"got {str(path)!r}, which is empty (or only comments); "
                                         f"allowed: a YAML mapping of sections ({', '.join(RunConfig.model_fields)})"
                                         "; `{}` runs every default")])
    if not isinstance(raw, dict):
        kind = "list" if isinstance(raw, list) else type(raw).__name__
        raise ConfigError([ConfigProblem("--config", f"{str(path)!r} holds a {kind}; allowed: a mapping of "
                                         f"sections ({', '.join(RunConfig.model_fields)})")])
    return raw


# ------------------------------------------------------------------------------- schema messages


_WHY_WRONG = {
    "int_parsing": "not an integer",
    "int_type": "not an integer",
    "int_from_float": "not a whole number",
    "float_parsing": "not a number",
    "float_type": "not a number",
    "finite_number": "not a finite number",
    "bool_parsing": "not true or false",
    "bool_type": "not true or false",
    "string_type": "not a string",
    "list_type": "not a list",
    "tuple_type": "not a list",
    "greater_than": "out of range",
    "greater_than_equal": "out of range",
    "less_than": "out of range",
    "less_than_equal": "out of range",
    "literal_error": "not one of the choices",
}


def _describe_pydantic_error(error: ErrorDetails) -> ConfigProblem:
    location = list(error["loc"])
    path = _dotted(location)
    kind = error["type"]
    given = error.get("input")
    field = field_at(location)
    if kind == "extra_forbidden":
        return ConfigProblem(path, _moved_key(location, given) or unknown_key_message(location))
    if kind == "missing":
        return ConfigProblem(path, "is missing")
    if kind == "value_error":  # the validators in this module write whole "got ...; allowed: ..." messages
        return ConfigProblem(path, str(error["ctx"]["error"]))
    if field is None:
        return ConfigProblem(path, f"got {_show(given)}; {error['msg']}")
    annotation = field.annotation
    if location and isinstance(location[-1], int):  # an item of a list or tuple
        annotation = next(iter(typing.get_args(_unwrap_optional(annotation))), annotation)
    section = _section_type(annotation)
    if section is not None:
        return ConfigProblem(path, f"got {_show(given)}, but {location[-1]} is a section; allowed: a mapping "
                             f"of its keys ({', '.join(section.model_fields)})")
    if kind == "dict_type":
        return ConfigProblem(path, f"got {_show(given)}, not a mapping; allowed: a mapping of keys to values")
    why = _WHY_WRONG.get(kind)
    if why is None:
        return ConfigProblem(path, f"got {_show(given)}; {error['msg']}")
    return ConfigProblem(path, f"got {_show(given)}, {why}; allowed: {describe_allowed(annotation, field)}")


def _dotted(location: Sequence[Any]) -> str:
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


# Keys a section does not have (any more) that are set elsewhere: (that section, the key) -> why, and where.
# The levels of dynamic offload were per model until they became run-wide.
_MOVED_KEYS: dict[tuple[type[Section], str], str] = {
    (DynamicOffload, "gpu_memory_threshold"):
        "the threshold is run-wide now (GPU memory in use is one number for all models): "
        "set dynamic_offload.gpu_memory_threshold instead",
    (DynamicOffload, "min_transformer_layers_on_gpu"):
        "the layer minimum is run-wide now (it applies to each dynamically offloaded model): "
        "set dynamic_offload.min_transformer_layers_on_gpu instead",
    (DynamicOffloadConfig, "enabled"):
        "dynamic offload is enabled per model (which models' layers may move): set it in each model's "
        "fsdp_config instead, e.g. actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true",
}


def _moved_key(location: Sequence[Any], given: Any) -> str | None:
    """Where an unknown key that its section used to have is set now; None for any other unknown key."""
    parent = field_at(location[:-1]) if len(location) > 1 else None
    section = _section_type(parent.annotation) if parent is not None else None
    if section is None or (section, str(location[-1])) not in _MOVED_KEYS:
        return None
    return (f"got {_show(given)}, but {_MOVED_KEYS[section, str(location[-1])]}; "
            f"allowed: {', '.join(section.model_fields)}")


def unknown_key_message(location: Sequence[Any]) -> str:
    """Name the unknown key, the closest known one, and the allowed keys of its section."""
    name = str(location[-1])
    parent = field_at(location[:-1]) if len(location) > 1 else None
    section = RunConfig if len(location) == 1 else _section_type(parent.annotation) if parent else None
    what = "section" if len(location) == 1 else "key"
    if section is None:
        return f"got the unknown {what} {name!r}"
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"got the unknown {what} {name!r}{hint}; allowed: {', '.join(allowed)}"


def field_at(location: Sequence[Any]) -> FieldInfo | None:
    """The schema field a pydantic error location points at (list indexes are skipped)."""
    section: type[BaseModel] | None = RunConfig
    field = None
    for part in location:
        if isinstance(part, int):
            continue
        if section is None:
            return None
        field = section.model_fields.get(str(part))
        if field is None:
            return None
        section = _section_type(field.annotation)
    return field
