"""Build the run's models from local directories or cached hub ids (never downloaded), or the built-in preset."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2VLForConditionalGeneration,
)
from transformers.utils import logging as transformers_logging

from trainer.config import BUILTIN_PREFIX, KEYS
from trainer.config.hub import HubModelNotCached, resolve_model_path
from trainer.errors import UserError
from trainer.models.attention import use_packed_gqa
from trainer.models.gguf import gguf_directory, is_gguf
from trainer.models.tiny import build_tiny_tokenizer, seeded_init, tiny_qwen2_config
from trainer.models.vision_language import TINY_VL, is_vision_language, tiny_qwen2_vl_config, tiny_vision_tokenizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ModelLoadError(UserError):
    """A model or tokenizer that could not be loaded; the message names the config key."""


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def load_tokenizer(path: str, *, trust_remote_code: bool = False,
                   setting: str = KEYS.actor_rollout_ref.model.tokenizer_path,
                   chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer set up for generation: left padding, and a pad token (eos when it has none); `chat_template`
    (model.custom_chat_template) in place of its own. `setting`: the config key that chooses the tokenizer, named in
    the errors."""
    if path == BUILTIN_PREFIX + TINY_VL:
        tokenizer = tiny_vision_tokenizer(build_tiny_tokenizer())
    elif path.startswith(BUILTIN_PREFIX):
        tokenizer = build_tiny_tokenizer()
    elif _declares_plain_tokenizer_json(path := _local_directory(path)):
        tokenizer = _from_local(PreTrainedTokenizerFast, path, "tokenizer")
    else:
        tokenizer = _from_local(AutoTokenizer, path, "tokenizer", trust_remote_code=trust_remote_code)
    if not set(tokenizer.get_vocab().values()) - set(tokenizer.all_special_ids):
        # AutoTokenizer builds an empty tokenizer from a model directory without tokenizer files: every
        # prompt would then be "empty after tokenization".
        raise ModelLoadError(f"{path!r} holds no tokenizer (no vocabulary: tokenizer.json, vocab.json, "
                             f"tokenizer.model ...); set {setting} to the model's tokenizer directory")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"tokenizer at {path!r} has no eos token: responses could never end")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _declares_plain_tokenizer_json(path: str) -> bool:
    """Whether the directory asks for its tokenizer.json as is (the tiny preset's tokenizer does).

    For a qwen2 model directory AutoTokenizer overrides that and rebuilds tokenizer.json as Qwen2's
    byte-level BPE, which drops unknown words and the spaces between decoded words.
    """
    try:
        declared = json.loads((Path(path) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(declared, dict) and declared.get("tokenizer_class") in ("TokenizersBackend",
                                                                              "PreTrainedTokenizerFast")


def load_policy(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: torch.dtype,
    seed: int,
    override_config: dict[str, Any] | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A causal LM, or a vision-language model (Qwen2-VL's: images in its prompts): the actor, the rollout and
    (frozen) the reference policy."""
    if path == BUILTIN_PREFIX + TINY_VL:
        try:
            config = tiny_qwen2_vl_config(tokenizer, override_config)
        except (TypeError, ValueError) as error:
            raise ModelLoadError(f"could not build the built-in model from override_config: {error}") from None
        model = seeded_init(Qwen2VLForConditionalGeneration, config, seed)
    elif not path.startswith(BUILTIN_PREFIX) and is_vision_language(_local_directory(path)):
        model = _from_local(AutoModelForImageTextToText, path, "model", dtype=dtype,
                            trust_remote_code=trust_remote_code, **(override_config or {}))
    elif path.startswith(BUILTIN_PREFIX):
        model = seeded_init(Qwen2ForCausalLM, _builtin_config(tokenizer, override_config), seed)
    else:
        model = _from_local(AutoModelForCausalLM, path, "model", dtype=dtype,
                            trust_remote_code=trust_remote_code, **(override_config or {}))
    return _prepare(model, tokenizer, dtype, gradient_checkpointing)


def _builtin_config(tokenizer: PreTrainedTokenizerBase, override_config: dict[str, Any] | None, **extra):
    try:
        return tiny_qwen2_config(tokenizer, override_config, **extra)
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"could not build the built-in model from override_config: {error}") from None


def load_critic(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: torch.dtype,
    seed: int,
    override_config: dict[str, Any] | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A value model: the policy's backbone with a one-output head per token (as verl's critic).

    From a directory the backbone's weights load and the head starts random; the built-in
    preset copies the backbone of the policy built from the same seed, to match.
    """
    if is_vision_language(path if path.startswith(BUILTIN_PREFIX) else _local_directory(path)):
        return _prepare(_vision_value_model(path, tokenizer, dtype=dtype, seed=seed, override_config=override_config,
                                            trust_remote_code=trust_remote_code),
                        tokenizer, dtype, gradient_checkpointing)
    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(tokenizer, override_config, num_labels=1)
        model = seeded_init(Qwen2ForTokenClassification, config, seed + 1)
        policy = seeded_init(Qwen2ForCausalLM, _builtin_config(tokenizer, override_config), seed)
        model.model.load_state_dict(policy.model.state_dict())
    else:
        model = _from_local(AutoModelForTokenClassification, path, "critic", dtype=dtype, num_labels=1,
                            trust_remote_code=trust_remote_code, **(override_config or {}))
    dropout = getattr(model, "dropout", None)
    if isinstance(dropout, torch.nn.Dropout) and "classifier_dropout" not in (override_config or {}):
        # No dropout before the value head (transformers' default is 0.1), as verl's critic: the update would
        # fit noisy values, and no two forwards of a batch (padded or padding-free) would agree.
        dropout.p = 0.0
        model.config.classifier_dropout = 0.0
    return _prepare(model, tokenizer, dtype, gradient_checkpointing)


def _vision_value_model(path: str, tokenizer: PreTrainedTokenizerBase, *, dtype: torch.dtype, seed: int,
                        override_config: dict[str, Any] | None, trust_remote_code: bool) -> PreTrainedModel:
    """A vision-language value model: the policy's model (its vision tower and language model, the built-in
    preset's from the same seed) with a one-output head per token in place of its language-model head, so that its
    forward reads the images as the actor's does; the head starts random (seeded). verl's critic of a
    vision-language model is the same backbone under a value head."""
    model = load_policy(path, tokenizer, dtype=dtype, seed=seed, override_config=override_config,
                        trust_remote_code=trust_remote_code)
    text = model.config.get_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        head = torch.nn.Linear(text.hidden_size, 1, bias=False)
        torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
    model.lm_head = head.to(dtype)
    # A tied head would be tied back to the embedding (a [vocabulary, hidden] matrix) on the next tie_weights.
    model.config.tie_word_embeddings = text.tie_word_embeddings = False
    return model


def load_reward_model(
    path: str, tokenizer: PreTrainedTokenizerBase, *, dtype: torch.dtype, seed: int, trust_remote_code: bool = False
) -> PreTrainedModel:
    """A sequence classifier with one output: the score of a whole prompt and response.

    The built-in preset gives a random reward model, for tests of the plumbing only.
    """
    if path.startswith(BUILTIN_PREFIX):
        model = seeded_init(Qwen2ForSequenceClassification,
                            tiny_qwen2_config(tokenizer, num_labels=1), seed + 2)
    else:
        model = _from_local(AutoModelForSequenceClassification, path, "reward model", dtype=dtype,
                            num_labels=1, trust_remote_code=trust_remote_code)
    model = _prepare(model, tokenizer, dtype, gradient_checkpointing=False)
    model.requires_grad_(False)
    return model.eval()


def _prepare(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype,
             gradient_checkpointing: bool) -> PreTrainedModel:
    model = model.to(dtype)
    use_packed_gqa()  # a decoded token attends on the key/value heads (models/attention.py), on any release
    if getattr(model.config, "pad_token_id", None) is None:
        # Sequence classifiers find the last real token through pad_token_id.
        model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False
    if gradient_checkpointing:
        # transformers 5.2x renamed it (the old name warns, and goes in v6); older 5.x has only the old one.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _local_directory(path: str) -> str:
    """The directory of a local path, of a hub id's cached snapshot (resolve_model_path), or converted from a
    GGUF file (models/gguf.py)."""
    if is_gguf(path):
        return gguf_directory(path)
    try:
        return resolve_model_path(path)
    except HubModelNotCached as error:
        raise ModelLoadError(str(error)) from None


def _from_local(auto_class, path: str, what: str, **kwargs):
    path = _local_directory(path)
    if what != "tokenizer":
        _check_weight_files(Path(path), what)
    try:
        with _no_progress_bars():
            return auto_class.from_pretrained(path, local_files_only=True, **kwargs)
    except (StrictDataclassError, TypeError) as error:
        # transformers checks config.json's fields by type (num_hidden_layers: "two"); override_config's
        # keys arrive the same way.
        source = repr(str(Path(path) / "config.json"))
        if set(kwargs) - _NOT_CONFIG_FIELDS:
            source += " with override_config"
        raise ModelLoadError(f"could not load the {what} from {path!r}: {source}: {_one_line(error)}") from None
    except (OSError, ValueError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"could not load the {what} from {path!r}: {first_line}") from error


# from_pretrained's own keywords: everything else in its kwargs sets a config field.
_NOT_CONFIG_FIELDS = {"dtype", "trust_remote_code", "num_labels"}


def _check_weight_files(directory: Path, what: str) -> None:
    """Read each safetensors file's header, which also checks that the file is as long as it says: a
    truncated copy or download is then named, instead of failing deep inside from_pretrained."""
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"could not load the {what} from {str(directory)!r}: {str(file)!r} is damaged "
                                 f"or incomplete ({_one_line(error)}); copy or download it again") from None


def _one_line(error: BaseException) -> str:
    """The error's message on one line (transformers' validation errors span several)."""
    return " ".join(str(error).split()) or type(error).__name__


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' "Loading weights" bars: they would tear through the trainer's own progress
    bar and log lines, and a local load has no download to watch. The previous state comes back after."""
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()
