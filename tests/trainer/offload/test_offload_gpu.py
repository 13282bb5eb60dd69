"""The offload engine on a CUDA GPU, in bf16: the same numbers as a resident model (to bf16's
tolerance), host arenas really page-locked, copies timed, and peak device memory lower by at
least the bytes the policy moves off the GPU."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.trainer.offload.test_offload import logits_around_a_delayed_update
from trainer.algorithms import kl_penalty, log_probs_from_logits
from trainer.config import FSDPConfig
from trainer.models import load_critic, load_policy, load_tokenizer
from trainer.models.tiny import seeded_init
from trainer.offload import OffloadOptions, attach_offload

pytestmark = pytest.mark.gpu

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
CUDA = torch.device("cuda")
SMALL = {"num_hidden_layers": 4}
# Big enough that the parameters dwarf the activations and the engine's slots.
MEDIUM = Qwen2Config(num_hidden_layers=6, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=32768, tie_word_embeddings=False)
SMALL_CHUNKS = OffloadOptions(head_chunk_bytes=2 << 20)
POLICIES = {
    "all_cpu": {"param_offload": True},
    "layered": {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}},
    "optimizer_offload": {"optimizer_offload": True},
    "all_cpu_optimizer_offload": {"param_offload": True, "optimizer_offload": True},
    # Gradients land straight in a pinned bf16 arena; the update reads them in fp32.
    "all_cpu_bf16_host_gradients": {"param_offload": True, "optimizer_offload": True, "offload_grad_dtype": "bf16"},
}


def policy(override_config, dtype=torch.bfloat16, **kwargs):
    return load_policy("builtin:tiny-qwen2", TOKENIZER, dtype=dtype, seed=1, override_config=override_config,
                       **kwargs)


def place(model, settings: dict, role: str = "actor", options: OffloadOptions = SMALL_CHUNKS):
    if settings is None:
        return model.to(CUDA), None
    return model, attach_offload(model, FSDPConfig.model_validate(settings), CUDA, role=role, options=options)



def relative_error(gradient: torch.Tensor, reference: torch.Tensor) -> float:
    return ((gradient.float().cpu() - reference.cpu()).norm() / reference.norm().cpu().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", ["layered", "all_cpu_bf16_host_gradients"])
def test_two_forwards_before_one_backward_add_up_every_gradient_on_cuda(name):
    """The head's chunks sent twice in one backward (through pinned memory, some through the
    worker) add up: every gradient is as close to an fp32 backward of the same weights as a
    resident bf16 model's is (a chunk copied over instead of added would be off by tens of percent).

    The fp32 backward is the yardstick because bf16 backwards of the same model differ from each
    other by a few percent in the small gradients (measured on CPU: 2.2% relative for both the
    resident model and ours, and ours the closer one for the embedding)."""
    ids = torch.randint(3, len(TOKENIZER), (4, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
    other = ids.flip(0)

    def two_forwards(model):
        (model(input_ids=ids, labels=ids).loss + model(input_ids=other, labels=other).loss).backward()
        return [parameter.grad for parameter in model.parameters()]

    reference = two_forwards(policy(SMALL).float().train().to(CUDA))
    resident = two_forwards(policy(SMALL).train().to(CUDA))
    # Four vocabulary rows (of the tiny model's 17, hidden 64, bf16) a chunk.
    model, engine = place(policy(SMALL).train(), POLICIES[name], options=OffloadOptions(head_chunk_bytes=4 * 64 * 2))
    offloaded = two_forwards(model)
    head = next(unit for unit in engine.units if unit.group == "lm_head")
    assert len(head.blocks) > 1  # streamed in several chunks
    names = [parameter_name for parameter_name, _ in model.named_parameters()]
    for parameter_name, ours, theirs, exact in zip(names, offloaded, resident, reference, strict=True):
        ours_error, resident_error = relative_error(ours, exact), relative_error(theirs, exact)
        assert ours_error <= 2 * resident_error + 5e-3, (parameter_name, ours_error, resident_error)


def train(settings, *, steps=3, gradient_checkpointing=False):
    model, engine = place(policy(SMALL, gradient_checkpointing=gradient_checkpointing).train(), settings)
    optimizer = (engine.optimizer(lr=1e-3) if engine is not None else
                 torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True))
    ids = torch.randint(3, len(TOKENIZER), (4, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        for micro_batch in ids.split(2):
            loss = model(input_ids=micro_batch, labels=micro_batch).loss
            (loss / 2).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    if engine is not None:
        engine.wait_for_updates()
    weights = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}
    return losses, weights, engine


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_offloaded_bf16_training_matches_the_resident_model(name, gradient_checkpointing):
    expected_losses, expected_weights, _ = train(None, gradient_checkpointing=gradient_checkpointing)
    losses, weights, engine = train(POLICIES[name], gradient_checkpointing=gradient_checkpointing)
    assert losses == pytest.approx(expected_losses, rel=2e-2)
    # bf16 weights move by lr = 1e-3 a step; fp32 masters (optimizer_offload) round differently.
    torch.testing.assert_close(weights, expected_weights, rtol=2e-2, atol=3e-3)
    assert all(copy["seconds"] > 0 for copy in engine.drain_copy_stats())


def test_host_arenas_and_gradients_are_page_locked():
    model, engine = place(policy(SMALL).train(), POLICIES["all_cpu"])
    assert engine.host_tensors() and all(tensor.is_pinned() for tensor in engine.host_tensors())
    assert all(parameter.is_pinned() for parameter in model.parameters())
    ids = torch.randint(3, len(TOKENIZER), (2, 8), device=CUDA)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(parameter.grad.is_pinned() for parameter in model.parameters())


def test_the_cpu_compute_dtype_and_device_are_what_hf_sees():
    model, _ = place(policy(SMALL).train(), POLICIES["all_cpu_optimizer_offload"])
    assert next(model.parameters()).dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16


def test_generate_with_streamed_layers_gives_the_resident_tokens():
    resident, _ = place(policy(SMALL, dtype=torch.float32).eval(), None)
    model, _ = place(policy(SMALL, dtype=torch.float32).eval(), POLICIES["all_cpu"])
    ids = torch.randint(3, len(TOKENIZER), (3, 6), generator=torch.Generator().manual_seed(2)).to(CUDA)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=TOKENIZER.pad_token_id, use_cache=True)
    assert torch.equal(model.generate(input_ids=ids, **settings), resident.generate(input_ids=ids, **settings))


def test_models_with_different_policies_compute_together_on_the_gpu():
    actor, _ = place(policy(SMALL).train(), POLICIES["all_cpu"])
    reference, _ = place(policy(SMALL).eval().requires_grad_(False), POLICIES["layered"], role="ref")
    critic = load_critic("builtin:tiny-qwen2", TOKENIZER, dtype=torch.bfloat16, seed=1, override_config=SMALL)
    critic, _ = place(critic.eval(), {"offload_policy": {"transformer": "cpu"}}, role="critic")
    ids = torch.randint(3, len(TOKENIZER), (2, 9), device=CUDA)
    log_probs = log_probs_from_logits(actor(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
    with torch.no_grad():
        reference_log_probs = log_probs_from_logits(reference(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
    values = critic(input_ids=ids).logits.squeeze(-1).float()
    (kl_penalty(log_probs, reference_log_probs, "low_var_kl").mean() + values.square().mean()).backward()
    assert all(parameter.grad is not None for parameter in actor.parameters())
    assert all(torch.isfinite(parameter.grad.float()).all() for parameter in critic.parameters())


def _peak_training_bytes(settings) -> tuple[int, int]:
    """(peak device bytes of a training step of two micro-batches, bytes the policy keeps off the device).

    Gradients accumulate over the micro-batches as in the actor's update: on the device for the
    resident model, on the host for the offloaded groups.
    """
    gc.collect()
    torch.cuda.empty_cache()
    model = seeded_init(Qwen2ForCausalLM, MEDIUM, 1).to(torch.bfloat16).train()
    before = torch.cuda.memory_allocated()
    model, engine = place(model, settings)
    ids = torch.randint(3, MEDIUM.vocab_size, (4, 256), device=CUDA)
    torch.cuda.reset_peak_memory_stats()
    for micro_batch in ids.split(2):
        model(input_ids=micro_batch, labels=micro_batch).loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    moved = sum(row["bytes"] for row in engine.summary() if row["device"] == "cpu") if engine else 0
    del model, engine
    return peak, moved


@pytest.mark.parametrize("name", ["all_cpu", "layered"])
def test_peak_device_memory_drops_by_at_least_the_bytes_moved_off(name):
    resident_peak, _ = _peak_training_bytes(None)
    peak, moved = _peak_training_bytes(POLICIES[name])
    assert moved > 0
    assert resident_peak - peak >= moved, (resident_peak, peak, moved)


@pytest.mark.parametrize("settings", [
    {"model_dtype": "bf16", "optimizer_offload": True, "offload_policy": {"embedding": "cpu", "lm_head": "cpu"}},
    {"model_dtype": "bf16", "optimizer_offload": True, "dynamic_offload": {"enabled": True}},
], ids=["layered", "dynamic"])
@pytest.mark.parametrize("update", ["cpu", "gpu", "both"])
def test_a_delayed_update_runs_while_a_rollout_reads_the_weights_before_it(settings, update):
    """fsdp_config.delayed_update on CUDA, where the update runs on the engine's worker threads (the host's, the
    device path's, or both, auto's pick): a forward inside stale_reads gives the logits from before the
    update (resident and streamed layers alike), the first one after it those of the same run without the delay,
    to the bit."""
    def build(delayed: bool):
        model, engine = place(policy(SMALL).train(),
                              {**settings, "delayed_update": delayed, "optimizer_update": update})
        if "dynamic_offload" in settings:
            engine.set_transformer_layers_on_gpu(2)  # two resident, two streamed
        return model, engine

    ids = torch.randint(3, len(TOKENIZER), (4, 24), generator=torch.Generator().manual_seed(0)).to(CUDA)
    logits = logits_around_a_delayed_update(build, ids)
    assert torch.equal(logits["stale"], logits["before"]) and not torch.equal(logits["fresh"], logits["before"])
    assert torch.equal(logits["fresh"], logits["plain"])


@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_the_clipping_norm_takes_the_square_of_layers_kept_on_the_gpu_there(grad_dtype):
    """Layers dynamic offload keeps on the GPU add up a mini-batch's gradients there and send them once; the
    square of each is taken on the GPU as it goes, and the norm is the gradients' norm (the host ones read
    on the host). fp32 host gradients of a bf16 model add up on the host (engine.accumulating), so there
    is no device square to take: the norm is read on the host, and is the same."""
    model = policy(SMALL).train()
    settings = {"model_dtype": "bf16", "optimizer_offload": True, "offload_grad_dtype": grad_dtype,
                "dynamic_offload": {"enabled": True}}
    _, engine = place(model, settings)
    optimizer = engine.optimizer(lr=1e-3)
    ids = torch.randint(3, len(TOKENIZER), (4, 12), device=CUDA)
    with engine.accumulating():
        for half in ids.split(2):
            (model(input_ids=half, labels=half).loss / 2).backward()
    layers = engine.transformer_units
    assert engine.layers_on_gpu == len(layers)
    if grad_dtype == "bf16":
        assert all(unit.grad_square is not None and unit.grad_square.device.type == "cuda" for unit in layers)
    else:
        assert all(unit.grad_square is None for unit in layers)
    grads = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    expected = torch.linalg.vector_norm(torch.cat([grad.double().view(-1).cpu() for grad in grads]))
    torch.testing.assert_close(optimizer.clip_grad_norm_(1.0).double(), expected, rtol=1e-5, atol=0)
    optimizer.step()
    optimizer.zero_grad()
    assert all(unit.grad_square is None for unit in layers)
