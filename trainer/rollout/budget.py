"""verl's rollout.gpu_memory_utilization, here: how many sequences the rollout decodes at once.

In verl the key is the share of the GPU's memory that vLLM or SGLang takes for its weights and its
preallocated KV-cache pool. The rollout here has no pool of its own: each batch allocates its cache
(transformers' StaticCache or generate's) for its own rows. So the key bounds what is in use on the GPU while
the rollout decodes: everything resident when it starts (the weights the rollout phase keeps on the GPU,
the other models' and optimizer states left there) plus the KV cache, which grows with the rows decoded at
once. The batch is decoded in pieces of as many rows as fit in

    gpu_memory_utilization x the GPU's memory - the memory in use when the rollout starts,

each row costing its KV cache over prompt + response tokens and its fp32 logits of one token. The
activations of a forward are not counted (one token's, or the prompt's at the first step), nor is the
fragmentation of the allocator: a piece that still runs out of memory is halved, as without a budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from trainer.config import FSDP_CONFIG, KEYS


@dataclass(frozen=True)
class KVCacheShape:
    """What one sequence's KV cache holds per token, from the model's config."""

    layers: int
    key_value_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, config: PretrainedConfig) -> KVCacheShape:
        config = config.get_text_config()  # a vision-language model's decoder (the config itself for a text model)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=config.num_hidden_layers, key_value_heads=getattr(config, "num_key_value_heads", None)
                   or heads, head_dim=head_dim, vocab_size=config.vocab_size)

    def bytes_per_sequence(self, tokens: int, element_bytes: int) -> int:
        """A sequence's keys and values over `tokens` positions, and its one token of fp32 logits."""
        return 2 * self.layers * self.key_value_heads * self.head_dim * tokens * element_bytes + 4 * self.vocab_size


def rows_within_budget(rows: int, *, utilization: float, in_use: int, capacity: int, bytes_per_row: int) -> int:
    """The most of `rows` sequences whose caches fit in `utilization` of `capacity` bytes beside `in_use` (0:
    not one)."""
    budget = int(utilization * capacity) - in_use
    return min(rows, max(0, budget // bytes_per_row))


def over_budget_message(*, utilization: float, in_use: int, capacity: int, bytes_per_row: int) -> str:
    """Why not one sequence fits, and what to change."""
    return (f"{KEYS.actor_rollout_ref.rollout.gpu_memory_utilization}={utilization:g} allows "
            f"{_gib(utilization * capacity)} of the GPU's {_gib(capacity)}, and {_gib(in_use)} is in use when the "
            f"rollout starts: no room for one sequence's KV cache ({_gib(bytes_per_row)}); the rollout decodes one "
            "sequence at a time (raise the fraction, or keep less on the GPU during the rollout: "
            f"{FSDP_CONFIG.param_offload}, offload_policy)")


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"
