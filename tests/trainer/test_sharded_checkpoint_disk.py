"""A checkpoint of several ranks (DCP shards) checks the disk before it writes, as a one-rank one does."""

from __future__ import annotations

import shutil

import pytest
import torch

from trainer import checkpoint
from trainer.checkpoint import CheckpointWriteError, save_sharded_checkpoint


class TwoRanks:
    """Rank 0 of a 2-rank run whose other rank holds as many bytes (gathered objects repeat this rank's)."""

    is_main, world_size = True, 2

    def gather_objects(self, value):
        return [value, value]

    def broadcast_from_main(self, value):
        return value

    def barrier(self):
        pass


def trained_linear() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_disk_without_room_for_every_rank_s_shards_is_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    models = {"actor": trained_linear()}
    one_rank = checkpoint._local_shard_bytes(*models["actor"])
    assert one_rank >= 3 * (64 * 64 + 64) * 4  # the weights and both moments
    # Room for one rank's shards, not for both.
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda path: usage._replace(free=one_rank + 1))
    with pytest.raises(CheckpointWriteError) as raised:
        save_sharded_checkpoint(tmp_path, 3, models, {"step": 3}, ranks=TwoRanks())
    message = str(raised.value)
    assert message.startswith(f"not enough disk space for the checkpoint of step 3 in {str(tmp_path)!r}: its 2 "
                              "ranks' shards need about ")
    assert "\n" not in message and "trainer.max_ckpt_to_keep" in message
    assert list(tmp_path.iterdir()) == []  # no partial folder left
