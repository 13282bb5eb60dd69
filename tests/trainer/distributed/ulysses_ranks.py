"""One rank of the Ulysses checks, run by torch.distributed.run (2 CPU ranks over gloo) from test_ulysses.py.

Each rank compares sequence-parallel results (S = world size) with the same computation done whole on the
rank (S = 1), and writes {check name: largest relative difference} to OUT/rank<r>.json; the test asserts on
them. Every check runs in this one launch because starting ranks costs seconds on a small CPU machine.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ulysses_ranks.py OUT
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainer.algorithms import (
    compute_policy_loss,
    entropy_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    sum_pi_squared_from_logits,
)
from trainer.distributed.ulysses import SequenceParallel, sequence_parallel_mesh, use_ulysses_attention
from trainer.rollout.batch import RolloutBatch
from trainer.workers.optimization import response_logits
from trainer.workers.sequence_split import SequenceSplit

VOCABULARY, PROMPT, RESPONSE, BATCH = 32, 5, 6, 3  # 11 positions: not a multiple of 2, so shards are padded


@torch.no_grad()
def difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the expected tensor's largest magnitude."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-12))


def tiny_model(kind: str, key_value_heads: int) -> torch.nn.Module:
    settings = dict(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=key_value_heads, max_position_embeddings=64,
                    attn_implementation="sdpa", pad_token_id=0,
                    initializer_range=0.2)  # sharp attention: a wrong position or mask shows clearly
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**settings)).float()
    return LlamaForCausalLM(LlamaConfig(**settings)).float()


def padded_batch(response: int = RESPONSE) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses, as the trainer's rollout batches are."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCABULARY, (BATCH, PROMPT + response), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0          # a short prompt
    attention_mask[1, PROMPT + 3:] = 0  # a short response
    attention_mask[2, :1] = 0
    attention_mask[2, PROMPT + 5:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


# ------------------------------------------------------------------------------ attention alone


def attention_checks(sp: SequenceParallel, key_value_heads: int, padded: bool) -> dict[str, float]:
    """The registered attention on this rank's positions against SDPA over the whole sequence: outputs, and
    the gradients of the local queries, keys and values for a loss summed over all positions."""
    model = tiny_model("qwen2", key_value_heads)
    use_ulysses_attention(model)
    length = 12  # a multiple of the degree: the shards need no padding of their own
    batch = padded_batch(response=length - PROMPT)
    if not padded:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
        batch["position_ids"] = torch.arange(length).expand(BATCH, -1)
    shard = sp.shard(model, **batch)
    assert (shard.attention.mask is None) == (not padded)
    module = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(BATCH, 4, length, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(BATCH, key_value_heads, length, 8, generator=generator, requires_grad=True)
                  for _ in range(2))
    weights = torch.randn(BATCH, length, 4, 8, generator=generator)
    whole, _ = sdpa_attention_forward(module, query, key, value, shard.attention.mask, scaling=module.scaling)
    (whole * weights).sum().backward()

    local_length = length // sp.size
    part = slice(sp.rank * local_length, (sp.rank + 1) * local_length)
    local = [tensor.detach()[:, :, part].clone().requires_grad_() for tensor in (query, key, value)]
    attention = ALL_ATTENTION_FUNCTIONS["ulysses_sdpa"]
    output, _ = attention(module, *local, None, scaling=module.scaling, sequence_parallel=shard.attention)
    (output * weights[:, part]).sum().backward()
    # Without the exchange each rank would attend over its own positions only: the check must tell them apart.
    alone, _ = sdpa_attention_forward(module, *(tensor.detach() for tensor in local), None, scaling=module.scaling)
    try:  # the whole sequence's mask has no window: a sliding-window layer must be refused, not run wrong
        attention(module, *local, None, scaling=module.scaling, sliding_window=4, sequence_parallel=shard.attention)
        refused = 0.0
    except ValueError:
        refused = 1.0
    name = f"attention/kv{key_value_heads}/{'padded' if padded else 'causal'}"
    results = {f"{name}/output": difference(output, whole[:, part]),
               f"{name}/unsharded_control": difference(alone, whole[:, part].detach()),
               f"{name}/refuses_sliding_window": refused}
    for label, tensor, full in zip(("query", "key", "value"), local, (query, key, value), strict=True):
        results[f"{name}/grad_{label}"] = difference(tensor.grad, full.grad[:, :, part])
    return results


# ----------------------------------------------------------------------------- a training step


def policy_loss(log_probs: torch.Tensor, entropy: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The actor's PPO loss with an entropy bonus over the response positions (as trainer/workers/actor.py)."""
    window = slice(PROMPT - 1, PROMPT - 1 + RESPONSE)  # position t predicts token t + 1
    response_mask = batch["attention_mask"][:, PROMPT:].float()
    generator = torch.Generator().manual_seed(3)
    advantages = torch.randn(BATCH, RESPONSE, generator=generator)
    old_log_probs = log_probs[:, window].detach() + 0.3 * torch.randn(BATCH, RESPONSE, generator=generator)
    loss = compute_policy_loss(old_log_probs, log_probs[:, window], advantages, response_mask, 0.2, 0.2).loss
    return loss - 0.01 * masked_mean(entropy[:, window], response_mask)


def training_step_checks(sp: SequenceParallel, kind: str, key_value_heads: int,
                         checkpointing: bool) -> dict[str, float]:
    """One AdamW step of the tiny model with the sequence split over the group against the same step whole."""
    batch = padded_batch()
    labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))
    whole_model = tiny_model(kind, key_value_heads)
    sharded_model = copy.deepcopy(whole_model)
    use_ulysses_attention(sharded_model)
    for model in (whole_model, sharded_model):
        model.train()
        if checkpointing:  # recomputation in backward runs outside any context: the inputs must carry the group
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    logits = whole_model(**batch, use_cache=False).logits
    whole_log_probs = log_probs_from_logits(logits, labels)
    policy_loss(whole_log_probs, entropy_from_logits(logits), batch).backward()

    shard = sp.shard(sharded_model, **batch)
    embedded = []  # what an embedding kept on the CPU would gather rows for (sequence_parallel_offload)
    sharded_model.get_input_embeddings().register_forward_hook(lambda module, args, output: embedded.append(args[0]))
    local_logits = sharded_model(**shard.model_inputs(), use_cache=False).logits
    local_positions = slice(sp.rank * 12 // sp.size, (sp.rank + 1) * 12 // sp.size)
    assert torch.equal(embedded[0], torch.nn.functional.pad(batch["input_ids"], (0, 1))[:, local_positions])
    assert local_logits.shape[1] == 12 // sp.size  # the head ran on this rank's positions only
    log_probs = shard.log_probs(local_logits)
    policy_loss(log_probs, shard.gather(entropy_from_logits(local_logits)), batch).backward()
    for parameter in sharded_model.parameters():  # what FSDP2 over the (dp, sp) mesh does with dp = 1
        dist.all_reduce(parameter.grad, group=sp.group)
        parameter.grad /= sp.size

    name = f"step/{kind}/kv{key_value_heads}" + ("/checkpointing" if checkpointing else "")
    valid = batch["attention_mask"].bool()
    results = {f"{name}/log_probs": difference(log_probs[valid], whole_log_probs[valid])}
    pairs = list(zip(sharded_model.named_parameters(), whole_model.parameters(), strict=True))
    results[f"{name}/grads"] = max(difference(mine[1].grad, theirs.grad) for mine, theirs in pairs)
    # Plain SGD: AdamW's first step divides each gradient by its magnitude, which turns rounding noise in a
    # gradient that is zero in exact arithmetic (a key bias: softmax ignores shifts) into lr-sized differences.
    for model in (whole_model, sharded_model):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    results[f"{name}/parameters_after_step"] = max(difference(mine[1], theirs) for mine, theirs in pairs)
    return results


def rollout_batch() -> RolloutBatch:
    """padded_batch's sequences as the trainer's rollout batch: prompts of 3, 5 and 4 tokens, responses of 6, 3
    and 5 (an odd number of real tokens in all, 26, so the padding-free row's shards are padded too)."""
    batch = padded_batch()
    mask = batch["attention_mask"]
    return RolloutBatch(prompt_ids=batch["input_ids"][:, :PROMPT], prompt_mask=mask[:, :PROMPT],
                        response_ids=batch["input_ids"][:, PROMPT:], response_mask=mask[:, PROMPT:].float(),
                        group_index=torch.arange(BATCH), records=[None] * BATCH)


def padding_free_checks(sp: SequenceParallel, kind: str, key_value_heads: int) -> dict[str, float]:
    """The workers' padding-free forward split over the group (use_remove_padding with Ulysses: one packed row of
    the real tokens, its sequences kept apart by the position ids) against the one-rank padding-free forward:
    the responses' log-probs and entropies, and the gradients of a loss over them."""
    batch = rollout_batch()
    wanted = batch.response_mask.bool()
    whole_model = tiny_model(kind, key_value_heads)
    sharded_model = copy.deepcopy(whole_model)
    split = SequenceSplit(sp, pad_token_id=0, remove_padding=True)
    split.prepare(sharded_model)
    weights = torch.randn(BATCH, RESPONSE, generator=torch.Generator().manual_seed(4))

    whole_log_probs, whole_entropy = log_probs_and_entropy_from_logits(
        response_logits(whole_model, batch, remove_padding=True), batch.response_ids, 1.0, entropy_graph=True)
    ((whole_log_probs + 0.1 * whole_entropy) * weights * wanted).sum().backward()
    log_probs, entropy = split.log_probs_and_entropy(sharded_model, batch, 1.0, entropy=True, entropy_graph=True)
    assert entropy is not None
    ((log_probs + 0.1 * entropy) * weights * wanted).sum().backward()
    for parameter in sharded_model.parameters():
        dist.all_reduce(parameter.grad, group=sp.group)
        parameter.grad /= sp.size
    # The same forward over padded sequences (no packing) gives the same figures: the packed row's sequences
    # did not see each other.
    padded_log_probs, _ = SequenceSplit(sp, pad_token_id=0).log_probs_and_entropy(sharded_model, batch, 1.0,
                                                                                   entropy=False)
    # verl's calculate_sum_pi_squared on the split row: each rank's positions' sums, gathered.
    with torch.no_grad():
        whole_squares = sum_pi_squared_from_logits(response_logits(whole_model, batch, remove_padding=True))
        squares_log_probs, squares = split.log_probs_and_sum_pi_squared(sharded_model, batch, 1.0)
    name = f"padding_free/{kind}/kv{key_value_heads}"
    pairs = list(zip(sharded_model.parameters(), whole_model.parameters(), strict=True))
    results = {f"{name}/sum_pi_squared": difference(squares[wanted], whole_squares[wanted]),
               f"{name}/sum_pi_squared_log_probs": difference(squares_log_probs[wanted],
                                                              whole_log_probs[wanted].detach())}
    return results | {f"{name}/log_probs": difference(log_probs[wanted], whole_log_probs[wanted].detach()),
            f"{name}/entropy": difference(entropy[wanted], whole_entropy[wanted].detach()),
            f"{name}/padding_zero": float(log_probs[~wanted].abs().max()),
            f"{name}/against_padded": difference(padded_log_probs[wanted], whole_log_probs[wanted].detach()),
            f"{name}/grads": max(difference(mine.grad, theirs.grad) for mine, theirs in pairs)}


def run_rank_checks(out: Path, checks: Callable[[SequenceParallel], dict[str, float]]) -> None:
    """`checks` on a sequence-parallel group of every rank (gloo, deterministic algorithms), each rank's figures
    written to `out`/rank<N>.json; the scripts' main (this one's and ulysses_vision_ranks.py's)."""
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    mesh = sequence_parallel_mesh("cpu", dist.get_world_size(), dist.get_world_size())
    results = checks(SequenceParallel.from_mesh(mesh))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def text_model_checks(sp: SequenceParallel) -> dict[str, float]:
    results: dict[str, float] = {}
    for key_value_heads in (2, 1):  # 1 key-value head on 2 ranks: repeated so each rank holds one
        for padded in (False, True):
            results |= attention_checks(sp, key_value_heads, padded)
    results |= training_step_checks(sp, "qwen2", 2, checkpointing=False)
    results |= training_step_checks(sp, "llama", 1, checkpointing=False)
    results |= training_step_checks(sp, "qwen2", 2, checkpointing=True)
    results |= padding_free_checks(sp, "qwen2", 2)
    results |= padding_free_checks(sp, "llama", 1)
    return results


if __name__ == "__main__":
    run_rank_checks(Path(sys.argv[1]), text_model_checks)
