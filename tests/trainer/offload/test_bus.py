"""Turns on the bus for the models' optimizer updates on the device (trainer/offload/bus.py): a less used model's
update waits while a more used one trains and updates, goes at once when something waits for it, and changes no
number. On this CPU machine the "device" update is the same code on the CPU, in the engines' worker threads."""

from __future__ import annotations

import threading
import time

import torch

from tests.trainer.offload.test_device_update import TOKENIZER, WHOLE_HEAD, batch
from trainer.config import FSDPConfig
from trainer.models import load_policy
from trainer.offload import attach_offload
from trainer.offload.bus import BusTurns

DEVICE_UPDATE = {"param_offload": True, "optimizer_offload": True, "optimizer_update": "gpu"}


def test_a_less_used_models_turn_waits_for_the_claims_of_the_models_ahead_of_it():
    turns = BusTurns()
    assert turns.may_go("critic") and turns.may_go("actor")
    turns.claim("actor")
    assert not turns.may_go("critic") and not turns.may_go("ref")
    assert turns.may_go("actor")  # its own claim never holds it
    turns.claim("critic")
    assert turns.may_go("actor")  # a claim of a less used model holds nothing of the actor's
    turns.release("critic")
    turns.hurry("critic")
    assert turns.may_go("critic") and not turns.may_go("ref")
    turns.claim("critic")  # a new claim of its own ends its hurry
    turns.release("critic")
    assert not turns.may_go("critic")
    turns.release("actor")
    assert turns.may_go("critic") and turns.may_go("ref")
    # A role the order does not name counts as the most used.
    turns.claim("policy")
    assert not turns.may_go("actor")


def test_a_delayed_models_updates_wait_behind_every_other_claim_and_its_phase_holds_the_others_only_while_it_runs():
    turns = BusTurns()
    turns.defer("actor")
    turns.claim("actor")  # its training phase: the critic's updates wait, as without a delayed update
    assert not turns.may_go("critic") and turns.may_go("actor")
    turns.release("actor")
    turns.claim("critic")  # the critic's update still to cross: the actor's delayed one waits behind it
    assert not turns.may_go("actor") and turns.may_go("critic")
    turns.hurry("actor")  # something reads the actor's weights: its updates go at once
    assert turns.may_go("actor")
    turns.claim("actor")
    turns.release("actor")
    assert not turns.may_go("actor")
    turns.release("critic")
    assert turns.may_go("actor")


def test_the_critics_held_updates_cross_before_the_actors_delayed_ones():
    """Under the actor's delayed_update its training phase's claim ends with the phase, and its updates (read at
    its next training phase at the earliest) wait behind the critic's, which its next values read right after
    the rollout."""
    turns = BusTurns()
    delayed = {**DEVICE_UPDATE, "model_dtype": "bf16", "delayed_update": True}
    models, engines = engine_pair(turns, settings={"actor": delayed})
    optimizers = {role: engines[role].optimizer(lr=1e-3) for role in engines}
    release = threading.Event()
    with engines["critic"].claiming_bus():
        step(models["critic"], optimizers["critic"], 0)
        # The critic's claim lasts until its device worker gets past this: its updates still crossing, as it were.
        engines["critic"].updates.after_updates(release.wait, path="device")
    with engines["actor"].claiming_bus():
        step(models["actor"], optimizers["actor"], 1)
    assert turns.may_go("critic")  # the actor's phase is over: its claim holds nothing
    time.sleep(0.3)
    assert not engines["actor"].updates.updates_drained()  # its updates wait behind the critic's claim
    release.set()
    engines["critic"].wait_for_updates()
    engines["actor"].wait_for_updates()
    assert turns.held_seconds["actor"] >= 0.3
    for engine in engines.values():
        engine.close()


def engine_pair(turns: BusTurns, settings: dict[str, dict] | None = None):
    """An actor and a critic (each a tiny policy) whose optimizer updates run on the device path, sharing `turns`
    (`settings`: a role's fsdp_config instead)."""
    models, engines = {}, {}
    for role, seed in (("actor", 1), ("critic", 2)):
        config = FSDPConfig.model_validate((settings or {}).get(role, DEVICE_UPDATE))
        model = load_policy("builtin:tiny-qwen2", TOKENIZER, seed=seed, override_config={"num_hidden_layers": 2},
                            dtype=torch.bfloat16 if config.model_dtype == "bf16" else torch.float32).train()
        engine = attach_offload(model, config, "cpu", role=role, options=WHOLE_HEAD)
        engine.share_bus(turns)
        models[role], engines[role] = model, engine
    return models, engines


def step(model, optimizer, seed: int) -> None:
    optimizer.zero_grad()
    ids = batch(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.clip_grad_norm_(1.0)
    optimizer.step()


def test_the_critics_update_waits_while_the_actor_trains_and_goes_once_the_actors_updates_have_run():
    turns = BusTurns()
    models, engines = engine_pair(turns)
    optimizers = {role: engines[role].optimizer(lr=1e-3) for role in engines}
    # verl's order: the critic's update, then the actor's training phase, whose claim holds the critic's updates.
    with engines["critic"].claiming_bus():
        step(models["critic"], optimizers["critic"], 0)
    release = threading.Event()
    with engines["actor"].claiming_bus():
        time.sleep(0.3)
        assert not engines["critic"].updates.updates_drained()  # held: the actor trains
        step(models["actor"], optimizers["actor"], 1)
        # The actor's own updates never wait; hold the worker until the test lets it go, to see the claim last.
        engines["actor"].updates.after_updates(release.wait, path="device")
    time.sleep(0.3)
    assert not engines["critic"].updates.updates_drained()  # still held: the actor's updates have not all run
    release.set()
    engines["actor"].wait_for_updates()
    deadline = time.monotonic() + 30
    while not engines["critic"].updates.updates_drained() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engines["critic"].updates.updates_drained()
    assert turns.held_seconds["critic"] >= 0.5
    for engine in engines.values():
        engine.close()


def test_waiting_for_a_held_models_update_lets_it_go_at_once():
    """A forward of the critic that reaches a unit still to update (or a checkpoint of it) while the actor claims
    the bus: the wait hurries the critic's updates instead of waiting for the claim (which might wait for it)."""
    turns = BusTurns()
    models, engines = engine_pair(turns)
    optimizer = engines["critic"].optimizer(lr=1e-3)
    turns.claim("actor")  # never released while the critic is read
    step(models["critic"], optimizer, 0)
    time.sleep(0.2)
    assert not engines["critic"].updates.updates_drained()  # held
    finished = threading.Event()

    def forward() -> None:
        with torch.no_grad():
            models["critic"](input_ids=batch(3))
        finished.set()

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    assert finished.wait(60), "the critic's forward waited for the actor's claim"
    step(models["critic"], optimizer, 1)
    engines["critic"].wait_for_updates()  # the step's wait for the last updates hurries them too
    turns.release("actor")
    for engine in engines.values():
        engine.close()


def test_updates_that_took_turns_give_the_same_weights_as_updates_that_did_not():
    def run(share: bool) -> list[torch.Tensor]:
        turns = BusTurns()
        models, engines = engine_pair(turns)
        if not share:
            for engine in engines.values():
                engine.updates.bus_turns = None
        optimizers = {role: engines[role].optimizer(lr=1e-3) for role in engines}
        for seed in range(3):
            for role in ("critic", "actor"):
                with engines[role].claiming_bus():
                    step(models[role], optimizers[role], seed)
        weights = []
        for role, engine in engines.items():
            engine.wait_for_updates()
            weights += [parameter.detach().clone() for parameter in models[role].parameters()]
            engine.close()
        return weights

    for shared, alone in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(shared, alone, rtol=0, atol=0)
