"""The sampling streams a rank takes from a checkpoint (trainer.randomness.restore_rank_streams)."""

from __future__ import annotations

import torch

from trainer.randomness import restore_rank_streams, rng_state, seed_everything


def saved_states(world_size: int) -> list[dict]:
    states = []
    for rank in range(world_size):
        seed_everything(100 + rank)
        states.append(rng_state())
    return states


def first_draws(state: dict) -> torch.Tensor:
    """What a generator set to `state` draws first."""
    torch.set_rng_state(state["torch"])
    return torch.rand(8)


def draws(*, rank: int, dp_rank: int, world_size: int, rank_states: list[dict] | None, saved: dict,
          step: int = 2) -> torch.Tensor:
    restore_rank_streams(saved, rank_states, rank=rank, dp_rank=dp_rank, world_size=world_size, seed=7, step=step)
    return torch.rand(8)


def test_at_the_same_world_size_each_rank_takes_its_own_saved_streams():
    states = saved_states(2)
    for rank in range(2):
        assert torch.equal(draws(rank=rank, dp_rank=rank, world_size=2, rank_states=states, saved=states[0]),
                           first_draws(states[rank]))


def test_at_another_world_size_the_ranks_sample_independently_and_reproducibly():
    one = saved_states(1)[0]
    expected_rank_0 = first_draws(one)
    # A one-rank checkpoint resumed on 2 ranks (the same holds for 2 ranks' streams on 4: a count that differs).
    rank_0 = draws(rank=0, dp_rank=0, world_size=2, rank_states=None, saved=one)
    rank_1 = draws(rank=1, dp_rank=1, world_size=2, rank_states=None, saved=one)
    assert torch.equal(rank_0, expected_rank_0)  # data-parallel rank 0 goes on with the run's own streams
    assert not torch.equal(rank_0, rank_1)  # the others do not repeat them
    assert torch.equal(rank_1, draws(rank=1, dp_rank=1, world_size=2, rank_states=None, saved=one))
    assert not torch.equal(rank_1, draws(rank=1, dp_rank=1, world_size=2, rank_states=None, saved=one, step=3))
    # Several-rank states at another world size (2 -> 4, two sequence-parallel groups of 2): the ranks of a group
    # share their data-parallel rank's stream.
    two = saved_states(2)
    group = [draws(rank=rank, dp_rank=rank // 2, world_size=4, rank_states=two, saved=two[0]) for rank in range(4)]
    assert torch.equal(group[0], group[1]) and torch.equal(group[2], group[3])
    assert not torch.equal(group[0], group[2])
