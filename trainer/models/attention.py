"""A decoded token's attention on the key/value heads, for transformers releases that lack it.

With grouped-query attention (fewer key/value heads than query heads), transformers' SDPA attention before
its `pack_gqa` (transformers/integrations/sdpa_attention.py, 5.2x) copies the keys and values out to every
query head (`repeat_kv`) at every layer and every decoded token. Measured on an H200 with the 7B shape
(benchmarks/README.md, `static_profile`): those copies took 2.0 ms of an 11.7 ms decode step, and the
attention reading them 1.2 ms more. A single query token needs no copy: its query heads of one key/value
head become that head's query rows, and one SDPA call over the key/value heads does the same arithmetic.

`use_packed_gqa()` registers that as transformers' "sdpa" where the installed release does not do it
already; newer releases keep their own (the library's path first). Everything but a single query token with
a mask shared by all heads goes to transformers' own function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import AttentionInterface

LIBRARY_SDPA = sdpa_attention.sdpa_attention_forward


def library_packs_gqa() -> bool:
    """Whether the installed transformers attends a single query token on the key/value heads itself."""
    return hasattr(sdpa_attention, "pack_gqa")


def packed_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (query [batch, heads, tokens, dim], key and value [batch, kv_heads,
    positions, dim]; returns [batch, tokens, heads, dim]), a single query token without `repeat_kv`."""
    groups = getattr(module, "num_key_value_groups", 1)
    packable = (query.shape[2] == 1 and groups > 1 and dropout == 0.0
                and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1))
                and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
                and not kwargs.get("output_attentions", False))
    if not packable:
        output: tuple[torch.Tensor, None] = LIBRARY_SDPA(module, query, key, value, attention_mask, dropout=dropout,
                                                           scaling=scaling, is_causal=is_causal, **kwargs)
        return output
    batch, heads, _, dim = query.shape
    # Query heads h*groups ... (h+1)*groups - 1 share key/value head h (repeat_kv's order): they become its rows.
    rows = query.reshape(batch, heads // groups, groups, dim)
    # A [batch, 1, 1, positions] mask broadcasts over the rows as it did over the heads.
    attended = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, scale=scaling)
    return attended.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_packed_gqa() -> bool:
    """Make transformers' "sdpa" attend a single query token on the key/value heads, unless the installed
    release does already; returns whether this module's function is the one registered."""
    if library_packs_gqa():
        return False
    AttentionInterface.register("sdpa", packed_gqa_attention)
    return True
