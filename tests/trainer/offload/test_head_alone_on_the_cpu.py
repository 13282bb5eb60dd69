"""A head streamed in chunks while every other group stays on the device: a forward without gradients reads its
current weights. A "steady" forward (no gradients, every hooked block in a device slot of its own) skipped the
copy checks of every block it acquired, the head's chunks too, which no hook or gathered embedding had fetched:
the rollout read an empty chunk slot (logits of 1e33, GRPO's step 1 without a gradient), or after an update the
chunk of the weights before it."""

from __future__ import annotations

import pytest
import torch

from trainer.config import FSDPConfig
from trainer.models import load_policy, load_tokenizer
from trainer.offload import attach_offload

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")


def logits_before_and_after_an_update(settings: dict) -> list[torch.Tensor]:
    """No-grad logits of a batch, then one step of the engine's AdamW on its loss, then the no-grad logits again."""
    model = load_policy("builtin:tiny-qwen2", TOKENIZER, seed=1, dtype=torch.float32)
    engine = attach_offload(model, FSDPConfig.model_validate(settings), "cpu", role="actor")
    optimizer = engine.optimizer(lr=1e-2)
    ids = torch.randint(3, len(TOKENIZER), (2, 6), generator=torch.Generator().manual_seed(0))
    seen = []
    with torch.no_grad():
        seen.append(model(input_ids=ids).logits)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with torch.no_grad():
        seen.append(model(input_ids=ids).logits)
    return seen


@pytest.mark.parametrize("settings", [{"offload_policy": {"lm_head": "cpu"}},
                                      {"offload_policy": {"lm_head": "cpu"}, "optimizer_offload": True}],
                         ids=["head_alone", "head_and_masters_on_the_host"])
def test_a_no_grad_forward_reads_the_current_head_when_only_the_head_streams(settings):
    resident = logits_before_and_after_an_update({})  # every group on the device: the same AdamW
    offloaded = logits_before_and_after_an_update(settings)
    assert not torch.equal(resident[0], resident[1]), "the update changes the logits"
    for step, (got, expected) in enumerate(zip(offloaded, resident, strict=True)):
        assert torch.equal(got, expected), f"forward {step}: off by {(got - expected).abs().max()}"
