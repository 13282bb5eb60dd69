"""The time limit's cost per call of a user's reward function (reward_model.reward_timeout_s): 10,000 calls of a
cheap function (an addition) with the limit and without it, on the CPU, printed as microseconds a call.

    .venv/bin/python benchmarks/reward_time_limit.py [--calls 10000] [--repeats 3]

The figure that counts is the overhead: what the limit adds to each call (the hand-off to a worker thread and the
wait for its answer). The best of `--repeats` runs is printed, the machine's noise being one-sided.
"""

from __future__ import annotations

import argparse
import time

from trainer.rewards.time_limit import call_with_time_limit


def cheap(a: int, b: int) -> int:
    return a + b


def seconds_per_call(calls: int, limit_s: float | None) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call_with_time_limit(cheap, (1, 2), {}, limit_s=limit_s, what=lambda: "cheap")
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    seconds_per_call(200, 60.0)  # warm-up: the pool's first worker starts here
    limited = min(seconds_per_call(arguments.calls, 60.0) for _ in range(arguments.repeats))
    direct = min(seconds_per_call(arguments.calls, None) for _ in range(arguments.repeats))
    print(f"{arguments.calls} calls: with the limit {limited * 1e6:.1f} us a call, without {direct * 1e6:.2f} us; "
          f"the limit adds {(limited - direct) * 1e6:.1f} us a call")


if __name__ == "__main__":
    main()
