"""One rank on a GPU moving a sharded model's decoder layers between the device and the host
(trainer/distributed/layer_moves.py), run by torch.distributed.run with one process over NCCL from
test_layer_moves.py: its checks need real device memory, which the CPU ranks of sharding_ranks.py do not have.

Three steps of two micro-batches each, layers moved between micro-batches and between steps, against the same model
never moved, for torch's AdamW and HostAdamW; where the moved shards live, and the device memory a move frees.
Writes OUT/rank0.json.

    python -m torch.distributed.run --standalone --nproc-per-node 1 layer_moves_rank.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.trainer.distributed.sharding_ranks import LENGTH, VOCABULARY, full, loss_of, tiny_model
from trainer.config import FSDPConfig
from trainer.distributed.host_adamw import HostAdamW
from trainer.distributed.layer_moves import ShardedLayers, fsdp_params_of
from trainer.distributed.sharding import shard_model

PLAN = {(1, 1): 1, (2, 0): 0, (2, 1): 2, (3, 0): 1}
"""(step, micro-batch) -> the layers kept on the device after it."""


def where(tensor: torch.Tensor) -> str:
    return tensor.device.type + ("/pinned" if tensor.is_pinned() else "")


def main(out: Path) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # As the trainer's ranks (trainer/distributed/ranks.py): a moved layer's CPU shards gather over gloo.
    dist.init_process_group("cpu:gloo,cuda:nccl")
    ranks = SimpleNamespace(mesh=init_device_mesh("cuda", (1,)), device=device, world_size=1)
    batch = torch.randint(1, VOCABULARY, (4, LENGTH), generator=torch.Generator().manual_seed(1)).to(device)
    results: dict = {}
    for name, optimizer_class in (("adamw", torch.optim.AdamW), ("host", HostAdamW)):
        models = {}
        for moving in (False, True):
            model = tiny_model("untied").to(device)
            layer_units = shard_model(model, FSDPConfig(), ranks, role="actor", log=lambda _: None).parts.layers
            models[moving] = model
        optimizers = {moving: optimizer_class(model.parameters(), lr=1e-2) for moving, model in models.items()}
        moving_optimizer = optimizers[True]
        layers = ShardedLayers("actor", layer_units, device, optimizer=lambda moving=moving_optimizer: moving)
        freed, places = [], []
        for step in (1, 2, 3):
            for moving, model in models.items():
                optimizers[moving].zero_grad()
                for micro, half in enumerate(batch.chunk(2)):
                    (loss_of(model, half) / 2).backward()
                    if moving and (step, micro) in PLAN:
                        torch.cuda.synchronize()
                        before = torch.cuda.memory_allocated(device)
                        layers.set_transformer_layers_on_gpu(PLAN[(step, micro)])
                        freed.append(before - torch.cuda.memory_allocated(device))
                        places.append([where(fsdp_params_of(unit)[0].sharded_param._local_tensor)
                                       for unit in layers.transformer_units])
                optimizers[moving].step()
        # Where the moving optimizer's moments of each layer live after the last move (layer 0 on the device).
        state_places = [sorted({where(value._local_tensor) for fsdp_param in fsdp_params_of(unit)
                                for key, value in moving_optimizer.state[fsdp_param.sharded_param].items()
                                if key != "step"}) for unit in layers.transformer_units]
        expected = dict(models[False].named_parameters())
        results[name] = {
            "difference": max(float((full(parameter).cpu() - full(expected[key]).cpu()).abs().max())
                              for key, parameter in models[True].named_parameters()),
            "moved": max(float((full(parameter).cpu() - full(original).cpu()).abs().max())
                         for (_, parameter), original in zip(models[False].named_parameters(),
                                                            tiny_model("untied").parameters(), strict=True)),
            "freed": freed, "places": places, "state_places": state_places, "layer_bytes": layers.layer_bytes,
            "moves": layers.moves}
    (out / "rank0.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
