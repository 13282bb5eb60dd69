"""Models and tokenizers: HF causal LMs from local directories, or the built-in tiny preset."""

from trainer.models.loading import (
    ModelLoadError,
    load_critic,
    load_policy,
    load_reward_model,
    load_tokenizer,
    torch_dtype,
)

__all__ = ["ModelLoadError", "load_critic", "load_policy", "load_reward_model", "load_tokenizer", "torch_dtype"]
