"""The offload summary in the article's words ("verl CPU offloading实战": "FSDP Offload Summary", "OFFLOADED to CPU",
"KEPT on GPU", "Total GPU Memory Saved"), so that a reader who greps a run's log for them finds them. On a GPU the
groups left there are KEPT on GPU; on a CPU-only run the lines name the compute device instead (the words of a CPU
run: tests/trainer/test_offload.py)."""

from __future__ import annotations

import torch

from trainer.config import FSDPConfig
from trainer.models import load_policy, load_tokenizer
from trainer.offload import OffloadOptions, attach_offload
from trainer.offload.layout import format_bytes, summary_lines

# The article's §2.2 placement: embedding and head on the CPU, the blocks and the final norm on the GPU.
ARTICLE = FSDPConfig.model_validate({"param_offload": True, "offload_policy": {
    "embedding": "cpu", "lm_head": "cpu", "transformer": "gpu", "norm": "gpu"}})


def test_the_summary_of_a_gpu_run_says_offloaded_kept_and_saved_as_the_article_does() -> None:
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = load_policy("builtin:tiny-qwen2", tokenizer, seed=1, override_config={"num_hidden_layers": 2},
                        dtype=torch.float32)
    engine = attach_offload(model, ARTICLE, "cpu", role="actor", options=OffloadOptions(head_chunk_bytes=1 << 30))
    sizes = engine.layout.group_bytes
    lines = summary_lines(engine.layout, role="actor", device=torch.device("cuda"), host=engine.host_bytes(),
                          saved_gpu_bytes=engine.saved_gpu_bytes())
    assert lines[:4] == [f"Embedding: OFFLOADED to CPU ({format_bytes(sizes['embedding'])})",
                         f"Transformer (2 layers): KEPT on GPU ({format_bytes(sizes['transformer'])})",
                         f"Norm: KEPT on GPU ({format_bytes(sizes['norm'])})",
                         f"LM head: OFFLOADED to CPU ({format_bytes(sizes['lm_head'])})"]
    # What the GPU does not hold: the embedding's and the head's weights, gradients and AdamW's two states (fp32,
    # all trained), less the device slots they stream through.
    saved = 4 * (sizes["embedding"] + sizes["lm_head"]) - engine.working_set_bytes()
    assert engine.saved_gpu_bytes() == saved
    assert f"Total GPU Memory Saved: {format_bytes(saved)}" in lines
