"""Per-phase placement and dynamic offload on a CUDA GPU: a decode copies the kept head once, not
at every token; under a memory cap at which the all-GPU run fails with out-of-memory, the same run
completes with dynamic offload, and lowering the threshold through the settings path moves layers
within one step."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from tests.trainer.offload.test_dynamic_offload import ThresholdChange
from tests.trainer.offload.test_offload_gpu import CUDA, MEDIUM, place
from tests.trainer.test_training import FakeDaemonLink
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.offload.copies import H2D

pytestmark = pytest.mark.gpu

LAYERED = {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}
# 8 layers of 15 M parameters: in fp32 with AdamW on the GPU the actor and the critic need about 4 GB.
WIDE = ("{num_hidden_layers: 8, hidden_size: 1024, intermediate_size: 4096, num_attention_heads: 8, "
        "num_key_value_heads: 2}")
CAP_BYTES = 1 << 30


def medium_model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(MEDIUM).to(torch.bfloat16).eval()


def test_a_decode_copies_the_kept_head_once_and_samples_as_the_all_gpu_model():
    reference = medium_model().to(CUDA)
    model, engine = place(medium_model(), LAYERED)
    prompt = torch.randint(3, MEDIUM.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)

    def generate(network):
        torch.manual_seed(0)
        return network.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=24, min_new_tokens=24, pad_token_id=0, eos_token_id=None)

    expected = generate(reference)
    head = engine.stageable_bytes()["lm_head"]
    before = engine.copied_bytes().get((H2D, "lm_head"), 0)
    with engine.placed_for("rollout") as kept:
        got = generate(model)
    assert kept == ["lm_head", "embedding"]
    assert engine.copied_bytes()[(H2D, "lm_head")] - before == head  # streamed, it would be 24 times that
    assert torch.equal(got, expected)


def capped_trainer(tmp_path, name: str, *overrides: str) -> Trainer:
    config = load_config("examples/quickstart.yaml", [
        "trainer.device=cuda", f"actor_rollout_ref.model.override_config={WIDE}", "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=4", f"trainer.runs_dir={tmp_path}", f"trainer.experiment_name={name}",
        *overrides])
    return Trainer(config, log=print, telemetry=FakeDaemonLink())


@pytest.fixture
def memory_cap():
    """The process may use CAP_BYTES of the device (torch.cuda.set_per_process_memory_fraction)."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)
    try:
        yield CAP_BYTES
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_under_a_memory_cap_the_all_gpu_run_fails_and_the_dynamic_one_completes(tmp_path, memory_cap):
    failed = False
    try:
        capped_trainer(tmp_path, "all-gpu").fit()
    except torch.OutOfMemoryError:
        failed = True  # (not pytest.raises: its record of the error would keep the run's tensors alive)
    assert failed, "the all-GPU run fitted under the cap: the cap is not tight"
    gc.collect()
    torch.cuda.empty_cache()

    dynamic = "fsdp_config.dynamic_offload.enabled=true"
    trainer = capped_trainer(tmp_path, "dynamic", f"actor_rollout_ref.actor.{dynamic}", f"critic.{dynamic}",
                             "dynamic_offload.gpu_memory_threshold=0.85")
    engines = trainer.memory.dynamic_engines
    assert len(engines) == 2
    started = [engine.layers_on_gpu for engine in engines]
    assert 0 < sum(started) < 16  # some on the GPU, not all

    # The first step learns what each phase needs, the second plans for it; then the threshold drops.
    trainer.observers.append(ThresholdChange(trainer, trainer.control.telemetry, after_step=2, threshold=0.3))
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert len(rows) == 4 and all(row["perf/oom_recoveries"] == 0 for row in rows[1:])
    # Step 3 runs after the change: its phases plan again, with fewer layers on the GPU.
    assert rows[2]["offload/moves_to_cpu"] > 0, rows[2]


def test_training_with_the_head_kept_matches_streaming_it_and_copies_it_once_a_step():
    from tests.trainer.offload.test_offload_gpu import SMALL, SMALL_CHUNKS, TOKENIZER, policy

    def train(keep: bool):
        model, engine = place(policy(SMALL).train(), LAYERED)
        optimizer = engine.optimizer(lr=1e-3)
        ids = torch.randint(3, len(TOKENIZER), (4, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
        losses = []
        with engine.placed_for("training") if keep else contextlib.nullcontext():
            for _ in range(3):
                optimizer.zero_grad()
                for micro_batch in ids.split(2):
                    loss = model(input_ids=micro_batch, labels=micro_batch).loss
                    (loss / 2).backward()
                    losses.append(loss.item())
                optimizer.step()
            engine.wait_for_updates()
        weights = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}
        return losses, weights, engine

    assert SMALL_CHUNKS.head_chunk_bytes < (1 << 30)  # place() streams the head in chunks
    expected_losses, expected_weights, _ = train(keep=False)
    losses, weights, engine = train(keep=True)
    assert losses == pytest.approx(expected_losses, rel=2e-2)
    torch.testing.assert_close(weights, expected_weights, rtol=2e-2, atol=3e-3)
    head = engine.stageable_bytes()["lm_head"]
    assert engine.copied_bytes()[(H2D, "lm_head")] == 3 * head  # once a step (the first, then after each update)
