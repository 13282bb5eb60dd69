"""verl's dumps of generations to files (trainer.rollout_data_dir for the training's responses,
trainer.validation_data_dir for validation's): each response one JSON line of <dir>/<step>.jsonl, with verl's
entries input, output, gts (the ground truth), score and step, and each entry the reward manager reported for every
response (verl's reward_extra_info)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

DUMPED = ("input", "output", "gts", "score", "step")
"""verl's own entries of a dumped response: a reported entry of the same name does not replace them."""


def decode_texts(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """[B, T] token ids (those where `mask` is 0 left out) -> B texts, special tokens dropped, as verl decodes them."""
    return tokenizer.batch_decode(ids.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)


def generation_lines(inputs: Sequence[str], outputs: Sequence[str], truths: Sequence[Any], scores: Sequence[float],
                     reported: Sequence[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """One dumped line per response (B of each argument): verl's entries, then the reported ones every response
    has."""
    shared = [name for name in (reported[0] if reported else {})
              if name not in DUMPED and all(name in entries for entries in reported)]
    return [{"input": text, "output": output, "gts": truth, "score": score, "step": step,
             **{name: entries[name] for name in shared}}
            for text, output, truth, score, entries in zip(inputs, outputs, truths, scores, reported, strict=True)]


def write_generations(folder: str, step: int, lines: Sequence[dict[str, Any]]) -> Path:
    """`lines` as <folder>/<step>.jsonl (the folder made if missing; a value JSON cannot hold written as its text)."""
    path = Path(folder).expanduser() / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line, ensure_ascii=False, default=str) + "\n" for line in lines),
                    encoding="utf-8")
    return path
