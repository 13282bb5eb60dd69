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
from trainer.offload.dynamic import DynamicOffloadController

GB = 10**9


class Probe:
    """A memory probe whose usage the test sets: (used, total) of a 100 GB device."""

    def __init__(self, usage: float = 0.5):
        self.usage = usage

    def __call__(self) -> tuple[int, int]:
        return int(self.usage * 100 * GB), 100 * GB


def controller(probe: Probe, **settings) -> tuple[DynamicOffloadController, dict]:
    current = {"settings": LiveSettings.model_validate({"dynamic_offload.enabled": True, **settings})}
    return DynamicOffloadController(probe, lambda: current["settings"]), current


def run(control: DynamicOffloadController, probe: Probe, usages, *, layers: int, total: int = 28,
        layer_bytes: int = 0) -> list[int]:
    """Layers on the GPU after each decision, for a sequence of usages."""
    history = []
    for usage in usages:
        probe.usage = usage
        decision = control.decide(layers_on_gpu=layers, total_layers=total, layer_bytes=layer_bytes)
        if decision is not None:
            layers = decision.layers_on_gpu
        history.append(layers)
    return history


def test_rising_usage_moves_layers_out_and_falling_usage_brings_them_back_one_at_a_time():
    probe = Probe()
    control, _ = controller(probe, gpu_memory_threshold=0.85)
    assert run(control, probe, [0.5, 0.86, 0.9, 0.84, 0.7, 0.7], layers=28) == [28, 27, 26, 26, 27, 28]


def test_enough_layers_move_to_get_under_the_threshold_at_once():
    probe = Probe(0.91)
    control, _ = controller(probe, gpu_memory_threshold=0.85)
    decision = control.decide(layers_on_gpu=28, total_layers=28, layer_bytes=int(1.5 * GB))
    # 6 GB over the threshold, 1.5 GB a layer: four layers.
    assert decision.layers_on_gpu == 24
    assert decision.describe().startswith("dynamic offload: 4 layers to CPU (GPU memory 0.91 > threshold 0.85")


def test_hysteresis_keeps_layers_where_they_are_just_below_the_threshold():
    probe = Probe()
    control, _ = controller(probe, gpu_memory_threshold=0.85)
    # Between threshold - 0.05 and the threshold nothing moves, however often it is asked.
    assert run(control, probe, [0.86, 0.82, 0.84, 0.81, 0.83], layers=10) == [9, 9, 9, 9, 9]
    # A layer that would push usage back above the margin stays out.
    assert run(control, probe, [0.75, 0.75], layers=9, layer_bytes=6 * GB) == [9, 9]
    assert run(control, probe, [0.75], layers=9, layer_bytes=4 * GB) == [10]


def test_never_below_the_minimum_and_a_raised_minimum_brings_layers_back():
    probe = Probe()
    control, current = controller(probe, gpu_memory_threshold=0.5, min_transformer_layers_on_gpu=3)
    assert run(control, probe, [0.99] * 6, layers=6, layer_bytes=GB) == [3, 3, 3, 3, 3, 3]
    current["settings"] = current["settings"].model_copy(update={"min_transformer_layers_on_gpu": 5})
    assert run(control, probe, [0.99], layers=3) == [5]


def test_a_live_threshold_change_acts_at_the_next_decision():
    probe = Probe(0.8)
    control, current = controller(probe, gpu_memory_threshold=0.85)
    assert run(control, probe, [0.8], layers=28) == [28]
    current["settings"] = current["settings"].model_copy(update={"gpu_memory_threshold": 0.6})
    assert run(control, probe, [0.8], layers=28, layer_bytes=5 * GB) == [24]


def test_disabled_never_moves():
    probe = Probe(0.99)
    control, current = controller(probe, gpu_memory_threshold=0.5)
    current["settings"] = current["settings"].model_copy(update={"dynamic_offload_enabled": False})
    assert run(control, probe, [0.99, 0.1], layers=28) == [28, 28]


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
