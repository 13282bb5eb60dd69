"""PPO with GAE on a vision-language model (verl's geo3k PPO runs): the critic is the policy's vision-language model
with a value head, and its values are those of a forward that sees the row's images."""

from __future__ import annotations

import io
import math
from pathlib import Path

import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from tests.trainer.test_training_vision import make_vision_trainer
from trainer.loop import Trainer
from trainer.models.vision_language import TINY_MAX_PIXELS, TINY_MIN_PIXELS

PPO = ("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=1e-2")


def plain_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 images: list[bytes], response_length: int) -> torch.Tensor:
    """[B, R] the value head's output at the position before each response token, from one forward of the HF model
    with the images processed here."""
    processor = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS)
    processed = processor(images=[Image.open(io.BytesIO(png)).convert("RGB") for png in images], return_tensors="pt")
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=processed["pixel_values"],
                       image_grid_thw=processed["image_grid_thw"],
                       mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits
    return output[:, -response_length - 1:-1, 0].float()


def test_a_ppo_step_trains_a_vision_language_critic_on_the_images(tmp_path: Path) -> None:
    trainer: Trainer = make_vision_trainer(tmp_path, *PPO)
    assert trainer.critic is not None
    critic = trainer.critic.model
    before = {name: parameter.detach().clone() for name, parameter in critic.named_parameters()}
    trainer.fit()
    [metrics] = trainer.metrics_log.read()
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "critic/values/mean", "actor/pg_loss"):
        assert math.isfinite(metrics[key]), key
    changed = {name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
               for name, parameter in critic.named_parameters() if not torch.equal(parameter, before[name])}
    # The value head, the language model and the vision tower all train: the images reached the critic's update.
    assert {"visual", "language_model", "lm_head"} <= changed

    records = trainer.records[:2]
    batch = trainer.generation.generate(records, n=1)
    ours = trainer.critic.compute_values(batch)
    mask = batch.response_mask.bool()
    pngs = [record.images[0]["bytes"] for record in records]
    plain = plain_values(critic, batch.input_ids, batch.attention_mask, pngs, batch.response_ids.shape[1])
    torch.testing.assert_close(ours[mask], plain[mask], atol=1e-5, rtol=1e-4)
    # The values depend on the images: the same tokens with the two rows' images swapped are valued otherwise.
    swapped = batch.select([0, 1])
    swapped.multi_modal_inputs = batch.multi_modal_inputs[::-1]
    assert (trainer.critic.compute_values(swapped)[mask] - ours[mask]).abs().max() > 1e-5

