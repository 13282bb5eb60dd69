"""Several ranks' rollout on a GPU: with the whole weights held and FSDP2's hooks off, the static decode captures
CUDA graphs as one rank's does (sharding.plain_forwards; the CPU ranks' checks are in test_sharding.py)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.distributed.test_ranks import rank_script_reports


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
def test_on_a_gpu_a_sharded_models_decode_is_captured_in_cuda_graphs_and_decodes_the_eager_tokens(tmp_path):
    [report] = rank_script_reports("decode_graphs_rank.py", tmp_path, ranks=1)
    eager, graphs = report["eager"], report["graphs"]
    assert eager["held"] and eager["plain"] and graphs["held"] and graphs["plain"]
    assert eager["replays"] == 0 and graphs["replays"] >= 8  # captured at the second step, replayed after
    assert graphs["tokens"] == eager["tokens"]
    assert report["trains_after"]
