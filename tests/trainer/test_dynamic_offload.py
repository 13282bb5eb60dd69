"""Dynamic offload: the controller's decisions from an injected memory probe, and the engine moving
transformer layers between the device and the host arena without changing a number."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.trainer.test_offload import POLICIES, offloaded, policy, token_batch, train
from trainer.config.live import LiveSettings
from trainer.config.messages import SettingsMessage
from trainer.offload.dynamic import ModelLayers, plan_layers

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


def plan(models, usage: float, *, bring_back: bool, **values) -> dict[str, int]:
    """The new layers on the GPU per model, for memory in use `usage` of a 100 GB device."""
    decisions = plan_layers(models, used=int(usage * 100 * GB), total=100 * GB, settings=settings(**values),
                            bring_back=bring_back)
    return {role: decision.layers_on_gpu for role, decision in decisions.items()}


def test_enough_layers_move_to_get_under_the_threshold_at_once():
    decisions = plan_layers([layers(layer_bytes=int(1.5 * GB))], used=91 * GB, total=100 * GB,
                            settings=settings(gpu_memory_threshold=0.85), bring_back=False)
    # 6 GB over the threshold, 1.5 GB a layer: four layers.
    assert decisions["actor"].layers_on_gpu == 24
    assert decisions["actor"].describe().startswith(
        "dynamic offload: 4 layers to CPU (GPU memory 0.91 > threshold 0.85")
    # Layers of unknown size: one at a time.
    assert plan([layers()], 0.9, bring_back=False, gpu_memory_threshold=0.85) == {"actor": 27}


def test_layers_come_back_only_at_a_step_end_and_as_many_as_fit_below_the_margin_at_once():
    model = layers(on_gpu=10, layer_bytes=4 * GB)
    # Between micro-batches and decode chunks the memory in use is not the step's peak: nothing comes back.
    assert plan([model], 0.5, bring_back=False, gpu_memory_threshold=0.85) == {}
    # At a step's end, from its peak of 50 GB: 30 GB below 0.85 - 0.05, seven 4 GB layers.
    assert plan([model], 0.5, bring_back=True, gpu_memory_threshold=0.85) == {"actor": 17}
    assert plan([layers(on_gpu=26, layer_bytes=4 * GB)], 0.5, bring_back=True) == {"actor": 28}  # all there are


def test_the_placement_settles_and_then_moves_nothing():
    """A step's peak is what the rest of the step holds plus its layers on the GPU: from any start the
    layers reach a placement within two steps and stay there."""
    for start in (0, 5, 28):
        model, moves = layers(on_gpu=start, layer_bytes=2 * GB), []
        for _ in range(8):
            peak = 30 * GB + model.layers_on_gpu * model.layer_bytes
            decision = plan_layers([model], used=peak, total=100 * GB, settings=settings(gpu_memory_threshold=0.85),
                                   bring_back=True).get("actor")
            moves.append(decision.moved if decision else 0)
            if decision:
                model = layers(on_gpu=decision.layers_on_gpu, layer_bytes=2 * GB)
        assert moves[2:] == [0] * 6, (start, moves)
        # Settled with the peak in the band where nothing moves: at most the threshold, and less than a
        # layer below the margin (0.85 - 0.05) that brings layers back.
        assert 80 - 2 < 30 + 2 * model.layers_on_gpu <= 85, (start, model.layers_on_gpu)


def test_hysteresis_keeps_layers_where_they_are_just_below_the_threshold():
    model = layers(on_gpu=10, layer_bytes=GB)
    for usage in (0.82, 0.84, 0.81, 0.849):
        assert plan([model], usage, bring_back=True, gpu_memory_threshold=0.85) == {}
    # A layer that would push the peak above the margin stays out.
    assert plan([layers(on_gpu=9, layer_bytes=6 * GB)], 0.75, bring_back=True) == {}
    assert plan([layers(on_gpu=9, layer_bytes=4 * GB)], 0.75, bring_back=True) == {"actor": 10}


def test_never_below_the_minimum_and_a_raised_minimum_brings_layers_back():
    model = layers(on_gpu=6, total=6, layer_bytes=GB)
    assert plan([model], 0.99, bring_back=False, gpu_memory_threshold=0.5, min_transformer_layers_on_gpu=3) == {
        "actor": 3}
    assert plan([layers(on_gpu=3, total=6)], 0.99, bring_back=False, min_transformer_layers_on_gpu=5) == {"actor": 5}


def test_a_live_threshold_change_acts_at_the_next_decision():
    model = layers(layer_bytes=5 * GB)
    assert plan([model], 0.8, bring_back=True, gpu_memory_threshold=0.85) == {}
    assert plan([model], 0.8, bring_back=False, gpu_memory_threshold=0.6) == {"actor": 24}


def test_disabled_never_moves():
    for usage in (0.99, 0.1):
        assert plan([layers(on_gpu=10)], usage, bring_back=True, gpu_memory_threshold=0.5,
                    **{"dynamic_offload.enabled": False}) == {}


def test_layers_leave_the_least_used_model_first_and_come_back_to_the_most_used_first():
    models = [layers("actor", 10, 10, GB), layers("critic", 10, 10, GB), layers("ref", 3, 10, GB)]
    # 5 GB over: the reference (used once a step) gives its 3, then the critic 2; the actor keeps all.
    assert plan(models, 0.9, bring_back=False, gpu_memory_threshold=0.85) == {"ref": 0, "critic": 8}
    models = [layers("actor", 4, 10, GB), layers("critic", 4, 10, GB), layers("ref", 0, 10, GB)]
    # 9 GB of room below the margin: the actor's six first, then three of the critic's.
    assert plan(models, 0.71, bring_back=True, gpu_memory_threshold=0.85) == {"actor": 10, "critic": 7}


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
            values = {**self.trainer.live_settings.public(), "gpu_memory_threshold": self.threshold}
            self.link.inbox.append(SettingsMessage(version=2, values=LiveSettings.model_validate(values)))


# The keys that give a model 3 transformer layers and dynamic offload.
SHAPE_AND_DYNAMIC_OFFLOAD = {
    "actor": ("actor_rollout_ref.model.override_config", "actor_rollout_ref.actor.fsdp_config"),
    "critic": ("critic.model.override_config", "critic.fsdp_config"),
}


def trainer_whose_threshold_drops(tmp_path, role: str, steps: int):
    """A tiny PPO run where only `role` has dynamic offload (3 transformer layers, at least 1 on the GPU) on a
    probed GPU 80% in use; after step 1 the daemon lowers the live threshold from 0.9 to 0.7."""
    from tests.trainer.test_training import TINY, FakeDaemonLink
    from trainer.config import load_config
    from trainer.loop import Trainer

    shape, fsdp = SHAPE_AND_DYNAMIC_OFFLOAD[role]
    config = load_config(None, [
        *TINY, f"{shape}={{num_hidden_layers: 3, hidden_size: 32, intermediate_size: 64}}",
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
    assert [row["offload/transformer_layers_on_gpu"] - others for row in rows] == [3, 1, 1]
    # Each model's own count too: the actor's is the one that moved.
    assert [row[f"offload/{engine.role}/transformer_layers_on_gpu"] for row in rows] == [3, 1, 1]
    assert {key for key in rows[0] if key.endswith("/transformer_layers_on_gpu")} == {
        "offload/transformer_layers_on_gpu", *(f"offload/{other.role}/transformer_layers_on_gpu"
                                               for other in trainer.memory.engines)}
    assert [row["offload/moves_to_cpu"] for row in rows] == [0, 2, 0]
    assert [row["offload/moves_to_gpu"] for row in rows] == [0, 0, 0]
    assert all(row["perf/oom_recoveries"] == 0 for row in rows)
    assert engine.layers_on_gpu == 1
    # 10 GB over the threshold and layers of a few KiB: all it may move go at once, down to the minimum.
    assert [line for line in logs if line.startswith("dynamic offload")] == [
        "dynamic offload: 2 layers to CPU (GPU memory 0.80 > threshold 0.70; 1 on GPU) [actor]"]


def test_a_run_where_only_the_critic_enables_dynamic_offload_moves_the_critics_layers(tmp_path):
    """The live switch starts on when any model enables dynamic offload: it once followed the actor's section,
    so a run where only the critic enabled it started paused and never moved a layer."""
    trainer, logs = trainer_whose_threshold_drops(tmp_path, "critic", steps=2)
    trainer.fit()
    assert [row["offload/critic/transformer_layers_on_gpu"] for row in trainer.metrics_log.read()] == [3, 1]
    assert [line for line in logs if line.startswith("dynamic offload")] == [
        "dynamic offload: 2 layers to CPU (GPU memory 0.80 > threshold 0.70; 1 on GPU) [critic]"]
