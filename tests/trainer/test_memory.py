"""The memory manager on the CPU, with real offload engines (the CPU plays the device) and a fake
device memory probe: the host budget, fitting dynamic layers once every model is placed, per-phase
placement, relief after an out-of-memory error, and the step metrics."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.offload.test_offload import TOKENIZER, policy
from trainer.config import ActorConfig, FSDPConfig, OptimConfig
from trainer.config.live import LiveSettings
from trainer.data import PromptRecord
from trainer.errors import RunSetupError
from trainer.memory import HOST_MARGIN_BYTES, MemoryManager
from trainer.offload import OffloadAdamW, format_bytes
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import Actor, compute_log_probs

DYNAMIC = {"dynamic_offload": {"enabled": True}}
LAYERED = {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}
THRESHOLD = 0.85


class Device:
    """A device's memory as the probe reads it: `base` bytes in use, plus the transformer layers the
    watched engines keep on it and the ring slots their streamed layers rotate through; `total` bytes in all."""

    def __init__(self, total: int = 10**12, base: int = 0):
        self.total, self.base, self.engines = total, base, []

    def __call__(self) -> tuple[int, int]:
        layers = sum((engine.layers_on_gpu + len(engine.streamer.layer_ring)) * engine.layer_bytes
                     for engine in self.engines)
        return self.base + layers, self.total


class Run:
    """A memory manager with its fakes: live settings the test may change, the log it writes."""

    def __init__(self, probe=None, host_available=lambda: 1 << 50, **settings):
        initial = LiveSettings.model_validate({"dynamic_offload.enabled": True,
                                               "gpu_memory_threshold": THRESHOLD, **settings})
        self.logs: list[str] = []
        self.memory = MemoryManager(torch.device("cpu"), settings=initial, probe=probe,
                                    host_available=host_available, log=self.logs.append, warn=self.logs.append)

    @property
    def settings(self) -> LiveSettings:
        return self.memory.settings

    @settings.setter
    def settings(self, settings: LiveSettings) -> None:
        """A live change, as the trainer's subscription hands it to the manager."""
        self.memory.apply_settings(settings)

    def place(self, role: str, settings: dict, layers: int = 4):
        """A tiny policy of `layers` transformer layers placed as `role`. Eight where layers move: with the engine's
        three ring slots, a model of four frees nothing by streaming fewer than all of them."""
        model = self.memory.place(policy(override_config={"num_hidden_layers": layers}),
                                  FSDPConfig.model_validate(settings), role)
        return model, self.memory.engine(role)


def two_responses() -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    return RolloutBatch(prompt_ids=torch.randint(3, len(TOKENIZER), (2, 4), generator=generator),
                        prompt_mask=torch.ones(2, 4, dtype=torch.long),
                        response_ids=torch.randint(3, len(TOKENIZER), (2, 3), generator=generator),
                        response_mask=torch.ones(2, 3), group_index=torch.arange(2),
                        records=[PromptRecord(prompt="p", data_source="test")] * 2)


def test_a_placement_counts_what_the_models_placed_before_it_will_need_on_the_host():
    probe_run = Run()
    _, engine = probe_run.place("actor", {"param_offload": True})
    host = engine.host_bytes()
    later = host["gradients"] + host["optimizer"]  # allocated once the actor trains
    # Room for the actor's placement, with half of its later needs to spare; not for a second one.
    run = Run(host_available=lambda: HOST_MARGIN_BYTES + later + later // 2)
    run.place("actor", {"param_offload": True})
    with pytest.raises(RunSetupError) as error:
        run.place("critic", {"param_offload": True})
    message = str(error.value)
    assert message.startswith("the critic's offload placement needs ")
    assert message.endswith("(keeping 2.00 GiB free): place fewer groups on the CPU (critic.fsdp_config."
                            "param_offload, .offload_policy, .optimizer_offload), keep their gradients in bf16 "
                            "(critic.fsdp_config.offload_grad_dtype) or use a machine with more memory")
    assert [engine.role for engine in run.memory.engines] == ["actor"]


def test_dynamic_layers_come_to_the_gpu_once_every_model_is_placed_first_placed_first_fitted():
    device = Device()
    run = Run(probe=device)
    _, actor = run.place("actor", DYNAMIC, layers=8)
    _, critic = run.place("critic", DYNAMIC, layers=8)
    assert (actor.layers_on_gpu, critic.layers_on_gpu) == (0, 0)  # streamed while the models are placed
    assert run.memory.dynamic_engines == [actor, critic] and run.memory.moves_layers
    # Below the threshold: room for 13 layers' bytes. Each model streams through 3 ring slots while any of its layers
    # streams: the actor's 8 fit beside the critic's ring, then the critic's 2 and its ring (2 + 3) in the 5 left.
    device.total, device.engines = int(13.5 * actor.layer_bytes / THRESHOLD), run.memory.engines
    run.memory.finish_placement()
    assert (actor.layers_on_gpu, critic.layers_on_gpu) == (8, 2)
    assert actor.moves == critic.moves == {"to_cpu": 0, "to_gpu": 0}  # where they start, not moves
    assert run.logs == ["dynamic offload: the critic starts with 2 of 8 transformer layers on the GPU "
                        f"(GPU memory threshold {THRESHOLD})"]


def test_without_a_gpu_to_measure_dynamic_layers_stay_where_the_policy_puts_them_and_it_says_so():
    run = Run(probe=None)
    _, engine = run.place("actor", DYNAMIC)
    run.memory.finish_placement()
    assert engine.layers_on_gpu == 4 and not run.memory.moves_layers
    assert run.logs == ["dynamic offload of the actor needs a GPU to measure memory on; on cpu its transformer "
                        "layers stay where the offload policy puts them"]


def test_a_phase_keeps_groups_within_the_room_below_the_threshold_and_says_so_when_that_changes():
    device = Device(total=10**9, base=10**8)
    run = Run(probe=device)
    _, engine = run.place("actor", LAYERED)
    budgets = []
    original = engine.placed_for

    def spy(phase, *, budget_bytes=None):
        budgets.append((phase, budget_bytes))
        return original(phase, budget_bytes=budget_bytes)

    engine.placed_for = spy
    for _ in range(2):
        with run.memory.placed_for("rollout", "actor"):
            assert sorted(engine.staging.staged_groups) == ["embedding", "lm_head"]
    device.base = device.total
    with run.memory.placed_for("rollout", "actor"):
        assert engine.staging.staged_groups == []
    with run.memory.placed_for("scoring", "reward"):  # no reward model: nothing to place
        pass
    room = int(THRESHOLD * 10**9)
    assert budgets == [("rollout", room - 10**8)] * 2 + [("rollout", room - 10**9)]
    kept = format_bytes(sum(engine.stageable_bytes().values()))
    assert run.logs == [
        f"per-phase placement: rollout keeps the actor's lm_head and embedding on the GPU ({kept})",
        "per-phase placement: rollout streams the actor's CPU-resident groups (no room below the GPU memory "
        f"threshold {THRESHOLD} to keep them on the GPU)"]


def test_relief_moves_half_the_layers_above_the_minimum_first_then_drops_the_kept_groups():
    run = Run(probe=Device(), min_transformer_layers_on_gpu=0)
    _, engine = run.place("actor", {**LAYERED, **DYNAMIC}, layers=8)
    run.memory.finish_placement()
    # Its 8 layers on the GPU take 8 layers' bytes; streamed they would take the 3 ring slots: 5 to free. Half of
    # that frees 2.5 layers' bytes: 6 layers off (2 on the GPU and 3 ring slots); then half of what is left, twice.
    relieved = []
    with run.memory.placed_for("rollout", "actor"):
        while run.memory.relieve_memory():
            relieved.append((engine.layers_on_gpu, sorted(engine.staging.staged_groups)))
    kept = ["embedding", "lm_head"]
    assert relieved == [(2, kept), (1, kept), (0, kept), (0, [])]
    assert [line for line in run.logs if line.startswith("out of GPU memory")] == [
        "out of GPU memory: actor keeps 2 transformer layers on GPU, retrying",
        "out of GPU memory: actor keeps 1 transformer layers on GPU, retrying",
        "out of GPU memory: actor keeps 0 transformer layers on GPU, retrying",
        "out of GPU memory: the actor's lm_head and embedding stream for the rest of the rollout phase, retrying"]


def test_relief_respects_the_live_minimum_and_moves_no_layer_while_dynamic_offload_is_off():
    run = Run(probe=Device(), min_transformer_layers_on_gpu=3)
    _, engine = run.place("actor", {**LAYERED, **DYNAMIC}, layers=8)
    run.memory.finish_placement()
    # Above the minimum of 3 (and its 3 ring slots), 2 layers' bytes to free: half of them, then the rest.
    assert run.memory.relieve_memory() and engine.layers_on_gpu == 4
    assert run.memory.relieve_memory() and engine.layers_on_gpu == 3
    assert not run.memory.relieve_memory()  # at the minimum, and no phase keeps groups
    run.settings = run.settings.model_copy(update={"min_transformer_layers_on_gpu": 0,
                                                   "dynamic_offload_enabled": False})
    with run.memory.placed_for("scoring", "actor"):
        assert run.memory.relieve_memory() and engine.layers_on_gpu == 3 and engine.staging.staged_groups == []
        assert not run.memory.relieve_memory()


def test_the_step_metrics_report_layers_moves_and_recoveries_since_the_last_step():
    run = Run(probe=Device())
    _, actor = run.place("actor", DYNAMIC)
    _, reference = run.place("ref", {})
    run.memory.finish_placement()
    layers = {"offload/actor/transformer_layers_on_gpu": 4, "offload/ref/transformer_layers_on_gpu": 4}
    assert run.memory.step_metrics() == {"perf/oom_recoveries": 0.0, "offload/transformer_layers_on_gpu": 8,
                                         **layers, "offload/moves_to_cpu": 0, "offload/moves_to_gpu": 0,
                                         "offload/phase_swaps": 0}
    actor.set_transformer_layers_on_gpu(1)
    run.memory.count_recoveries(2)
    run.memory.for_role("ref").count_recoveries(1)
    second = run.memory.step_metrics()
    assert second["perf/oom_recoveries"] == 3.0 and second["offload/moves_to_cpu"] == 3
    assert second["offload/transformer_layers_on_gpu"] == 5 and second["offload/actor/transformer_layers_on_gpu"] == 1
    actor.set_transformer_layers_on_gpu(3)
    third = run.memory.step_metrics()
    assert (third["perf/oom_recoveries"], third["offload/moves_to_cpu"], third["offload/moves_to_gpu"]) == (0, 0, 2)


def test_each_role_gets_its_engines_optimizer_and_its_recoveries_reach_the_step_metrics():
    run = Run()
    model, engine = run.place("actor", {"param_offload": True})
    assert isinstance(run.memory.for_role("actor").build_optimizer(model, OptimConfig()), OffloadAdamW)
    plain = run.memory.for_role("critic").build_optimizer(policy(), OptimConfig())  # no critic placed
    assert type(plain) is torch.optim.AdamW
    batch = two_responses()
    failures = iter([True])

    def fail_once(module, args):
        if next(failures, False):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = model.model.layers[1].register_forward_pre_hook(fail_once)
    try:
        compute_log_probs(model, batch, micro_batch_size=2, temperature=1.0, memory=run.memory.for_role("actor"))
    finally:
        handle.remove()
    assert not any(block.acquired for block in engine.blocks)  # the failed pass was released
    assert run.memory.step_metrics()["perf/oom_recoveries"] == 1


def test_an_update_reports_its_recoveries_to_the_manager_not_in_its_own_metrics():
    run = Run()
    model = run.memory.place(policy(), FSDPConfig(), "actor")
    actor = Actor(model, ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2), temperature=1.0,
                  rollout_n=1, log_prob_micro_batch_size=2, total_steps=1, seed=1, memory=run.memory.for_role("actor"))
    batch = two_responses()
    batch.old_log_probs = actor.compute_log_probs(batch)
    batch.advantages = torch.ones(2, 3)
    failures = iter([True])

    def fail_once(module, args):
        if module.training and next(failures, False):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    model.model.layers[0].register_forward_pre_hook(fail_once)
    metrics = actor.update(batch)
    assert len(metrics["actor/pg_loss"]) == 1 and not any("oom" in key for key in metrics)
    assert run.memory.step_metrics()["perf/oom_recoveries"] == 1


class PhaseMeter:
    """The peak meter of a fake device: what it has in use plus what the running phase allocates besides
    its layers (`working`, which the test sets inside the phase)."""

    def __init__(self, device: Device):
        self.device, self.working = device, 0

    def reset(self) -> None:
        self.working = 0

    def peak(self) -> int:
        return self.device()[0] + self.working


def phase_run(layers_each: int = 4, total_layers: int = 20, base_layers: int = 2, layers: int = 4, **settings):
    """An actor and a critic of `layers` transformer layers each, which move dynamically on a device of
    `total_layers` layers' bytes."""
    _, sizing = Run().place("actor", DYNAMIC, layers=layers)
    layer = sizing.layer_bytes
    device = Device(total=total_layers * layer, base=base_layers * layer)
    run = Run(probe=device, **settings)
    meter = PhaseMeter(device)
    run.memory.meter = meter
    _, actor = run.place("actor", DYNAMIC, layers=layers)
    _, critic = run.place("critic", DYNAMIC, layers=layers)
    device.engines += [actor, critic]
    actor.set_transformer_layers_on_gpu(layers_each)
    critic.set_transformer_layers_on_gpu(layers_each)
    run.memory.step_metrics()  # the placement by hand above is not a step's move
    return run, actor, critic, meter, layer


def test_a_phase_takes_the_room_of_the_models_it_does_not_run_and_then_places_the_same_every_step():
    """Issue 14: the critic held its layers through the rollout while the actor streamed 20 of its 36 at every
    decoded token. The rollout's first run frees the critic's layers (down to the live minimum) and learns what it
    needs; from the second on the actor has every layer that fits. The same plan each step is the phase's
    placement (offload/phase_swaps), not a dynamic-offload move."""
    run, actor, critic, meter, layer = phase_run(total_layers=22, layers=8, min_transformer_layers_on_gpu=1)
    moves, swaps = [], []
    for _ in range(4):
        with run.memory.placed_for("rollout", "actor"):
            rollout = (actor.layers_on_gpu, critic.layers_on_gpu)
            meter.working = 3 * layer  # the KV cache and activations
        with run.memory.placed_for("training", "critic"):
            training = (actor.layers_on_gpu, critic.layers_on_gpu)
            meter.working = 2 * layer + critic.layers_on_gpu * layer  # activations, and the layers' gradients
        metrics = run.memory.step_metrics()
        moves.append(metrics["offload/moves_to_cpu"] + metrics["offload/moves_to_gpu"])
        swaps.append(metrics["offload/phase_swaps"])
    # The first step frees the room of the model a phase does not run; the second plans: below 0.85 - 0.02 of 22
    # layers (18.3), the rollout's 2 besides + 3 working + the critic's 1 and the 3 ring slots its streamed layers
    # need leave the actor all its 8; the critic's training, 2 besides + 2 working + the actor's 1 (the minimum)
    # and its ring, 3 of its layers at twice their size (gradients) and its own ring (3 x 2 + 3 = 9). From then on
    # the same plans: no move, and the 9 layers they bring to the GPU (7 of the actor's, 2 of the critic's) are swaps.
    assert rollout == (8, 1) and training == (1, 3)
    assert moves == [6, 16, 0, 0] and swaps == [0, 0, 9, 9], (moves, swaps)
    assert ("placement plan: rollout/actor: actor 4, critic 1 layers on the GPU (working memory not yet learned)"
            in run.logs)
    assert run.memory.plan_lines()[0].startswith("rollout/actor: actor 8, critic 1 layers on the GPU")
    assert run.memory.plan_rows()[0] == {"phase": "rollout/actor", "layers_on_gpu": {"actor": 8, "critic": 1},
                                         "working_bytes": 3 * layer, "threshold": THRESHOLD}
    assert run.memory.summary_lines()[-1].startswith(
        "dynamic offload: transformer layers on the GPU now: actor 1 of 8, critic 3 of 8. Each phase of a step "
        "gives them to the model it runs, less what the phase needs besides them, taken from the models it does "
        "not run in this order: critic, actor;")


def test_a_phase_that_runs_out_of_memory_learns_it_and_plans_for_it_next_time():
    run, actor, critic, meter, layer = phase_run(min_transformer_layers_on_gpu=0)
    with run.memory.placed_for("rollout", "actor"):
        meter.working = layer
    with run.memory.placed_for("rollout", "actor"):  # learned: 1 layer besides; the actor keeps its 4
        assert (actor.layers_on_gpu, critic.layers_on_gpu) == (4, 0)
        # An out-of-memory error: the phase needed more than the 14 layers' bytes free at its start.
        assert run.memory.relieve_memory()
        meter.working = layer
    with run.memory.placed_for("rollout", "actor"):
        # It is planned for what was free then: 0.83 x 20 - 2 - 14 leaves no whole layer for the actor.
        assert (actor.layers_on_gpu, critic.layers_on_gpu) == (0, 0)
    # A paused dynamic offload places nothing.
    run.settings = run.settings.model_copy(update={"dynamic_offload_enabled": False})
    actor.set_transformer_layers_on_gpu(3)
    with run.memory.placed_for("rollout", "actor"):
        assert (actor.layers_on_gpu, critic.layers_on_gpu) == (3, 0)


def test_relief_takes_the_layers_of_the_least_used_model_first():
    run = Run(probe=Device(), min_transformer_layers_on_gpu=0)
    _, actor = run.place("actor", DYNAMIC, layers=8)
    _, critic = run.place("critic", DYNAMIC, layers=8)
    run.memory.finish_placement()
    assert (actor.layers_on_gpu, critic.layers_on_gpu) == (8, 8)
    # Half of the 10 layers' bytes the two could free (each 8 less its ring's 3): all five of the critic's, none of
    # the actor's (which the rollout reads at every decoded token); then half of the actor's five.
    assert run.memory.relieve_memory() and (actor.layers_on_gpu, critic.layers_on_gpu) == (8, 0)
    assert run.memory.relieve_memory() and (actor.layers_on_gpu, critic.layers_on_gpu) == (2, 0)
    assert [line for line in run.logs if line.startswith("out of GPU memory")] == [
        "out of GPU memory: critic keeps 0 transformer layers on GPU, retrying",
        "out of GPU memory: actor keeps 2 transformer layers on GPU, retrying"]


def test_the_cpu_optimizer_states_are_made_once_every_model_is_placed():
    """Not before: a model placed after the actor has its host budget counted with the actor's states still to
    come, and states made meanwhile would count twice."""
    run = Run()
    model, _ = run.place("actor", {"param_offload": True, "optimizer_offload": True})
    optimizer = run.memory.for_role("actor").build_optimizer(model, OptimConfig())
    run.place("critic", {"param_offload": True})
    optimizer.wait()
    assert not optimizer.state
    run.memory.finish_placement()
    optimizer.wait()
    assert len(optimizer.state) == sum(parameter.requires_grad for parameter in model.parameters())


def test_on_a_cpu_device_the_trainers_engines_keep_the_head_one_chunk_and_its_gradients_are_the_resident_ones():
    """Issue 39's real model (SmolLM2, 49,152 vocabulary rows): the head streamed in 64-MiB chunks summed the input's
    gradient over the vocabulary in pieces, 1.3e-7 of KL away from the resident run. On a CPU device the head is in
    host memory already, so the trainer's engines keep it whole, and the gradients are the resident run's to the bit."""
    vocab = (64 << 20) // (64 * 4) + 4096  # more rows than one default 64-MiB chunk holds, at hidden size 64
    shape = {"vocab_size": vocab, "num_hidden_layers": 2}
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    resident = policy(override_config=shape)
    resident(input_ids=ids, labels=ids).loss.backward()
    run = Run()
    model = run.memory.place(policy(override_config=shape), FSDPConfig.model_validate({"param_offload": True}),
                             "actor")
    model(input_ids=ids, labels=ids).loss.backward()
    head = next(unit for unit in run.memory.engine("actor").units if unit.group == "lm_head")
    assert len(head.blocks) == 1
    for (name, parameter), expected in zip(model.named_parameters(), resident.parameters(), strict=True):
        assert torch.equal(parameter.grad, expected.grad), name
