"""The offloaded optimizer's update on the compute device (fsdp_config.optimizer_update: gpu, trainer/offload/
device_update.py), and split between the device and the host at once (both, update_split.py). On this CPU machine
the "device" is the CPU: the same code copies CPU to CPU, and must give the host update's values, states and
checkpoints; the GPU test checks it on the GPU."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from trainer.config import ConfigError, FSDPConfig, load_config
from trainer.models import load_policy, load_tokenizer
from trainer.offload import OffloadOptions, attach_offload, update_mode, updates_on_device
from trainer.offload.update_split import WINDOW_SHARE

TOKENIZER = load_tokenizer("builtin:tiny-qwen2")
WHOLE_HEAD = OffloadOptions(head_chunk_bytes=1 << 30)
SETTINGS = {
    "fp32": ({"param_offload": True, "optimizer_offload": True}, torch.float32),
    "bf16": ({"param_offload": True, "optimizer_offload": True, "model_dtype": "bf16"}, torch.bfloat16),
    "bf16_host_gradients": ({"param_offload": True, "optimizer_offload": True, "model_dtype": "bf16",
                             "offload_grad_dtype": "bf16"}, torch.bfloat16),
    "layered": ({"optimizer_offload": True, "offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}, torch.float32),
}


def build(settings: dict, dtype: torch.dtype, update: str, device: str = "cpu",
          options: OffloadOptions = WHOLE_HEAD):
    model = load_policy("builtin:tiny-qwen2", TOKENIZER, seed=1, override_config={"num_hidden_layers": 3},
                        dtype=dtype).train()
    engine = attach_offload(model, FSDPConfig.model_validate({**settings, "optimizer_update": update}), device,
                            role="actor", options=options)
    return model, engine


def even_split(engine) -> None:
    """Both paths as fast by the split's estimates, which stop learning: the units alternate between them (a
    split learned from this machine's timings could send every unit to one side), with no window."""
    assert engine.update_split is not None
    engine.update_split.seconds_per_element = {"device": 1e-9, "host": 1e-9}
    engine.update_split.smoothing = 0.0
    engine.update_split.window_share = 0.0  # no window: the tiny update would otherwise all go to the host


def states_in_order(optimizer) -> dict[str, list[torch.Tensor]]:
    """AdamW's moments and step counts in the parameters' order (the paths make states in their own order)."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]
                  if parameter in optimizer.state]
    return {key: [optimizer.state[parameter][key].clone() for parameter in parameters]
            for key in ("exp_avg", "exp_avg_sq", "step")}


def trained_units(engine) -> list[str]:
    return [unit.name for unit in engine.units if unit.offloaded and unit.trainable]


def batch(seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(TOKENIZER), (4, 12), generator=generator).to(device)


def train(model, engine, optimizer, steps: int, device: str = "cpu", first_step: int = 0) -> list[float]:
    """Steps of two micro-batches each, clipped as the actor's update clips (inside the update)."""
    losses = []
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        for micro_batch in batch(step, device).split(2):
            loss = model(input_ids=micro_batch, labels=micro_batch).loss
            (loss / 2).backward()
            losses.append(loss.item())
        optimizer.clip_grad_norm_(0.5)
        if device == "cuda":
            # The trainer's stream still busy as the update starts (the next phase's kernels): the update's own
            # device tensors must not wait behind them, nor be read before they are made.
            torch.cuda._sleep(200_000_000)
        optimizer.step()
    engine.wait_for_updates()
    return losses


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().cpu().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_update_on_the_device_or_split_gives_the_host_updates_losses_weights_and_states(name):
    settings, dtype = SETTINGS[name]
    results = []
    for update in ("cpu", "gpu", "both"):
        model, engine = build(settings, dtype, update)
        optimizer = engine.optimizer(lr=1e-3, weight_decay=0.01)
        if update == "cpu":
            assert engine.device_update is None and engine.update_split is None
        else:
            assert engine.device_update is not None
            # Slices of 100 elements through a ring of 2: every tensor in many slices, the ring reused.
            engine.device_update.slice_elements, engine.device_update.buffer_count = 100, 2
        if update == "both":
            even_split(engine)
        losses = train(model, engine, optimizer, steps=3)
        expected_paths = {"cpu": {"host"}, "gpu": {"device"}, "both": {"device", "host"}}[update]
        assert set(engine.updates.update_paths.values()) == expected_paths
        assert set(engine.updates.update_paths) == set(trained_units(engine))
        results.append((losses, weights(model), states_in_order(optimizer)))
    (host_losses, host_weights, host_states), *others = results
    for losses, device_weights, states in others:
        assert losses == pytest.approx(host_losses, rel=1e-6, abs=1e-7)
        # The kernel's vector and scalar tails fall on other elements in slices of 100: rounding apart, the same.
        torch.testing.assert_close(device_weights, host_weights, rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(states[key], host_states[key], rtol=1e-6, atol=1e-9)


def test_the_split_runs_both_paths_at_once_each_in_forward_order_and_waits_for_both():
    settings, dtype = SETTINGS["bf16_host_gradients"]
    model, engine = build(settings, dtype, "both")
    optimizer = engine.optimizer(lr=1e-3)
    even_split(engine)
    train(model, engine, optimizer, steps=1)
    order = {unit.name: position for position, unit in enumerate(engine.units)}
    ran: dict[str, list[tuple[str, str]]] = {"device": [], "host": []}
    # The first unit of each path waits for the other path's first: it passes only if they run at once.
    meet = threading.Barrier(2, timeout=30)
    landed = threading.Event()
    update = optimizer._update_unit

    def recorded(group, unit, grad_scale, path):
        ran[path].append((unit.name, threading.current_thread().name))
        if len(ran[path]) == 1:
            meet.wait()
        elif path == "host" and len(ran[path]) == 2:
            landed.wait(timeout=30)  # the host's second unit: held until the test has seen the step unfinished
        update(group, unit, grad_scale, path)

    optimizer._update_unit = recorded
    optimizer.zero_grad()
    model(input_ids=batch(1), labels=batch(1)).loss.backward()
    optimizer.step()
    assert not engine.updates.updates_drained()
    landed.set()
    engine.wait_for_updates()
    assert engine.updates.updates_drained() and all(unit.ready.is_set() for unit in engine.units)
    assert {name for path in ran.values() for name, _ in path} == set(trained_units(engine))
    for path, units in ran.items():
        assert [order[name] for name, _ in units] == sorted(order[name] for name, _ in units), path
        assert all(engine.updates.update_paths[name] == path for name, _ in units)
    threads = {path: {thread for _, thread in units} for path, units in ran.items()}
    assert len(threads["device"]) == len(threads["host"]) == 1 and threads["device"] != threads["host"]


def test_the_split_learns_each_paths_speed_from_the_steps_timings():
    settings, dtype = SETTINGS["bf16_host_gradients"]
    model, engine = build(settings, dtype, "both")
    optimizer = engine.optimizer(lr=1e-3)
    assert engine.update_split is not None
    guessed = dict(engine.update_split.seconds_per_element)
    # On this machine both paths run on the CPU, far from the guesses (a bus of 50 GB/s, a host of 1 ns an element).
    # The first step made the states: its timings are not learned, so after two steps the guesses stand.
    train(model, engine, optimizer, steps=2)
    assert engine.update_split.seconds_per_element == guessed and not engine.update_split.measured
    train(model, engine, optimizer, steps=2)
    learned = engine.update_split.seconds_per_element
    assert all(value > 0 for value in learned.values())
    # Each path that ran a learned step's units has its own figure now. Which paths those are depends on this
    # machine's load (a slow host moves the next step's units to the device, measured one step later), so the test
    # asks it of the paths measured, not of the last step's assignment.
    measured = engine.update_split.measured
    assert measured and all(learned[path] != guessed[path] for path in measured)
    assert engine.update_mode == "both"


def test_without_the_pipelined_update_the_split_runs_in_line_with_the_same_values():
    settings, dtype = SETTINGS["fp32"]
    results = []
    for update in ("cpu", "both"):
        model, engine = build(settings, dtype, update, options=OffloadOptions(head_chunk_bytes=1 << 30,
                                                                              pipelined_update=False))
        optimizer = engine.optimizer(lr=1e-3)
        if update == "both":
            even_split(engine)
        losses = train(model, engine, optimizer, steps=2)
        if update == "both":
            assert set(engine.updates.update_paths.values()) == {"device", "host"}
        results.append((losses, weights(model)))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("update", "words"), [
    ("cpu", "AdamW runs on the host's cores"),
    ("gpu", "AdamW runs on the CPU, streaming them through it"),
    ("both", "AdamW runs on the CPU, streaming them through it, and on the host's cores at once"),
])
def test_the_offload_summary_says_where_the_update_runs(update, words):
    settings, dtype = SETTINGS["bf16"]
    _, engine = build(settings, dtype, update)
    [line] = [line for line in engine.summary_lines() if line.startswith("Optimizer:")]
    assert words in line
    assert ("split" in line) == (update == "both")


def test_the_updates_copies_are_counted_both_ways_per_group():
    settings, dtype = SETTINGS["bf16_host_gradients"]
    model, engine = build(settings, dtype, "gpu")
    optimizer = engine.optimizer(lr=1e-3)
    train(model, engine, optimizer, steps=1)
    before = engine.copied_bytes()
    optimizer.zero_grad()
    model(input_ids=batch(), labels=batch()).loss.backward()
    forward_and_backward = engine.copied_bytes()
    optimizer.step()
    engine.wait_for_updates()
    after = engine.copied_bytes()
    assert before != forward_and_backward
    update = {key: after.get(key, 0) - forward_and_backward.get(key, 0) for key in after}
    elements: dict[str, int] = {}
    for unit in engine.units:
        if unit.offloaded:
            elements[unit.group] = elements.get(unit.group, 0) + sum(entry.parameter.numel() for entry in unit.entries)
    assert {"embedding", "transformer", "norm"} <= set(elements)
    for group, count in elements.items():
        # Up: the fp32 master and moments, the bf16 gradient; down: the three, and the new bf16 weights.
        assert update[("h2d", group)] == count * (3 * 4 + 2)
        assert update[("d2h", group)] == count * (3 * 4 + 2)


def test_a_checkpoint_of_the_device_update_resumes_under_the_host_update_and_back():
    settings, dtype = SETTINGS["bf16_host_gradients"]
    model, engine = build(settings, dtype, "gpu")
    optimizer = engine.optimizer(lr=1e-3)
    train(model, engine, optimizer, steps=2)
    # Copies: the updates go on changing the tensors in place.
    saved_model = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    continued = train(model, engine, optimizer, steps=2, first_step=2)
    expected = weights(model)
    for update in ("cpu", "gpu", "both"):
        resumed_model, resumed_engine = build(settings, dtype, update)
        resumed_model.load_state_dict(saved_model)
        resumed_optimizer = resumed_engine.optimizer(lr=1e-3)
        resumed_optimizer.load_state_dict(copy.deepcopy(saved_optimizer))  # (loaded tensors are changed in place)
        assert train(resumed_model, resumed_engine, resumed_optimizer, steps=2, first_step=2) == pytest.approx(
            continued, rel=1e-6)
        torch.testing.assert_close(weights(resumed_model), expected, rtol=1e-6, atol=1e-7)


def test_auto_updates_on_a_gpu_with_or_without_a_delayed_update_and_on_the_host_on_a_cpu():
    offloaded = {"optimizer_offload": True, "model_dtype": "bf16"}
    assert updates_on_device(FSDPConfig.model_validate(offloaded), torch.device("cuda"))
    assert not updates_on_device(FSDPConfig.model_validate(offloaded), torch.device("cpu"))
    delayed = FSDPConfig.model_validate({**offloaded, "delayed_update": True})
    assert update_mode(delayed, torch.device("cuda")) == "both"
    assert update_mode(delayed, torch.device("cpu")) == "cpu"
    assert updates_on_device(FSDPConfig.model_validate({**offloaded, "optimizer_update": "gpu"}), torch.device("cpu"))
    assert not updates_on_device(FSDPConfig.model_validate({**offloaded, "optimizer_update": "cpu"}),
                                 torch.device("cuda"))
    both = FSDPConfig.model_validate({**offloaded, "optimizer_update": "both"})
    assert update_mode(both, torch.device("cuda")) == update_mode(both, torch.device("cpu")) == "both"
    assert updates_on_device(both, torch.device("cpu"))
    # auto splits the update between the two paths on a GPU, and keeps it on the host's cores on a CPU.
    assert update_mode(FSDPConfig.model_validate(offloaded), torch.device("cuda")) == "both"
    assert update_mode(FSDPConfig.model_validate(offloaded), torch.device("cpu")) == "cpu"


def test_optimizer_update_without_optimizer_offload_is_one_line_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      optimizer_update: gpu\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    lines = [line for line in str(raised.value).splitlines() if "optimizer_update" in line]
    assert len(lines) == 1
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_update" in lines[0]
    assert "optimizer_offload" in lines[0] and "allowed" in lines[0]


def test_an_unknown_optimizer_update_names_the_allowed_values(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("critic:\n  fsdp_config:\n    optimizer_offload: true\n    optimizer_update: tpu\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    message = str(raised.value)
    assert "critic.fsdp_config.optimizer_update" in message
    assert all(value in message for value in ("auto", "cpu", "gpu", "both"))


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["even", "learned"])
def test_on_the_gpu_the_update_streams_pinned_states_and_matches_the_host_update(split):
    settings, dtype = SETTINGS["bf16_host_gradients"]
    results = []
    for update in ("cpu", "gpu", "both"):
        torch.manual_seed(0)
        model, engine = build(settings, dtype, update, device="cuda")
        optimizer = engine.optimizer(lr=1e-3, weight_decay=0.01)
        if update == "both" and split == "even":
            even_split(engine)
        losses = train(model, engine, optimizer, steps=3, device="cuda")
        if update != "cpu":
            assert all(state[key].is_pinned() for state in optimizer.state.values() if state["exp_avg"].is_cpu
                       for key in ("exp_avg", "exp_avg_sq"))
            assert all(master.is_pinned() for unit in engine.units for master in unit.masters)
            assert engine.device_update is not None and not engine.device_update._ring  # given back after the step
        if update == "both":
            assert engine.update_split is not None and min(engine.update_split.seconds_per_element.values()) > 0
            if split == "even":
                assert set(engine.updates.update_paths.values()) == {"device", "host"}
        results.append((losses, weights(model)))
    (host_losses, host_weights), *others = results
    for losses, device_weights in others:
        # The CUDA kernel rounds as the GPU does (fused multiply-adds): bf16 weights agree to their rounding.
        assert losses == pytest.approx(host_losses, rel=1e-2)
        torch.testing.assert_close(device_weights, host_weights, rtol=1e-2, atol=1e-3)


def test_the_split_learns_the_window_from_its_plan_to_the_first_read_that_needs_the_update():
    """The window ends at the first read that needs the last step's update, here a forward 0.3 s after it (not at
    the next plan, 0.5 s later); under a delayed update the rollout's stale reads do not end it, the first read
    after them does. With a window that long, the update goes to the host (the device path's bytes would buy an
    end nobody waits for)."""
    settings, dtype = SETTINGS["bf16_host_gradients"]
    for delayed in (False, True):
        model, engine = build({**settings, "delayed_update": delayed}, dtype, "both")
        optimizer = engine.optimizer(lr=1e-3)
        even_split(engine)
        # Both paths as fast, at rates that make the whole update 0.2 s on either one by the estimates.
        elements = sum(entry.parameter.numel() for unit in engine.units if unit.offloaded and unit.trainable
                       for entry in unit.entries if entry.parameter.requires_grad)
        engine.update_split.seconds_per_element = {"device": 0.2 / elements, "host": 0.2 / elements}
        engine.update_split.window_share = WINDOW_SHARE
        train(model, engine, optimizer, steps=1)
        assert engine.update_split.window is None
        if delayed:
            with engine.stale_reads(), torch.no_grad():
                time.sleep(0.1)
                model(input_ids=batch(7))
        time.sleep(0.3)
        with torch.no_grad():
            model(input_ids=batch(8))  # the read that ends the window; the next plan comes 0.5 s after it
        time.sleep(0.5)
        train(model, engine, optimizer, steps=1)
        window = engine.update_split.window
        assert window is not None and 0.3 + 0.1 * delayed <= window < 0.75, window
        assert set(engine.update_split.last_assignment) == {"host"}, engine.update_split.describe()
        # Steps back to back: the window is the step's own forward and backward, the split balanced again.
        engine.update_split.smoothing = 1.0
        train(model, engine, optimizer, steps=2)
        assert engine.update_split.window < 0.3 and set(engine.update_split.last_assignment) == {"device", "host"}
        engine.close()
