"""What Ulysses sequence parallelism needs of a run, checked at config load (no torch import here).

Ulysses (trainer/distributed/ulysses.py) trades each rank's sequence shard of all attention heads for the
whole sequence of a shard of the heads, so a sequence-parallel degree S must split the heads evenly. Key-value
heads are split too, or, when there are fewer of them than S, each repeated so that every rank holds a whole
one: S must be a multiple of their number then. The S ranks of a group are S of the run's ranks, so S divides
the world size (the data-parallel degree is world size / S).

The rules of several ranks (trainer/config/ranks.py, in the one pass of rules.py) call `sequence_parallel_problems`
with the head counts `model_heads` reads from the model's config.json (or a built-in model's shape), with the
run's override_config on top, and the run's world size (trainer.nnodes x trainer.n_gpus_per_node), and turns
each `Problem` into one of its own ConfigProblems.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config.builtin_models import BUILTIN_MODEL_CONFIGS
from trainer.config.hub import HubModelNotCached, resolve_model_path

ACTOR_KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
"""Where verl's example scripts set the degree."""
ACTOR_FSDP_KEY = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
"""Where verl's newer configs set it."""
CRITIC_KEY = "critic.ulysses_sequence_parallel_size"


@dataclass(frozen=True)
class Problem:
    """One reason a sequence-parallel degree cannot run: the key that set it and a one-line message."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class AttentionHeads:
    """The head counts Ulysses splits: query heads and key-value heads (equal without grouped-query attention)."""

    attention: int
    key_value: int


def attention_heads(model_config: Mapping[str, Any]) -> AttentionHeads:
    """The head counts of a HuggingFace config.json (as a dict), looking into `text_config` for multimodal ones."""
    config = model_config.get("text_config") or model_config
    attention = int(config["num_attention_heads"])
    # Configs without the key predate grouped-query attention: one key-value head per query head.
    key_value = config.get("num_key_value_heads")
    return AttentionHeads(attention, attention if key_value is None else int(key_value))


def model_heads(path: str, override_config: Mapping[str, Any], builtin_prefix: str = "builtin:"
                ) -> AttentionHeads | None:
    """The head counts of the model at `path` (a built-in one, a local directory or a cached hub id) with
    `override_config` applied; None when its config cannot be read (the path's own check says why)."""
    if path.startswith(builtin_prefix):
        shape = BUILTIN_MODEL_CONFIGS.get(path.removeprefix(builtin_prefix))
        if shape is None:
            return None
        config: dict[str, Any] = dict(shape)
    else:
        try:
            config_file = Path(resolve_model_path(path)).expanduser() / "config.json"
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (HubModelNotCached, OSError, ValueError):
            return None
    try:
        return attention_heads({**config, **override_config})
    except (KeyError, TypeError, ValueError):
        return None


def allowed_sizes(world_size: int, heads: AttentionHeads) -> list[int]:
    """Every sequence-parallel degree this model can run with on `world_size` ranks."""
    return [size for size in range(1, world_size + 1)
            if world_size % size == 0 and _splits_heads(size, heads) is None]


def sequence_parallel_problems(size: int, *, world_size: int, heads: AttentionHeads,
                               key: str = ACTOR_KEY) -> list[Problem]:
    """Every reason `size` (set at `key`) cannot run this model on `world_size` ranks; empty when it can."""
    if size == 1:
        return []
    problems = []
    allowed = ", ".join(str(value) for value in allowed_sizes(world_size, heads))
    if size > world_size:
        problems.append(Problem(key, f"got {size}, more than the run's {world_size} rank(s) (trainer.nnodes x "
                                     f"trainer.n_gpus_per_node); allowed: {allowed}"))
    elif world_size % size:
        problems.append(Problem(key, f"got {size}, which does not divide the run's {world_size} ranks (trainer.nnodes "
                                     f"x trainer.n_gpus_per_node) into data-parallel groups; allowed: {allowed}"))
    heads_problem = _splits_heads(size, heads)
    if heads_problem is not None:
        problems.append(Problem(key, f"got {size}, but {heads_problem}; allowed: {allowed}"))
    return problems


def _splits_heads(size: int, heads: AttentionHeads) -> str | None:
    """Why `size` ranks cannot share the heads, or None when they can."""
    if heads.attention % size:
        return f"the model's {heads.attention} attention heads do not divide by it"
    if heads.key_value % size and size % heads.key_value:
        return (f"the model's {heads.key_value} key-value heads neither divide by it nor divide it "
                "(so they can be neither split nor repeated evenly)")
    return None
