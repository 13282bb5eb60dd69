"""Arithmetic questions in verl's parquet layout, for examples/smollm2_arithmetic.yaml.

Like verl's examples/data_preprocess scripts (gsm8k.py), but the questions are generated, not downloaded: the
same seed writes the same files. Each row: ``prompt`` (one user chat message), ``data_source`` ("arithmetic",
scored by trainer/rewards/scorers.py's final-number rule), ``ability``, ``reward_model.ground_truth`` (the
answer as text) and ``extra_info`` (split, index, the operands and the operator).

    python examples/data_preprocess/arithmetic.py --local_save_dir ~/data/arithmetic
"""

from __future__ import annotations

import argparse
import operator
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic"
INSTRUCTION = "Answer with just the number."
# Addition and subtraction of numbers up to 50: a 135M instruct model gets some right from the start (so GRPO's
# groups are not all-zero) and many wrong, most by explaining instead of answering (so there is room to learn).
OPERATORS = {"+": operator.add, "-": operator.sub}


def make_question(rng: random.Random, low: int, high: int) -> tuple[int, str, int, int]:
    """One question's operands, operator and answer, drawn from `rng`."""
    left, right = rng.randint(low, high), rng.randint(low, high)
    symbol = rng.choice(sorted(OPERATORS))
    return left, symbol, right, OPERATORS[symbol](left, right)


def make_rows(count: int, split: str, rng: random.Random, low: int, high: int,
              exclude: set[str] | None = None) -> list[dict]:
    """`count` distinct questions in verl's layout, none of whose text is in `exclude`."""
    rows: list[dict] = []
    seen = set(exclude or ())
    while len(rows) < count:
        left, symbol, right, answer = make_question(rng, low, high)
        question = f"What is {left} {symbol} {right}? {INSTRUCTION}"
        if question in seen:
            continue
        seen.add(question)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": len(rows), "left": left, "right": right, "operator": symbol},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_save_dir", default="~/data/arithmetic", help="where train.parquet and "
                        "test.parquet are written")
    parser.add_argument("--train_size", type=int, default=512)
    parser.add_argument("--test_size", type=int, default=32, help="held-out questions, none of them in train")
    parser.add_argument("--low", type=int, default=1, help="the smallest operand")
    parser.add_argument("--high", type=int, default=50, help="the largest operand")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    test = make_rows(args.test_size, "test", rng, args.low, args.high)
    train = make_rows(args.train_size, "train", rng, args.low, args.high,
                      exclude={row["prompt"][0]["content"] for row in test})
    directory = Path(args.local_save_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(rows), directory / f"{name}.parquet")
    print(f"wrote {len(train)} train and {len(test)} test questions to {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
