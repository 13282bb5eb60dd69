"""The order in which prompts are taken, reproducible across a checkpoint and resume."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from trainer.config import KEYS

# What fixes the order of the batches, by the name a user knows it by.
_RESUME_KEYS = {"num_records": "prompts", "batch_size": KEYS.data.train_batch_size, "shuffle": KEYS.data.shuffle,
                "seed": KEYS.data.seed}


class PromptSampler:
    """Batches of record indices: drop-last, a fresh permutation each epoch.

    The order of an epoch depends only on (seed, epoch), so ``epoch`` and ``position`` (batches
    already taken in this epoch) are all a checkpoint needs to continue with the same batches
    as an uninterrupted run.
    """

    def __init__(self, num_records: int, batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"{KEYS.data.train_batch_size} must be at least 1, got {batch_size}")
        if num_records < batch_size:
            raise ValueError(f"{num_records} prompts cannot fill one batch of {KEYS.data.train_batch_size}="
                             f"{batch_size}; lower {KEYS.data.train_batch_size} to at most {num_records} "
                             "or add prompts")
        self.num_records = num_records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return self.num_records // self.batch_size

    def next_batch(self) -> list[int]:
        """The next batch of record indices, moving into the next epoch when this one is spent."""
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        batch = self._epoch_order()[start : start + self.batch_size]
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """Batches without end; the caller decides when training stops."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_records": self.num_records,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed}

    def update(self, batch: Any) -> None:
        """Nothing: the order is fixed by (seed, epoch); a curriculum sampler (data.sampler) reads the step's batch."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; the prompts and batching must be those it was saved with."""
        if "sampler_state" in state:
            raise ValueError(f"the checkpoint's prompt order was {state['sampler']}'s ({KEYS.data.sampler}), this "
                             f"run's is {KEYS.data.shuffle}'s: resume with the same {KEYS.data.sampler}")
        changed = [f"{name} {state[key]} in the checkpoint, {getattr(self, key)} now"
                   for key, name in _RESUME_KEYS.items() if state[key] != getattr(self, key)]
        if changed:
            raise ValueError("the checkpoint's prompt order does not fit this run (" + "; ".join(changed)
                             + f"): resume with the same data files, {KEYS.data.train_batch_size}, "
                             f"{KEYS.data.shuffle} and {KEYS.data.seed}")
        self.epoch = state["epoch"]
        self.position = state["position"]

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                # SeedSequence wants non-negative entropy; the modulo keeps any int seed usable.
                generator = np.random.default_rng([self.seed % 2**64, self.epoch])
                self._order = generator.permutation(self.num_records).tolist()
            else:
                self._order = list(range(self.num_records))
            self._order_epoch = self.epoch
        return self._order


def rank_share(batch: list[int], *, rank: int, world_size: int, mini_batch_size: int) -> list[int]:
    """Rank `rank`'s disjoint share of a global batch of prompt indices: its 1/world_size slice of each
    mini-batch of `mini_batch_size` prompts, so that the ranks' local mini-batches together are exactly the
    global ones a single rank would take (the same prompts in each optimizer step). Whole prompts are split,
    before each is repeated rollout.n times, so a GRPO group stays on one rank."""
    if len(batch) % world_size or mini_batch_size % world_size or len(batch) % mini_batch_size:
        raise ValueError(f"a batch of {len(batch)} prompts in mini-batches of {mini_batch_size} does not split "
                         f"among {world_size} ranks")
    share = mini_batch_size // world_size
    return [index for start in range(0, len(batch), mini_batch_size)
            for index in batch[start + rank * share: start + (rank + 1) * share]]


def uneven_shares(count: int, world_size: int) -> list[int]:
    """`count` items dealt among `world_size` ranks as evenly as they go: the first count % world_size ranks take one
    more (numpy's array_split)."""
    return [count // world_size + (rank < count % world_size) for rank in range(world_size)]


def rank_mini_batches(sequences: int, mini_batch_size: int, rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s sequences in each mini-batch of a step of `sequences` that do not divide among the ranks: each
    global mini-batch of `mini_batch_size` sequences (ppo_mini_batch_size x rollout.n; the last may be shorter)
    dealt by `uneven_shares`, so that the ranks' local mini-batches together are the one-process ones."""
    return [uneven_shares(min(mini_batch_size, sequences - start), world_size)[rank]
            for start in range(0, sequences, mini_batch_size)]


def sequence_share(batch: list[int], *, copies: int, rank: int, world_size: int,
                   mini_batch_size: int, global_mini_batch: int | None = None) -> tuple[list[int], list[int]]:
    """Rank `rank`'s share of a step's sequences when whole prompts do not split among the ranks (fewer prompts
    than ranks, per step or per mini-batch, or not a multiple of them): verl splits the sequences, each prompt of
    `batch` repeated `copies` (rollout.n) times in a row, not the prompts, so a prompt's group may span ranks.

    As rank_share deals prompts, each rank takes its 1/world_size slice of every mini-batch of the sequences, so the
    ranks' local mini-batches together are the global ones a single rank would take; `mini_batch_size` is verl's
    per-rank size (ppo_mini_batch_size x rollout.n // ranks, workers/optimization.rank_mini_batch_size), and the
    last mini-batch may be shorter. Returns each of this rank's sequences' prompt (an entry of `batch`) and its
    group: the position of that prompt in `batch`, the same on every rank.

    Sequences that do not divide among the ranks (use_dynamic_bsz: verl skips its batch-size check) are dealt by
    `global_mini_batch` (ppo_mini_batch_size x rollout.n): each mini-batch of that many split as `uneven_shares`
    does (`rank_mini_batches`)."""
    sequences = len(batch) * copies
    if sequences % world_size and global_mini_batch is not None and global_mini_batch >= world_size:
        positions, start = [], 0
        for sizes in (uneven_shares(min(global_mini_batch, sequences - first), world_size)
                      for first in range(0, sequences, global_mini_batch)):
            positions.extend(range(start + sum(sizes[:rank]), start + sum(sizes[:rank + 1])))
            start += sum(sizes)
        groups = [position // copies for position in positions]
        return [batch[group] for group in groups], groups
    if sequences % world_size or mini_batch_size < 1:
        raise ValueError(f"{len(batch)} prompts x {copies} responses in mini-batches of {mini_batch_size} per rank "
                         f"do not split among {world_size} ranks")
    positions: list[int] = []
    for start in range(0, sequences, mini_batch_size * world_size):
        share = min(mini_batch_size * world_size, sequences - start) // world_size
        positions.extend(range(start + rank * share, start + (rank + 1) * share))
    groups = [position // copies for position in positions]
    return [batch[group] for group in groups], groups
