"""Where each model's parameters, gradients and optimizer states live: the fsdp_config section every model has
(actor, reference, critic, reward model), and the run-wide levels of dynamic offload. Part of the schema
(trainer/config/schema.py), kept apart because all four models share these sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from trainer.config.fields import LayerMinimum, MemoryThreshold, Placement, Section


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


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}

# The settings of an fsdp_config that act on a model that trains only (its gradients and optimizer): a frozen
# model's (the reference's, the reward model's) have nothing to act on.
TRAINING_ONLY_KEYS = ("optimizer_offload", "optimizer_update", "offload_grad_dtype", "delayed_update",
                      "merge_micro_batches")


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
    """Dtype of the parameters (bf16 trains without fp32 master weights); verl's float32 and bfloat16 are read so."""
    offload_grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of CPU gradients beside fp32 masters (bf16: half their host memory; on ranks, half the bytes down)."""
    delayed_update: bool = False
    """The actor's CPU update runs during the next rollout, which samples with the weights before it."""
    merge_micro_batches: bool = True
    """While the update streams layers from the CPU to a GPU, run each mini-batch as one micro-batch (same gradient)."""

    @field_validator("model_dtype", mode="before")
    @classmethod
    def _torch_names(cls, dtype: Any) -> Any:
        """verl (PrecisionType) and the article also write the dtype by torch's names."""
        return _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype

    def placement(self, group: str) -> Placement:
        """Where a module group lives once param_offload and offload_policy are combined."""
        explicit: Placement | None = getattr(self.offload_policy, group)
        if explicit is not None:
            return explicit
        return "cpu" if self.param_offload else "gpu"
