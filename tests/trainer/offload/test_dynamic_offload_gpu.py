"""Dynamic offload and out-of-memory recovery on a CUDA GPU: moving layers frees their device memory
and changes no number; a real CUDA out-of-memory error half-way through a backward is recovered.
(Passed on one H200, 2026-11-30.)"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.offload.test_offload_gpu import CUDA, MEDIUM, SMALL, TOKENIZER, place, policy
from tests.trainer.workers.test_oom_recovery import Loss, Memory, rollout_batch
from trainer.workers.optimization import run_updates

pytestmark = pytest.mark.gpu
DYNAMIC = {"dynamic_offload": {"enabled": True}}


def train(moves: list[int] | None, steps: int = 3):
    model, engine = place(policy(SMALL).train(), DYNAMIC)
    optimizer = engine.optimizer(lr=1e-3)
    ids = torch.randint(3, len(TOKENIZER), (4, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
    counts, losses = iter(moves or []), []
    for _ in range(steps):
        optimizer.zero_grad()
        for micro_batch in ids.split(2):
            if moves is not None:
                engine.set_transformer_layers_on_gpu(next(counts))
            loss = model(input_ids=micro_batch, labels=micro_batch).loss
            (loss / 2).backward()
            losses.append(loss.item())
        optimizer.step()
    engine.wait_for_updates()
    return losses, {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}, engine


def test_moving_layers_between_micro_batches_on_the_gpu_changes_no_number():
    expected_losses, expected_weights, _ = train(None)
    losses, weights, engine = train([0, 4, 2, 1, 3, 4])
    assert losses == expected_losses
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    assert engine.moves == {"to_cpu": 7, "to_gpu": 7}  # 4, 2 and 1 out; 4, 2 and 1 back


def test_moving_layers_to_the_cpu_frees_their_device_memory():
    wide = {"num_hidden_layers": MEDIUM.num_hidden_layers, "hidden_size": MEDIUM.hidden_size,
            "intermediate_size": MEDIUM.intermediate_size, "num_attention_heads": MEDIUM.num_attention_heads,
            "num_key_value_heads": MEDIUM.num_key_value_heads}
    model, engine = place(policy(wide).eval(), DYNAMIC)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.set_transformer_layers_on_gpu(0)
    freed = before - torch.cuda.memory_allocated()
    layers = len(engine.transformer_units)
    ring = min(engine.options.prefetch + 1, layers)  # streamed layers share these slots
    assert freed >= (layers - ring) * engine.layer_bytes - (1 << 20)
    engine.set_transformer_layers_on_gpu(layers)
    assert torch.cuda.memory_allocated() >= before - (1 << 20)
    ids = torch.randint(3, len(TOKENIZER), (2, 8), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        engine.set_transformer_layers_on_gpu(1)
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)


class RealOutOfMemory(Loss):
    """Loss whose failing call asks CUDA for an impossible allocation half-way through the backward."""

    def __call__(self, batch):
        self.calls += 1
        if self.calls != self.fail_on:
            return super().__call__(batch.to(CUDA))
        handle = self.model.model.layers[1].register_forward_hook(_allocate_in_backward)
        try:
            self.fail_on, self.calls = None, self.calls - 1
            return self(batch)
        finally:
            handle.remove()


def _allocate_in_backward(module, args, output):
    hidden = output[0] if isinstance(output, tuple) else output
    hidden.register_hook(lambda grad: torch.empty(1 << 50, dtype=torch.uint8, device=CUDA))


@pytest.mark.parametrize("relieve", [False, True], ids=["split", "offload_more"])
def test_a_real_cuda_oom_in_the_backward_is_recovered(relieve):
    results = []
    for fail_on in (None, 2):
        model, engine = place(policy(SMALL, dtype=torch.float32).train(), DYNAMIC)
        optimizer = engine.optimizer(lr=1e-3)
        metrics = run_updates(
            model, optimizer, rollout_batch(), RealOutOfMemory(model, fail_on), mini_batch_size=4, micro_batch_size=2,
            epochs=1, grad_clip=1.0, shuffle_generator=None,
            memory=Memory(engine, (lambda engine=engine: engine.set_transformer_layers_on_gpu(2) != (0, 0)) if relieve
                          else None))
        engine.wait_for_updates()
        results.append((metrics, {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}))
    (expected, expected_weights), (metrics, weights) = results
    assert metrics["oom_recoveries"] == [1.0]
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-4, atol=2e-5)
