"""A static decode step's attention reads only the cache's written columns (live_keys.py, issue 40): the same
tokens as reading the whole cache, and the same log-probabilities to the last bits of fp32 (a softmax over fewer
masked columns sums in another order: a few ulps of these values apart), at the lengths counted by hand."""

import pytest
import torch

from tests.trainer.rollout.test_static_decode import PROMPTS
from trainer.rollout.live_keys import live_length, live_step
from trainer.rollout.prompts import encode_prompts
from trainer.rollout.static_decode import Sampling, StaticDecoder


def test_the_read_length_is_the_written_one_rounded_up_to_an_eighth_of_the_cache():
    # long3b's cache: a 16-token prompt and 4096 new tokens; an eighth of 4112 columns is 514, 576 in multiples of 64.
    assert live_step(4112) == 576
    assert [live_length(written, 4112, 576) for written in (17, 576, 577, 1000, 4000, 4112)] == [
        576, 576, 1152, 1152, 4032, 4112]
    assert live_step(1152) == 192  # the uneven benchmark's: 128 + 1024
    assert live_step(14) == 64 and live_length(9, 14, 64) == 14  # a small cache is read whole


def decode(policy, tokenizer, *, live_keys: bool, step: int | None, eos_ids, sampling: Sampling, seed: int = 5):
    prompt_ids, prompt_mask = encode_prompts(PROMPTS, tokenizer, max_length=8)
    decoder = StaticDecoder(policy, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, sampling=sampling, check_every=1)
    decoder.live_keys, decoder.live_step, decoder.keep_log_probs = live_keys, step, True
    torch.manual_seed(seed)
    tokens = decoder.generate(prompt_ids, prompt_mask, 12)
    return tokens, decoder.log_probs, decoder, prompt_ids.shape[1]


@pytest.mark.parametrize("step", [1, 3, None])
@pytest.mark.parametrize("sampling", [Sampling(do_sample=False), Sampling(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("eos_ids", [[1], [1, 4, 12]], ids=["few_end", "rows_end_and_the_batch_shrinks"])
def test_reading_the_live_keys_gives_the_same_tokens_and_log_probs_as_the_whole_cache(tokenizer, policy, step,
                                                                                      sampling, eos_ids):
    whole, whole_log_probs, whole_decoder, _ = decode(policy, tokenizer, live_keys=False, step=step, eos_ids=eos_ids,
                                                      sampling=sampling)
    live, live_log_probs, decoder, _ = decode(policy, tokenizer, live_keys=True, step=step, eos_ids=eos_ids,
                                              sampling=sampling)
    assert torch.equal(live, whole)
    # |log p| < 4, where an ulp is 2.4e-7: 3 ulps apart on this machine's CPU kernels (7.2e-7 at -2.56; 2 on another),
    # where reading a wrong column would move a log-prob by far more.
    assert torch.allclose(live_log_probs, whole_log_probs, rtol=0, atol=1e-6)
    assert (live_log_probs != 0).sum() == (whole_log_probs != 0).sum() > 0
    assert decoder.bucket_history == whole_decoder.bucket_history
    if step is not None:
        assert decoder.columns_read < whole_decoder.columns_read


def test_attention_reads_the_prompt_and_the_tokens_decoded_so_far(tokenizer, policy, monkeypatch):
    """What attention is handed at each decode step, counted by hand: a prompt width of P columns and step s of the
    decode reads P + s columns with a step of 1, of the P + 12 of the cache."""
    lengths = []
    attend = torch.nn.functional.scaled_dot_product_attention

    def counted(query, key, value, *args, **kwargs):
        mask = kwargs.get("attn_mask", args[0] if args else None)
        if mask.shape[-2] == 1:  # a decode step's [rows, 1, 1, columns] (the prefill's mask has the prompt's rows)
            lengths.append(key.shape[-2])
            assert mask.shape[-1] == key.shape[-2]
        return attend(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    tokens, _, decoder, width = decode(policy, tokenizer, live_keys=True, step=1, eos_ids=[-1],
                                       sampling=Sampling(do_sample=False))
    layers = policy.config.num_hidden_layers
    assert tokens.shape[1] == 12 and decoder.steps == 11  # no EOS: the first token from the prefill, 11 steps
    assert lengths == [width + step for step in range(1, 12) for _ in range(layers)]
    assert decoder.cache_columns == width + 12
    assert decoder.columns_read == sum(width + step for step in range(1, 12))
    # Rounded up to multiples of 4: width 5 + step 1..11 -> 8 (steps 1-3), 12 (4-7), 16 (8-11), of 17.
    lengths.clear()
    decode(policy, tokenizer, live_keys=True, step=4, eos_ids=[-1], sampling=Sampling(do_sample=False))
    assert width == 5 and lengths == [length for length in [8] * 3 + [12] * 4 + [16] * 4 for _ in range(layers)]
