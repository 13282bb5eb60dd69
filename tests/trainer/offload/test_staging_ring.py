"""The pinned region gradients wait in for the offload engine's worker (trainer/offload/copies.py)."""

import random

import pytest
import torch

from trainer.offload.copies import StagingRing


class Task:
    """A worker task: done once somebody waits for it (`exception()`), or when the test says so."""

    def __init__(self):
        self.finished = False
        self.waited = False

    def done(self) -> bool:
        return self.finished

    def exception(self):
        self.waited = self.finished = True
        return None


def ring(capacity: int, alignment: int = 100) -> tuple[StagingRing, list[int]]:
    allocations = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocations.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    return StagingRing(capacity, allocate, alignment), allocations


def offset(staging: StagingRing, view: torch.Tensor) -> int:
    return view.data_ptr() - staging._region.data_ptr()


def take(staging: StagingRing, nbytes: int) -> tuple[torch.Tensor, Task]:
    view, task = staging.take(nbytes), Task()
    staging.hold_until(task)
    return view, task


def test_pieces_follow_each_other_and_wrap_once_the_oldest_is_landed():
    staging, allocations = ring(1000)
    views = [take(staging, 300) for _ in range(3)]
    assert [offset(staging, view) for view, _ in views] == [0, 300, 600]
    assert allocations == [1000]  # one region, at the first take

    views[0][1].finished = True  # the worker landed the oldest: the next piece wraps into its place
    view, _ = take(staging, 250)
    assert offset(staging, view) == 0 and view.numel() == 250
    assert staging.waits == 0 and not views[1][1].waited


def test_a_full_region_waits_for_the_oldest_pieces_only_as_long_as_it_must():
    staging, _ = ring(1000)
    tasks = [take(staging, 300)[1] for _ in range(3)]
    view, _ = take(staging, 500)  # 100 free at the end, none before the oldest: wait for two
    assert [task.waited for task in tasks] == [True, True, False]
    assert staging.waits == 2
    assert offset(staging, view) == 0


def test_live_pieces_never_overlap_and_stay_aligned_inside_the_region():
    generator = random.Random(0)
    staging, allocations = ring(4096, alignment=64)
    live: list[tuple[int, int, Task]] = []
    wraps = 0
    for _ in range(2000):
        if live and generator.random() < 0.4:
            # The worker lands in order: some of the oldest pieces are done.
            for _, _, task in live[:generator.randint(1, len(live))]:
                task.finished = True
        nbytes = generator.choice([0, 1, 63, 64, 200, 1000, 2048, 4096])
        view, task = take(staging, nbytes)
        piece = staging._pieces[-1]  # what the piece holds: its bytes rounded up to the alignment
        start, end = piece.start, piece.end
        assert view.numel() == nbytes and (nbytes == 0 or offset(staging, view) == start)
        assert start % 64 == 0 and nbytes <= end - start <= max(nbytes, 1) + 63 and end <= 4096
        wraps += bool(live) and start < live[-1][0]
        live = [piece for piece in live if not piece[2].finished]
        for other_start, other_end, _ in live:
            assert end <= other_start or other_end <= start, "a live piece was handed out again"
        live.append((start, end, task))
    assert allocations == [4096]
    assert wraps > 100 and staging.waits > 100  # both ways a full region resolves were taken


def test_a_piece_larger_than_the_region_is_refused_in_one_line():
    staging, _ = ring(1000)
    with pytest.raises(ValueError, match="piece of 1001 bytes is larger than the staging region"):
        staging.take(1001)


def test_a_piece_taken_without_a_task_holding_it_blocks_the_next():
    staging, _ = ring(1000)
    staging.take(100)
    with pytest.raises(RuntimeError, match="no task holding it"):
        staging.take(100)
    staging.reset()  # what the engine does after abandoning a pass
    assert offset(staging, take(staging, 100)[0]) == 0


def test_clear_gives_the_region_back_and_the_next_take_allocates_again():
    staging, allocations = ring(1000)
    take(staging, 100)
    staging.clear()
    assert staging._region is None
    take(staging, 100)
    assert allocations == [1000, 1000]
