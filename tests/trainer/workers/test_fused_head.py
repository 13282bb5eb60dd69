"""actor_rollout_ref.model.use_fused_kernels through the workers: the actor's update, its old log-probs and the
reference's log-probs from the fused head (trainer/models/fused_head.py) equal the logits' path, padded and packed,
at a temperature other than 1, with an entropy bonus and without, with LoRA (a frozen head), through the offload
engine's head streamed from the CPU; and a model whose head cannot is named in one line."""

from __future__ import annotations

import pytest
import torch

import trainer.algorithms.fused_head as fused_head_arithmetic
from tests.trainer.offload.test_offload import TOKENIZER
from tests.trainer.workers.test_packing import actor_gradients, ragged_batch
from trainer.config import ActorConfig, FSDPConfig
from trainer.models import load_policy
from trainer.models.fused_head import FusedScoring, fused_head_blocker
from trainer.models.lora import LoraSettings, with_adapter
from trainer.offload import OffloadOptions
from trainer.offload.rows import StreamedHeadRows
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import Actor, compute_log_probs

VOCABULARY = 600  # rows of the head beyond the tokenizer's 17: the labels below reach all of them
SHAPE = {"num_hidden_layers": 2, "vocab_size": VOCABULARY}
TEMPERATURE = 0.7
TOLERANCE = {"rtol": 1e-5, "atol": 2e-5}


@pytest.fixture(autouse=True)
def several_tiles(monkeypatch):
    """The head read in chunks of 128 rows and tiles of 1000 logits, as a 152k vocabulary is read on a GPU."""
    monkeypatch.setattr(fused_head_arithmetic, "HEAD_ROWS_PER_CHUNK", 128)
    monkeypatch.setattr(fused_head_arithmetic, "TILE_ELEMENTS", 1000)


def policy(**overrides) -> torch.nn.Module:
    return load_policy("builtin:tiny-qwen2", TOKENIZER, seed=1, dtype=torch.float32,
                       override_config={**SHAPE, **overrides})


def wide_batch(seed: int = 0) -> RolloutBatch:
    """The ragged batch, its real tokens drawn from the head's whole vocabulary."""
    batch = ragged_batch(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for ids, mask in ((batch.prompt_ids, batch.prompt_mask), (batch.response_ids, batch.response_mask)):
        real = mask.bool()
        ids[real] = torch.randint(3, VOCABULARY, (int(real.sum()),), generator=generator)
    return batch


def actor_for(model, *, fused: bool, remove_padding: bool = False, memory=None, **config) -> Actor:
    settings = {"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 2, "clip_ratio": 10.0,
                "use_torch_compile": False, **config}
    return Actor(model, ActorConfig.model_validate(settings), temperature=TEMPERATURE, rollout_n=1,
                 log_prob_micro_batch_size=3, total_steps=1, seed=1, memory=memory, remove_padding=remove_padding,
                 fused_head=fused)


def head_widths(model: torch.nn.Module) -> list[int]:
    """The last dimension of each output of the model's head from now on: V for logits, 2 for fused figures."""
    widths: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, output: widths.append(output.shape[-1]))
    return widths


def loss_and_metrics(actor: Actor, batch: RolloutBatch) -> tuple[float, dict[str, float]]:
    loss, metrics = actor._loss(batch)
    assert isinstance(loss, torch.Tensor)
    return loss.item(), metrics


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01], ids=["entropy_metric", "entropy_bonus"])
def test_the_fused_actor_gives_the_unfused_log_probs_loss_metrics_and_gradients(remove_padding, entropy_coeff):
    batch = wide_batch()
    unfused = actor_for(policy(), fused=False, remove_padding=remove_padding, entropy_coeff=entropy_coeff)
    fused = actor_for(policy(), fused=True, remove_padding=remove_padding, entropy_coeff=entropy_coeff)
    widths = head_widths(fused.model)
    expected = unfused.compute_log_probs(batch)
    torch.testing.assert_close(fused.compute_log_probs(batch), expected, **TOLERANCE)
    batch.old_log_probs = expected + 0.05 * batch.response_mask
    loss, metrics = loss_and_metrics(fused, batch)
    expected_loss, expected_metrics = loss_and_metrics(unfused, batch)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert metrics == pytest.approx(expected_metrics, rel=1e-5, abs=1e-6)
    gradients, expected_gradients = actor_gradients(fused, batch, 2), actor_gradients(unfused, batch, 2)
    assert gradients.keys() == expected_gradients.keys() and "lm_head.weight" in gradients
    torch.testing.assert_close(gradients, expected_gradients, rtol=1e-4, atol=1e-6)
    assert widths and set(widths) == {2}, "every forward of the fused actor went through the fused head"


def test_the_reference_and_old_log_probs_without_gradients_are_the_unfused_ones():
    model, batch = policy(), wide_batch(3)
    widths = head_widths(model)
    with torch.no_grad():
        expected = compute_log_probs(model, batch, micro_batch_size=4, temperature=1.3)
        got = compute_log_probs(model, batch, micro_batch_size=4, temperature=1.3, fused_head=True)
    assert widths == [VOCABULARY, VOCABULARY, 2, 2]
    torch.testing.assert_close(got, expected, **TOLERANCE)


def test_with_lora_the_frozen_heads_fused_update_gives_the_adapters_unfused_gradients():
    batch = wide_batch(1)
    settings = LoraSettings(rank=4, alpha=8, target_modules="all-linear", exclude_modules=None, setting="lora",
                            adapter_path=None)
    models = [with_adapter(policy(), settings, role="actor", seed=2)[0] for _ in range(2)]
    assert not models[0].get_output_embeddings().weight.requires_grad, "all-linear leaves the head frozen"
    assert fused_head_blocker(models[0]) is None
    unfused = actor_for(models[0], fused=False, entropy_coeff=0.01)
    fused = actor_for(models[1], fused=True, entropy_coeff=0.01)
    batch.old_log_probs = unfused.compute_log_probs(batch) + 0.05 * batch.response_mask
    widths = head_widths(models[1])
    gradients, expected = actor_gradients(fused, batch, 3), actor_gradients(unfused, batch, 3)
    assert widths == [2, 2]
    assert expected and all("lora_" in name for name in expected)
    torch.testing.assert_close(gradients, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("placement", "tied", "streamed"), [
    ({"offload_policy": {"lm_head": "cpu"}}, False, True),
    ({"param_offload": True}, False, True),
    ({"offload_policy": {"lm_head": "cpu"}, "optimizer_offload": True}, False, True),
    ({"param_offload": True}, True, True),  # the embedding's rows gathered, the same weight streamed as the head
    ({"optimizer_offload": True}, False, False),  # the head in a device slot the engine's hooks swap in
], ids=["head_on_cpu", "all_on_cpu", "head_and_masters_on_cpu", "tied_all_on_cpu", "head_hooked_on_device"])
def test_through_the_offload_engine_the_fused_update_gives_the_resident_numbers(placement, tied, streamed,
                                                                               monkeypatch):
    """A head the engine streams in chunks of 64 rows (its own forward, routed by the engine): the fused forward
    and backward read each chunk once and send each chunk's weight gradient to the host. A head the engine keeps in
    a device slot: the swapped forward reads the weight its hooks put in place."""
    from tests.trainer.test_memory import Run
    from trainer.memory import MemoryManager

    monkeypatch.setattr(MemoryManager, "_options", lambda self: OffloadOptions(head_chunk_bytes=64 * 64 * 4))
    chunks_read: list[int] = []
    streamed_chunks = StreamedHeadRows.chunks

    def counted(self, weight, *, backward):
        for first, chunk in streamed_chunks(self, weight, backward=backward):
            chunks_read.append(first)
            yield first, chunk

    monkeypatch.setattr(StreamedHeadRows, "chunks", counted)
    batch = wide_batch(2)
    resident = actor_for(policy(tie_word_embeddings=tied), fused=False, entropy_coeff=0.01)
    run = Run()
    model = run.memory.place(policy(tie_word_embeddings=tied), FSDPConfig.model_validate(placement), "actor")
    chunked = [unit for unit in run.memory.engine("actor").layout.units if unit.blocks and unit.blocks[0].rows]
    assert [len(unit.blocks) for unit in chunked] == ([VOCABULARY // 64 + 1] if streamed else [])
    offloaded = actor_for(model, fused=True, memory=run.memory.for_role("actor"), entropy_coeff=0.01)
    widths = head_widths(model)
    expected = resident.compute_log_probs(batch)
    torch.testing.assert_close(offloaded.compute_log_probs(batch), expected, **TOLERANCE)
    batch.old_log_probs = expected + 0.05 * batch.response_mask
    resident_metrics, offloaded_metrics = resident.update(batch), offloaded.update(batch)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert offloaded_metrics[key] == pytest.approx(resident_metrics[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(dict(offloaded.model.state_dict()), dict(resident.model.state_dict()),
                               rtol=1e-5, atol=1e-6)
    assert widths == [2] * 5, "two scoring forwards and three micro-batches' forwards, each fused"
    # Each scoring forward reads the 10 chunks once; each micro-batch's forward and backward, once each way.
    rows = list(range(0, VOCABULARY, 64))
    assert chunks_read == ((rows * 2 + (rows + rows[::-1]) * 3) if streamed else [])


def test_an_update_of_long_responses_makes_no_tensor_of_the_logits_size(monkeypatch):
    """Two sequences of 200 response tokens and a 4096-token vocabulary: the logits would be 1.6M elements, more than
    anything else the forward and backward make (the embedding's 262k, attention's 2 x 4 x 206^2 scores)."""
    from tests.trainer.algorithms.test_fused_head import LargestOutput

    monkeypatch.setattr(fused_head_arithmetic, "HEAD_ROWS_PER_CHUNK", 1024)
    monkeypatch.setattr(fused_head_arithmetic, "TILE_ELEMENTS", 1 << 16)
    vocabulary, prompt, response = 4096, 6, 200
    generator = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.randint(3, vocabulary, (2, prompt), generator=generator),
                         prompt_mask=torch.ones(2, prompt, dtype=torch.long),
                         response_ids=torch.randint(3, vocabulary, (2, response), generator=generator),
                         response_mask=torch.ones(2, response), group_index=torch.arange(2),
                         records=ragged_batch().records[:2])
    batch.advantages = torch.randn(2, response, generator=generator)
    logits_size = 2 * response * vocabulary
    largest = {}
    for fused in (False, True):
        actor = actor_for(policy(vocab_size=vocabulary), fused=fused, entropy_coeff=0.01)
        with LargestOutput() as probe:
            loss, _ = actor._loss(batch)
            loss.backward()
        largest[fused] = probe.largest
    assert largest[False] >= logits_size, "the probe sees the unfused path's logits"
    assert largest[True] < logits_size / 4, largest


def test_a_model_whose_head_cannot_be_fused_is_named_in_one_line():
    assert fused_head_blocker(policy()) is None
    assert fused_head_blocker(policy(), sequence_parallel=True) == (
        "the sequence-parallel forward (Ulysses) computes each shard's log-probs from its logits")
    capped = policy()
    capped.config.final_logit_softcapping = 30.0
    assert fused_head_blocker(capped) == "its config's final_logit_softcapping=30.0 changes the logits after the head"
    vision = load_policy("builtin:tiny-qwen2-vl", TOKENIZER, seed=1, dtype=torch.float32)
    assert fused_head_blocker(vision) == "a vision-language model's forward is not fused here"


def test_the_heads_own_forward_is_back_after_the_fused_one():
    model = policy()
    head = model.get_output_embeddings()
    ids = torch.randint(3, VOCABULARY, (2, 5))
    with FusedScoring(1.0).around(model, ids):
        assert model(input_ids=ids).logits.shape == (2, 5, 2)
    assert "forward" not in head.__dict__ and model(input_ids=ids).logits.shape == (2, 5, VOCABULARY)
