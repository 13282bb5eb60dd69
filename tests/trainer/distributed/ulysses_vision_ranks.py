"""One rank of the Ulysses checks on a vision-language model, run by torch.distributed.run (2 CPU ranks over gloo)
from test_ulysses_vision.py.

Each rank builds the built-in tiny Qwen2-VL (the actor's model, and the critic's: the same with a value head), a tiny
Qwen2.5-VL actor, and a rollout batch of prompts with images of two sizes and one without, left-padded, with
responses of several lengths.
The workers' forwards split by Ulysses (SequenceSplit: the images merged into the whole sequence's embeddings and
the multimodal positions computed before the decoder, whose inputs are cut to the rank's positions) are compared with
the same forwards of one process without Ulysses (response_logits). Each rank writes {check name: largest relative
difference} to OUT/rank<r>.json; the test asserts on them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ulysses_vision_ranks.py OUT
"""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from tests.trainer.distributed.ulysses_ranks import run_rank_checks
from trainer.algorithms import log_probs_and_entropy_from_logits
from trainer.distributed.ulysses import SequenceParallel
from trainer.models.loading import load_critic, load_policy, load_tokenizer
from trainer.models.vision_language import TINY_VL, ImageProcessor, tiny_qwen2_vl_config
from trainer.rollout.batch import RolloutBatch
from trainer.workers.optimization import response_logits
from trainer.workers.sequence_split import SequenceSplit

MODEL = "builtin:" + TINY_VL
RESPONSE = 5
FIRST_VISION_TOKEN = 17  # the tiny tokenizer's vision tokens and <image> are its last ids: responses use none


def difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the expected tensor's largest magnitude."""
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-12))


def png(width: int, height: int, seed: int) -> bytes:
    """A random-noise PNG (every patch differs, so the vision tower's output does too)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def vision_batch(with_images: bool = True) -> RolloutBatch:
    """Three rows: an image of 56 x 56 (4 vision tokens), one of 112 x 56 (8), and text alone, their prompts left-padded
    to one length and their responses of 5, 3 and 4 tokens right-padded (21 positions: the shards are padded too).
    Without `with_images`, every row is text alone (a batch of a vision-language run with no image in it)."""
    tokenizer = load_tokenizer(MODEL)
    processor = ImageProcessor.load(MODEL, tokenizer)
    rows = [("<image> : =", [png(56, 56, 1)]), ("1 <image> 2 + =", [png(112, 56, 2)]), ("1 2 3 + 4 =", [])]
    if not with_images:
        rows = [("1 2 =", []), ("1 2 3 4 + 5 =", []), ("1 2 3 + 4 =", [])]
    prompts, multi_modal = [], []
    for prompt, images in rows:
        written, inputs = processor.prompt_inputs(prompt, [{"bytes": image} for image in images], "a test row")
        prompts.append(tokenizer(written)["input_ids"])
        multi_modal.append(inputs)
    length = max(len(prompt) for prompt in prompts)
    prompt_ids = torch.tensor([[0] * (length - len(prompt)) + prompt for prompt in prompts])
    generator = torch.Generator().manual_seed(5)
    response_ids = torch.randint(1, FIRST_VISION_TOKEN, (len(rows), RESPONSE), generator=generator)
    response_mask = torch.ones(len(rows), RESPONSE)
    response_mask[1, 3:] = response_mask[2, 4:] = 0
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=(prompt_ids != 0).long(),
                        response_ids=response_ids.masked_fill(response_mask == 0, 0), response_mask=response_mask,
                        group_index=torch.arange(len(rows)), records=[None] * len(rows),
                        multi_modal_inputs=multi_modal)


def averaged_over_group(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """What FSDP2 over the (dp, sp) mesh does with the gradients when dp = 1: their mean over the group."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=sp.group)
            parameter.grad /= sp.size


def gradient_differences(sharded: torch.nn.Module, whole: torch.nn.Module, name: str) -> dict[str, float]:
    """The largest gradient difference over all parameters, over the vision tower's, and how large the vision
    tower's gradients are (so that a tower the loss does not reach cannot pass)."""
    pairs = [(name_, mine.grad, theirs.grad) for (name_, mine), theirs
             in zip(sharded.named_parameters(), whole.parameters(), strict=True)]
    vision = [(mine, theirs) for name_, mine, theirs in pairs if ".visual." in f".{name_}"]
    return {f"{name}/grads": max(difference(mine, theirs) for _, mine, theirs in pairs),
            f"{name}/vision_grads": max(difference(mine, theirs) for mine, theirs in vision),
            f"{name}/vision_grad_size": max(float(theirs.abs().max()) for _, theirs in vision)}


def tiny_qwen2_5_vl() -> torch.nn.Module:
    """A Qwen2.5-VL of the built-in Qwen2-VL's language model, with a two-block vision tower whose first block
    attends within windows (Qwen2.5-VL's own)."""
    tokenizer = load_tokenizer(MODEL)
    qwen2_vl = tiny_qwen2_vl_config(tokenizer)
    text = qwen2_vl.text_config.to_dict()
    vision = dict(depth=2, hidden_size=32, out_hidden_size=text["hidden_size"], num_heads=2, intermediate_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], in_channels=3)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=qwen2_vl.image_token_id,
                              video_token_id=qwen2_vl.video_token_id, tie_word_embeddings=False,
                              vision_start_token_id=qwen2_vl.vision_start_token_id,
                              vision_end_token_id=qwen2_vl.vision_end_token_id)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).float()


def actor_checks(sp: SequenceParallel, *, with_images: bool, checkpointing: bool,
                 kind: str = "qwen2_vl") -> dict[str, float]:
    """The actor's log-probs and entropies of the responses, and the gradients of a loss over them, split over the
    group against one process's padded forward."""
    batch = vision_batch(with_images)
    wanted = batch.response_mask.bool()
    tokenizer = load_tokenizer(MODEL)
    whole = (load_policy(MODEL, tokenizer, dtype=torch.float32, seed=0) if kind == "qwen2_vl"
             else tiny_qwen2_5_vl())
    sharded = copy.deepcopy(whole)
    split = SequenceSplit(sp, pad_token_id=tokenizer.pad_token_id)
    split.prepare(sharded)
    for model in (whole, sharded):
        model.train()
        if checkpointing:  # recomputation in backward runs outside the hook: the layers' inputs carry the group
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = torch.randn(*wanted.shape, generator=torch.Generator().manual_seed(4))

    whole_log_probs, whole_entropy = log_probs_and_entropy_from_logits(response_logits(whole, batch),
                                                                       batch.response_ids, 1.0, entropy_graph=True)
    ((whole_log_probs + 0.1 * whole_entropy) * weights * wanted).sum().backward()
    layer_lengths: list[int] = []  # the positions each decoder layer of the sharded model ran on
    sharded.model.language_model.layers[0].register_forward_hook(
        lambda module, args, output: layer_lengths.append(args[0].shape[1]))
    log_probs, entropy = split.log_probs_and_entropy(sharded, batch, 1.0, entropy=True, entropy_graph=True)
    assert entropy is not None
    ((log_probs + 0.1 * entropy) * weights * wanted).sum().backward()
    averaged_over_group(sharded, sp)

    name = (("actor/" if kind == "qwen2_vl" else f"actor/{kind}/") + ("images" if with_images else "text_only")
            + ("/checkpointing" if checkpointing else ""))
    results = {f"{name}/log_probs": difference(log_probs[wanted], whole_log_probs[wanted]),
               f"{name}/entropy": difference(entropy[wanted], whole_entropy[wanted]),
               f"{name}/sequence_length": batch.input_ids.shape[1], f"{name}/decoder_length": layer_lengths[0]}
    if with_images:
        results |= gradient_differences(sharded, whole, name)
        # The check can fail: the same tokens with another image in the first row give other log-probs.
        with torch.no_grad():
            other, _ = split.log_probs_and_entropy(sharded, another_first_image(batch), 1.0, entropy=False)
        results[f"{name}/another_image_control"] = difference(other[wanted], whole_log_probs[wanted])
    else:
        results[f"{name}/grads"] = max(difference(mine.grad, theirs.grad) for mine, theirs
                                       in zip(sharded.parameters(), whole.parameters(), strict=True)
                                       if theirs.grad is not None)
    return results


def another_first_image(batch: RolloutBatch) -> RolloutBatch:
    """`batch` with its first row's image replaced by another of the same size (its tokens stay right)."""
    tokenizer = load_tokenizer(MODEL)
    processor = ImageProcessor.load(MODEL, tokenizer)
    _, inputs = processor.prompt_inputs("<image>", [{"bytes": png(56, 56, 9)}], "a test row")
    other = batch.select(range(len(batch)))
    other.multi_modal_inputs = [inputs, *batch.multi_modal_inputs[1:]]
    return other


def critic_checks(sp: SequenceParallel) -> dict[str, float]:
    """The critic's values of the responses (a value head on the same vision-language model), and the gradients of
    a loss over them, split over the group against one process's padded forward."""
    batch = vision_batch()
    wanted = batch.response_mask.bool()
    tokenizer = load_tokenizer(MODEL)
    whole = load_critic(MODEL, tokenizer, dtype=torch.float32, seed=0)
    sharded = copy.deepcopy(whole)
    split = SequenceSplit(sp, pad_token_id=tokenizer.pad_token_id)
    split.prepare(sharded)
    weights = torch.randn(*wanted.shape, generator=torch.Generator().manual_seed(6))
    whole_values = response_logits(whole, batch).squeeze(-1)
    (whole_values * weights * wanted).sum().backward()
    values = split.values(sharded, batch)
    (values * weights * wanted).sum().backward()
    averaged_over_group(sharded, sp)
    return {"critic/values": difference(values[wanted], whole_values[wanted])} | gradient_differences(
        sharded, whole, "critic")


def vision_model_checks(sp: SequenceParallel) -> dict[str, float]:
    results: dict[str, float] = {}
    results |= actor_checks(sp, with_images=True, checkpointing=False)
    results |= actor_checks(sp, with_images=True, checkpointing=True)
    results |= actor_checks(sp, with_images=False, checkpointing=False)
    results |= actor_checks(sp, with_images=True, checkpointing=False, kind="qwen2_5_vl")
    results |= critic_checks(sp)
    return results


if __name__ == "__main__":
    run_rank_checks(Path(sys.argv[1]), vision_model_checks)
