"""Seeding and the RNG states a checkpoint carries, so a resumed run samples what an unbroken one would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_rank_streams(saved: dict[str, Any], rank_states: list[dict[str, Any]] | None, *, rank: int, dp_rank: int,
                         world_size: int, seed: int, step: int) -> None:
    """Set this rank's sampling streams from a checkpoint: its own saved ones when the checkpoint was written by
    as many ranks (`rank_states`, one per rank); otherwise rank 0's (`saved`) on data-parallel rank 0, and on every
    other data-parallel rank a stream of its own drawn from (seed, step, its rank), so that at another world size
    the ranks still sample their prompts independently (the ranks of one sequence-parallel group share a
    data-parallel rank, and so one stream, as they do from the start)."""
    if rank_states is not None and len(rank_states) == world_size:
        set_rng_state(rank_states[rank])
        return
    set_rng_state(saved)
    if dp_rank > 0:
        seed_everything(int(np.random.SeedSequence([seed, step, dp_rank]).generate_state(1)[0]))
