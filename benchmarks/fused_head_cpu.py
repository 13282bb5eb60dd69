"""model.use_fused_kernels on the CPU: the peak memory and the time of one actor forward+backward (the update's loss
with an entropy bonus, at temperature 0.7) of the built-in tiny model at long responses, fused against unfused.

    python benchmarks/fused_head_cpu.py --out fused.json                         # 2 x 2048 tokens, three vocabularies
    python benchmarks/fused_head_cpu.py --vocabularies 17 --tokens 512 --repeats 1  # a smoke run

The peak is the largest sum of live tensors torch's profiler saw during the pass (profile_memory's timeline, every
category: the logits, activations, gradients), not the process's RSS. The vocabulary is the tiny model's own (17
tokens: the logits are nothing there) and, with the same 64-wide model, the larger ones of real models (the head's
rows beyond the tokenizer's are never sampled, but the logits have them all). The time is the median of `repeats`
passes outside the profiler. The speed that matters is the GPU's (benchmarks/e2e_bench.py's long3b): on a CPU both
paths are bound by the same matrix products.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfileTimeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import ActorConfig  # noqa: E402
from trainer.data import PromptRecord  # noqa: E402
from trainer.models import load_policy, load_tokenizer  # noqa: E402
from trainer.rollout.batch import RolloutBatch  # noqa: E402
from trainer.workers.actor import Actor  # noqa: E402

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
PROMPT = 16
MIB = 1 << 20


def long_batch(sequences: int, tokens: int, vocabulary: int) -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.randint(3, vocabulary, (sequences, PROMPT), generator=generator),
                         prompt_mask=torch.ones(sequences, PROMPT, dtype=torch.long),
                         response_ids=torch.randint(3, vocabulary, (sequences, tokens), generator=generator),
                         response_mask=torch.ones(sequences, tokens), group_index=torch.arange(sequences),
                         records=[PromptRecord(prompt="p", data_source="bench")] * sequences)
    batch.advantages = torch.randn(sequences, tokens, generator=generator)
    batch.old_log_probs = torch.zeros(sequences, tokens)
    return batch


def actor(vocabulary: int, fused: bool) -> Actor:
    model = load_policy("builtin:tiny-qwen2", TOKENIZER, seed=1, dtype=torch.float32,
                        override_config={"vocab_size": vocabulary})
    config = ActorConfig.model_validate({"ppo_mini_batch_size": 2, "entropy_coeff": 0.01, "use_torch_compile": False})
    return Actor(model, config, temperature=0.7, rollout_n=1, log_prob_micro_batch_size=2, total_steps=1, seed=1,
                 fused_head=fused)


def one_pass(worker: Actor, batch: RolloutBatch) -> None:
    worker.model.zero_grad(set_to_none=True)
    loss, _ = worker._loss(batch)
    assert isinstance(loss, torch.Tensor)
    loss.backward()


def peak_bytes(worker: Actor, batch: RolloutBatch) -> int:
    """The largest sum of live tensors during one pass, from the profiler's memory timeline."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        one_pass(worker, batch)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(row) for row in sizes)


def measure(vocabulary: int, sequences: int, tokens: int, repeats: int) -> list[dict]:
    batch = long_batch(sequences, tokens, vocabulary)
    rows = []
    for fused in (False, True):
        worker = actor(vocabulary, fused)
        one_pass(worker, batch)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            one_pass(worker, batch)
            times.append(time.perf_counter() - started)
        rows.append({"vocabulary": vocabulary, "sequences": sequences, "tokens": tokens, "fused": fused,
                     "peak_mib": peak_bytes(worker, batch) / MIB, "seconds": statistics.median(times),
                     "logits_mib": sequences * (tokens + 1) * vocabulary * 4 / MIB})
        del worker
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabularies", type=int, nargs="+", default=[17, 32768, 151936])
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="response tokens of each sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = [row for vocabulary in args.vocabularies
            for row in measure(vocabulary, args.sequences, args.tokens, args.repeats)]
    print(f"{'vocabulary':>10} {'path':>8} {'peak MiB':>9} {'seconds':>8}  (one float32 [B, R+1, V]: MiB)")
    for row in rows:
        print(f"{row['vocabulary']:>10} {'fused' if row['fused'] else 'unfused':>8} {row['peak_mib']:>9.1f} "
              f"{row['seconds']:>8.3f}  ({row['logits_mib']:.1f})")
    if args.out is not None:
        machine = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                   "date": time.strftime("%Y-%m-%dT%H:%M", time.gmtime())}
        args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
