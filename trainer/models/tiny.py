"""The built-in tiny preset: a Qwen2-architecture model with random weights and a word-level
tokenizer built here, so tests and the demo never download anything."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config

from trainer.config.builtin_models import TINY_QWEN2

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Digits and a few symbols cover the built-in tasks (counting, short arithmetic); any other
# word maps to <unk>. A small vocabulary keeps a random policy's chance of a right token high
# enough for RL to find a signal within minutes on a CPU.
WORDS = [*"0123456789", "+", "-", "=", ":"]
VOCABULARY = [PAD, EOS, UNK, *WORDS]

# Responses are words separated by spaces; the template joins the messages' contents the same way.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"



def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over VOCABULARY, with pad, eos and a chat template."""
    vocab = {word: index for index, word in enumerate(VOCABULARY)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # With no decoder, tokenizers joins the words with single spaces, which is what the scorers read.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerFast, overrides: dict | None = None, **extra) -> Qwen2Config:
    """The preset's HF config, with the user's override_config applied on top."""
    settings = {**TINY_QWEN2, **(overrides or {}), **extra}
    # A larger vocabulary than the tokenizer's is allowed (a real model's shape, rows never looked up).
    vocab_size = settings.pop("vocab_size", len(tokenizer))
    if not isinstance(vocab_size, int) or vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size: got {vocab_size!r}; allowed: an integer of at least the "
                         f"built-in tokenizer's {len(tokenizer)} tokens")
    return Qwen2Config(
        vocab_size=vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **settings,
    )


def seeded_init(model_class, config, seed: int):
    """Build a model with weights drawn from `seed` alone, whatever the global RNG has done.

    The reference policy and a resumed run rebuild the same initial weights this way.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)
