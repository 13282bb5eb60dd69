"""The offload engine on the CPU: the CPU plays the device, so every copy is a real copy between a
host arena and a device slot, and offloaded runs must give the numbers of resident runs."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable

import pytest
import torch

from trainer.algorithms import compute_value_loss, kl_penalty, log_probs_from_logits
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import FSDPConfig
from trainer.config.ipc import MAX_MESSAGE_BYTES, encode
from trainer.config.messages import CopyCount
from trainer.models import load_critic, load_policy, load_reward_model, load_tokenizer
from trainer.offload import (
    GROUPS,
    HostMemoryError,
    OffloadEngine,
    OffloadOptions,
    UnsupportedModel,
    attach_offload,
    format_bytes,
    offload_message,
)
from trainer.offload.copies import MAX_RECORDS_PER_DRAIN, TIMED_COPIES_PER_DRAIN, CopyLog
from trainer.offload.layout import storage_bytes

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
FOUR_LAYERS = {"num_hidden_layers": 4}
# One chunk for the head: its input gradient is then one matrix product, as on a resident model.
WHOLE_HEAD = OffloadOptions(head_chunk_bytes=1 << 30)

POLICIES = {
    "all_gpu": {},
    "all_cpu": {"param_offload": True},
    "layered": {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}},
    "transformer_cpu": {"offload_policy": {"transformer": "cpu", "norm": "cpu"}},
    "optimizer_offload": {"optimizer_offload": True},
    "all_cpu_optimizer_offload": {"param_offload": True, "optimizer_offload": True},
    "cpu_except_head": {"param_offload": True, "offload_policy": {"lm_head": "gpu"}},
}


def policy(**overrides) -> torch.nn.Module:
    overrides.setdefault("override_config", FOUR_LAYERS)
    overrides.setdefault("dtype", torch.float32)
    return load_policy("builtin:tiny-qwen2", TOKENIZER, seed=1, **overrides)


def offloaded(model, settings: dict, role: str = "actor", options: OffloadOptions = WHOLE_HEAD):
    return attach_offload(model, FSDPConfig.model_validate(settings), "cpu", role=role, options=options)


def token_batch(rows: int = 4, length: int = 10, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(TOKENIZER), (rows, length), generator=generator)


def train(settings: dict, *, steps: int = 3, options: OffloadOptions = WHOLE_HEAD,
          before_micro_batch: Callable[[OffloadEngine], None] | None = None, **model_overrides):
    """Steps of AdamW over two micro-batches each, as the actor's update runs them; the losses and
    the final weights. zero_grad alternates between dropping and zeroing the gradients.
    `before_micro_batch` runs at the safe point before each micro-batch (dynamic offload moves there)."""
    model = policy(**model_overrides).train()
    engine = offloaded(model, settings, options=options)
    optimizer = engine.optimizer(lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    ids = token_batch()
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        for micro_batch in ids.split(2):
            if before_micro_batch is not None:
                before_micro_batch(engine)
            loss = model(input_ids=micro_batch, labels=micro_batch).loss
            (loss / 2).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return losses, weights, engine


@pytest.fixture(scope="module")
def resident_run():
    return train({})


@pytest.mark.parametrize("name", list(POLICIES))
def test_offloaded_training_gives_the_resident_losses_and_weights(name, resident_run):
    losses, weights, engine = train(POLICIES[name])
    expected_losses, expected_weights, _ = resident_run
    assert losses == pytest.approx(expected_losses, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    placed = {row["group"]: row["placement"] for row in engine.summary()}
    config = FSDPConfig.model_validate(POLICIES[name])
    assert placed == {group: config.placement(group) for group in GROUPS}


def test_the_cpu_update_overlapping_the_next_forward_gives_the_same_weights(resident_run):
    _, weights, _ = train(POLICIES["all_cpu_optimizer_offload"],
                          options=OffloadOptions(head_chunk_bytes=1 << 30, pipelined_update=True))
    torch.testing.assert_close(weights, resident_run[1], rtol=1e-6, atol=1e-7)


def test_clipping_inside_the_update_matches_clip_grad_norm():
    """OffloadAdamW.clip_grad_norm_ leaves the gradients alone and scales them inside the fused
    update: the same weights as torch.nn.utils.clip_grad_norm_ followed by the step."""
    results = []
    for clip_inside in (False, True):
        model = policy().train()
        optimizer = offloaded(model, POLICIES["all_cpu_optimizer_offload"]).optimizer(lr=1e-3)
        for step in range(2):
            optimizer.zero_grad()
            ids = token_batch(seed=step)
            model(input_ids=ids, labels=ids).loss.backward()
            if clip_inside:
                norm = optimizer.clip_grad_norm_(0.05)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert norm > 0.05  # the clipping binds
            optimizer.step()
        optimizer.wait()
        results.append((norm, dict(model.state_dict())))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


def test_the_norm_of_bf16_host_gradients_is_their_fp32_norm_slice_by_slice():
    model = policy(dtype=torch.bfloat16).train()
    optimizer = offloaded(model, BF16_HOST_GRADS).optimizer(lr=1e-3)
    optimizer.slice_elements = 100  # many slices per tensor, the last one of each short
    ids = token_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [parameter.grad for parameter in model.parameters()]
    assert all(grad.dtype == torch.bfloat16 and grad.device.type == "cpu" for grad in grads)
    expected = torch.linalg.vector_norm(torch.cat([grad.double().view(-1) for grad in grads]))
    norm = optimizer.clip_grad_norm_(1.0)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), expected, rtol=1e-6, atol=0)
    assert optimizer._squares._scratch.numel() == 100
    assert all(parameter.grad is grad for parameter, grad in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunked_head", [False, True], ids=["whole_head", "chunked_head"])
@pytest.mark.parametrize("name", ["all_cpu", "layered", "all_cpu_optimizer_offload"])
def test_two_forwards_before_one_backward_add_up_every_gradient(name, chunked_head, tied):
    """A parameter that gets two gradients in one backward (its forward ran twice) gets their sum,
    as a resident model's does: the head's second piece is added, not copied over the first (nor
    over the embedding rows' gradient, when the head is the embedding)."""
    ids, other = token_batch(seed=0), token_batch(seed=1)
    config = {**FOUR_LAYERS, "tie_word_embeddings": tied}
    resident = policy(override_config=config).train()
    (resident(input_ids=ids, labels=ids).loss + resident(input_ids=other, labels=other).loss).backward()
    model = policy(override_config=config).train()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    chunks = OffloadOptions(head_chunk_bytes=4 * 64 * 4)  # four vocabulary rows a chunk
    offloaded(model, POLICIES[name], options=chunks if chunked_head else WHOLE_HEAD)
    (model(input_ids=ids, labels=ids).loss + model(input_ids=other, labels=other).loss).backward()
    for (parameter_name, parameter), expected in zip(model.named_parameters(), resident.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad.float(), expected.grad, rtol=1e-4, atol=1e-6, msg=parameter_name)


def test_a_head_streamed_in_chunks_changes_only_rounding(resident_run):
    chunks = OffloadOptions(head_chunk_bytes=4 * 64 * 4)  # four vocabulary rows a chunk
    losses, weights, engine = train(POLICIES["all_cpu"], options=chunks)
    head = next(unit for unit in engine.units if unit.group == "lm_head")
    assert len(head.blocks) == -(-len(TOKENIZER) // 4)
    assert losses == pytest.approx(resident_run[0], rel=1e-5)
    torch.testing.assert_close(weights, resident_run[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("settings", [POLICIES["all_cpu"], POLICIES["layered"], POLICIES["optimizer_offload"]],
                         ids=["all_cpu", "layered", "optimizer_offload"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gradient_checkpointing_and_tied_embeddings_train_as_resident(settings, tied):
    config = {**FOUR_LAYERS, "tie_word_embeddings": tied}
    expected_losses, expected_weights, _ = train({}, override_config=config, gradient_checkpointing=True)
    losses, weights, engine = train(settings, override_config=config, gradient_checkpointing=True)
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    # A tied weight's two gradients (head and embedding) are summed in another order across micro-batches.
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    if tied:
        lines = engine.summary_lines()
        assert "LM head: tied to the embedding" in lines


def test_an_actor_a_reference_and_a_critic_with_different_policies_compute_together():
    """PPO's pieces in one computation: the actor fully offloaded, the reference layered, the critic's
    transformer on the CPU: the same losses and gradients as three resident models."""

    def step(actor_settings, reference_settings, critic_settings):
        actor = policy()
        reference = policy().eval().requires_grad_(False)
        critic = load_critic("builtin:tiny-qwen2", TOKENIZER, dtype=torch.float32, seed=1,
                             override_config=FOUR_LAYERS).eval()
        offloaded(actor, actor_settings)
        offloaded(reference, reference_settings, role="ref")
        offloaded(critic, critic_settings, role="critic")
        ids = token_batch(rows=3, length=9, seed=4)
        logits = actor(input_ids=ids).logits[:, :-1]
        log_probs = log_probs_from_logits(logits, ids[:, 1:])
        with torch.no_grad():
            reference_log_probs = log_probs_from_logits(reference(input_ids=ids).logits[:, :-1], ids[:, 1:])
        values = critic(input_ids=ids).logits.squeeze(-1)[:, :-1]
        mask = torch.ones_like(log_probs)
        kl = kl_penalty(log_probs, reference_log_probs, "low_var_kl").mean()
        value_loss, _ = compute_value_loss(values, values.detach() + 0.1, log_probs.detach(), mask,
                                           cliprange_value=0.2, loss_agg_mode="token-mean")
        (kl + value_loss).backward()
        grads = {f"actor.{name}": p.grad.clone() for name, p in actor.named_parameters()}
        grads |= {f"critic.{name}": p.grad.clone() for name, p in critic.named_parameters()}
        return kl.item(), value_loss.item(), grads

    expected = step({}, {}, {})
    mixed = step(POLICIES["all_cpu"], POLICIES["layered"], {"offload_policy": {"transformer": "cpu"}})
    assert mixed[:2] == pytest.approx(expected[:2], rel=1e-6)
    torch.testing.assert_close(mixed[2], expected[2], rtol=1e-6, atol=1e-7)


def test_the_summary_reports_each_groups_place_and_parameter_bytes():
    reference = policy()
    expected = {group: 0 for group in GROUPS}
    for name, parameter in reference.named_parameters():
        group = ("embedding" if "embed_tokens" in name else "transformer" if ".layers." in name
                 else "norm" if name == "model.norm.weight" else "lm_head")
        expected[group] += parameter.numel() * parameter.element_size()
    engine = offloaded(policy(), POLICIES["layered"])
    summary = engine.summary()
    assert {row["group"]: row["bytes"] for row in summary} == expected
    assert {row["group"]: row["placement"] for row in summary} == {
        "embedding": "cpu", "transformer": "gpu", "norm": "gpu", "lm_head": "cpu"}
    assert {row["role"] for row in summary} == {"actor"}
    lines = engine.summary_lines()
    assert f"Embedding: OFFLOADED to CPU ({expected['embedding'] / 1024:.2f} KiB)" in lines
    assert any(line.startswith("Transformer (4 layers): KEPT on the compute device, the CPU") for line in lines)
    assert lines[-2].startswith("Total GPU Memory Saved on a GPU: ")
    host = engine.host_bytes()
    assert lines[-1] == (f"Host memory: {format_bytes(sum(host.values()))} ({format_bytes(host['arena'])} weights, "
                         f"{format_bytes(host['gradients'] + host['optimizer'])} more once it trains)")
    assert host["masters"] == 0  # no optimizer_offload: the arena holds the masters


def test_a_cpu_run_summary_names_the_compute_device_in_its_words_and_its_rows():
    """On a CPU-only run the "gpu" placement is the compute device, the CPU: the words say so, and so
    do the rows' `device` (what the live page, `verl status --json` and /metrics show), while their
    `placement` keeps offload_policy's choice."""
    engine = offloaded(policy(), POLICIES["layered"])
    lines = engine.summary_lines()
    assert not [line for line in lines if "on GPU" in line or line.startswith("Total GPU Memory Saved:")], lines
    assert "Norm: KEPT on the compute device, the CPU (" in "\n".join(lines)
    assert "(this run computes on the CPU)" in lines[-2]
    rows = engine.summary()
    assert {row["group"]: (row["placement"], row["device"]) for row in rows} == {
        "embedding": ("cpu", "cpu"), "transformer": ("gpu", "cpu"), "norm": ("gpu", "cpu"), "lm_head": ("cpu", "cpu")}


def test_the_host_memory_line_names_fp32_masters_beside_a_bf16_arena():
    engine = offloaded(policy().to(torch.bfloat16), POLICIES["all_cpu_optimizer_offload"])
    host = engine.host_bytes()
    assert host["masters"] == 2 * host["arena"] > 0
    assert engine.summary_lines()[-1] == (
        f"Host memory: {format_bytes(sum(host.values()))} ({format_bytes(host['arena'])} weights and "
        f"{format_bytes(host['masters'])} float32 masters, {format_bytes(host['gradients'] + host['optimizer'])} "
        "more once it trains)")


BF16_HOST_GRADS = {**POLICIES["all_cpu_optimizer_offload"], "offload_grad_dtype": "bf16"}


def test_bf16_host_gradients_are_read_back_a_slice_at_a_time_as_adamw_reads_them_whole():
    model = policy(dtype=torch.bfloat16).train()
    engine = offloaded(model, BF16_HOST_GRADS)
    optimizer = engine.optimizer(lr=1e-3, weight_decay=0.01)
    optimizer.slice_elements = 100  # many slices per tensor, the last one of each short
    masters = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    assert all(master.dtype == torch.float32 for master in masters.values())
    reference = torch.optim.AdamW(masters.values(), lr=1e-3, weight_decay=0.01, fused=True)
    ids = token_batch()
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        for name, parameter in model.named_parameters():
            assert parameter.grad.dtype == torch.bfloat16
            masters[name].grad = parameter.grad.float()
        optimizer.step()
        engine.wait_for_updates()
        reference.step()
    assert optimizer._scratch.numel() == 100
    # The same arithmetic; only the kernel's vector and scalar tails fall on other elements.
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.detach(), masters[name], rtol=1e-6, atol=1e-9)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[parameter][key], reference.state[masters[name]][key],
                                       rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize(("settings", "dtype"), [(POLICIES["all_cpu"], torch.float32),
                                                 (POLICIES["all_cpu_optimizer_offload"], torch.bfloat16),
                                                 (BF16_HOST_GRADS, torch.bfloat16),
                                                 (POLICIES["layered"], torch.float32)],
                         ids=["all_cpu", "bf16_optimizer_offload", "bf16_host_gradients", "layered"])
def test_the_host_memory_plan_is_what_a_training_step_allocates(settings, dtype):
    model = policy(dtype=dtype).train()
    engine = offloaded(model, settings)
    plan = engine.host_bytes()
    optimizer = engine.optimizer(lr=1e-3)
    ids = token_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    engine.wait_for_updates()

    offloaded_units = [unit for unit in engine.units if unit.arena is not None]
    assert storage_bytes(unit.arena for unit in offloaded_units) == plan["arena"]
    # bf16 gradients are read in fp32 by the update and by the norm, each into a buffer of its own.
    buffers = (optimizer._scratch, optimizer._squares._scratch)
    scratch = sum(buffer.numel() * 4 for buffer in buffers if buffer is not None)
    assert storage_bytes(view for unit in offloaded_units for view in unit.grad_views) + scratch == plan["gradients"]
    states = [state for values in optimizer.state.values() for state in values.values()
              if isinstance(state, torch.Tensor) and state.dim() > 0 and state.device.type == "cpu"]
    if settings is POLICIES["layered"]:
        # The transformer stays on the device: its states are not the host's.
        states = [state for unit in offloaded_units for entry in unit.entries
                  for state in optimizer.state[entry.parameter].values() if state.dim() > 0]
    assert sum(state.numel() * state.element_size() for state in states) == plan["optimizer"]
    assert plan["masters"] == (plan["arena"] * 2 if dtype == torch.bfloat16 else 0)
    if settings is BF16_HOST_GRADS:
        assert plan["gradients"] - scratch == plan["arena"]  # half the fp32 gradients


def test_bf16_host_gradients_train_like_fp32_ones_to_bf16_tolerance():
    """offload_grad_dtype: bf16 keeps the CPU gradients of a bf16 model in bf16 beside fp32 masters."""
    expected_losses, expected_weights, _ = train(POLICIES["all_cpu_optimizer_offload"], dtype=torch.bfloat16)
    losses, weights, engine = train(BF16_HOST_GRADS, dtype=torch.bfloat16)
    assert engine.layout.dtypes.grad == torch.bfloat16 and engine.layout.dtypes.master == torch.float32
    master = next(unit for unit in engine.units if unit.group == "transformer").entries[0].parameter
    assert master.dtype == torch.float32
    assert losses == pytest.approx(expected_losses, rel=2e-2)
    torch.testing.assert_close(weights, expected_weights, rtol=2e-2, atol=2e-3)


def test_a_placement_that_does_not_fit_in_host_memory_says_so_before_allocating():
    model = policy()
    size = r"[\d.]+ [KM]iB"
    # The model's own weights on the host count as available: packing gives them back.
    weights = sum(tensor.nbytes for tensor in (*model.parameters(), *model.buffers()))
    with pytest.raises(HostMemoryError, match=rf"^the actor's offload placement needs {size} of host memory "
                                              rf"\(arena {size}, gradients {size}, optimizer {size}\) and "
                                              rf"{re.escape(format_bytes(weights + 1024))} is available$"):
        attach_offload(model, FSDPConfig(param_offload=True), "cpu", role="actor", host_budget=1024)
    assert all(parameter.device.type == "cpu" for parameter in model.parameters()) and not model._forward_pre_hooks


def test_copies_are_counted_per_direction_and_group_with_their_bytes():
    model = policy()
    engine = offloaded(model, POLICIES["all_cpu"])
    layer_bytes = [unit.nbytes for unit in engine.units if unit.group == "transformer"]
    ids = token_batch(rows=2, length=7)
    model(input_ids=ids, labels=ids).loss.backward()

    def param_bytes(group):
        return next(row["bytes"] for row in engine.summary() if row["group"] == group)

    # Only the distinct tokens' rows cross, both ways.
    rows_bytes = ids.unique().numel() * model.config.hidden_size * 4
    assert ids.unique().numel() < ids.numel()
    # Forward streams the four blocks into three slots; backward finds the last three still there.
    assert engine.copied_bytes() == {
        ("h2d", "embedding"): rows_bytes,
        ("h2d", "transformer"): sum(layer_bytes) + layer_bytes[0],
        ("h2d", "norm"): param_bytes("norm"),
        ("h2d", "lm_head"): param_bytes("lm_head"),
        ("d2h", "embedding"): rows_bytes,
        ("d2h", "transformer"): param_bytes("transformer"),
        ("d2h", "norm"): param_bytes("norm"),
        ("d2h", "lm_head"): param_bytes("lm_head"),
    }
    assert all(nbytes - param < 256 * 12 for nbytes, param in zip(layer_bytes, [param_bytes("transformer") // 4] * 4,
                                                                    strict=True))
    copies = engine.drain_copy_stats()
    totals: dict[tuple[str, str], int] = {}
    for copy in copies:
        assert set(copy) == {"direction", "group", "bytes", "seconds"} and copy["seconds"] >= 0
        totals[copy["direction"], copy["group"]] = totals.get((copy["direction"], copy["group"]), 0) + copy["bytes"]
    assert totals == engine.copied_bytes()
    assert engine.drain_copy_stats() == []


@pytest.mark.parametrize("head_slots", [None, 5], ids=["three_slots", "whole_head"])
def test_more_head_slots_keep_the_head_from_forward_to_backward(head_slots):
    """Five chunks through three slots: backward fetches back the two chunks that were overwritten;
    through five, the head crosses the bus once a step."""
    model = policy()
    options = OffloadOptions(head_chunk_bytes=4 * 64 * 4, head_slots=head_slots)
    engine = offloaded(model, POLICIES["layered"], options=options)
    ids = token_batch(rows=2, length=5)
    model(input_ids=ids, labels=ids).loss.backward()
    chunks = engine.copy_counts()["h2d", "lm_head"]
    assert chunks == (5 if head_slots == 5 else 5 + 2)
    assert engine.working_set_bytes() == min(head_slots or 3, 5) * 4 * 64 * 4


def test_a_drain_is_bounded_and_folds_the_excess_per_direction_and_group():
    log = CopyLog(cuda=False, max_records=4)
    for index in range(10):
        log.timed("h2d" if index % 2 else "d2h", "transformer", 100, None, lambda: None)
    records = log.drain()
    assert len(records) == 4 + 2
    assert sum(record["bytes"] for record in records) == 1000
    assert {(record["direction"], record["bytes"]) for record in records[4:]} == {("d2h", 300), ("h2d", 300)}


def test_every_copy_is_counted_and_a_sample_is_timed_after_the_first_drain():
    log = CopyLog(cuda=False, timed_per_drain=4)
    for index in range(10):
        log.timed("h2d" if index % 2 else "d2h", "transformer", 100, None, lambda: None)
    assert len(log.drain()) == 10, "until the first drain every copy is timed"
    assert sorted(log.drain_counts(), key=lambda row: row["direction"]) == [
        {"direction": "d2h", "group": "transformer", "copies": 5, "bytes": 500},
        {"direction": "h2d", "group": "transformer", "copies": 5, "bytes": 500}]
    assert log.stride == 3  # 10 copies a drain, about 4 to time
    done = []
    for index in range(12):
        log.timed("h2d" if index % 2 else "d2h", "transformer", 100, None, lambda index=index: done.append(index))
    assert done == list(range(12)), "a copy that is not timed still runs"
    timed = log.drain()
    # One in three of each direction: both directions are sampled, whatever their interleaving.
    assert sorted(record["direction"] for record in timed) == ["d2h", "d2h", "h2d", "h2d"]
    assert sum(row["copies"] for row in log.drain_counts()) == 12 and log.drain_counts() == []
    assert log.stride == 3  # a drain with no copies since the last one leaves the stride as it was


def test_a_log_that_times_every_copy_keeps_doing_so():
    log = CopyLog(cuda=False, timed_per_drain=None)
    for _ in range(3):
        for _ in range(50):
            log.timed("h2d", "transformer", 1, None, lambda: None)
        log.drain_counts()
        assert len(log.drain()) == 50 and log.stride == 1


def test_the_ipc_message_of_several_engines_stays_within_the_protocols_limit():
    engines = [offloaded(policy(), POLICIES["all_cpu"], role=role) for role in ("actor", "ref", "critic")]
    for engine in engines:
        for _ in range(MAX_RECORDS_PER_DRAIN):
            engine.log.timed("h2d", "transformer", 1000, None, lambda: None)
    message = offload_message(engines, with_summary=True)
    assert len(encode(message)) < MAX_MESSAGE_BYTES
    assert sum(copy.bytes for copy in message.copies) == 3 * MAX_RECORDS_PER_DRAIN * 1000
    assert message.counts == [CopyCount(direction="h2d", group="transformer", copies=3 * MAX_RECORDS_PER_DRAIN,
                                        bytes=3 * MAX_RECORDS_PER_DRAIN * 1000)]
    assert {row.role for row in message.summary} == {"actor", "ref", "critic"}
    empty = offload_message(engines, with_summary=False)
    assert (empty.copies, empty.counts, empty.summary) == ([], [], None)
    # From now on each engine times a sample: a step's worth of copies makes a small message.
    for engine in engines:
        for _ in range(MAX_RECORDS_PER_DRAIN):
            engine.log.timed("h2d", "transformer", 1000, None, lambda: None)
    message = offload_message(engines, with_summary=False)
    assert 3 * TIMED_COPIES_PER_DRAIN // 2 <= len(message.copies) <= 3 * TIMED_COPIES_PER_DRAIN
    assert message.counts[0].copies == 3 * MAX_RECORDS_PER_DRAIN


@pytest.mark.parametrize("name", ["all_cpu", "layered", "optimizer_offload"])
def test_no_grad_forward_and_generate_match_the_resident_model(name):
    resident = policy().eval()
    model = policy().eval()
    offloaded(model, POLICIES[name])
    ids = token_batch(rows=3, length=6, seed=2)
    ids[0, :2] = TOKENIZER.pad_token_id
    mask = (ids != TOKENIZER.pad_token_id).long()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   resident(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=TOKENIZER.pad_token_id, use_cache=True)
    expected = resident.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **settings), expected)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32


def test_a_frozen_reward_model_streams_without_gradients():
    resident = load_reward_model("builtin:tiny-qwen2", TOKENIZER, dtype=torch.float32, seed=1)
    model = load_reward_model("builtin:tiny-qwen2", TOKENIZER, dtype=torch.float32, seed=1)
    engine = offloaded(model, POLICIES["all_cpu"], role="reward")
    ids = token_batch(rows=2, length=5)
    torch.testing.assert_close(model(input_ids=ids).logits, resident(input_ids=ids).logits, rtol=0, atol=0)
    assert all(unit.grad_views is None for unit in engine.units)
    assert all(direction == "h2d" for direction, _ in engine.copied_bytes())


def test_checkpoints_round_trip_and_resume_under_another_policy(tmp_path):
    """Weights and AdamW states saved from a fully offloaded actor load into a layered one, which
    then trains exactly as the original would have."""
    source = policy().train()
    engine = offloaded(source, POLICIES["all_cpu_optimizer_offload"])
    optimizer = engine.optimizer(lr=1e-3)
    ids = token_batch()

    def one_step(model, optimizer):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    one_step(source, optimizer)
    path = save_checkpoint(tmp_path, 1, {"actor": source}, {"optimizer": optimizer.state_dict()})

    target = policy(override_config={**FOUR_LAYERS, "initializer_range": 0.5}).train()
    target_optimizer = offloaded(target, POLICIES["layered"]).optimizer(lr=1e-3)
    state = load_checkpoint(path, {"actor": target})
    target_optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids=ids).logits, source(input_ids=ids).logits, rtol=0, atol=0)
    one_step(source, optimizer)
    one_step(target, target_optimizer)
    optimizer.wait()
    target_optimizer.wait()
    torch.testing.assert_close(dict(target.state_dict()), dict(source.state_dict()), rtol=1e-6, atol=1e-7)


def test_a_model_without_recognisable_blocks_is_refused_with_the_setting_to_change():
    model = policy()
    with pytest.raises(UnsupportedModel, match="transformer_layer_cls_to_wrap"):
        attach_offload(model, FSDPConfig.model_validate(
            {"param_offload": True, "wrap_policy": {"transformer_layer_cls_to_wrap": ["NoSuchBlock"]}}),
            "cpu", role="actor")


def _mini_batch_gradients(settings: dict, *, accumulating: bool, move_between: int | None = None):
    """The masters' gradients after two micro-batches' backward passes, and the D2H copies of the
    transformer group they took; `move_between` layers on the GPU between the two (dynamic offload)."""
    model = policy().train()
    engine = offloaded(model, settings)
    context = engine.accumulating() if accumulating else contextlib.nullcontext()
    with context:
        for half in token_batch(rows=4).split(2):
            (model(input_ids=half, labels=half).loss / 2).backward()
            if move_between is not None:
                engine.set_transformer_layers_on_gpu(move_between)
                move_between = None
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}
    return grads, engine.copy_counts().get(("d2h", "transformer"), 0), engine


@pytest.mark.parametrize("settings", [POLICIES["optimizer_offload"], {"dynamic_offload": {"enabled": True}}],
                         ids=["optimizer_offload", "dynamic_layers"])
def test_a_mini_batch_sends_the_gradients_of_device_kept_blocks_home_once(settings):
    """Issue 14: each micro-batch sent every gradient to the host, which added them up there. Blocks kept in
    device slots of their own now add them up on the device and send them once a mini-batch: the same sums,
    half the copies for two micro-batches."""
    expected, per_micro_batch, _ = _mini_batch_gradients(settings, accumulating=False)
    grads, once, engine = _mini_batch_gradients(settings, accumulating=True)
    assert grads.keys() == expected.keys() and len(grads) == sum(1 for _ in policy().parameters())
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0, msg=name)
    assert once > 0 and per_micro_batch == 2 * once
    assert not any(compute.grad is not None for unit in engine.units for compute in unit.compute_params)


def test_a_layer_that_moves_between_micro_batches_takes_its_device_gradient_home_first():
    settings = {"dynamic_offload": {"enabled": True}}
    expected, _, _ = _mini_batch_gradients(settings, accumulating=False)
    grads, _, engine = _mini_batch_gradients(settings, accumulating=True, move_between=1)
    assert engine.layers_on_gpu == 1
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0, msg=name)


DELAYED = {"model_dtype": "bf16", "optimizer_offload": True, "offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}


def logits_around_a_delayed_update(build, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One AdamW step of a model built with `build(delayed)` (-> model, engine), delayed and not: the delayed
    model's logits before the step, inside stale_reads after it and after that, and the plain model's after it.
    Asserts that the stale read left the update pending and the fresh one published it."""
    runs = []
    for delayed in (True, False):
        model, engine = build(delayed)
        with torch.no_grad():
            before = model(input_ids=ids).logits.clone()
        optimizer = engine.optimizer(lr=1e-2)
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        runs.append((model, engine, before))
    (model, engine, before), (plain, _, _) = runs
    with torch.no_grad():
        with engine.stale_reads():
            stale = model(input_ids=ids).logits
        assert any(unit.publish_pending for unit in engine.units)
        fresh = model(input_ids=ids).logits
        assert not any(unit.publish_pending for unit in engine.units)
        return {"before": before, "stale": stale, "fresh": fresh, "plain": plain(input_ids=ids).logits}


def test_a_delayed_update_lets_the_rollout_read_the_weights_from_before_it_and_publishes_it_afterwards():
    """fsdp_config.delayed_update (ZeRO-Offload's delayed parameter update): while the CPU update runs, reads inside
    stale_reads (the rollout) take the weights from before it; the first read after it takes the updated ones,
    the same as without the delay."""

    def build(delayed: bool):
        model = policy(dtype=torch.bfloat16).train()
        return model, attach_offload(model, FSDPConfig.model_validate({**DELAYED, "delayed_update": delayed}), "cpu",
                                     role="actor")

    logits = logits_around_a_delayed_update(build, token_batch())
    assert torch.equal(logits["stale"], logits["before"]) and not torch.equal(logits["fresh"], logits["before"])
    assert torch.equal(logits["fresh"], logits["plain"])


def test_publishing_a_delayed_update_makes_even_a_stale_read_take_the_updated_weights():
    """OffloadEngine.publish_updates (before a checkpoint and validation): the update is waited for and published
    at once, so the next rollout's stale reads take the updated weights, as a run resumed from the checkpoint would;
    nothing is left pending, and a second call does nothing."""
    model = policy(dtype=torch.bfloat16).train()
    engine = attach_offload(model, FSDPConfig.model_validate({**DELAYED, "delayed_update": True}), "cpu", role="actor")
    ids = token_batch()
    with torch.no_grad():
        before = model(input_ids=ids).logits.clone()
    optimizer = engine.optimizer(lr=1e-2)
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    assert any(unit.publish_pending for unit in engine.units)
    engine.publish_updates()
    assert not any(unit.publish_pending for unit in engine.units)
    engine.publish_updates()
    with torch.no_grad(), engine.stale_reads():
        after = model(input_ids=ids).logits
    assert not torch.equal(after, before)


def test_the_publisher_writes_a_delayed_update_once_the_stale_reads_end_and_the_next_step_keeps_it():
    """Under a delayed update the engine's publisher writes the updated masters into the arenas as the rollout's
    stale reads end (on a CPU at once), and the first read after them makes them the weights: the next rollout
    samples the first update, and the read after it the second, as a run without the delay would. Without a read
    after the stale ones, the engine's next wait for its updates does it."""
    ids = token_batch()
    runs = {}
    for delayed in (True, False):
        model = policy(dtype=torch.bfloat16).train()
        engine = attach_offload(model, FSDPConfig.model_validate({**DELAYED, "delayed_update": delayed}), "cpu",
                                role="actor")
        runs[delayed] = (model, engine, engine.optimizer(lr=1e-2))
    (model, engine, optimizer), (plain, _, plain_optimizer) = runs[True], runs[False]

    def step(model, optimizer):
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step(model, optimizer)
    step(plain, plain_optimizer)
    with torch.no_grad():
        after_one = plain(input_ids=ids).logits
        with engine.stale_reads():
            model(input_ids=ids)
        pending = [unit for unit in engine.units if unit.publish_pending]
        assert pending and all(unit.publishing is not None and unit.publishing.is_set() for unit in pending)
    step(model, optimizer)  # its forward publishes the first update; then the second is pending
    step(plain, plain_optimizer)
    with torch.no_grad():
        with engine.stale_reads():
            stale = model(input_ids=ids).logits
        assert torch.equal(stale, after_one)
    # No read after these stale ones: what the next step does first (so do a checkpoint's state_dict and close)
    # makes the publisher's arenas the weights, so that the next update's publish starts afresh.
    engine.wait_for_updates()
    assert not any(unit.publish_pending or unit.publishing is not None for unit in engine.units)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)


@pytest.mark.parametrize("update", ["cpu", "both"])
def test_the_publisher_on_its_own_thread_publishes_each_unit_whichever_comes_first_it_or_the_read(update):
    """The workers on threads of their own, as on a GPU (on a CPU they run at once): a read may take a unit's event
    off it before the publisher reaches the unit (so it once waited forever, updates on both paths), and the reads
    still give the logits of the run without the delay."""

    def build(delayed: bool):
        model = policy(dtype=torch.bfloat16).train()
        engine = attach_offload(model, FSDPConfig.model_validate(
            {**DELAYED, "delayed_update": delayed, "optimizer_update": update}), "cpu", role="actor")
        for worker in (engine.worker, engine.updates.device_worker, engine.updates.publisher):
            if worker is not None:
                worker.cuda = True  # (HostWorker: a thread of its own rather than at once)
        if engine.updates.publisher is not None:  # the publisher starts late: the first reads come before it
            submit = engine.updates.publisher.submit
            engine.updates.publisher.submit = lambda work: submit(lambda: (time.sleep(0.5), work()))
        return model, engine

    done: dict[str, torch.Tensor] = {}
    thread = threading.Thread(target=lambda: done.update(logits_around_a_delayed_update(build, token_batch())),
                              daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "a read waited forever for the publisher"
    assert torch.equal(done["stale"], done["before"]) and torch.equal(done["fresh"], done["plain"])


def test_a_failure_of_the_publisher_is_raised_by_the_read_that_publishes():
    model = policy(dtype=torch.bfloat16).train()
    engine = attach_offload(model, FSDPConfig.model_validate({**DELAYED, "delayed_update": True}), "cpu", role="actor")
    ids = token_batch()
    optimizer = engine.optimizer(lr=1e-2)
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    unit = next(unit for unit in engine.units if unit.publish_pending)

    def broken() -> None:
        raise OSError("no memory for the arena")

    unit._masters_to_arena = broken
    with torch.no_grad(), engine.stale_reads():
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match=f"publishing {unit.name}'s delayed update failed"):
        engine.publish_updates()


def test_a_delayed_update_is_refused_where_the_device_reads_the_masters_themselves():
    with pytest.raises(ValueError, match="the actor.s delayed_update needs fp32 masters on the CPU apart"):
        offloaded(policy(), {"optimizer_offload": True, "delayed_update": True})


def test_the_cpu_states_of_adamw_are_made_in_the_background_before_the_first_update():
    """Their first allocation and touch (61 GB for a 7B actor) made the first update 8 s slower than the others,
    and the next rollout waited for it; the worker makes them before it, as torch would."""
    model = policy()
    engine = offloaded(model, POLICIES["all_cpu_optimizer_offload"])
    optimizer = engine.optimizer(lr=1e-3)
    assert not optimizer.state  # made once every model is placed (MemoryManager.finish_placement)
    engine.make_optimizer_states()
    optimizer.wait()
    states = [optimizer.state[parameter] for parameter in model.parameters() if parameter.requires_grad]
    assert states and all(state["step"].item() == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
                          and state["exp_avg"].shape == parameter.shape
                          for state, parameter in zip(states, (p for p in model.parameters() if p.requires_grad),
                                                      strict=True))


def test_the_engine_worker_runs_torch_on_the_threads_it_is_given_and_leaves_the_main_threads_count():
    from trainer.offload.gradients import HostWorker
    before = torch.get_num_threads()
    worker = HostWorker(cuda=False, role="actor", threads=1)
    try:
        assert worker.submit(torch.get_num_threads, inline=False).result() == 1
    finally:
        worker.shutdown()
    assert torch.get_num_threads() == before


def test_a_bad_worker_thread_count_in_the_environment_is_refused_in_one_line(monkeypatch):
    from trainer.errors import UserError

    monkeypatch.setenv("VERL_OFFLOAD_WORKER_THREADS", "lots")
    with pytest.raises(UserError, match="VERL_OFFLOAD_WORKER_THREADS must be a whole number.*'lots'") as raised:
        OffloadOptions()
    assert "\n" not in str(raised.value)  # the trainer reports a user's error in one line, exit code 2
    monkeypatch.setenv("VERL_OFFLOAD_WORKER_THREADS", "3")
    assert OffloadOptions().worker_threads == 3


def test_a_steady_no_grad_forward_skips_the_block_checks_and_still_reads_each_update():
    """With every layer on the device and current, a no-grad forward (a decoded token) goes without the
    per-block fetch; after an update the next one copies the new weights first, as the general path does."""
    model = policy().train()
    engine = offloaded(model, {"optimizer_offload": True, "dynamic_offload": {"enabled": True}})
    optimizer = engine.optimizer(lr=1e-2)
    streamer, ids = engine.streamer, token_batch()
    fetches = []
    fetch = streamer.fetch
    streamer.fetch = lambda block, *, required: (fetches.append(block.unit.name), fetch(block, required=required))[1]

    def logits(steady: bool) -> torch.Tensor:
        streamer.steady_forwards = steady
        fetches.clear()
        with torch.no_grad():
            return model(input_ids=ids).logits

    for _ in range(2):
        general = logits(False)
        assert any(name.startswith("layers.") for name in fetches)
        steady = logits(True)
        assert not [name for name in fetches if name.startswith("layers.")]
        torch.testing.assert_close(steady, general, rtol=0, atol=0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.wait_for_updates()
        # The update changed every layer: the next forward is not a steady one, and it reads the new weights.
        updated = logits(True)
        assert any(name.startswith("layers.") for name in fetches)
        assert not torch.equal(updated, steady)
        torch.testing.assert_close(updated, logits(False), rtol=0, atol=0)


@pytest.mark.parametrize("move_between", [None, 1], ids=["kept", "moved_mid_mini_batch"])
def test_the_gradient_norm_reads_the_device_square_of_a_gradient_sent_once_and_the_host_for_the_rest(move_between):
    """A block kept on the device sends its mini-batch's gradient once: its square is taken on the device then,
    and the clipping norm does not read that host gradient again. A block that moved mid-mini-batch (its later
    gradients land on the host) is read on the host. Either way the norm is the gradients' norm."""
    settings = {"optimizer_offload": True, "dynamic_offload": {"enabled": True}}
    model = policy().train()
    engine = offloaded(model, settings)
    engine.gradients.device_squares = True  # the GPU's way (on the CPU the host's norm is the same read)
    optimizer = engine.optimizer(lr=1e-3)
    with engine.accumulating():
        for number, half in enumerate(token_batch(rows=4).split(2)):
            (model(input_ids=half, labels=half).loss / 2).backward()
            if number == 0 and move_between is not None:
                engine.set_transformer_layers_on_gpu(move_between)
    layers = engine.transformer_units
    known = [unit.name for unit in layers if unit.grad_square is not None]
    expected = torch.nn.utils.get_total_norm([parameter.grad for parameter in model.parameters()
                                              if parameter.grad is not None])
    # Moved: every layer sent its first micro-batch's gradient at the move; the second landed on the host (the
    # streamed ones) or was added there (layers.0, sent again at the end): no square is the whole gradient.
    assert known == ([] if move_between == 1 else [unit.name for unit in layers])
    for unit in layers:  # the norm does not read a known unit's host gradient: a poisoned one shows it
        if unit.grad_square is not None:
            for entry in unit.entries:
                entry.parameter.grad.mul_(1e6)
    norm = optimizer.clip_grad_norm_(1.0)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    optimizer.zero_grad()
    assert all(unit.grad_square is None for unit in engine.units)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunked_head", [False, True], ids=["whole_head", "chunked_head"])
def test_every_gradient_streamed_once_into_a_fresh_host_gradient_has_its_square_taken_on_the_device(chunked_head,
                                                                                                     tied):
    """Streamed layers, the head (whole or in chunks) and the embedding's rows send each piece once into an empty
    host gradient: the sum of the pieces' squares, taken on the device, is the host gradient's square, and the
    clipping norm reads no host gradient. A tied weight (the head's gradient and the rows added in one place) and
    a second backward before zero_grad (added on the host) are read on the host. The norm is the same each way."""
    config = {**FOUR_LAYERS, "tie_word_embeddings": tied}
    model = policy(override_config=config).train()
    chunks = OffloadOptions(head_chunk_bytes=4 * 64 * 4)  # four vocabulary rows a chunk
    engine = offloaded(model, POLICIES["all_cpu_optimizer_offload"], options=chunks if chunked_head else WHOLE_HEAD)
    engine.gradients.device_squares = True  # the GPU's way (on the CPU the host's norm is the same read)
    optimizer = engine.optimizer(lr=1e-3)
    known_after = []
    for seed in (0, 1):
        ids = token_batch(seed=seed)
        model(input_ids=ids, labels=ids).loss.backward()
        known_after.append({unit.group for unit in engine.units if unit.grad_square is not None})
        expected = torch.nn.utils.get_total_norm([parameter.grad.clone() for parameter in model.parameters()
                                                  if parameter.grad is not None])
        for unit in engine.units:  # a known unit's host gradient is not read: a poisoned one would show it
            if unit.grad_square is not None:
                for entry in unit.entries:
                    entry.parameter.grad.mul_(1e6)
        torch.testing.assert_close(optimizer.clip_grad_norm_(1.0), expected, rtol=1e-5, atol=0)
        for unit in engine.units:
            if unit.grad_square is not None:
                for entry in unit.entries:
                    entry.parameter.grad.div_(1e6)
    shared = {"embedding"} if tied else set()
    assert known_after[0] == {unit.group for unit in engine.units} - shared
    assert known_after[1] == set()  # the second backward added onto the first's host gradients
    optimizer.zero_grad()
    assert all(unit.grad_square is None for unit in engine.units)


def test_a_bf16_gradient_update_writes_each_updated_slice_into_the_arena_as_it_goes():
    """The device's copy of the weights (the arena, bf16) is written slice by slice during the update, not by a
    second pass over the fp32 masters afterwards: the same bytes as that pass would write."""
    model = policy(dtype=torch.bfloat16).train()
    engine = offloaded(model, BF16_HOST_GRADS)
    optimizer = engine.optimizer(lr=1e-2)
    optimizer.slice_elements = 100
    second_pass = []
    for unit in engine.units:
        original = unit._masters_to_arena
        unit._masters_to_arena = (lambda skip=frozenset(), unit=unit, original=original:
                                  (second_pass.extend((unit.name, index) for index in range(len(unit.masters))
                                                      if index not in skip), original(skip))[1])
    ids = token_batch()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    engine.wait_for_updates()
    trained = [(unit.name, index) for unit in engine.units for index, entry in enumerate(unit.entries)
               if entry.parameter.grad is not None]
    assert trained and not set(trained) & set(second_pass)
    for unit in engine.units:
        assert not unit.master_is_arena
        for index, master in enumerate(unit.masters):
            assert torch.equal(unit.arena_view(index), master.to(torch.bfloat16)), (unit.name, index)
    # And what the device reads next is the update: a forward through the engine gives the masters' logits.
    with torch.no_grad():
        streamed = model(input_ids=ids).logits
    reference = policy(dtype=torch.bfloat16)
    reference.load_state_dict({name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(streamed, reference(input_ids=ids).logits, rtol=0, atol=0)
