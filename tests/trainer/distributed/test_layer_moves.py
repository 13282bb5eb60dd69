"""Dynamic offload on several ranks: a sharded model's decoder layers moved between the device and the host
(trainer/distributed/layer_moves.py). The two CPU ranks' checks are in test_sharding.py (sharding_ranks.py's
moves_checks); this one needs a GPU, where a move frees device memory and lands in pinned host memory."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.distributed.test_ranks import rank_script_reports


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
def test_on_a_gpu_a_moved_layer_frees_its_shards_device_memory_and_trains_as_one_never_moved(tmp_path):
    [report] = rank_script_reports("layer_moves_rank.py", tmp_path, ranks=1)
    for name in ("adamw", "host"):
        result = report[name]
        assert result["difference"] <= 1e-5, (name, result["difference"])  # AdamW on the CPU for moved shards
        assert result["moved"] > 1e-3  # the check can fail: the steps moved the weights
        # After each move: layer 0 then layer 1 (PLAN: 1, 0, 2, 1 layers kept on the device).
        assert result["places"] == [["cuda", "cpu/pinned"], ["cpu/pinned", "cpu/pinned"], ["cuda", "cuda"],
                                    ["cuda", "cpu/pinned"]]
        assert result["moves"] == {"to_cpu": 3, "to_gpu": 2}
        # torch's AdamW keeps a layer's moments where its shards are; HostAdamW keeps them all on the CPU (not
        # pinned: only the host's arithmetic reads them; DTensor.from_local put them on the GPU, a bug now fixed).
        assert result["state_places"] == ([["cuda"], ["cpu"]] if name == "adamw" else [["cpu"], ["cpu"]])
        # A layer leaving frees at least its shards (with torch's AdamW also their states and gradients).
        assert result["freed"][0] >= result["layer_bytes"] and result["freed"][1] >= result["layer_bytes"]
        assert result["freed"][2] < 0  # two layers came back
