"""One rank on a GPU decoding with a sharded model's whole weights held and FSDP2's forward hooks off
(sharding.whole_weights, sharding.plain_forwards), as several ranks' rollouts do: the static decode captures its step
in CUDA graphs there (FSDP2's root hook would have ordered its gather streams after the capture, unjoined). Run by
torch.distributed.run with one process over NCCL from test_decode_graphs.py; writes OUT/rank0.json.

    python -m torch.distributed.run --standalone --nproc-per-node 1 decode_graphs_rank.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.trainer.distributed.sharding_ranks import VOCABULARY, loss_of, tiny_model
from trainer.config import FSDPConfig
from trainer.distributed.ranks import Ranks
from trainer.distributed.sharding import plain_forwards, shard_model, whole_weights
from trainer.rollout.static_decode import Sampling, StaticDecoder

NEW_TOKENS = 12


def main(out: Path) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl")  # as the trainer's ranks (trainer/distributed/ranks.py)
    ranks = Ranks(device=device, mesh=init_device_mesh("cuda", (1,)))
    model = tiny_model("untied").to(device)
    model.set_attn_implementation("sdpa")  # the captured step's attention
    sharded = shard_model(model, FSDPConfig(), ranks, role="actor", log=lambda _: None)
    prompts = torch.randint(1, VOCABULARY, (4, 5), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(prompts)
    results: dict = {}
    for name, graphs in (("eager", False), ("graphs", True)):
        # An end-of-sequence id outside the vocabulary: every row decodes all the tokens.
        decoder = StaticDecoder(model, eos_ids=[VOCABULARY], pad_id=0, sampling=Sampling(do_sample=False),
                                cuda_graphs=graphs)
        with whole_weights(sharded, ranks) as held, plain_forwards(model) as plain:
            tokens = decoder.generate(prompts, mask, NEW_TOKENS)
        results[name] = {"held": held, "plain": plain, "replays": decoder.replays, "tokens": tokens.tolist()}
    # FSDP2's hooks are back: a training step gathers, reduces and gives a finite loss.
    loss = loss_of(model, prompts)
    loss.backward()
    results["trains_after"] = bool(torch.isfinite(loss).item()) and all(
        parameter.grad is not None for parameter in model.parameters())
    (out / "rank0.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
