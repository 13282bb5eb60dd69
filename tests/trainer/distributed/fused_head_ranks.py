"""One rank of the fused head's FSDP2 checks, run by torch.distributed.run (2 CPU ranks over gloo) from
test_fused_head_ranks.py.

For each case the tiny model of sharding_ranks.py is sharded twice by shard_model; on the rank's half of a batch one
copy computes its log-probs and entropies from its logits, the other from the fused head
(actor_rollout_ref.model.use_fused_kernels), each backward of the same loss. The rank reports the largest
differences of the figures and of every parameter's whole gradient, and the all-gathers FSDP2 ran for each path.
Everything is written to OUT/rank<r>.json; the test asserts on it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 fused_head_ranks.py OUT
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

import trainer.algorithms.fused_head as fused_head_arithmetic
from tests.trainer.distributed.sharding_ranks import BATCH, LENGTH, VOCABULARY, GatherCount, full, tiny_model
from trainer.algorithms import log_probs_and_entropy_from_logits
from trainer.config import FSDPConfig
from trainer.distributed.ranks import Ranks
from trainer.distributed.sharding import shard_model
from trainer.models.fused_head import FusedScoring

TEMPERATURE = 0.7
CASES = {
    "untied/all_on_device": ("untied", {}),
    "untied/head_on_cpu": ("untied", {"offload_policy": {"lm_head": "cpu"}}),
    "tied/embedding_and_head_on_cpu": ("tied", {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}),
}


def figures(model: torch.nn.Module, input_ids: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, L - 1] log-probs of each next token and entropies at TEMPERATURE."""
    if fused:
        with FusedScoring(TEMPERATURE).around(model, input_ids):
            scores = model(input_ids=input_ids).logits[:, :-1]
        return scores[..., 0], scores[..., 1]
    logits = model(input_ids=input_ids).logits[:, :-1]
    return log_probs_and_entropy_from_logits(logits, input_ids[:, 1:], TEMPERATURE)


def main(out: Path) -> None:
    # The 24-row head in chunks of 8 rows, tiles of 40 logits.
    fused_head_arithmetic.HEAD_ROWS_PER_CHUNK, fused_head_arithmetic.TILE_ELEMENTS = 8, 40
    ranks = Ranks.from_environment("cpu")
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(1, VOCABULARY, (BATCH, LENGTH), generator=generator)
    weights = torch.randn(2, BATCH, LENGTH - 1, generator=generator)
    share, share_weights = batch.chunk(ranks.world_size)[ranks.rank], weights.chunk(ranks.world_size, dim=1)[ranks.rank]
    results: dict[str, dict] = {}
    for name, (kind, settings) in CASES.items():
        whole = tiny_model(kind)
        report: dict = {}
        seen: dict[bool, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}
        for fused in (False, True):
            model = copy.deepcopy(whole)
            shard_model(model, FSDPConfig.model_validate(settings), ranks, role="actor", log=lambda _: None)
            with GatherCount() as gathers:
                log_probs, entropies = figures(model, share, fused)
                ((log_probs * share_weights[0]).sum() + (entropies * share_weights[1]).sum()).backward()
            report[f"gathers_{'fused' if fused else 'unfused'}"] = gathers.count
            seen[fused] = ([log_probs.detach(), entropies.detach()],
                           {key: full(parameter.grad) for key, parameter in model.named_parameters()})
        (expected_figures, expected_grads), (got_figures, got_grads) = seen[False], seen[True]
        report["figures"] = max(float((got - expected).abs().max())
                                for got, expected in zip(got_figures, expected_figures, strict=True))
        report["gradients"] = {key: float((got_grads[key] - expected_grads[key]).abs().max()) for key in expected_grads}
        report["gradient_scale"] = max(float(grad.abs().max()) for grad in expected_grads.values())
        results[name] = report
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(results, indent=1))
    ranks.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
