"""The rollout tests' tiny policy: the built-in model cut to 2 layers, fp32, in eval mode (a module of tests that
wants another defines its own `tokenizer` or `policy`)."""

from __future__ import annotations

import pytest
import torch

from trainer.models import load_policy, load_tokenizer

TINY = "builtin:tiny-qwen2"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return load_policy(TINY, tokenizer, dtype=torch.float32, seed=3, override_config={"num_hidden_layers": 2}).eval()
