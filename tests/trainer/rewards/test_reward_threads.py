"""The reward time limit's worker threads (issue 41's remaining faults, item 1): calls share a pool that lives for
the process instead of a thread each; a call that times out leaves its thread behind, marked lost, and the next call
gets a fresh worker; past a bound of lost threads still stuck, a call is refused with one clear line."""

from __future__ import annotations

import threading
import time

import pytest

from trainer.rewards.time_limit import (
    RewardThreads,
    RewardThreadsExhausted,
    RewardTimeoutError,
    call_with_time_limit,
)


def test_calls_reuse_one_worker_thread_instead_of_starting_one_each():
    """It was: a thread started for every call (a cheap scorer paid more for the thread than for its work)."""
    workers = [call_with_time_limit(threading.current_thread, (), {}, limit_s=10, what=lambda: "f")
               for _ in range(50)]  # the Thread objects kept, so that none's identity is reused
    assert len({id(worker) for worker in workers}) == 1
    assert workers[0] is not threading.current_thread() and workers[0].daemon


def test_a_stuck_call_is_left_behind_and_the_next_call_gets_a_fresh_worker():
    threads = RewardThreads()
    release = threading.Event()
    with pytest.raises(RewardTimeoutError):
        call_with_time_limit(release.wait, (), {}, limit_s=0.1, what=lambda: "f", threads=threads)
    assert threads.lost == 1
    start = time.monotonic()
    assert call_with_time_limit(lambda: 7, (), {}, limit_s=5, what=lambda: "f", threads=threads) == 7
    assert time.monotonic() - start < 1  # not behind the stuck call
    release.set()  # the stuck call returns at last: its thread leaves the pool, no longer counted lost
    deadline = time.monotonic() + 5
    while threads.lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads.lost == 0


def test_past_the_bound_of_lost_threads_a_call_is_refused_in_one_line():
    threads = RewardThreads(max_lost=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(RewardTimeoutError):
            call_with_time_limit(release.wait, (), {}, limit_s=0.05, what=lambda: "f", threads=threads)
    called = []
    with pytest.raises(RewardThreadsExhausted) as refused:
        call_with_time_limit(called.append, (1,), {}, limit_s=5, threads=threads,
                             what=lambda: "custom_reward_function 'score' scoring a response of data_source 'gsm8k'")
    assert called == []  # not called: no third thread left behind
    assert str(refused.value) == (
        "2 calls of the reward function that did not return within reward_model.reward_timeout_s are still running "
        "on abandoned threads, the most this process leaves behind; not calling custom_reward_function 'score' "
        "scoring a response of data_source 'gsm8k' again: make the function return sooner, or raise "
        "reward_model.reward_timeout_s")
    release.set()
    deadline = time.monotonic() + 5
    while threads.lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call_with_time_limit(lambda: "scored", (), {}, limit_s=5, what=lambda: "f", threads=threads) == "scored"
