"""rollout.decode=static: the static-cache decode loop against transformers' generate (issue 15)."""

import math
import sys

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trainer.config import RolloutConfig
from trainer.models import load_policy
from trainer.rollout.hf_rollout import HFRollout
from trainer.rollout.prompts import encode_prompts
from trainer.rollout.static_decode import CHECK_EVERY, Sampling, StaticDecoder, buckets

TINY = "builtin:tiny-qwen2"
PROMPTS = ["1 2 3", "4", "5 6", "7 8 9 0", "2 2", "9 8 7 6 5", "0", "3 1"]


def prompts(tokenizer, repeat: int = 1):
    return encode_prompts(PROMPTS * repeat, tokenizer, max_length=8)


def generate(policy, prompt_ids, prompt_mask, *, eos_ids, pad_id, new_tokens, **sampling) -> torch.Tensor:
    """transformers' generate with the same settings: its new tokens, pads after each row's EOS."""
    config = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True,
                              **sampling)
    defaults, policy.generation_config = policy.generation_config, GenerationConfig()
    try:
        with torch.no_grad():
            return policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)[
                :, prompt_ids.shape[1]:]
    finally:
        policy.generation_config = defaults


@pytest.mark.parametrize("check_every", [1, CHECK_EVERY], ids=["checked_every_token", "checked_every_few"])
@pytest.mark.parametrize("eos_ids", [[1], [1, 4, 12]], ids=["few_end", "many_end_and_the_batch_shrinks"])
def test_greedy_decoding_gives_generates_tokens(tokenizer, policy, eos_ids, check_every):
    """The same tokens, and as many of them, as generate, whether the host looks at every token which rows still
    decode or every few (rows that finished meanwhile decode pads, and the steps after the last row's EOS
    are cut)."""
    prompt_ids, prompt_mask = prompts(tokenizer)
    decoder = StaticDecoder(policy, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False),
                            check_every=check_every)
    ours = decoder.generate(prompt_ids, prompt_mask, 12)
    expected = generate(policy, prompt_ids, prompt_mask, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id,
                        new_tokens=12, do_sample=False)
    assert torch.equal(ours, expected)
    if len(eos_ids) > 1 and check_every == 1:
        assert decoder.bucket_history[0] == 8 and len(decoder.bucket_history) > 1, decoder.bucket_history


@pytest.mark.parametrize("settings", [{"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                                      {"temperature": 0.7, "top_k": 5, "top_p": 0.9}], ids=["plain", "warped"])
def test_sampling_gives_generates_tokens_for_the_same_random_state_while_no_row_is_dropped(tokenizer, policy,
                                                                                           settings):
    prompt_ids, prompt_mask = prompts(tokenizer)
    pad = tokenizer.pad_token_id
    torch.manual_seed(5)
    ours = StaticDecoder(policy, eos_ids=[1], pad_id=pad, sampling=Sampling(**settings), compact=False).generate(
        prompt_ids, prompt_mask, 10)
    torch.manual_seed(5)
    expected = generate(policy, prompt_ids, prompt_mask, eos_ids=[1], pad_id=pad, new_tokens=10, do_sample=True,
                        **settings)
    assert torch.equal(ours, expected)


def test_sampling_with_a_fixed_seed_is_reproducible_when_rows_are_dropped(tokenizer, policy):
    prompt_ids, prompt_mask = prompts(tokenizer, repeat=2)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        decoder = StaticDecoder(policy, eos_ids=[1, 4, 12], pad_id=tokenizer.pad_token_id,
                                sampling=Sampling(temperature=1.5))
        runs.append(decoder.generate(prompt_ids, prompt_mask, 12))
        assert len(decoder.bucket_history) > 1  # rows were dropped on the way
    assert torch.equal(runs[0], runs[1])


def chi_square_critical(degrees: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), by Wilson and Hilferty's approximation."""
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


@pytest.mark.parametrize("settings", [{"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                                      {"temperature": 0.7, "top_k": 6, "top_p": 0.8},
                                      {"temperature": 2.0, "top_k": 0, "top_p": 0.95}], ids=["plain", "top_k_top_p",
                                                                                             "hot_top_p"])
def test_the_first_tokens_follow_generates_distribution(tokenizer, policy, settings):
    """Chi-square of 20,000 first tokens against the probabilities transformers' warpers give the same logits."""
    prompt_ids, prompt_mask = encode_prompts(["5 6"], tokenizer, max_length=8)
    with torch.no_grad():
        # The random model's next-token distribution is nearly flat (its logits span a few hundredths): scaled, a
        # wrong temperature or cut shows (a temperature 15% off fails the test).
        logits = policy(input_ids=prompt_ids, attention_mask=prompt_mask).logits[:, -1].float()
        logits = (logits - logits.mean()) / logits.std() * 1.5
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])]
                                  + ([TopKLogitsWarper(settings["top_k"])] if settings["top_k"] > 0 else [])
                                  + ([TopPLogitsWarper(settings["top_p"])] if settings["top_p"] < 1 else []))
    expected = warpers(prompt_ids, logits.clone()).softmax(dim=-1)[0]
    samples = 20_000
    torch.manual_seed(0)
    tokens = Sampling(**settings).next_tokens(logits.expand(samples, -1))
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0  # nothing the warpers removed is ever drawn
    frequent = expected * samples >= 5
    observed, wanted = counts[frequent], expected[frequent].double() * samples
    rest = samples - observed.sum()  # the rare tokens together, as one cell
    statistic = ((observed - wanted) ** 2 / wanted).sum() + (
        (rest - (samples - wanted.sum())) ** 2 / max(samples - wanted.sum(), 1e-9) if rest > 0 else 0)
    degrees = int(frequent.sum()) - (0 if rest > 0 else 1)
    assert degrees >= 2 and statistic < chi_square_critical(degrees), (statistic, degrees)


def test_the_batch_shrinks_through_powers_of_two():
    assert buckets(8) == [8, 4, 2, 1]
    assert buckets(6) == [6, 4, 2, 1]
    assert buckets(1) == [1]
    assert buckets(33) == [33, 32, 16, 8, 4, 2, 1]


def test_the_rollout_decodes_the_same_greedy_responses_either_way_and_calls_its_safe_points(tokenizer, policy):
    prompt_ids, prompt_mask = prompts(tokenizer)
    results, calls = {}, {}
    for decode in ("generate", "static"):
        calls[decode] = 0

        def safe_point(decode=decode):
            calls[decode] += 1

        rollout = HFRollout(policy, tokenizer, RolloutConfig(do_sample=False, decode=decode), 17,
                            safe_point=safe_point)
        results[decode] = rollout.generate(prompt_ids, prompt_mask)
    for ours, theirs in zip(results["static"], results["generate"], strict=True):
        assert torch.equal(ours, theirs)
    assert results["static"][0].shape == (8, 17)
    assert calls["static"] == 2 and calls["generate"] >= 2  # every 8 decoded tokens, between two forwards


def test_auto_decodes_static_on_a_gpu_for_models_transformers_marks_fit_for_it(tokenizer, policy):
    """rollout.decode=auto (the default): the static decoder on a GPU where the model class says it can be
    captured whole (transformers' _can_compile_fullgraph), generate on the CPU and for other classes."""
    rollout = HFRollout(policy, tokenizer, RolloutConfig(), 8)
    assert RolloutConfig().decode == "auto" and rollout.decoder is not None
    assert rollout._decodes_static(torch.device("cuda")) and not rollout._decodes_static(torch.device("cpu"))

    class Unmarked(type(policy)):
        _can_compile_fullgraph = False

    unmarked = HFRollout(Unmarked(policy.config), tokenizer, RolloutConfig(), 8)
    assert not unmarked._decodes_static(torch.device("cuda"))
    assert HFRollout(policy, tokenizer, RolloutConfig(decode="static"), 8)._decodes_static(torch.device("cpu"))


def test_a_training_run_samples_with_the_static_decoder(tmp_path):
    from trainer.config import load_config
    from trainer.loop import Trainer

    logs: list[str] = []
    trainer = Trainer(load_config("examples/quickstart.yaml", [
        f"trainer.runs_dir={tmp_path}", "trainer.device=cpu", "trainer.total_training_steps=2", "trainer.save_freq=-1",
        "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.decode=static",
    ]), log=logs.append)
    assert trainer.rollout.decoder is not None
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["actor/pg_loss"]) and row["response_length/mean"] > 0 for row in rows)
    # The static cache's bytes are reported each step (and said once in the log): keys and values of every layer
    # for each row's prompt and response positions, in the model's dtype. No CUDA graph on the CPU.
    config = trainer.actor.model.config
    rows_decoded = 16 * trainer.config.actor_rollout_ref.rollout.n
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    positions = trainer.config.data.max_prompt_length + trainer.config.data.max_response_length
    element = next(trainer.actor.model.parameters()).element_size()
    per_position = 2 * config.num_hidden_layers * rows_decoded * config.num_key_value_heads * head_dim * element
    for row in rows:
        assert row["rollout/graph_pool_gb"] == 0
        # The cache spans the batch's longest prompt (at most max_prompt_length) and max_response_length.
        held = row["rollout/kv_cache_gb"] * 2**30 / per_position
        assert held == int(held) and trainer.config.data.max_response_length < held <= positions, held
    assert len([line for line in logs if line.startswith("static decode: KV cache")]) == 1


def test_the_log_probs_kept_while_sampling_are_the_training_forwards(tokenizer, policy):
    """What the decode's logits gave each sampled token is what the training forward (compute_log_probs: the
    whole sequence at once, no cache) gives it: the cache, the positions and the masks agree."""
    from tests.trainer.rollout.test_rollout import make_batch
    from trainer.rollout.hf_rollout import response_mask_until_eos
    from trainer.workers.actor import compute_log_probs

    prompt_ids, prompt_mask = prompts(tokenizer, repeat=2)
    decoder = StaticDecoder(policy, eos_ids=[1, 4], pad_id=tokenizer.pad_token_id, sampling=Sampling(temperature=1.0))
    decoder.keep_log_probs = True
    torch.manual_seed(3)
    responses = decoder.generate(prompt_ids, prompt_mask, 10)
    assert len(decoder.bucket_history) > 1  # through a shrinking batch
    mask = response_mask_until_eos(responses, [1, 4])
    expected = compute_log_probs(policy, make_batch(prompt_ids, prompt_mask, responses, mask), micro_batch_size=4,
                                 temperature=1.0)
    torch.testing.assert_close(decoder.log_probs * mask, expected[:, :responses.shape[1]] * mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_greedy_decoding_gives_generates_tokens_with_either_attention(tokenizer, implementation):
    """The boolean 4-D mask of the decode steps is SDPA's; with another attention the 2-D mask goes as generate's."""
    model = load_policy(TINY, tokenizer, dtype=torch.float32, seed=4, override_config={"num_hidden_layers": 2},
                        ).eval()
    model.set_attn_implementation(implementation)
    prompt_ids, prompt_mask = prompts(tokenizer)
    decoder = StaticDecoder(model, eos_ids=[1, 4, 12], pad_id=tokenizer.pad_token_id,
                            sampling=Sampling(do_sample=False))
    assert decoder._full_attention_only() == (implementation == "sdpa")
    expected = generate(model, prompt_ids, prompt_mask, eos_ids=[1, 4, 12], pad_id=tokenizer.pad_token_id,
                        new_tokens=12, do_sample=False)
    assert torch.equal(decoder.generate(prompt_ids, prompt_mask, 12), expected)


def test_the_engine_says_when_a_forward_may_be_captured_and_what_it_reads(tokenizer):
    """Streamer.graph_key (what OffloadEngine.graph_key gives a GPU): a key while every layer is kept in a slot of
    its own and the head and embedding are kept whole for the phase; None while a layer streams, outside the
    rollout's placement, or while an update runs; a new key once a layer's weights changed."""
    from trainer.config.schema import FSDPConfig
    from trainer.offload import attach_offload

    policy = load_policy(TINY, tokenizer, dtype=torch.float32, seed=3, override_config={"num_hidden_layers": 2})
    settings = FSDPConfig.model_validate({"offload_policy": {"embedding": "cpu", "lm_head": "cpu"},
                                          "dynamic_offload": {"enabled": True}})
    engine = attach_offload(policy, settings, torch.device("cpu"), role="actor")
    streamer = engine.streamer
    try:
        engine.set_transformer_layers_on_gpu(2)
        ids = torch.tensor([[3, 4, 5]])
        assert streamer.graph_key() is None  # the head and embedding stream
        with engine.placed_for("rollout"), torch.no_grad():
            policy(input_ids=ids)  # the staged copies and the layers' first copies, waited for
            key = streamer.graph_key()
            assert key is not None and streamer.graph_key() == key
            engine.transformer_units[0].ready.clear()  # an update running
            assert streamer.graph_key() is None
            engine.transformer_units[0].ready.set()
            engine.set_transformer_layers_on_gpu(1)
            assert streamer.graph_key() is None  # a layer streams
            engine.set_transformer_layers_on_gpu(2)
            policy(input_ids=ids)
            assert streamer.graph_key() is not None
            engine.updates.after_update(engine.transformer_units[1])  # new weights in its arena: copied again
            assert streamer.graph_key() is None
            policy(input_ids=ids)
            assert streamer.graph_key() not in (None, key)
        assert engine.graph_key() is None  # not on a GPU
    finally:
        engine.close()


def test_a_rollout_under_a_delayed_update_may_be_captured_and_reads_the_weights_from_before_it(tokenizer):
    """Under fsdp_config.delayed_update the rollout's reads take the weights from before the update running beside
    them (engine.stale_reads), which the device copies keep until the update is published: the graph key is the
    one from before the update there, so the decode keeps its CUDA graphs (without them the decode ran 4 to 9
    times slower beside the host's update on an H200, 2026-12-04), the same at every token; outside the stale reads
    there is no key until a forward has published the update, and then a new one."""
    from trainer.config.schema import FSDPConfig
    from trainer.offload import attach_offload

    policy = load_policy(TINY, tokenizer, dtype=torch.bfloat16, seed=3, override_config={"num_hidden_layers": 2})
    settings = FSDPConfig.model_validate({"model_dtype": "bf16", "optimizer_offload": True, "delayed_update": True,
                                          "offload_policy": {"embedding": "cpu", "lm_head": "cpu"},
                                          "dynamic_offload": {"enabled": True}})
    engine = attach_offload(policy, settings, torch.device("cpu"), role="actor")
    streamer = engine.streamer
    ids = torch.tensor([[3, 4, 5]])
    try:
        engine.set_transformer_layers_on_gpu(2)
        optimizer = engine.optimizer(lr=1e-2)
        with engine.placed_for("rollout"), torch.no_grad():
            before = policy(input_ids=ids).logits.clone()
        policy.train()
        policy(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        policy.eval()
        assert all(unit.publish_pending for unit in engine.units if unit.trainable)
        with engine.stale_reads(), engine.placed_for("rollout"), torch.no_grad():  # as the memory manager places
            policy(input_ids=ids)
            key = streamer.graph_key()
            assert key is not None and streamer.graph_key() == key
            assert torch.equal(policy(input_ids=ids).logits, before)
            assert streamer.graph_key() == key
        with engine.placed_for("rollout"), torch.no_grad():
            assert streamer.graph_key() is None  # the update is to be published before the next read
            after = policy(input_ids=ids).logits
            assert not torch.equal(after, before)
            assert streamer.graph_key() not in (None, key)
    finally:
        engine.close()


def test_the_norms_that_compute_rms_norm_run_the_fused_kernel_and_decode_the_same_tokens(tokenizer, policy):
    """fused_norms.py swaps a norm's forward for torch's F.rms_norm only where the two agree on a random input and
    weight (checked once per class), and only while decoding on a GPU. On this CPU the swap is forced by naming a
    GPU device: the greedy tokens are generate's, and the model's own forwards come back afterwards."""
    from torch import nn

    from trainer.rollout.fused_norms import fused_rms_norms

    norms = [module for module in policy.modules() if type(module).__name__ == "Qwen2RMSNorm"]
    assert norms
    with fused_rms_norms(policy, torch.device("cpu")) as swapped:
        assert swapped == 0  # on the CPU the kernels are the same either way
    prompt_ids, prompt_mask = prompts(tokenizer)
    expected = generate(policy, prompt_ids, prompt_mask, eos_ids=[1], pad_id=tokenizer.pad_token_id, new_tokens=12,
                        do_sample=False)
    with fused_rms_norms(policy, torch.device("cuda")) as swapped:
        assert swapped == len(norms) and all("forward" in norm.__dict__ for norm in norms)
        decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False))
        assert torch.equal(decoder.generate(prompt_ids, prompt_mask, 12), expected)
    assert not any("forward" in norm.__dict__ for norm in norms)

    class ScaledByOnePlusWeight(nn.Module):  # Gemma's RMSNorm: 1 + weight, which F.rms_norm does not compute
        def __init__(self, size: int):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(size))
            self.eps = 1e-6

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            normed = hidden.float() * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.float())).type_as(hidden)

    ScaledByOnePlusWeight.__name__ = "GemmaLikeRMSNorm"
    other = nn.Sequential(ScaledByOnePlusWeight(16))
    with fused_rms_norms(other, torch.device("cuda")) as swapped:
        assert swapped == 0


def test_decode_steps_rotate_with_the_compiled_rotary_function_where_it_compiles_and_agrees(tokenizer, policy,
                                                                                          monkeypatch):
    """fused_rotary.py swaps the modeling module's own apply_rotary_pos_emb, for the decode's duration on a GPU, for
    a wrapper that sends decode steps (one position per row) to its torch.compile'd copy once that agreed with the
    original on the first step's own inputs, and prompts to the original. Here on the CPU, with the GPU check and
    torch.compile faked: a copy that agrees is used; one that fails to compile, or disagrees, leaves the original,
    said once; the tokens are generate's each time and the module's own function comes back afterwards."""
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    from trainer.rollout import fused_rotary

    original = qwen2.apply_rotary_pos_emb
    with fused_rotary.fused_rotary(policy, torch.device("cpu")) as swapped:
        assert swapped == 0 and qwen2.apply_rotary_pos_emb is original
    prompt_ids, prompt_mask = prompts(tokenizer)
    expected = generate(policy, prompt_ids, prompt_mask, eos_ids=[1], pad_id=tokenizer.pad_token_id, new_tokens=12,
                        do_sample=False)
    monkeypatch.setattr(fused_rotary, "_decoding", lambda cos: cos.dim() == 3 and cos.shape[1] == 1)
    calls = {"compiled": 0, "original": 0}

    def counted(function, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)
        return call

    def broken(q, k, cos, sin, unsqueeze_dim=1):
        q_embed, k_embed = original(q, k, cos, sin, unsqueeze_dim)
        return q_embed + 0.5, k_embed

    def failing(function, **kwargs):
        raise RuntimeError("Cannot find a working triton installation\nmore")

    for compile_as, used in ((lambda function, **kwargs: counted(function, "compiled"), True),
                             (failing, False), (lambda function, **kwargs: broken, False)):
        for cache in (fused_rotary._COMPILED, fused_rotary._AGREES, fused_rotary._FAILURES):
            cache.clear()
        monkeypatch.setattr(fused_rotary.torch, "compile", compile_as)
        monkeypatch.setattr(qwen2, "apply_rotary_pos_emb", counted(original, "original"))
        calls.update(compiled=0, original=0)
        said: list[str] = []
        decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False),
                                warn=said.append)
        with fused_rotary.fused_rotary(policy, torch.device("cuda"), said.append) as swapped:
            assert swapped == 1
            decoded = decoder.generate(prompt_ids, prompt_mask, 12)
            assert torch.equal(decoded, expected)
        # Every decode step of every layer (not the prompt's forward) ran the compiled copy.
        assert calls["compiled"] == ((decoded.shape[1] - 1) * policy.config.num_hidden_layers if used else 0), calls
        assert calls["original"] > 0
        assert len(said) == (0 if used else 1), said
        assert used or ("did not compile (RuntimeError: Cannot find a working triton installation)" in said[0]
                        if compile_as is failing else "disagreed" in said[0])
        assert not hasattr(qwen2.apply_rotary_pos_emb, "fused_rotary_of")
    for cache in (fused_rotary._COMPILED, fused_rotary._AGREES, fused_rotary._FAILURES):
        cache.clear()


def test_decode_steps_run_gated_silu_mlps_with_the_activation_and_product_fused(tokenizer, policy, monkeypatch):
    """fused_mlp.py: on a GPU, decode steps of every MLP computing down(silu(gate(x)) * up(x)) (checked once per
    class) run silu(gate) * up as one compiled function; the prompt's forward keeps the module's own. Here on the
    CPU, with the GPU checks faked and the function uncompiled: the tokens are generate's, the own forwards come
    back, an MLP with another activation is left alone, and a failed compilation is said once and changes nothing."""
    from torch import nn

    from trainer.rollout import fused_mlp

    mlps = [module for module in policy.modules() if type(module).__name__ == "Qwen2MLP"]
    with fused_mlp.fused_mlps(policy, torch.device("cpu")) as swapped:
        assert swapped == 0
    prompt_ids, prompt_mask = prompts(tokenizer)
    expected = generate(policy, prompt_ids, prompt_mask, eos_ids=[1], pad_id=tokenizer.pad_token_id, new_tokens=12,
                        do_sample=False)
    fused_calls = []

    def counted(gate, up):
        fused_calls.append(gate.shape)
        return fused_mlp._silu_and_mul(gate, up)

    monkeypatch.setattr(fused_mlp, "_compiled", lambda say: counted)
    fused_mlp._VERIFIED.clear()
    decoder = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id, sampling=Sampling(do_sample=False))
    with fused_mlp.fused_mlps(policy, torch.device("cuda")) as swapped:
        assert swapped == len(mlps) and all("forward" in mlp.__dict__ for mlp in mlps)
        decoded = decoder.generate(prompt_ids, prompt_mask, 12)
        assert torch.equal(decoded, expected)
    assert not any("forward" in mlp.__dict__ for mlp in mlps)
    # Every decode step of every layer, and none of the prompt's forward (the class's check runs the formula
    # eagerly on a probe).
    assert len(fused_calls) == (decoded.shape[1] - 1) * len(mlps)
    assert all(shape[1] == 1 for shape in fused_calls)

    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.act_fn = nn.SiLU()

        def forward(self, x):  # says SiLU, computes GELU
            return self.down_proj(nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))

    class ScaledMLP(GeluMLP):
        def forward(self, x):  # SiLU, but a scaled product
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)

    class SizedMLP(GeluMLP):
        def forward(self, x):  # reads its sizes: fails on the probe, so it is left alone
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)).view(*x.shape[:-1], 8)

    for other in (GeluMLP, ScaledMLP, SizedMLP):
        with fused_mlp.fused_mlps(nn.Sequential(other()), torch.device("cuda")) as swapped:
            assert swapped == 0, other.__name__
    fused_mlp._VERIFIED.clear()

    monkeypatch.undo()
    said: list[str] = []

    def failing(function, **kwargs):
        raise RuntimeError("no working C compiler found")

    monkeypatch.setattr(fused_mlp.torch, "compile", failing)
    monkeypatch.setattr(fused_mlp, "_FUSED", [])
    monkeypatch.setattr(fused_mlp, "_FAILURE", [])
    for _ in range(2):
        with fused_mlp.fused_mlps(policy, torch.device("cuda"), said.append) as swapped:
            assert swapped == 0
    assert len(said) == 1 and "did not compile (RuntimeError: no working C compiler found)" in said[0]


def test_a_rank_whose_rows_have_finished_decodes_pads_until_every_ranks_rows_have(tokenizer, policy):
    """Synced over ranks (agree_active: the largest count of rows still decoding on any rank): the same tokens as
    alone, and as many forwards as the rank that decodes longest, here one that keeps a row decoding for 12 tokens."""
    prompt_ids, prompt_mask = prompts(tokenizer)
    first = StaticDecoder(policy, eos_ids=[1], pad_id=tokenizer.pad_token_id,
                          sampling=Sampling(do_sample=False)).generate(prompt_ids, prompt_mask, 12)
    eos_ids = sorted(set(first[:, 2].tolist()))  # every row ends by its third token
    forwards = []
    handle = policy.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        results = {}
        for other_rank_active in (None, 0, 1):
            forwards.clear()
            agree = None if other_rank_active is None else (lambda active, other=other_rank_active: max(active, other))
            decoder = StaticDecoder(policy, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id,
                                    sampling=Sampling(do_sample=False), agree_active=agree)
            results[other_rank_active] = (decoder.generate(prompt_ids, prompt_mask, 12), len(forwards))
    finally:
        handle.remove()
    alone, alone_forwards = results[None]
    assert alone.shape[1] <= 3 and alone_forwards < 12
    assert torch.equal(results[0][0], alone) and results[0][1] == alone_forwards  # no other rank decoding longer
    # Another rank still decodes: this one steps as often (the prefill and 11 steps), its tokens the same.
    assert torch.equal(results[1][0], alone) and results[1][1] == 12


@pytest.mark.parametrize(("model_type", "extra", "mlps_fused"), [
    ("llama", {}, True), ("mistral", {}, True), ("qwen3", {"head_dim": 16}, True),
    ("gemma", {"head_dim": 16}, False),  # GELU: its MLP keeps its own forward
    ("phi3", {"partial_rotary_factor": 0.5, "pad_token_id": 0}, False),  # a fused gate_up_proj; half the dims rotate
])
def test_other_architectures_rotary_and_mlps_compile_for_real_and_decode_the_same_tokens(model_type, extra, mlps_fused,
                                                                                       monkeypatch):
    """The compiled pieces are built for any decoder, not the Qwen2 shape: each architecture's own rotary function,
    really compiled by torch.compile (inductor's CPU backend here, Triton on a GPU), agrees with the original, and
    the greedy tokens of a decode with both pieces are the plain decode's (the GPU checks faked to run on the CPU)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.rollout import fused_mlp, fused_rotary

    if shutil.which("cc") is None:
        pytest.skip("torch.compile's CPU backend needs a C compiler")
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                  max_position_embeddings=128, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 100, (4, 6))
    plain = StaticDecoder(model, eos_ids=[1], pad_id=0, sampling=Sampling(do_sample=False)).generate(
        ids, torch.ones_like(ids), 8)
    monkeypatch.setattr(fused_rotary, "_decoding", lambda cos: cos.dim() == 3 and cos.shape[1] == 1)
    saved = (dict(fused_rotary._COMPILED), dict(fused_rotary._AGREES), dict(fused_rotary._FAILURES))
    compiled_mlp = torch.compile(fused_mlp._silu_and_mul, dynamic=True, fullgraph=True)
    monkeypatch.setattr(fused_mlp, "_compiled", lambda say: compiled_mlp)
    monkeypatch.setattr(fused_mlp, "_VERIFIED", {})
    said: list[str] = []
    try:
        with fused_rotary.fused_rotary(model, torch.device("cuda"), said.append) as rotary, \
                fused_mlp.fused_mlps(model, torch.device("cuda"), said.append) as mlps:
            decoded = StaticDecoder(model, eos_ids=[1], pad_id=0, sampling=Sampling(do_sample=False)).generate(
                ids, torch.ones_like(ids), 8)
        original = sys.modules[type(model).__module__].apply_rotary_pos_emb
        assert rotary == 1 and fused_rotary._AGREES.get((original, torch.float32)) is True, said
    finally:
        for cache, before in zip((fused_rotary._COMPILED, fused_rotary._AGREES, fused_rotary._FAILURES), saved,
                                 strict=True):
            cache.clear()
            cache.update(before)
    assert said == []
    assert mlps == (config.num_hidden_layers if mlps_fused else 0)
    assert torch.equal(decoded, plain)
