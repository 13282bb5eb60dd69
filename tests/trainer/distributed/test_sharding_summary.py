"""A sharded model's offload summary in the article's words (several ranks: FSDP2 places the groups, not the offload
engine): each group OFFLOADED to CPU or KEPT on the device with this rank's bytes of it, and the Total GPU Memory
Saved on each rank. Hand-computed on the tiny model (vocabulary 17, hidden 32, fp32), unsharded: a rank's local
shards of one rank are the whole weights."""

from __future__ import annotations

import torch

from trainer.distributed.sharding import offload_summary
from trainer.models import load_policy, load_tokenizer
from trainer.offload.groups import find_parts

SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
PLACED = {"embedding": True, "transformer": False, "norm": False, "lm_head": True}


def parts(**override: object):
    model = load_policy("builtin:tiny-qwen2", load_tokenizer("builtin:tiny-qwen2"), dtype=torch.float32, seed=3,
                        override_config={**SMALL, **override})
    return find_parts(model, None)


def test_each_group_says_where_it_lives_and_the_offloaded_ones_add_up_to_what_is_saved() -> None:
    lines = offload_summary(PLACED, parts(), torch.device("cuda"))
    # embedding and head: 17 x 32 fp32 = 2176 bytes (2.125 KiB) each; the norm 32 x 4 = 128 bytes
    assert lines[0] == "Embedding: OFFLOADED to CPU (2.12 KiB of this rank's shards)"
    assert lines[1].startswith("Transformer (1 layers): KEPT on GPU (")
    assert lines[2:] == ["Norm: KEPT on GPU (0.12 KiB of this rank's shards)",
                         "LM head: OFFLOADED to CPU (2.12 KiB of this rank's shards)",
                         "Total GPU Memory Saved: 4.25 KiB on each rank"]


def test_a_cpu_run_names_its_compute_device_and_a_tied_head_is_the_embeddings() -> None:
    lines = offload_summary(PLACED, parts(tie_word_embeddings=True), torch.device("cpu"))
    assert "LM head: tied to the embedding" in lines
    assert lines[1].startswith("Transformer (1 layers): KEPT on the compute device, the CPU (")
    assert lines[-1] == "Total GPU Memory Saved on a GPU: 2.12 KiB on each rank (this run computes on the CPU)"
