"""The run configuration: one typed tree, validated at load.

Keys follow verl's names (``actor_rollout_ref.actor.optim.lr``, ``data.train_batch_size``, ...).
Every field has its default and a one-line docstring here and nowhere else; the rest of the
code reads typed attributes, never ``dict.get(key, default)``. docs/config.md is written from
these docstrings (``python -m trainer.config.docs``).

This module holds the tree only. Beside it: the rules between fields (rules.py) and those that
read the disk and the environment (environment.py), the messages (errors.py), loading
(loading.py), and verl's spellings of keys (aliases.py, verl.py).

This module must not import torch: the daemon imports it to validate a config before it
starts the trainer process.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from trainer.config.fields import (
    GpuSampleInterval,
    KLEstimator,
    LayerMinimum,
    LogLevel,
    LossAggregation,
    MemoryThreshold,
    PcieSampleInterval,
    Placement,
    Section,
    TrackerBackend,
    show,
)
from trainer.config.losses import PfPpoConfig, PolicyLossConfig, RolloutCorrectionConfig
from trainer.config.multi_turn import MultiTurnConfig
from trainer.config.placement import DynamicOffload, DynamicOffloadConfig, FSDPConfig, OffloadPolicy, WrapPolicy
from trainer.config.running import DaemonConfig, TelemetryConfig, TrainerConfig

# The tree, its parts kept in placement.py and running.py included, and the types of its fields.
__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_MODELS", "BUILTIN_PREFIX", "DATA_FILE_SUFFIXES", "FROZEN_ROLES", "FSDP_PREFIX",
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "CriticConfig", "CriticModelConfig",
    "CustomRewardFunction", "DaemonConfig", "DataConfig", "DynamicOffload", "DynamicOffloadConfig", "EmbeddingCache",
    "FSDPConfig", "GpuSampleInterval", "KLControl", "KLEstimator", "LayerMinimum", "LogLevel", "LossAggregation",
    "MemoryThreshold", "ModelConfig", "OffloadPolicy", "OptimConfig", "PcieSampleInterval", "Placement",
    "RefConfig", "RewardModelConfig", "RewardModelNetwork", "RolloutConfig", "RunConfig", "Section",
    "TelemetryConfig", "TrackerBackend", "TrainerConfig", "WrapPolicy",
    "OverlongBuffer", "RewardKwargs", "ValKwargs",
    "PfPpoConfig", "PolicyLossConfig", "RolloutCorrectionConfig",  # losses.py
]

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-qwen2", "tiny-qwen2-vl")
BUILTIN_DATASETS = ("counting",)
DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")


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
    lora_alpha: int = Field(16, ge=0)
    """LoRA scaling numerator: the adapter's output is scaled by lora_alpha / lora_rank."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get an adapter: all-linear (every linear layer but the output head), a list of names, or a regex."""
    exclude_modules: str | list[str] | None = None
    """Modules of target_modules left without an adapter: a list of names, or a regex; unset excludes none."""
    use_remove_padding: bool = False
    """Padding-free forward (real tokens packed in one row) for the actor's and reference's log-probs and update."""
    use_fused_kernels: bool = False
    """Log-probs and entropies from the hidden states and the head's weight a tile at a time, never the logits."""
    lora_adapter_path: str | None = None
    """A saved peft adapter the policy's LoRA starts from (its own rank, alpha and modules); unset: a new one."""
    custom_chat_template: str | None = None
    """A Jinja chat template used in place of the tokenizer's own for the prompts and the multi-turn rollout's turns."""

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
    raise ValueError(f"got {show(value)}; allowed: {choices}a list of module names (e.g. [q_proj, v_proj]) or a "
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
            raise ValueError(f"got {show(betas)}; allowed: two numbers [beta1, beta2], each 0 <= beta < 1")
        return betas

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"got {show(list(betas))}, out of range; allowed: each 0 <= beta < 1")
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
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    """The policy loss: verl's loss mode and its settings."""
    tau_pos: float = Field(1.0, gt=0.0)
    """SAPO's gate temperature on tokens of positive advantage."""
    tau_neg: float = Field(1.05, gt=0.0)
    """SAPO's gate temperature on tokens of zero or negative advantage."""
    entropy_coeff: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the actor loss (GRPO style)."""
    kl_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the KL loss."""
    freeze_vision_tower: bool = False
    """A vision-language model's vision encoder is not trained (no effect on a text model: a NOTE says so)."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss (k1, k2, k3 are verl's names for kl, mse, low_var_kl)."""
    loss_agg_mode: LossAggregation = "token-mean"
    """How token losses are averaged."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the gradient norm to this value."""
    use_torch_compile: bool = True
    """Compile the update's log-prob and entropy computation from the logits (torch.compile, on a GPU; verl's key)."""
    calculate_sum_pi_squared: bool = False
    """Score each token's sum of squared probabilities with the old log-probs (variance_proxy/*; OTB always does)."""
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


class ValKwargs(Section):
    do_sample: bool = False
    """Sample the validation responses; false (verl's default) decodes them greedily."""
    temperature: float = Field(0.0, ge=0.0)
    """Validation's sampling temperature; 0 decodes greedily whatever do_sample (as verl's engines do)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Validation's nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Validation samples from the k most likely tokens; -1 or 0 disables."""
    n: int = Field(1, ge=1)
    """Responses per validation prompt; above 1, validation reports verl's mean@n, best@k and worst@k."""

    @property
    def samples(self) -> bool:
        """Whether validation samples: do_sample with a temperature above 0; otherwise it decodes greedily."""
        return self.do_sample and self.temperature > 0


class RolloutConfig(Section):
    name: Literal["hf", "vllm", "sglang", "trtllm"] = "hf"
    """Generation engine: hf, the built-in rollout on the actor's own weights; verl's vllm, sglang, trtllm: it too."""
    tensor_model_parallel_size: int = Field(1, ge=1)
    """verl's key: above 1, the rollout runs data-parallel on the run's ranks instead (each decodes its share whole)."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """Fraction of GPU memory in use while decoding (resident weights and states + KV cache); unset: no budget."""
    max_num_seqs: int = Field(256, ge=1)
    """verl's (vLLM's) key: most sequences the rollout decodes at once, in one piece of the batch."""
    max_num_batched_tokens: int = Field(8192, ge=1)
    """verl's (vLLM's) key: most tokens one decode step of a piece processes, one per sequence: caps it as well."""
    max_model_len: int | None = Field(None, ge=1)
    """verl's key: most tokens of prompt and response; a response stops there, as verl's engines stop it; null: none."""
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
    val_kwargs: ValKwargs = ValKwargs()
    """Validation's own sampling (verl's val_kwargs): greedy, one response per prompt, unless set."""
    calculate_log_probs: bool = False
    """Record each sampled token's log-prob (at the temperature); on by itself when rollout_correction needs them."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """verl's multi-turn rollout: tool calls run and their responses appended between the model's turns."""

    @field_validator("name", mode="before")
    @classmethod
    def _engine_named(cls, name: Any) -> Any:
        if name == "???":
            raise ValueError("got '???', verl's mark of a value a config must give; allowed: 'hf' (the built-in "
                             "rollout), or verl's 'vllm', 'sglang' or 'trtllm', which run it too")
        return name


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
    lora_alpha: int = Field(16, ge=0)
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
    use_remove_padding: bool = False
    """Padding-free forward (each micro-batch's real tokens packed in one row) for the reward model's scores."""


class OverlongBuffer(Section):
    enable: bool = False
    """DAPO's overlong reward shaping: a penalty on responses longer than max_resp_len - len tokens."""
    len: int = Field(0, ge=0)
    """Tokens before max_resp_len over which the penalty grows linearly from 0 to penalty_factor."""
    penalty_factor: float = Field(1.0, ge=0.0)
    """The penalty of a response of max_resp_len tokens."""
    log: bool = False
    """Report each response's penalty as verl's overlong_reward and overlong (reward/* and val-aux/* metrics)."""


class RewardKwargs(Section):
    """dapo reads max_resp_len and overlong_buffer_cfg; batch passes every key given here (any name) to its
    function as a keyword argument; naive and prime take none (as verl's constructors)."""

    # Any other key is the batch function's keyword argument (rules.py refuses one for another manager).
    model_config = ConfigDict(extra="allow")

    max_resp_len: int | None = Field(None, ge=1)
    """dapo: the response length the overlong buffer ends at (verl's scripts give data.max_response_length)."""
    overlong_buffer_cfg: OverlongBuffer = OverlongBuffer()
    """dapo: the overlong buffer's penalty."""

    def given(self) -> dict[str, Any]:
        """The keys set away from their defaults, and every key of the batch function's (the trainer reads the
        resolved config, in which every default is written out)."""
        default = RewardKwargs()
        return {name: value for name, value in self.model_dump().items()
                if name not in RewardKwargs.model_fields or getattr(self, name) != getattr(default, name)}


class SandboxFusionConfig(Section):
    url: str | None = None
    """A SandboxFusion service's /run_code URL: code data sources (codecontests, apps, ...) are scored there."""
    max_concurrent: int = Field(64, ge=1)
    """Most requests to the sandbox in flight at once."""
    memory_limit_mb: int = Field(1024, ge=1)
    """Memory limit of each program the sandbox runs, in MB."""


class RewardModelConfig(Section):
    enable: bool = False
    """Score responses with a reward model instead of the rule-based scorers."""
    model: RewardModelNetwork = RewardModelNetwork()
    """The reward model."""
    micro_batch_size_per_gpu: int = Field(16, ge=1)
    """Sequences per reward-model forward."""
    max_length: int | None = Field(None, ge=1)
    """Most tokens of a reward-model input (prompt and response, cut on the right); null: the two data limits' sum."""
    reward_manager: Literal["naive", "dapo", "prime", "batch", "remote"] = "naive"
    """verl's rule-based reward manager: naive, dapo (overlong penalty), prime or remote (in processes) or batch."""
    reward_kwargs: RewardKwargs = RewardKwargs()
    """Arguments of the reward manager (verl's scripts give them as +reward_model.reward_kwargs.*)."""
    reward_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds a call of custom_reward_function may take before the run stops (exit 2); null: no limit."""
    sandbox_fusion: SandboxFusionConfig = SandboxFusionConfig()
    """verl's code sandbox for the built-in scorers (without custom_reward_function.path, as in verl)."""


class CustomRewardFunction(Section):
    path: str | None = None
    """A Python file defining the scoring function; unset uses the built-in scorers."""
    name: str = "compute_score"
    """Function in that file: (data_source, solution_str, ground_truth, extra_info) -> float (null: compute_score)."""

    @field_validator("name", mode="before")
    @classmethod
    def _null_is_verls_default(cls, value: Any) -> Any:
        """verl's scripts pass `custom_reward_function.name=null` beside a null path: verl's default name."""
        return "compute_score" if value is None else value
    on_error: Literal["raise", "zero"] = "raise"
    """When the function raises: raise stops the run (exit 2), zero scores the response 0 (counted: reward/errors)."""
    reward_kwargs: dict[str, Any] = {}
    """Keyword arguments the function is called with besides verl's four (verl's reward_kwargs of the function)."""


class KLControl(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed keeps kl_coef; adaptive steers it towards target_kl (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0.0)
    """(Initial) coefficient of the KL penalty in the reward."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon in samples."""
    target_kl: float = Field(0.1, gt=0.0)
    """KL the adaptive controller aims at."""


AdvantageEstimatorName = Literal[
    "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "grpo_passk", "gpg",
    "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline"]
"""verl's AdvantageEstimator names, in its order (trainer/algorithms registers an estimator under each)."""


class AlgorithmConfig(Section):
    adv_estimator: AdvantageEstimatorName = "gae"
    """Advantage estimator, by verl's name: gae (PPO, with a critic), grpo or another (no critic; docs/training.md)."""
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
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Importance weights and rejection between the policy that sampled (its log-probs) and the one trained."""
    use_pf_ppo: bool = False
    """Policy-filtration PPO: resample each rank's batch by its responses' scores after the advantages."""
    pf_ppo: PfPpoConfig = PfPpoConfig()
    """How pf_ppo weighs the responses."""

    @property
    def reads_sum_pi_squared(self) -> bool:
        """Whether the estimator reads the policy's sum of squared probabilities (the optimal token baselines)."""
        return self.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline")


class CustomDatasetClass(Section):
    path: str | None = None
    """A Python file (or pkg://module) with a dataset class of one's own; null: verl's parquet or JSONL files."""
    name: str | None = None
    """The class's name there: a torch Dataset built as cls(data_files=, tokenizer=, processor=, config=)."""


class CustomSampler(Section):
    class_path: str | None = None
    """A Python file (or pkg://module) with a sampler of one's own (a curriculum among them); null: data.shuffle."""
    class_name: str | None = None
    """The sampler's class name there, built as cls(data_source=, data_config=); update(batch) after each step."""


class DataConfig(Section):
    train_files: list[str] = ["builtin:counting"]
    """Training prompts: verl parquet or JSONL files, or builtin:counting."""
    val_files: list[str] = []
    """Validation prompts, scored every trainer.test_freq steps."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or plain text)."""
    image_key: str = "images"
    """Column of a row's images ({bytes} or paths), one per <image> in its prompt; read for a vision-language model."""
    max_prompt_length: int = Field(512, ge=1)
    """Longest prompt in tokens."""
    max_response_length: int = Field(512, ge=1)
    """Most tokens generated per response."""
    train_batch_size: int = Field(1024, ge=1)
    """Prompts per training step."""
    val_batch_size: int | None = Field(256, ge=1)
    """Prompts per validation generation batch; null: all of them in one batch (verl's meaning)."""
    train_max_samples: int = -1
    """At most this many training prompts, drawn at load as verl draws them (shuffle: a seeded draw); -1: all."""
    val_max_samples: int = -1
    """The same for the validation prompts; -1: all of them."""
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
    apply_chat_template_kwargs: dict[str, Any] = {}
    """Keyword arguments to the tokenizer's chat template for every prompt (e.g. enable_thinking, reasoning_effort)."""
    custom_cls: CustomDatasetClass = CustomDatasetClass()
    """verl's dataset class of one's own (both keys, or neither)."""
    sampler: CustomSampler = CustomSampler()
    """verl's sampler of one's own, a curriculum among them (both keys, or neither)."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


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
    def records_rollout_log_probs(self) -> bool:
        """Whether the rollout records the log-prob of each token it samples: asked for, or rollout correction's."""
        return self.actor_rollout_ref.rollout.calculate_log_probs or self.algorithm.rollout_correction.active

    @property
    def scores_sum_pi_squared(self) -> bool:
        """Whether the old-log-prob pass scores each position's sum of squared probabilities: asked for (verl's
        variance_proxy/* metrics, any estimator), or read by the optimal token baselines."""
        return self.actor_rollout_ref.actor.calculate_sum_pi_squared or self.algorithm.reads_sum_pi_squared

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


# Where each model's fsdp_config sits in the tree, by role (outside trainer/config: keys.fsdp_key(role)).
FSDP_PREFIX = {
    "actor": "actor_rollout_ref.actor.fsdp_config",
    "ref": "actor_rollout_ref.ref.fsdp_config",
    "critic": "critic.fsdp_config",
    "reward_model": "reward_model.model.fsdp_config",
}
# The models that never train: an optimizer or gradient setting of theirs has nothing to act on.
FROZEN_ROLES = ("ref", "reward_model")
