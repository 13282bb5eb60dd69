"""rollout.decode=static on a GPU: the log-probs of what it samples against the training forward's (bf16)."""

import pytest
import torch

from tests.trainer.rollout.test_rollout import make_batch
from trainer.models import load_policy, load_tokenizer
from trainer.rollout.hf_rollout import response_mask_until_eos
from trainer.rollout.prompts import encode_prompts
from trainer.rollout.static_decode import Sampling, StaticDecoder
from trainer.workers.actor import compute_log_probs

pytestmark = pytest.mark.gpu


def bf16_policy_and_prompts():
    """A small bf16 policy on the GPU (4 layers, 2 key/value heads) and 32 left-padded prompts there."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.bfloat16, seed=3,
                         override_config={"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                          "num_attention_heads": 4, "num_key_value_heads": 2}).cuda().eval()
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6", "7 8 9 0"] * 8, tokenizer, max_length=8)
    return tokenizer, policy, prompt_ids.cuda(), prompt_mask.cuda()


def test_the_static_decodes_log_probs_agree_with_the_training_forward_in_bf16():
    tokenizer, policy, prompt_ids, prompt_mask = bf16_policy_and_prompts()
    decoder = StaticDecoder(policy, eos_ids=[1, 4], pad_id=tokenizer.pad_token_id, sampling=Sampling())
    decoder.keep_log_probs = True
    torch.manual_seed(0)
    responses = decoder.generate(prompt_ids, prompt_mask, 24)
    mask = response_mask_until_eos(responses, [1, 4])
    expected = compute_log_probs(policy, make_batch(prompt_ids, prompt_mask, responses, mask), micro_batch_size=8,
                                 temperature=1.0)
    difference = ((decoder.log_probs - expected[:, :responses.shape[1]]) * mask).abs()
    assert difference.max() < 0.1 and difference.sum() / mask.sum() < 0.02, difference.max()


def test_the_per_token_step_in_cuda_graphs_decodes_what_the_eager_step_does():
    """Greedy, through a shrinking batch: each batch size's step is captured at its second step and replayed;
    the tokens are the eager decoder's."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.bfloat16, seed=3,
                         override_config={"num_hidden_layers": 2}).cuda().eval()
    prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6", "7 8 9 0"] * 4, tokenizer, max_length=8)
    prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
    results = {}
    for graphs in (False, True):
        decoder = StaticDecoder(policy, eos_ids=[1, 4, 12], pad_id=tokenizer.pad_token_id,
                                sampling=Sampling(do_sample=False), cuda_graphs=graphs)
        results[graphs] = decoder.generate(prompt_ids, prompt_mask, 20)
        history = decoder.bucket_history
    assert len(history) > 1, history
    assert torch.equal(results[True], results[False])


def _engine_placed(layers_on_gpu: int):
    """The tiny policy with its head and embedding on the CPU and dynamic offload keeping `layers_on_gpu` of
    its 4 layers on the GPU (the others stream)."""
    from trainer.config.schema import FSDPConfig
    from trainer.offload import attach_offload

    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    policy = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.bfloat16, seed=3,
                         override_config={"num_hidden_layers": 4}).eval()
    settings = FSDPConfig.model_validate({"offload_policy": {"embedding": "cpu", "lm_head": "cpu"},
                                          "dynamic_offload": {"enabled": True}})
    engine = attach_offload(policy, settings, torch.device("cuda"), role="actor")
    engine.set_transformer_layers_on_gpu(layers_on_gpu)
    return tokenizer, policy, engine


@pytest.mark.parametrize("layers_on_gpu", [4, 2], ids=["layers_kept", "layers_streamed"])
def test_graphs_of_an_engine_placed_model_replay_only_while_its_weights_stay_put(layers_on_gpu):
    """Under the rollout's placement (head and embedding kept whole on the GPU): with every layer kept there the
    step is replayed from graphs, with two layers streaming it runs eagerly (a graph would not copy them);
    both decode the eager tokens, with every norm and MLP fused (a layer's weights on the host between its
    forwards, kept or streamed, as a resident layer's)."""
    tokenizer, policy, engine = _engine_placed(layers_on_gpu)
    try:
        prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6", "7 8 9 0"] * 4, tokenizer, max_length=8)
        prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
        results, replays = {}, {}
        for graphs in (False, True):
            decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id,
                                    sampling=Sampling(do_sample=False), cuda_graphs=graphs, safety=engine)
            with engine.placed_for("rollout"):
                results[graphs] = decoder.generate(prompt_ids, prompt_mask, 20)
            replays[graphs] = decoder.replays
            assert (decoder.fused_norms, decoder.fused_mlps) == (2 * 4 + 1, 4)
        assert torch.equal(results[True], results[False])
        assert replays[False] == 0
        assert (replays[True] > 0) == (layers_on_gpu == 4), replays
    finally:
        engine.close()


def test_a_safe_point_that_moves_layers_drops_the_graphs_it_invalidates():
    """Layers moved at safe points (dynamic offload): out to the CPU (decoding goes on eagerly, the moved layer
    streaming) and back (a new graph under the new slots): the tokens are those of a decode without moves."""
    tokenizer, policy, engine = _engine_placed(4)
    try:
        prompt_ids, prompt_mask = encode_prompts(["1 2 3", "4", "5 6", "7 8 9 0"] * 4, tokenizer, max_length=8)
        prompt_ids, prompt_mask = prompt_ids.cuda(), prompt_mask.cuda()
        plans = iter([3, 4, 2, 4, 4, 4, 4, 4])

        def safe_point():
            engine.set_transformer_layers_on_gpu(next(plans))

        results = {}
        for moving in (False, True):
            decoder = StaticDecoder(policy, eos_ids=[-1], pad_id=tokenizer.pad_token_id,
                                    sampling=Sampling(do_sample=False), cuda_graphs=True, safety=engine)
            with engine.placed_for("rollout"):
                results[moving] = decoder.generate(prompt_ids, prompt_mask, 48, safe_point if moving else None)
            assert decoder.replays > 0
        assert engine.moves["to_cpu"] > 0 and engine.moves["to_gpu"] > 0, engine.moves
        assert torch.equal(results[True], results[False])
    finally:
        engine.close()


def test_the_fused_norms_decode_what_the_models_own_norms_decode():
    """bf16 on the GPU: the fused kernel rounds once where transformers' RMSNorm rounds twice; greedy tokens agree
    on nearly every position and the kept log-probs within bf16's noise."""
    tokenizer, policy, prompt_ids, prompt_mask = bf16_policy_and_prompts()
    results = {}
    for fuse in (False, True):
        decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False),
                                cuda_graphs=True)
        decoder.fuse_norms, decoder.keep_log_probs = fuse, True
        results[fuse] = (decoder.generate(prompt_ids, prompt_mask, 16), decoder.log_probs.clone(), decoder.fused_norms)
    assert results[True][2] == 2 * 4 + 1 and results[False][2] == 0
    first_tokens = results[True][0][:, 0] == results[False][0][:, 0]
    assert first_tokens.float().mean() > 0.9
    assert (results[True][1][:, 0] - results[False][1][:, 0]).abs().max() < 0.1


def test_the_compiled_rotary_embedding_and_mlps_decode_what_transformers_own_decode():
    """bf16 on the GPU, each step in a CUDA graph: the decode steps rotate with the torch.compile'd copy of the
    model's own apply_rotary_pos_emb and run the MLPs' silu(gate) * up compiled (both compiled and agreed, nothing
    said), through a shrinking batch whose buckets reuse one dynamic-shape compilation; greedy tokens agree on
    nearly every position and the kept log-probs within bf16's noise."""
    from trainer.rollout import fused_rotary

    tokenizer, policy, prompt_ids, prompt_mask = bf16_policy_and_prompts()
    results, said = {}, []
    for fuse in (False, True):
        decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False),
                                cuda_graphs=True, warn=said.append)
        decoder.fuse_rotary, decoder.fuse_mlps, decoder.keep_log_probs = fuse, fuse, True
        results[fuse] = (decoder.generate(prompt_ids, prompt_mask, 16), decoder.log_probs.clone(),
                         (decoder.fused_rotary, decoder.fused_mlps), decoder.replays)
    assert said == []
    assert results[True][2] == (1, 4) and results[False][2] == (0, 0) and results[True][3] > 0
    assert any(fused_rotary._AGREES.values()), fused_rotary._AGREES
    # The first token comes from the prompt's forward (the original either way); the next ones from decode steps.
    decoded = results[True][0][:, 1:4] == results[False][0][:, 1:4]
    assert decoded.float().mean() > 0.9
    assert (results[True][1][:, 1] - results[False][1][:, 1]).abs().max() < 0.1
