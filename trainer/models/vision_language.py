"""Vision-language models (Qwen2-VL, Qwen2.5-VL; verl's geo3k examples): the built-in tiny one, the image processor,
and what a forward takes besides the tokens.

verl's dataset (verl/utils/dataset/rl_dataset.py) turns each `<image>` of a prompt into the model's vision tokens and
hands the rollout and the actor the row's `multi_modal_inputs` (pixel_values, image_grid_thw). Here the same happens
in two steps: `ImageProcessor.prompt_inputs` writes each `<image>` as `<|vision_start|>` + one `<|image_pad|>` per
merged patch + `<|vision_end|>` (what Qwen's chat template and processor write for an image) and returns the row's
pixel values; `forward_inputs` joins a batch's rows for one forward. The multimodal RoPE position ids ([3, B, T]:
time, height, width) are the model's own (get_rope_index), computed from the tokens, the image grids and
`mm_token_type_ids` (1 on image tokens), so the caller passes no position_ids; a forward split along the sequence
(Ulysses, trainer/workers/sequence_split.py) computes them once beforehand with the same function
(`multimodal_position_ids`), so that its decoder gets the whole sequence's positions to cut.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase, Qwen2VLConfig, Qwen2VLImageProcessorPil

from trainer.config.builtin_models import TINY_QWEN2_VL, TINY_QWEN2_VL_VISION
from trainer.config.hub import resolve_model_path
from trainer.errors import UserError

TINY_VL = "tiny-qwen2-vl"
IMAGE_PLACEHOLDER = "<image>"
"""How a prompt of verl's geo3k layout marks where an image goes."""
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
# The tiny model sees images of 56 x 56 to 112 x 112 pixels: 4 to 16 patches of 14, 1 to 4 tokens after the 2 x 2
# merge, so a CPU step stays within seconds.
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


class ImageDataError(UserError):
    """A row's images cannot be used (the message says which row and why)."""


def add_vision_tokens(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """`tokenizer` with Qwen-VL's vision special tokens (a real Qwen-VL tokenizer has them already)."""
    missing = [token for token in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
               if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
    return tokenizer


def tiny_vision_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The built-in word-level tokenizer with the vision tokens, and `<image>` as one word of its own (the
    tokenizer's data check then knows it; the rollout writes it as vision tokens before tokenizing)."""
    add_vision_tokens(tokenizer).add_special_tokens({"additional_special_tokens": [IMAGE_PLACEHOLDER]})
    return tokenizer


def tiny_qwen2_vl_config(tokenizer: PreTrainedTokenizerBase, overrides: dict | None = None) -> Qwen2VLConfig:
    """The built-in tiny Qwen2-VL's HF config (builtin_models.TINY_QWEN2_VL), its vision tokens the tokenizer's, with
    the user's override_config on the language model's settings."""
    ids = tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD])
    text = {**TINY_QWEN2_VL, **(overrides or {})}
    text.setdefault("vocab_size", len(tokenizer))
    return Qwen2VLConfig(
        text_config={**text, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "bos_token_id": None},
        vision_config=dict(TINY_QWEN2_VL_VISION),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
        tie_word_embeddings=False,
    )


def is_vision_language(path_or_model: str | torch.nn.Module) -> bool:
    """Whether a model (or the config.json of a model directory, or a built-in name) has a vision tower."""
    if isinstance(path_or_model, torch.nn.Module):
        return getattr(getattr(path_or_model, "config", None), "vision_config", None) is not None
    if path_or_model.removeprefix("builtin:") == TINY_VL:
        return True
    try:
        declared = json.loads((Path(path_or_model).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(declared, dict) and "vision_config" in declared


@dataclass
class ImageProcessor:
    """A tokenizer with an image processor: a prompt's `<image>`s as vision tokens, its images as pixel values."""

    tokenizer: PreTrainedTokenizerBase
    images: Any
    """transformers' Qwen2VLImageProcessor (patch_size, merge_size; __call__(images=...) -> pixel_values,
    image_grid_thw)."""

    @classmethod
    def load(cls, path: str, tokenizer: PreTrainedTokenizerBase) -> ImageProcessor:
        """The model directory's image processor (preprocessor_config.json), or the tiny model's small one."""
        if path.removeprefix("builtin:") == TINY_VL:
            return cls(tokenizer, Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS))
        directory = resolve_model_path(path)
        return cls(add_vision_tokens(tokenizer),
                   Qwen2VLImageProcessorPil.from_pretrained(directory, local_files_only=True))

    def prompt_inputs(self, prompt: str | list[dict[str, Any]], images: Sequence[Any], where: str
                      ) -> tuple[str | list[dict[str, Any]], dict[str, torch.Tensor]]:
        """`prompt` with each `<image>` written as the vision tokens of the matching image of `images` (verl's row:
        {'bytes': PNG} or a path), and the row's multi-modal inputs: pixel_values [patches, channels * 2 * 14 * 14]
        and image_grid_thw [images, 3]. `where` names the row in errors."""
        _check_marks(prompt, images, where)
        if not images:
            return prompt, {}
        processed = self.images(images=[_image(image, where) for image in images], return_tensors="pt")
        grid = processed["image_grid_thw"]
        tokens = (grid.prod(dim=-1) // self.images.merge_size ** 2).tolist()
        return _written(prompt, tokens), {"pixel_values": processed["pixel_values"], "image_grid_thw": grid}

    def seen_prompt(self, prompt: str | list[dict[str, Any]], images: Sequence[Any], where: str
                    ) -> str | list[dict[str, Any]]:
        """`prompt` as the model sees it, each `<image>` written as its image's vision tokens, as `prompt_inputs`
        writes it, from each image's size alone (no pixels are processed): what data.max_prompt_length counts at
        start, as verl's dataset counts a prompt through its processor."""
        _check_marks(prompt, images, where)
        return _written(prompt, [self.image_tokens(image, where) for image in images]) if images else prompt

    def image_tokens(self, image: Any, where: str) -> int:
        """The vision tokens one image is written as: its patches at the size the processor resizes it to, merged
        merge_size x merge_size."""
        width, height = _opened(image, where).size
        return int(self.images.get_number_of_image_patches(height, width)) // self.images.merge_size ** 2


def prompts_as_seen(path: str, tokenizer: PreTrainedTokenizerBase
                    ) -> Callable[[Any], str | list[dict[str, Any]]] | None:
    """For the model at `path` (a directory, a cached hub id or a built-in name), a record's prompt as the model sees
    it (`ImageProcessor.seen_prompt`: its images' vision tokens written in), where it is a vision-language model;
    None for a text model (or a path that does not resolve: loading the model says why)."""
    try:
        directory = path if path.startswith("builtin:") else resolve_model_path(path)
    except UserError:
        return None
    if not is_vision_language(directory):
        return None
    processor = ImageProcessor.load(path, tokenizer)
    return lambda record: processor.seen_prompt(record.prompt, record.images, record.source or "a prompt")


def _check_marks(prompt: str | list[dict[str, Any]], images: Sequence[Any], where: str) -> None:
    texts = [prompt] if isinstance(prompt, str) else [message["content"] for message in prompt]
    marks = sum(text.count(IMAGE_PLACEHOLDER) for text in texts if isinstance(text, str))
    if marks != len(images):
        raise ImageDataError(f"{where}: its prompt has {marks} {IMAGE_PLACEHOLDER} and the row {len(images)} "
                             f"images; each image needs one {IMAGE_PLACEHOLDER} where it goes in the prompt")


def _written(prompt: str | list[dict[str, Any]], tokens: Sequence[int]) -> str | list[dict[str, Any]]:
    """`prompt` with its i-th `<image>` written as `<|vision_start|>`, tokens[i] `<|image_pad|>`, `<|vision_end|>`."""
    counts = iter(tokens)

    def written(text: str) -> str:
        pieces = text.split(IMAGE_PLACEHOLDER)
        return pieces[0] + "".join(f"{VISION_START}{IMAGE_PAD * next(counts)}{VISION_END}{piece}"
                                   for piece in pieces[1:])

    if isinstance(prompt, str):
        return written(prompt)
    return [{**message, "content": written(message["content"])} for message in prompt]


def _image(image: Any, where: str) -> Image.Image:
    """One image of verl's row layout as RGB: {'bytes': ...} (or {'path': ...}), raw bytes, or a path."""
    opened = _opened(image, where)
    try:
        return opened.convert("RGB")
    except (OSError, ValueError) as error:
        raise _unreadable(where, error) from None


def _opened(image: Any, where: str) -> Image.Image:
    """One image of verl's row layout, opened (its header read: its size is known, its pixels not yet decoded)."""
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    try:
        source = io.BytesIO(image) if isinstance(image, bytes) else Path(str(image)).expanduser()
        return Image.open(source)
    except (OSError, ValueError) as error:
        raise _unreadable(where, error) from None


def _unreadable(where: str, error: Exception) -> ImageDataError:
    return ImageDataError(f"{where}: an image could not be read ({error}); allowed: {{'bytes': PNG or JPEG bytes}}, "
                          "or a path")


def vision_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids of the model's image and video placeholders and vision start: tokens only the prompt's images write."""
    config = model.config
    return [token for token in (config.image_token_id, getattr(config, "video_token_id", None),
                                getattr(config, "vision_start_token_id", None)) if token is not None]


def forward_inputs(model: torch.nn.Module, input_ids: torch.Tensor,
                   rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What a forward of a vision-language model takes besides the [B, T] tokens for `rows` (their multi-modal inputs,
    in the batch's order): the rows' pixel values and image grids joined, and mm_token_type_ids ([B, T], 1 on image
    tokens) from which the model computes its multimodal RoPE position ids; {} when no row has an image."""
    images = image_inputs(rows, input_ids.device)
    if not images:
        return {}
    return {**images, "mm_token_type_ids": (input_ids == model.config.image_token_id).to(torch.int32)}


def image_inputs(rows: Sequence[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """The pixel values and image grids of a batch's `rows` (their multi-modal inputs, in the batch's order) joined
    for one forward, on `device`; {} when no row has an image."""
    rows = [row for row in rows if row]
    if not rows:
        return {}
    return {"pixel_values": torch.cat([row["pixel_values"] for row in rows]).to(device),
            "image_grid_thw": torch.cat([row["image_grid_thw"] for row in rows]).to(device)}


def rope_index_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The part of a vision-language model that computes its multimodal RoPE positions (`get_rope_index`) and runs
    its decoder (`language_model`): Qwen2-VL's and Qwen2.5-VL's inner model (under a LoRA or FSDP wrapper too); None
    for a model without one."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)) and isinstance(
                getattr(module, "language_model", None), torch.nn.Module):
            return module
    return None


def multimodal_position_ids(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            images: dict[str, torch.Tensor]) -> torch.Tensor:
    """[3, B, T] the multimodal RoPE positions (time, height, width) of a padded batch with `images`
    (`image_inputs`): the model's own get_rope_index, from the tokens, the image grids and the mask, when a row has an
    image; otherwise each row's text positions, counted from its first real token, on all three axes (as the rollout's
    generate gave them; the model's own forward counts them from the padding's first, which rotary attention,
    relative, does not tell apart)."""
    if not images:
        text = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        return text.unsqueeze(0).expand(3, -1, -1)
    owner = rope_index_owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} has no get_rope_index to place its images' tokens")
    positions, _ = owner.get_rope_index(input_ids, mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                                        image_grid_thw=images["image_grid_thw"], attention_mask=attention_mask)
    return positions
