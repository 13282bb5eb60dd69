"""The built-in tiny Qwen2-VL and its image processor: a prompt's <image> becomes as many vision tokens as the image
has merged patches, and what cannot be used is said in one line."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.models import load_critic, load_policy, load_tokenizer
from trainer.models.vision_language import IMAGE_PAD, VISION_END, VISION_START, ImageDataError, ImageProcessor
from trainer.rollout.budget import KVCacheShape

TINY_VL = "builtin:tiny-qwen2-vl"


def png(height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 128, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor() -> ImageProcessor:
    return ImageProcessor.load(TINY_VL, load_tokenizer(TINY_VL))


def test_each_image_becomes_one_token_per_two_by_two_patches(processor: ImageProcessor) -> None:
    # 56 x 112 pixels: 4 x 8 patches of 14, merged 2 x 2 -> 8 tokens; 56 x 56: 4 x 4 -> 4 tokens.
    prompt = [{"role": "user", "content": "<image> 1 <image> ="}]
    written, inputs = processor.prompt_inputs(prompt, [{"bytes": png(56, 112)}, png(56, 56)], "row 0")
    assert written == [{"role": "user", "content": f"{VISION_START}{IMAGE_PAD * 8}{VISION_END} 1 "
                                                   f"{VISION_START}{IMAGE_PAD * 4}{VISION_END} ="}]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]
    assert inputs["pixel_values"].shape == (32 + 16, 3 * 2 * 14 * 14)


def test_a_text_row_has_no_multi_modal_inputs(processor: ImageProcessor) -> None:
    assert processor.prompt_inputs("1 2 =", [], "row 3") == ("1 2 =", {})


def test_images_and_placeholders_that_do_not_pair_up_are_named(processor: ImageProcessor) -> None:
    with pytest.raises(ImageDataError, match=r"row 2: its prompt has 1 <image> and the row 2 images"):
        processor.prompt_inputs("<image> =", [png(56, 56), png(56, 56)], "row 2")


def test_an_unreadable_image_is_named(processor: ImageProcessor) -> None:
    with pytest.raises(ImageDataError, match="row 5: an image could not be read"):
        processor.prompt_inputs("<image> =", [{"bytes": b"not a png"}], "row 5")


def test_the_tiny_model_sees_its_images() -> None:
    tokenizer = load_tokenizer(TINY_VL)
    model = load_policy(TINY_VL, tokenizer, dtype=torch.float32, seed=0)
    processor = ImageProcessor.load(TINY_VL, tokenizer)
    logits = []
    for image in (np.zeros((56, 56, 3), dtype=np.uint8), np.full((56, 56, 3), 255, dtype=np.uint8)):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        prompt, inputs = processor.prompt_inputs("<image> 1 =", [buffer.getvalue()], "row 0")
        ids = tokenizer([prompt], return_tensors="pt").input_ids
        with torch.no_grad():
            logits.append(model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                **inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])


def test_a_vision_language_critic_is_the_policys_model_under_a_value_head() -> None:
    tokenizer = load_tokenizer(TINY_VL)
    critic = load_critic(TINY_VL, tokenizer, dtype=torch.float32, seed=0)
    policy = load_policy(TINY_VL, tokenizer, dtype=torch.float32, seed=0)
    assert critic.lm_head.weight.shape == (1, policy.config.get_text_config().hidden_size)
    # The same parameters, the policy's values but the head's.
    for (name, ours), (_, theirs) in zip(critic.named_parameters(), policy.named_parameters(), strict=True):
        assert name == "lm_head.weight" or torch.equal(ours, theirs), name
    ids = torch.tensor([[3, 4, 5, 6]])
    assert critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape == (1, 4, 1)


def test_the_rollout_budget_reads_the_language_models_shape() -> None:
    tokenizer = load_tokenizer(TINY_VL)
    config = load_policy(TINY_VL, tokenizer, dtype=torch.float32, seed=0).config
    # 2 layers x 2 key/value heads x 16 dims, keys and values, 10 tokens of fp32; plus one fp32 row of logits.
    assert KVCacheShape.of(config).bytes_per_sequence(10, 4) == 2 * 2 * 2 * 16 * 10 * 4 + 4 * len(tokenizer)


def test_a_qwen2_vl_directory_loads_with_its_image_processor(tmp_path) -> None:
    """A Qwen2-VL directory (what save_pretrained writes, as a downloaded Qwen2.5-VL holds): the model as a
    vision-language model with its weights, and the image processor of its preprocessor_config.json."""
    tokenizer = load_tokenizer(TINY_VL)
    model = load_policy(TINY_VL, tokenizer, dtype=torch.float32, seed=0)
    builtin = ImageProcessor.load(TINY_VL, tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    builtin.images.save_pretrained(tmp_path)
    loaded = load_policy(str(tmp_path), load_tokenizer(str(tmp_path)), dtype=torch.float32, seed=1)
    assert type(loaded).__name__ == "Qwen2VLForConditionalGeneration"
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(model.state_dict().values(),
                                                                 loaded.state_dict().values(), strict=True))
    processor = ImageProcessor.load(str(tmp_path), load_tokenizer(str(tmp_path)))
    image = png(56, 112)
    assert processor.prompt_inputs("<image> =", [image], "row 0")[0] == builtin.prompt_inputs("<image> =", [image],
                                                                                             "row 0")[0]
