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

# A Qwen2-VL of the same text shape with a one-block vision tower (patches of 14 pixels, 2x2 merged into one token):
# the language model's settings (Qwen2VLTextConfig) and the vision tower's (Qwen2VLVisionConfig).
TINY_QWEN2_VL: dict[str, Any] = {
    **{key: value for key, value in TINY_QWEN2.items() if key != "rope_theta"},
    "intermediate_size": 128,
    # The head's 16 dimensions rotate as 8 pairs: 2 by time, 3 by height, 3 by width (multimodal RoPE).
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
TINY_QWEN2_VL_VISION: dict[str, Any] = dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2,
                                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                            in_channels=3)

BUILTIN_MODEL_CONFIGS: dict[str, dict[str, Any]] = {"tiny-qwen2": TINY_QWEN2, "tiny-qwen2-vl": TINY_QWEN2_VL}
"""Each built-in model's HF config keys (beside those the tokenizer sets), by its name after builtin:."""
