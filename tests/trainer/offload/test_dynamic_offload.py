"""Dynamic offload: the controller's decisions from an injected memory probe, and the engine moving
transformer layers between the device and the host arena without changing a number."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.trainer.offload.test_offload import POLICIES, offloaded, policy, token_batch, train
from trainer.config.live import LiveSettings
from trainer.config.messages import OffloadMessage, SettingsMessage
from trainer.offload.dynamic import ModelLayers, PhasePlanner, plan_layers

GB = 10**9


class Probe:
    """A memory probe whose usage the test sets: (used, total) of a 100 GB device."""

    def __init__(self, usage: float = 0.5):
        self.usage = usage

    def __call__(self) -> tuple[int, int]:
        return int(self.usage * 100 * GB), 100 * GB


def settings(**values) -> LiveSettings:
    return LiveSettings.model_validate({"dynamic_offload.enabled": True, **values})


def layers(role: str = "actor", on_gpu: int = 28, total: int = 28, layer_bytes: int = 0) -> ModelLayers:
    return ModelLayers(role, on_gpu, total, layer_bytes)


def plan(models, usage: float, **values) -> dict[str, int]:
    """The new layers on the GPU per model at a safe point, for memory in use `usage` of a 100 GB device."""
    decisions = plan_layers(models, used=int(usage * 100 * GB), total=100 * GB, settings=settings(**values))
    return {role: decision.layers_on_gpu for role, decision in decisions.items()}


def test_enough_layers_move_to_get_under_the_threshold_at_once():
    decisions = plan_layers([layers(layer_bytes=int(1.5 * GB))], used=91 * GB, total=100 * GB,
                            settings=settings(gpu_memory_threshold=0.85))
    # 6 GB over the threshold, 1.5 GB a layer: four layers.
    assert decisions["actor"].layers_on_gpu == 24
    assert decisions["actor"].describe().startswith(
        "dynamic offload: 4 layers to CPU (GPU memory 0.91 > threshold 0.85")
    # Layers of unknown size: one at a time.
    assert plan([layers()], 0.9, gpu_memory_threshold=0.85) == {"actor": 27}


def test_a_safe_point_never_brings_layers_back():
    """Between micro-batches and decode chunks the memory in use is not a phase's peak: a layer brought
    back there went out again in the update (issue 14: three moves a step)."""
    assert plan([layers(on_gpu=10, layer_bytes=4 * GB)], 0.1, gpu_memory_threshold=0.85) == {}


def test_never_below_the_minimum_and_a_raised_minimum_brings_layers_back():
    model = layers(on_gpu=6, total=6, layer_bytes=GB)
    assert plan([model], 0.99, gpu_memory_threshold=0.5, min_transformer_layers_on_gpu=3) == {"actor": 3}
    assert plan([layers(on_gpu=3, total=6)], 0.99, min_transformer_layers_on_gpu=5) == {"actor": 5}


def test_a_live_threshold_change_acts_at_the_next_decision():
    model = layers(layer_bytes=5 * GB)
    assert plan([model], 0.8, gpu_memory_threshold=0.85) == {}
    assert plan([model], 0.8, gpu_memory_threshold=0.6) == {"actor": 24}


def test_disabled_never_moves():
    for usage in (0.99, 0.1):
        assert plan([layers(on_gpu=10)], usage, gpu_memory_threshold=0.5, **{"dynamic_offload.enabled": False}) == {}


def test_layers_leave_the_least_used_model_first():
    models = [layers("actor", 10, 10, GB), layers("critic", 10, 10, GB), layers("ref", 3, 10, GB)]
    # 5 GB over: the reference (used once a step) gives its 3, then the critic 2; the actor keeps all.
    assert plan(models, 0.9, gpu_memory_threshold=0.85) == {"ref": 0, "critic": 8}


# ------------------------------------------------------------------------------- the phase planner


def place(planner: PhasePlanner, phase: str, running: str, models, used_gb: float, *, training: bool = False,
          reserve_gb: float = 0, passes: int | None = None, **values):
    placed = planner.plan(phase, running, models, used=int(used_gb * GB), total=100 * GB,
                          settings=settings(**values), reserve=int(reserve_gb * GB), training=training, passes=passes)
    return placed.counts, placed.new


def test_a_phases_first_run_frees_the_other_models_room_and_keeps_the_running_models_layers():
    planner = PhasePlanner()
    models = [layers("actor", 10, 20, GB), layers("critic", 8, 20, GB)]
    # What the rollout needs besides the layers is not known yet: the critic (not run) gives its layers down to
    # the minimum, the actor keeps its 10 (not more: its peak is measured first).
    assert place(planner, "rollout/actor", "actor", models, 30, min_transformer_layers_on_gpu=1) == (
        {"actor": 10, "critic": 1}, True)
    # Learned: it needs 10 GB besides its layers. Of 0.9 - 0.02 of 100 GB, less 30 - 10 - 8 = 12 GB of the rest
    # and 10 GB of working memory, 66 GB are the actor's: its 20 layers; the critic gives no more than it must.
    planner.learn("rollout/actor", 10 * GB)
    models = [layers("actor", 10, 20, GB), layers("critic", 1, 20, GB)]
    assert place(planner, "rollout/actor", "actor", models, 23, gpu_memory_threshold=0.9,
                 min_transformer_layers_on_gpu=1) == ({"actor": 20, "critic": 1}, True)


def test_the_running_model_takes_the_room_of_the_least_used_model_first():
    planner = PhasePlanner()
    planner.learn("training/actor", 20 * GB)
    models = [layers("actor", 0, 10, 2 * GB), layers("critic", 10, 10, 2 * GB), layers("ref", 10, 10, 2 * GB)]
    # 60 GB in use (the critic's and the reference's 40, 20 else) and 20 GB of working memory, below 0.88 of
    # 100 GB: 8 GB of room. The actor's 10 layers cost 4 GB each in training (weights and gradients): 40 GB,
    # 32 short: the reference (used once a step) gives all 10 of its 2 GB layers, then the critic 6.
    counts, new = place(planner, "training/actor", "actor", models, 60, training=True, gpu_memory_threshold=0.9,
                        min_transformer_layers_on_gpu=0)
    assert new and counts == {"actor": 10, "critic": 4, "ref": 0}
    # Without training's gradients a layer costs its weights: the reference gives 6.
    planner.learn("scoring/actor", 20 * GB)
    counts, _ = place(planner, "scoring/actor", "actor", models, 60, gpu_memory_threshold=0.9,
                      min_transformer_layers_on_gpu=0)
    assert counts == {"actor": 10, "critic": 10, "ref": 4}


def test_a_phase_that_runs_its_layers_once_takes_no_other_models_room():
    """A layer taken from the actor costs a copy at the phase's start and one when the actor needs it back, neither
    overlapped with compute: more than streaming the reference's layer once or twice (overlapped). A scoring of one or
    two micro-batches streams what the free room does not hold; of three or more it takes."""
    models = [layers("actor", 10, 10, GB), layers("ref", 0, 10, GB)]
    for passes, expected in ((1, {"actor": 10, "ref": 3}), (2, {"actor": 10, "ref": 3}), (3, {"actor": 3, "ref": 10})):
        planner = PhasePlanner()
        planner.learn("scoring/ref", 5 * GB)
        assert place(planner, "scoring/ref", "ref", models, 80, gpu_memory_threshold=0.9,
                     min_transformer_layers_on_gpu=0, passes=passes)[0] == expected, passes
        # Nor does its first run free the other models' room.
        first = PhasePlanner().plan("scoring/ref", "ref", models, used=80 * GB, total=100 * GB, passes=passes,
                                    settings=settings(gpu_memory_threshold=0.9, min_transformer_layers_on_gpu=0))
        assert first.counts["actor"] == (10 if passes < 3 else 0)


def test_a_phase_of_few_passes_still_takes_the_room_it_needs_to_run():
    """Few passes spare the other models' layers only while the phase fits without them: at its minimum of layers
    it takes what its working memory needs. And a training phase's first run (one merged micro-batch: two passes)
    frees the other models' room, as any first run of many passes does."""
    models = [layers("actor", 10, 10, GB), layers("ref", 0, 10, GB)]
    planner = PhasePlanner()
    planner.learn("scoring/ref", 12 * GB)  # 88 - 80 = 8 GB of room, 4 short: the actor gives 4 layers
    assert place(planner, "scoring/ref", "ref", models, 80, gpu_memory_threshold=0.9,
                 min_transformer_layers_on_gpu=0, passes=1)[0] == {"actor": 6, "ref": 0}
    critic = [layers("actor", 10, 10, GB), layers("critic", 0, 10, GB)]
    first = PhasePlanner().plan("training/critic", "critic", critic, used=80 * GB, total=100 * GB, passes=2,
                                training=True,
                                settings=settings(gpu_memory_threshold=0.9, min_transformer_layers_on_gpu=0))
    assert first.counts == {"actor": 0, "critic": 0}


def test_a_phase_keeps_its_plan_while_it_fits_and_plans_again_when_it_does_not():
    planner = PhasePlanner()
    planner.learn("rollout/actor", 10 * GB)
    models = [layers("actor", 0, 40, GB), layers("critic", 40, 40, GB)]
    counts, new = place(planner, "rollout/actor", "actor", models, 50, gpu_memory_threshold=0.9,
                        min_transformer_layers_on_gpu=0)
    # 88 GB: 10 besides, 10 working, room for 68 layers: the actor's 40 and 28 of the critic's.
    assert new and counts == {"actor": 40, "critic": 28}
    # Next step the models are back where the other phases put them and a little more is in use (longer
    # sequences): the same plan, not a new one (no dynamic-offload move).
    for extra in (0.0, 0.5, 1.5):
        assert place(planner, "rollout/actor", "actor", models, 50 + extra, gpu_memory_threshold=0.9,
                     min_transformer_layers_on_gpu=0) == ({"actor": 40, "critic": 28}, False)
    # Once it would go over the threshold (3 GB more in use), it plans again.
    assert place(planner, "rollout/actor", "actor", models, 53, gpu_memory_threshold=0.9,
                 min_transformer_layers_on_gpu=0) == ({"actor": 40, "critic": 25}, True)
    # So does a phase found to need more (an out-of-memory error, a longer workload) ...
    planner.learn("rollout/actor", 14 * GB)
    assert place(planner, "rollout/actor", "actor", models, 53, gpu_memory_threshold=0.9,
                 min_transformer_layers_on_gpu=0) == ({"actor": 40, "critic": 21}, True)
    # ... and a live threshold change, down or up.
    assert place(planner, "rollout/actor", "actor", models, 53, gpu_memory_threshold=0.95,
                 min_transformer_layers_on_gpu=0) == ({"actor": 40, "critic": 26}, True)


def test_the_groups_a_phase_keeps_count_once_its_working_memory_is_learned():
    """A phase's working memory is measured from its start, before it keeps its head and embedding on the GPU, so the
    learned figure holds them: the plan subtracts it alone, not the kept groups (`reserve`) on top. Unlearned, the
    kept groups are what the plan reserves."""
    models = [layers("actor", 0, 40, GB), layers("critic", 40, 40, GB)]
    first = place(PhasePlanner(), "rollout/actor", "actor", models, 50, reserve_gb=3, gpu_memory_threshold=0.9,
                  min_transformer_layers_on_gpu=0)[0]
    assert first == {"actor": 0, "critic": 0}  # the first run frees the room; what it needs is learned
    planner = PhasePlanner()
    planner.learn("rollout/actor", 5 * GB)  # 3 GB of kept groups and 2 of the decode's own
    # 88 GB less 10 of the rest, 40 of the critic's and 5 of working memory: 33 for the actor's 40; the critic gives 7.
    assert place(planner, "rollout/actor", "actor", models, 50, reserve_gb=3, gpu_memory_threshold=0.9,
                 min_transformer_layers_on_gpu=0)[0] == {"actor": 40, "critic": 33}


def test_a_phase_never_goes_below_the_minimum_and_paused_moves_nothing():
    planner = PhasePlanner()
    planner.learn("rollout/actor", 95 * GB)
    models = [layers("actor", 5, 10, GB), layers("critic", 5, 10, GB)]
    assert place(planner, "rollout/actor", "actor", models, 10, min_transformer_layers_on_gpu=2)[0] == {
        "actor": 2, "critic": 2}
    assert place(PhasePlanner(), "rollout/actor", "actor", models, 99, **{"dynamic_offload.enabled": False}) == (
        {"actor": 5, "critic": 5}, False)


def test_the_ring_its_streamed_layers_need_counts_so_a_phase_keeps_every_layer_when_that_costs_no_more():
    """The H200 headline's rollout (issue 14): a 7B actor's 28 layers of 0.43 GB with 3 ring slots, after an update
    that kept 14 (so 17 slots in use). Counting only the layers, 27 fitted and one layer streamed through a ring slot
    of its own size: the memory of all 28, and a decode without CUDA graphs (one layer streamed: 28-51 ms a token)."""
    layer = int(0.4345 * GB)
    actor = ModelLayers("actor", 14, 28, layer, ring_slots=3)

    def rollout(room_in_layers: float) -> int:
        """The actor's layers on the GPU for a rollout with room for this many layers' bytes below 0.88."""
        planner = PhasePlanner()
        planner.learn("rollout/actor", 2 * GB)
        rest = 88 * GB - 2 * GB - room_in_layers * layer  # other models, the working memory: the rest of 0.88
        placed = planner.plan("rollout/actor", "actor", [actor], used=int(rest + actor.device_bytes(14)),
                              total=100 * GB, settings=settings(gpu_memory_threshold=0.9,
                                                                min_transformer_layers_on_gpu=0))
        return placed.counts["actor"]

    assert rollout(28.2) == 28
    # Room for 27.5 layers: 24 stay (24 layers and 3 ring slots are 27 layers' worth), never 25 to 27.
    assert rollout(27.5) == 24
    assert rollout(10) == 7


def test_layers_leave_in_numbers_that_free_memory_and_trading_places_with_the_ring_frees_none():
    layer = GB
    resident = ModelLayers("actor", 10, 10, layer, ring_slots=3)
    # 0.5 GB over: one layer streamed takes a ring slot of its size, so it takes four to free one layer's bytes.
    assert plan([resident], 0.855, gpu_memory_threshold=0.85) == {"actor": 6}
    assert resident.device_bytes(10) - resident.device_bytes(6) == layer
    # After an out-of-memory error: half of what the layers above the minimum could free (7 of them: 7 - 3 ring)...
    from trainer.offload.dynamic import relieve_layers
    assert relieve_layers([resident], 3) == {"actor": 5}
    # ... and nothing when they would only trade places with ring slots (then the caller drops kept groups instead).
    assert relieve_layers([ModelLayers("actor", 3, 3, layer, ring_slots=3)], 0) == {}
    # The start: every layer streamed, its 3 ring slots in use among 13 GB. Below 20 GB, all 10 layers fit in the ring's
    # and the 7 more layers' bytes (counting only the layers, 7 stayed and 3 streamed through the same memory)...
    from trainer.offload.dynamic import layers_that_fit
    assert layers_that_fit(lambda: (13 * GB, 100 * GB), threshold=0.2, layer_bytes=layer, total_layers=10,
                           ring_slots=3) == 10
    # ... and below 18 GB, 5 layers and the ring.
    assert layers_that_fit(lambda: (13 * GB, 100 * GB), threshold=0.18, layer_bytes=layer, total_layers=10,
                           ring_slots=3) == 5


class Step:
    """A device and a step of four phases, each needing some working memory besides the layers (training
    also the running model's layer gradients), planned the way the memory manager plans them."""

    NEEDS = {"rollout/actor": ("actor", 6, False), "scoring/critic": ("critic", 4, False),
             "training/critic": ("critic", 12, True), "training/actor": ("actor", 20, True)}

    def __init__(self):
        self.counts = {"actor": 12, "critic": 12}
        self.planner = PhasePlanner()
        self.base = 10  # GB in use besides the layers

    def run(self) -> tuple[int, float]:
        """One step: the new plans, and the highest peak (GB) any phase reached."""
        new_plans, highest = 0, 0.0
        for phase, (running, working, training) in self.NEEDS.items():
            models = [layers(role, count, 30, GB) for role, count in self.counts.items()]
            placed = self.planner.plan(phase, running, models, used=int(self.used() * GB), total=100 * GB,
                                       settings=settings(gpu_memory_threshold=0.9, min_transformer_layers_on_gpu=0),
                                       training=training)
            new_plans += placed.new
            self.counts = placed.counts
            peak = self.used() + working + (self.counts[running] if training else 0)
            highest = max(highest, peak)
            self.planner.learn(phase, (peak - self.used() - (self.counts[running] if training else 0)) * GB)
        return new_plans, highest

    def used(self) -> float:
        return self.base + sum(self.counts.values())


def test_the_phases_settle_within_two_steps_and_then_change_nothing():
    """Issue 14: the controller moved layers three times a step and never settled. The planner learns each
    phase's need in the first step, plans once for it in the second, and from then on places the same
    layers each step: no new plan, and no phase over the threshold."""
    step = Step()
    runs = [step.run() for _ in range(6)]
    assert [new for new, _ in runs] == [4, 4, 0, 0, 0, 0]
    assert all(peak <= 90 for _, peak in runs[1:]), runs
    # The training of the actor, the largest, gets all 30 of its layers: 10 + 30 x 2 (gradients) + 20 = 90 GB
    # is over 0.88 of 100, so 29, and the critic gives way.
    assert step.counts["actor"] == 29 and step.counts["critic"] == 0


# ------------------------------------------------------------------------------------ the engine

DYNAMIC = {"dynamic_offload": {"enabled": True}}


def test_moving_layers_keeps_the_forward_and_counts_the_moves():
    model = policy().eval()
    engine = offloaded(model, DYNAMIC)
    ids = token_batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert engine.layers_on_gpu == 4
        for count, moved in ((1, (3, 0)), (0, (1, 0)), (3, (0, 3)), (3, (0, 0)), (4, (0, 1))):
            assert engine.set_transformer_layers_on_gpu(count) == moved
            assert engine.layers_on_gpu == count
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert engine.moves == {"to_cpu": 4, "to_gpu": 4}
    streamed = [unit.blocks[0].streamed for unit in engine.transformer_units]
    assert streamed == [False] * 4


class SlotBudget:
    """The engine's device slots under a memory cap: one that would go over it raises
    torch.OutOfMemoryError, as CUDA does; a slot's bytes come back when its tensor is freed."""

    def __init__(self, monkeypatch, cap: int):
        from trainer.offload import units as units_module

        self.cap, self.live, self.peak = cap, 0, 0
        allocate = units_module.Slot.__init__

        def init(slot, nbytes, device):
            if self.live + nbytes > self.cap:
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {self.live} + {nbytes} > {self.cap})")
            allocate(slot, nbytes, device)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(slot.data, self._free, nbytes)

        monkeypatch.setattr(units_module.Slot, "__init__", init)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def test_a_move_gives_device_memory_back_before_it_asks_for_more(monkeypatch):
    reference = policy().eval()
    model = policy().eval()
    layer = offloaded(policy(), DYNAMIC).layer_bytes
    budget = SlotBudget(monkeypatch, cap=4 * layer)  # exactly the four layers' own slots
    engine = offloaded(model, DYNAMIC)
    ids = token_batch()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        # To the CPU: three own slots go before the ring of three is made; back: the ring's slots change hands.
        for count in (1, 4, 0, 2):
            engine.set_transformer_layers_on_gpu(count)
            assert engine.layers_on_gpu == count and budget.peak <= 4 * layer
            gc.collect()
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
        # Tighter still: one streamed layer needs a ring slot too, so under 3 layers' worth none can
        # come back (not even one: 1 on the GPU + 3 streamed needs 1 + 3 slots).
        engine.set_transformer_layers_on_gpu(0)
        gc.collect()
        budget.cap = 3 * layer
        assert engine.set_transformer_layers_on_gpu(4) == (0, 0)
        assert engine.layers_on_gpu == 0
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_layers_that_cannot_all_come_back_leave_room_for_the_ring(monkeypatch):
    six = {"override_config": {"num_hidden_layers": 6}}
    reference = policy(**six).eval()
    model = policy(**six).eval()
    layer = offloaded(policy(**six), DYNAMIC).layer_bytes
    budget = SlotBudget(monkeypatch, cap=6 * layer)
    engine = offloaded(model, DYNAMIC)
    engine.set_transformer_layers_on_gpu(0)  # a ring of three
    gc.collect()
    budget.cap = 5 * layer
    # Six back would need 6 slots; k back and 6 - k streamed need k + min(3, 6 - k): at most 5 for k <= 2.
    assert engine.set_transformer_layers_on_gpu(6) == (0, 2)
    assert engine.layers_on_gpu == 2
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_moving_layers_between_steps_and_micro_batches_trains_as_resident():
    expected_losses, expected_weights, _ = train({})
    moves = iter([2, 0, 4, 1, 3, 2])

    losses, weights, engine = train({**POLICIES["optimizer_offload"], **DYNAMIC},
                                    before_micro_batch=lambda engine: engine.set_transformer_layers_on_gpu(next(moves)))
    assert losses == pytest.approx(expected_losses, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    assert engine.moves["to_cpu"] > 0 and engine.moves["to_gpu"] > 0


def test_layers_move_only_between_passes_and_only_with_dynamic_offload():
    model = policy().train()
    engine = offloaded(model, DYNAMIC)
    calls = []

    def move_inside(*_):
        with pytest.raises(RuntimeError, match="between passes"):
            engine.set_transformer_layers_on_gpu(0)
        calls.append(1)

    model.model.layers[1].register_forward_pre_hook(move_inside)
    model(input_ids=token_batch())
    assert calls and engine.layers_on_gpu == 4
    with pytest.raises(RuntimeError, match="dynamic_offload.enabled"):
        offloaded(policy(), POLICIES["all_cpu"]).set_transformer_layers_on_gpu(2)


# ------------------------------------------------------------------------------------ the trainer

class ThresholdChange:
    """A step observer that sends the trainer a new gpu_memory_threshold after `after_step`, the way
    `PATCH /v1/settings` reaches it (a settings message from the daemon)."""

    def __init__(self, trainer, link, *, after_step: int, threshold: float):
        self.trainer, self.link, self.after_step, self.threshold = trainer, link, after_step, threshold

    def on_step(self, step, metrics):
        if step == self.after_step:
            values = {**self.trainer.settings.current.public(), "dynamic_offload.gpu_memory_threshold": self.threshold}
            self.link.inbox.append(SettingsMessage(version=2, values=LiveSettings.model_validate(values)))


# The keys that give a model 3 transformer layers and dynamic offload.
SHAPE_AND_DYNAMIC_OFFLOAD = {
    "actor": ("actor_rollout_ref.model.override_config", "actor_rollout_ref.actor.fsdp_config"),
    "critic": ("critic.model.override_config", "critic.fsdp_config"),
}


def trainer_whose_threshold_drops(tmp_path, role: str, steps: int):
    """A tiny PPO run where only `role` has dynamic offload (6 transformer layers, at least 1 on the GPU) on a
    probed GPU 80% in use; after step 1 the daemon lowers the live threshold from 0.9 to 0.7. (Six: with the
    engine's three ring slots, a model of three layers frees nothing by streaming two of them.)"""
    from tests.trainer.test_training import TINY, FakeDaemonLink
    from trainer.config import load_config
    from trainer.loop import Trainer

    shape, fsdp = SHAPE_AND_DYNAMIC_OFFLOAD[role]
    config = load_config(None, [
        *TINY, f"{shape}={{num_hidden_layers: 6, hidden_size: 32, intermediate_size: 64}}",
        f"{fsdp}.dynamic_offload.enabled=true",
        "dynamic_offload={gpu_memory_threshold: 0.9, min_transformer_layers_on_gpu: 1}",
        f"trainer.total_training_steps={steps}", f"trainer.runs_dir={tmp_path}"])
    logs: list[str] = []
    link = FakeDaemonLink()
    trainer = Trainer(config, log=logs.append, telemetry=link, memory_probe=Probe(0.8))
    trainer.observers.append(ThresholdChange(trainer, link, after_step=1, threshold=0.7))
    return trainer, logs


def test_a_live_threshold_change_moves_layers_within_one_step(tmp_path):
    trainer, logs = trainer_whose_threshold_drops(tmp_path, "actor", steps=3)
    [engine] = trainer.memory.dynamic_engines
    trainer.fit()
    rows = trainer.metrics_log.read()
    others = sum(other.layers_on_gpu for other in trainer.memory.engines if other is not engine)
    assert [row["offload/transformer_layers_on_gpu"] - others for row in rows] == [6, 1, 1]
    # Each model's own count too: the actor's is the one that moved.
    assert [row[f"offload/{engine.role}/transformer_layers_on_gpu"] for row in rows] == [6, 1, 1]
    assert {key for key in rows[0] if key.endswith("/transformer_layers_on_gpu")} == {
        "offload/transformer_layers_on_gpu", *(f"offload/{other.role}/transformer_layers_on_gpu"
                                               for other in trainer.memory.engines)}
    assert [row["offload/moves_to_cpu"] for row in rows] == [0, 5, 0]
    assert [row["offload/moves_to_gpu"] for row in rows] == [0, 0, 0]
    assert all(row["perf/oom_recoveries"] == 0 for row in rows)
    assert engine.layers_on_gpu == 1
    # 10 GB over the threshold and layers of a few KiB: all it may move go at once, down to the minimum.
    assert [line for line in logs if line.startswith("dynamic offload")] == [
        "dynamic offload: 5 layers to CPU (GPU memory 0.80 > threshold 0.70; 1 on GPU) [actor]"]
    # Each offload message carries the phases' plans, for /v1/status.
    plans = trainer.control.telemetry.of_type(OffloadMessage)[-1].plans
    assert [plan.phase for plan in plans] == ["rollout/actor", "scoring/actor", "training/actor"]
    assert all(plan.layers_on_gpu == {"actor": 1} and plan.threshold == 0.7 and plan.working_bytes is not None
               for plan in plans), plans


def test_a_run_where_only_the_critic_enables_dynamic_offload_moves_the_critics_layers(tmp_path):
    """The live switch starts on when any model enables dynamic offload: it once followed the actor's section,
    so a run where only the critic enabled it started paused and never moved a layer."""
    trainer, logs = trainer_whose_threshold_drops(tmp_path, "critic", steps=2)
    trainer.fit()
    assert [row["offload/critic/transformer_layers_on_gpu"] for row in trainer.metrics_log.read()] == [6, 1]
    assert [line for line in logs if line.startswith("dynamic offload")] == [
        "dynamic offload: 5 layers to CPU (GPU memory 0.80 > threshold 0.70; 1 on GPU) [critic]"]


def layer_slot_bytes(engine) -> int:
    """Device bytes of an engine's transformer layers: those kept on the device, and the ring slots its streamed
    layers rotate through."""
    return (engine.layers_on_gpu + len(engine.streamer.layer_ring)) * engine.layer_bytes


class LayerProbe:
    """A device that holds `base` bytes and the transformer layers the run's dynamic engines keep on it (their ring
    slots too), of `total` (set once the run is built, from its layers' size)."""

    def __init__(self):
        self.base, self.total, self.engines = 0, 1 << 40, []

    def __call__(self) -> tuple[int, int]:
        return self.base + sum(layer_slot_bytes(engine) for engine in self.engines), self.total


@pytest.mark.parametrize("reference_micro_batch", [16, 4], ids=["one_pass", "four_passes"])
def test_a_grpo_run_gives_each_phase_the_room_of_the_model_it_runs_and_settles(tmp_path, reference_micro_batch):
    """GRPO with a reference, both models' layers dynamic, on a device with room for 12 of their 16 layers' slots: the
    rollout and the update take the room they need from the reference, the reference's scoring takes the actor's
    when it runs its layers more than once (4 micro-batches of the 16 sequences), else streams what the free room
    does not hold (a layer taken would cost the actor a copy, as much as streaming it once; issue 14: a model used
    once a step streams before another model's hot layers do). From the third step on every step places the same
    and nothing counts as a move."""
    from tests.trainer.test_training import TINY, FakeDaemonLink
    from trainer.config import load_config
    from trainer.loop import Trainer

    eight = "{num_hidden_layers: 8, hidden_size: 32, intermediate_size: 64}"
    config = load_config(None, [
        *TINY, f"actor_rollout_ref.model.override_config={eight}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "critic.enable=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled=true",
        "actor_rollout_ref.ref.fsdp_config.dynamic_offload.enabled=true",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={reference_micro_batch}",
        "dynamic_offload={gpu_memory_threshold: 0.9, min_transformer_layers_on_gpu: 0}",
        "trainer.total_training_steps=5", f"trainer.runs_dir={tmp_path}"])
    probe = LayerProbe()
    logs: list[str] = []
    trainer = Trainer(config, log=logs.append, telemetry=FakeDaemonLink(), memory_probe=probe)
    engines = {engine.role: engine for engine in trainer.memory.dynamic_engines}
    assert set(engines) == {"actor", "ref"}
    layer = engines["actor"].layer_bytes
    probe.engines = list(engines.values())
    # 12 layers' room below the threshold less the planner's margin (0.88 of the device), beside 10 of the rest.
    probe.base, probe.total = 10 * layer, int(22.01 * layer / 0.88)
    seen: dict[str, list[tuple[int, int]]] = {}
    placed_for = trainer.memory.placed_for

    def watched(phase, role, passes=None):
        manager = placed_for(phase, role, passes)

        class Watch:
            def __enter__(self):
                manager.__enter__()
                seen.setdefault(f"{phase}/{role}", []).append((engines["actor"].layers_on_gpu,
                                                               engines["ref"].layers_on_gpu))

            def __exit__(self, *exc):
                return manager.__exit__(*exc)

        return Watch()

    trainer.memory.placed_for = watched
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert [row["offload/moves_to_cpu"] + row["offload/moves_to_gpu"] for row in rows][2:] == [0, 0, 0]
    # From the second step on (the first learns) each phase places the same: the model it runs takes what room it may
    # from the other, which keeps what is left. A model that streams any layer also holds its 3 ring slots. In the
    # update a layer costs twice (its gradients): 3 of the actor's fit (6 + its ring 3 + the reference's ring 3 = 12);
    # the rollout then brings the actor's other 5 back (8 + the reference's ring). The reference's scoring of 4
    # micro-batches takes the actor's layers for all 8 of its own (the actor keeps 1 and its ring); of one
    # micro-batch it gets the free room, 1 layer. (No reward model: its scoring places nothing.)
    takes = reference_micro_batch == 4
    expected = {"rollout/actor": (8, 0), "scoring/reward": (8, 0), "scoring/actor": (8, 0),
                "scoring/ref": (1, 8) if takes else (8, 1), "training/actor": (3, 0)}
    assert {phase: set(counts[1:]) for phase, counts in seen.items()} == {
        phase: {counts} for phase, counts in expected.items()}, seen
    # Layers copied in a step: 5 (rollout) + 8 (reference) + 2 (update), or 5 + 1 + 0.
    assert [row["offload/phase_swaps"] for row in rows][2:] == ([15] * 3 if takes else [6] * 3)
    assert [plan.split(":")[0] for plan in trainer.memory.plan_lines()] == [
        "rollout/actor", "scoring/actor", "scoring/ref", "training/actor"]
