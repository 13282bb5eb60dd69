"""Per-phase placement (the rollout and scoring keep the CPU-resident head and embedding on the
device within a budget), safe points between decode chunks, where a dynamic run starts, and
out-of-memory recovery in the no-grad phases. On the CPU the CPU plays the device."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteriaList

from tests.trainer.offload.test_offload import offloaded, policy, token_batch
from tests.trainer.workers.test_oom_recovery import Memory, rollout_batch
from trainer.offload import OffloadOptions
from trainer.offload.copies import H2D
from trainer.offload.dynamic import layers_that_fit
from trainer.rollout.hf_rollout import SafePoints
from trainer.workers.actor import compute_log_probs
from trainer.workers.recovery import run_in_pieces

LAYERED = {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}


def h2d_bytes(engine, group: str) -> int:
    return engine.copied_bytes().get((H2D, group), 0)


# ------------------------------------------------------------------------------ per-phase placement


def test_rollout_keeps_head_and_embedding_on_the_device_and_gives_the_same_logits():
    reference = policy().eval()
    model = policy().eval()
    engine = offloaded(model, LAYERED)
    ids = token_batch()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        sizes = engine.stageable_bytes()
        assert list(sizes) == ["lm_head", "embedding"]
        assert sizes["lm_head"] == model.lm_head.weight.numel() * 4
        before = {group: h2d_bytes(engine, group) for group in sizes}
        with engine.placed_for("rollout") as staged:
            assert staged == ["lm_head", "embedding"]
            first = model(input_ids=ids).logits
            second = model(input_ids=ids).logits
        # One copy of each, whatever the number of forwards (decode steps).
        assert {group: h2d_bytes(engine, group) - before[group] for group in sizes} == sizes
        assert engine.staging.staged_groups == [] and engine.phase == "training"
        after = model(input_ids=ids).logits  # streamed again
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("budget", "staged"), [(None, ["lm_head", "embedding"]), ("head", ["lm_head"]), (0, [])])
def test_what_is_kept_follows_the_budget_head_first(budget, staged):
    engine = offloaded(policy(), LAYERED)
    if budget == "head":
        budget = engine.stageable_bytes()["lm_head"] + 1
    with engine.placed_for("rollout", budget_bytes=budget) as kept:
        assert kept == staged
    with engine.placed_for("training", budget_bytes=budget) as kept:
        assert kept == [group for group in staged if group == "lm_head"]  # training keeps the head only


def test_a_copy_that_runs_out_of_device_memory_is_not_kept_and_the_phase_streams(monkeypatch):
    engine = offloaded(policy(), LAYERED)
    stage = engine.staging._stage

    def head_only(unit):
        if unit.group == "embedding":
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        stage(unit)

    monkeypatch.setattr(engine.staging, "_stage", head_only)
    with engine.placed_for("rollout") as kept:
        assert kept == ["lm_head"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_training_with_the_head_kept_trains_as_streaming_it_and_copies_it_once_a_step(tied):
    from tests.trainer.offload.test_offload import train

    # The head in chunks of two rows through three slots: streamed, it crosses again at every pass.
    overrides = {"override_config": {"num_hidden_layers": 2, "tie_word_embeddings": tied},
                 "options": OffloadOptions(head_chunk_bytes=512)}
    expected_losses, expected_weights, streamed = train(LAYERED, **overrides)
    copies = {}

    def keep_the_head(engine):
        if "phase" not in copies:  # entered once, for the whole run: the kept copy follows each update
            copies["phase"] = engine.placed_for("training")
            copies["kept"] = copies["phase"].__enter__()

    losses, weights, engine = train(LAYERED, before_micro_batch=keep_the_head, **overrides)
    copies["phase"].__exit__(None, None, None)
    assert copies["kept"] == ([] if tied else ["lm_head"])
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    # A whole matrix product against chunked ones: float rounding, which Adam enlarges for near-zero gradients.
    torch.testing.assert_close(weights, expected_weights, rtol=1e-4, atol=2e-5)
    if not tied:
        head = engine.stageable_bytes()["lm_head"]
        # 3 steps: one copy each (after each update), where streaming copies it twice per micro-batch.
        assert h2d_bytes(engine, "lm_head") == 3 * head
        # Streamed: in forward and again in backward, for each of two micro-batches (less the chunks
        # still in their slots when the backward turns around).
        assert h2d_bytes(streamed, "lm_head") > 3 * 2 * head


def test_after_an_update_the_kept_head_is_copied_before_the_forward_reaches_the_layers():
    model = policy().train()
    engine = offloaded(model, LAYERED)
    optimizer = engine.optimizer(lr=1e-2)
    head = engine.stageable_bytes()["lm_head"]
    ids = token_batch()
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(h2d_bytes(engine, "lm_head")))
    with engine.placed_for("training"):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        engine.wait_for_updates()  # the head's update has landed: its new copy can start at once
        model(input_ids=ids, labels=ids).loss.backward()
    # The copy made on entering the phase, then the refresh, already on its way at the first layer
    # (on a GPU it overlaps the layers; the head's forward waits for it there).
    assert seen == [head, 2 * head]
    assert h2d_bytes(engine, "lm_head") == 2 * head


def test_a_kept_copy_follows_an_update_and_gradients_flow_through_kept_and_streamed_groups():
    reference = policy()
    model = policy()
    engine = offloaded(model, LAYERED)
    optimizer = engine.optimizer(lr=1e-2)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = token_batch()
    with engine.placed_for("scoring"):
        for network, opt in ((model, optimizer), (reference, expected_optimizer)):
            network(input_ids=ids, labels=ids).loss.backward()  # with grad: the streamed path
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            got, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_groups_on_the_gpu_have_nothing_to_keep_and_a_bad_phase_is_refused():
    engine = offloaded(policy(), {})
    assert engine.stageable_bytes() == {}
    with engine.placed_for("rollout") as kept:
        assert kept == []
    with pytest.raises(ValueError, match="unknown phase 'decode'; expected one of rollout, scoring, training"):
        with engine.placed_for("decode"):
            pass


def test_what_each_phase_may_keep_is_what_the_planner_reserves_for_it():
    """The phase planner reserves, for a phase whose working memory it has not learned yet, the groups that phase may
    keep: the head and the embedding in a no-grad phase, the head alone in training (its embedding's gradient rows
    come from the CPU gather)."""
    engine = offloaded(policy(), LAYERED)
    every = engine.stageable_bytes()
    assert set(every) == {"embedding", "lm_head"}
    assert engine.stageable_bytes("rollout") == engine.stageable_bytes("scoring") == every
    assert engine.stageable_bytes("training") == {"lm_head": every["lm_head"]}
    with engine.placed_for("training") as kept:
        assert kept == ["lm_head"]


def test_a_tied_model_keeps_its_one_table():
    reference = policy(override_config={"num_hidden_layers": 2, "tie_word_embeddings": True}).eval()
    model = policy(override_config={"num_hidden_layers": 2, "tie_word_embeddings": True}).eval()
    engine = offloaded(model, LAYERED)
    assert list(engine.stageable_bytes()) == ["embedding"]
    ids = token_batch()
    with torch.no_grad(), engine.placed_for("rollout") as kept:
        assert kept == ["embedding"]
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


# -------------------------------------------------------------------------------------- safe points


def test_safe_points_come_every_few_decoded_tokens_and_change_nothing():
    model = policy().eval()
    prompt = token_batch(rows=2, length=4)
    calls = []

    def generate(stopping):
        torch.manual_seed(0)
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                              max_new_tokens=20, min_new_tokens=20, pad_token_id=0, eos_token_id=None,
                              stopping_criteria=stopping)

    plain = generate(StoppingCriteriaList())
    with_safe_points = generate(StoppingCriteriaList([SafePoints(lambda: calls.append(1), every=8)]))
    assert torch.equal(plain, with_safe_points)
    assert len(calls) == 2  # after tokens 8 and 16 of 20


def test_layers_move_at_a_safe_point_in_the_middle_of_a_generate():
    reference = policy().eval()
    model = policy().eval()
    engine = offloaded(model, {"dynamic_offload": {"enabled": True}})
    prompt = token_batch(rows=2, length=4)
    moves = iter([1, 3, 0, 2])  # after tokens 4, 8, 12 and 16

    def generate(network, stopping):
        torch.manual_seed(0)
        return network.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                max_new_tokens=16, min_new_tokens=16, pad_token_id=0, eos_token_id=None,
                                stopping_criteria=stopping)

    safe_point = SafePoints(lambda: engine.set_transformer_layers_on_gpu(next(moves)), every=4)
    assert torch.equal(generate(model, StoppingCriteriaList([safe_point])), generate(reference, StoppingCriteriaList()))
    assert engine.layers_on_gpu == 2 and engine.moves == {"to_cpu": 3 + 3, "to_gpu": 2 + 2}


def test_a_dynamic_run_starts_with_the_layers_that_fit():
    layer = 1000
    probe = lambda: (2000, 10_000)  # noqa: E731
    assert layers_that_fit(probe, threshold=0.9, layer_bytes=layer, total_layers=28) == 7
    assert layers_that_fit(probe, threshold=0.9, layer_bytes=layer, total_layers=4) == 4
    assert layers_that_fit(probe, threshold=0.9, layer_bytes=layer, total_layers=28, reserve_bytes=6500) == 0
    engine = offloaded(policy(), {"dynamic_offload": {"enabled": True}})
    assert engine.layers_on_gpu == 4
    from trainer.config import FSDPConfig
    from trainer.offload import attach_offload

    started = attach_offload(policy(), FSDPConfig.model_validate({"dynamic_offload": {"enabled": True}}), "cpu",
                             role="actor", layers_on_gpu=1)
    assert started.layers_on_gpu == 1
    with pytest.raises(ValueError, match="layers_on_gpu needs dynamic_layers"):
        attach_offload(policy(), FSDPConfig(), "cpu", role="actor", layers_on_gpu=1)


# ------------------------------------------------------------------------- recovery without grad


def test_pieces_are_retried_after_relief_or_split_and_keep_their_order():
    failures = {(0, 8)}  # the whole batch fails once; then halves

    def run(first, count):
        if (first, count) in failures:
            failures.discard((first, count))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return list(range(first, first + count))

    memory = Memory()
    assert run_in_pieces(run, 8, 8, memory=memory) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert memory.recoveries == 1
    failures.add((0, 8))
    relieved = []
    memory = Memory(relieve=lambda: relieved.append(1) or True)
    assert run_in_pieces(run, 8, 8, memory=memory) == [list(range(8))]
    assert relieved == [1] and memory.recoveries == 1


def test_one_item_that_does_not_fit_with_nothing_to_move_raises_and_without_recovery_the_error_passes():
    def never(first, count):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    with pytest.raises(torch.OutOfMemoryError, match="single sequence"):
        run_in_pieces(never, 2, 2, memory=Memory(relieve=lambda: False))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        run_in_pieces(never, 2, 2, memory=None)


def test_log_probs_after_an_oom_in_a_micro_batch_equal_the_uninterrupted_ones():
    model = policy()
    engine = offloaded(model, {"param_offload": True})
    batch = rollout_batch()
    expected = compute_log_probs(model, batch, micro_batch_size=4, temperature=1.0)
    calls = {"count": 0}

    def fail_once(module, args):
        calls["count"] += 1
        if calls["count"] == 2:  # the second micro-batch, half-way through the model
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = model.model.layers[2].register_forward_pre_hook(fail_once)
    memory = Memory(engine)
    try:
        got = compute_log_probs(model, batch, micro_batch_size=4, temperature=1.0, memory=memory)
    finally:
        handle.remove()
    assert memory.recoveries == 1
    assert not any(block.acquired for block in engine.blocks)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- the trainer


class Probe:
    def __init__(self, used: int, total: int):
        self.used, self.total = used, total

    def __call__(self):
        return self.used, self.total


def test_the_trainer_places_groups_per_phase_within_the_threshold_and_recovers_a_rollout_oom(tmp_path):
    from tests.trainer.test_training import TINY
    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(None, [
        *TINY, "actor_rollout_ref.actor.fsdp_config.offload_policy={embedding: cpu, lm_head: cpu}",
        "trainer.total_training_steps=2", f"trainer.runs_dir={tmp_path}"])
    logs = []
    probe = Probe(used=0, total=10**9)
    trainer = Trainer(config, log=logs.append, memory_probe=probe)
    engine = trainer.memory.engine("actor")
    phases = []
    original = engine.placed_for

    def spy(phase, *, budget_bytes=None):
        phases.append((phase, budget_bytes))
        return original(phase, budget_bytes=budget_bytes)

    engine.placed_for = spy
    sample = trainer.rollout.sample
    failed = []

    def generate_failing_once(prompt_ids, prompt_mask):
        if not failed:
            failed.append(len(prompt_ids))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return sample(prompt_ids, prompt_mask)

    trainer.rollout.sample = generate_failing_once
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert [row["perf/oom_recoveries"] for row in rows] == [1, 0]
    assert failed == [config.data.train_batch_size]
    threshold_budget = int(0.85 * 10**9)
    assert ("rollout", threshold_budget) in phases and ("scoring", threshold_budget) in phases
    assert [line for line in logs if line.startswith("per-phase placement")] == [
        "per-phase placement: rollout keeps the actor's lm_head and embedding on the GPU (4.25 KiB)",
        "per-phase placement: scoring keeps the actor's lm_head and embedding on the GPU (4.25 KiB)",
        "per-phase placement: training keeps the actor's lm_head on the GPU (2.12 KiB)"]


def test_a_run_without_room_streams_and_says_so(tmp_path):
    from tests.trainer.test_training import TINY
    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(None, [
        *TINY, "actor_rollout_ref.actor.fsdp_config.offload_policy={embedding: cpu, lm_head: cpu}",
        "trainer.total_training_steps=1", f"trainer.runs_dir={tmp_path}"])
    logs = []
    trainer = Trainer(config, log=logs.append, memory_probe=Probe(used=95, total=100))
    trainer.fit()
    assert any(line.startswith("per-phase placement: rollout streams the actor's CPU-resident groups (no room "
                               "below the GPU memory threshold 0.85") for line in logs)



def test_a_cpu_run_has_no_gpu_to_keep_groups_on_and_says_nothing_about_it(tmp_path):
    from tests.trainer.test_training import TINY
    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(None, [
        *TINY, "actor_rollout_ref.actor.fsdp_config.offload_policy={embedding: cpu, lm_head: cpu}",
        "trainer.total_training_steps=1", f"trainer.runs_dir={tmp_path}"])
    logs = []
    trainer = Trainer(config, log=logs.append)
    trainer.fit()
    assert trainer.memory.engine("actor").staging.staged_groups == []
    assert not any(line.startswith("per-phase placement") for line in logs)


def test_an_oom_in_a_rollout_that_keeps_groups_drops_them_and_retries_the_whole_batch(tmp_path):
    from tests.trainer.test_training import TINY
    from trainer.config import load_config
    from trainer.loop import Trainer

    config = load_config(None, [
        *TINY, "actor_rollout_ref.actor.fsdp_config.offload_policy={embedding: cpu, lm_head: cpu}",
        "trainer.total_training_steps=1", f"trainer.runs_dir={tmp_path}"])
    logs = []
    trainer = Trainer(config, log=logs.append, memory_probe=Probe(used=0, total=10**9))
    engine = trainer.memory.engine("actor")
    sample = trainer.rollout.sample
    attempts = []

    def generate_failing_once(prompt_ids, prompt_mask):
        attempts.append((len(prompt_ids), sorted(engine.staging.staged_groups)))
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return sample(prompt_ids, prompt_mask)

    trainer.rollout.sample = generate_failing_once
    trainer.fit()
    batch = config.data.train_batch_size
    assert attempts == [(batch, ["embedding", "lm_head"]), (batch, [])]  # the same batch, now streaming
    assert trainer.metrics_log.read()[0]["perf/oom_recoveries"] == 1
    assert "out of GPU memory: the actor's lm_head and embedding stream for the rest of the rollout phase, " \
           "retrying" in logs


def test_dynamic_layers_come_to_the_gpu_once_every_model_is_placed_leaving_room_for_the_kept_groups(
        tmp_path, monkeypatch):
    from tests.trainer.test_training import TINY
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.memory import MemoryManager

    fsdp = "actor_rollout_ref.actor.fsdp_config"
    config = load_config(None, [
        *TINY, "actor_rollout_ref.model.override_config={num_hidden_layers: 6, hidden_size: 32, intermediate_size: 64}",
        f"{fsdp}.offload_policy={{embedding: cpu, lm_head: cpu}}", f"{fsdp}.dynamic_offload.enabled=true",
        "trainer.total_training_steps=1", f"trainer.runs_dir={tmp_path}"])
    sizes = {}

    class SizedProbe:
        """Room below the 0.85 threshold for the kept head and embedding and four and a half layers: one layer and the
        three ring slots its five streamed ones rotate through fit, two layers and the ring do not. In use: the ring
        slots the layers stream through while all of them stream."""

        def __call__(self):
            if not sizes:
                return 0, 10**12  # while the models are placed
            return sizes["ring"], int((sizes["kept"] + 4.5 * sizes["layer"]) / 0.85)

    logs = []
    original = MemoryManager.finish_placement

    def fit_with_sizes(memory):
        [engine] = memory.dynamic_engines
        assert engine.layers_on_gpu == 0 and len(memory.engines) == 2  # the critic is placed too
        sizes.update(kept=sum(engine.stageable_bytes().values()), layer=engine.layer_bytes,
                     ring=len(engine.streamer.layer_ring) * engine.layer_bytes)
        original(memory)

    monkeypatch.setattr(MemoryManager, "finish_placement", fit_with_sizes)
    trainer = Trainer(config, log=logs.append, memory_probe=SizedProbe())
    [engine] = trainer.memory.dynamic_engines
    assert engine.layers_on_gpu == 1 and engine.moves == {"to_cpu": 0, "to_gpu": 0}
    assert "dynamic offload: the actor starts with 1 of 6 transformer layers on the GPU (GPU memory threshold " \
           "0.85)" in logs
