"""Refilled slots (issue 40) on a GPU: under CUDA graphs, and with the offload engine's streamed layers."""

import pytest
import torch

from tests.trainer.rollout.test_static_decode_gpu import _engine_placed
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.prompts import encode_prompts
from trainer.rollout.static_decode import Sampling, StaticDecoder

pytestmark = pytest.mark.gpu
PROMPTS = ["1 2 3", "4", "5 6", "7 8 9 0"] * 4


def test_refilled_slots_replayed_in_cuda_graphs_decode_the_eager_refills_tokens():
    """Refills write the captured step's tensors and cache in place: the replays decode what the eager step does,
    through a ring that wraps (16 prompts, 5 slots, up to 20 tokens)."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.bfloat16, seed=3,
                         override_config={"num_hidden_layers": 2}).cuda().eval()
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
    results = {}
    for graphs in (False, True):
        decoder = StaticDecoder(policy, eos_ids=[1, 4, 12], pad_id=tokenizer.pad_token_id,
                                sampling=Sampling(do_sample=False), cuda_graphs=graphs)
        results[graphs] = decoder.generate(prompt_ids, prompt_mask, 20, slots=5)
        assert decoder.refilled == len(PROMPTS) - 5
        assert (decoder.replays > 0) == graphs
    assert torch.equal(results[True], results[False])


@pytest.mark.parametrize("layers_on_gpu", [4, 2], ids=["layers_kept", "layers_streamed"])
def test_refilled_slots_decode_the_same_tokens_with_the_engines_layers_kept_or_streamed(layers_on_gpu):
    tokenizer, policy, engine = _engine_placed(layers_on_gpu)
    try:
        prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
        prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
        results = {}
        for graphs in (False, True):
            decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id,
                                    sampling=Sampling(do_sample=False), cuda_graphs=graphs, safety=engine)
            with engine.placed_for("rollout"):
                results[graphs] = decoder.generate(prompt_ids, prompt_mask, 20, slots=6)
            assert decoder.refilled == len(PROMPTS) - 6
        assert torch.equal(results[True], results[False])
    finally:
        engine.close()
