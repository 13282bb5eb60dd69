"""The built-in models' shapes, torch-free: trainer/models/tiny.py builds them, and the config check reads their
head counts (Ulysses' constraints) without importing torch."""

from __future__ import annotations

from typing import Any

TINY_QWEN2: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)

BUILTIN_MODEL_CONFIGS: dict[str, dict[str, Any]] = {"tiny-qwen2": TINY_QWEN2}
"""Each built-in model's HF config keys (beside those the tokenizer sets), by its name after builtin:."""
