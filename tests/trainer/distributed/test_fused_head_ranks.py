"""The fused head (actor_rollout_ref.model.use_fused_kernels) on a model FSDP2 shards over 2 CPU ranks: the head is
called as the model calls it, so FSDP2 gathers its weight around the fused forward and again for its backward, as
around the logits' matrix product, and the log-probs, entropies and every parameter's gradient are the logits' path's
(fused_head_ranks.py reports them)."""

from __future__ import annotations

import pytest

from tests.trainer.distributed.fused_head_ranks import CASES
from tests.trainer.distributed.test_ranks import rank_script_reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return rank_script_reports("fused_head_ranks.py", tmp_path_factory.mktemp("fused_head"), ranks=2)


@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_models_fused_head_gives_the_logits_paths_figures_and_gradients(reports, case):
    for rank, report in enumerate(reports):
        figures = report[case]
        assert figures["figures"] < 1e-5, f"rank {rank}"
        assert figures["gradient_scale"] > 1e-3, "the gradients are not all zero: the comparison means something"
        assert max(figures["gradients"].values()) < 1e-5, (rank, figures["gradients"])
        assert figures["gathers_fused"] == figures["gathers_unfused"] > 0, "FSDP2 gathers the head as it does today"
