"""The RL loop as a user runs it: it learns, it resumes exactly, PPO and GRPO variants run."""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import re
import shutil
import signal
import weakref
from typing import TypeVar

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer import checkpoint as checkpoint_module
from trainer.checkpoint import FinalCheckpointError, latest_checkpoint, list_checkpoints
from trainer.config import ConfigError, load_config
from trainer.config.live import LiveSettings
from trainer.config.messages import (
    CheckpointMessage,
    CheckpointNowMessage,
    DownMessage,
    HeartbeatMessage,
    PhaseMessage,
    SettingsAckMessage,
    SettingsMessage,
    StepMessage,
    StopMessage,
    UpMessage,
)
from trainer.data import DataError
from trainer.data.checks import UnknownTokens
from trainer.errors import RunSetupError
from trainer.loop import Trainer
from trainer.models import load_policy, load_tokenizer
from trainer.offload import OffloadAdamW
from trainer.rewards import RewardFunctionError
from trainer.rewards.manager import place_on_last_token
from trainer.rollout.prompts import PromptTooLong

TINY = [
    "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "critic.optim.lr=1e-3",
    "data.max_prompt_length=8",
    "data.max_response_length=6",
    "trainer.device=cpu",
]
# Metrics that measure the machine, not the computation: they differ between identical runs.
MACHINE_METRICS = ("timing_s/", "timing_per_token_ms/", "perf/")


def make_trainer(tmp_path, *overrides: str, name: str = "run") -> Trainer:
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", f"trainer.experiment_name={name}",
                                *overrides])
    return Trainer(config, log=lambda *_: None)


def computed_metrics(trainer: Trainer) -> list[dict]:
    return [{key: value for key, value in row.items() if not key.startswith(MACHINE_METRICS)}
            for row in trainer.metrics_log.read()]


@pytest.mark.slow
def test_ppo_on_the_builtin_task_learns_well_above_chance(tmp_path):
    trainer = Trainer(load_config("examples/quickstart.yaml", [
        f"trainer.runs_dir={tmp_path}", "trainer.device=cpu", "trainer.total_training_steps=70",
        "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32", "trainer.save_freq=-1",
    ]), log=lambda *_: None)
    trainer.fit()
    scores = [row["critic/score/mean"] for row in trainer.metrics_log.read()]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    # A random policy over the tiny vocabulary scores about 0.04; the learned one several times that.
    assert first < 0.1
    assert last > 0.3 and last > 4 * first, scores


def test_resume_gives_the_same_parameters_and_metrics_as_a_straight_run(tmp_path):
    straight = make_trainer(tmp_path, "trainer.total_training_steps=4", "trainer.save_freq=2", name="straight")
    straight.fit()

    first_half = make_trainer(tmp_path, "trainer.total_training_steps=2", name="resumed")
    first_half.fit()
    second_half = make_trainer(tmp_path, "trainer.total_training_steps=4", name="resumed")
    second_half.fit()

    assert second_half.step == 4
    for role in ("actor", "critic"):
        expected = getattr(straight, role).model.state_dict()
        for key, value in getattr(second_half, role).model.state_dict().items():
            torch.testing.assert_close(value, expected[key], msg=f"{role} {key}")
    assert computed_metrics(second_half) == computed_metrics(straight)
    assert [row["step"] for row in second_half.metrics_log.read()] == [1, 2, 3, 4]


def test_resume_redoes_only_the_steps_after_the_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=2")
    trainer.fit()
    # As if the run died after step 3 was logged but before its checkpoint: drop that checkpoint.
    shutil.rmtree(latest_checkpoint(trainer.checkpointer.directory))
    resumed = make_trainer(tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=2")
    resumed.resume()
    assert resumed.step == 2
    assert [row["step"] for row in resumed.metrics_log.read()] == [1, 2]
    resumed.fit()
    assert [row["step"] for row in resumed.metrics_log.read()] == [1, 2, 3]


def test_a_finished_run_does_nothing_when_started_again(tmp_path):
    make_trainer(tmp_path, "trainer.total_training_steps=1").fit()
    again = make_trainer(tmp_path, "trainer.total_training_steps=1")
    again.fit()
    assert again.step == 1
    assert len(again.metrics_log.read()) == 1


def test_resume_mode_disable_refuses_to_overwrite_a_run(tmp_path):
    make_trainer(tmp_path, "trainer.total_training_steps=1").fit()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.resume_mode=disable")
    with pytest.raises(RunSetupError, match="trainer.resume_mode"):
        trainer.fit()


def test_stop_request_checkpoints_at_the_end_of_the_step(tmp_path):
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=5")

    class StopAfterTwo:
        def on_step(self, step, metrics):
            if step == 2:
                trainer.control.request_stop()

    trainer.observers.append(StopAfterTwo())
    trainer.fit()
    assert [step for step, _ in list_checkpoints(trainer.checkpointer.directory)] == [2]
    assert len(trainer.metrics_log.read()) == 2


def test_signal_handlers_stop_at_the_safe_point_and_give_the_trainer_back_when_removed(tmp_path):
    """A SIGTERM asks for a stop; the handlers, once removed, no longer hold the trainer (whose sharded models hold
    the process groups: a group alive at interpreter exit can abort a rank that trained to the end)."""
    previous = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=5")

    class TerminatedAfterTwo:
        def on_step(self, step, metrics):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer.observers.append(TerminatedAfterTwo())
    restore = trainer.control.install_signal_handlers()
    try:
        trainer.fit()
    finally:
        restore()
    assert [step for step, _ in list_checkpoints(trainer.checkpointer.directory)] == [2]
    assert signal.getsignal(signal.SIGTERM) is previous
    alive = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert alive() is None


def test_metrics_use_verls_names(tmp_path):
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=1")
    trainer.fit()
    row = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "actor/lr", "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean",
                "critic/returns/mean", "critic/values/mean", "critic/vf_loss", "critic/vf_clipfrac",
                "critic/vf_explained_var", "response_length/mean", "response_length/clip_ratio",
                "prompt_length/mean", "timing_s/gen", "timing_s/values",
                "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor", "timing_s/update_critic",
                "timing_s/step", "perf/throughput", "perf/total_num_tokens", "perf/max_memory_allocated_gb",
                "training/epoch"):
        assert key in row, key
    assert row["step"] == 1
    assert 0.0 <= row["critic/score/mean"] <= 1.0


def test_grpo_with_kl_loss_runs_without_a_critic(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                           "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                           "trainer.total_training_steps=2")
    assert trainer.critic is None and trainer.reference is not None
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert len(rows) == 2
    assert "actor/kl_loss" in rows[0] and "critic/vf_loss" not in rows[0]


def test_grpo_advantages_are_centred_within_each_prompts_group(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                           "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    batch = trainer.generation.generate(trainer.records[:4])
    scores = torch.tensor([0.0, 1.0, 0.5, 0.5] * 4)
    batch.token_level_scores = place_on_last_token(scores, batch.response_mask)
    trainer.advantages.compute_advantages(batch)
    # Every token of a response carries that response's advantage; the group's advantages sum to 0.
    per_response = batch.advantages[:, 0]
    torch.testing.assert_close(per_response.view(4, 4).sum(dim=1), torch.zeros(4), atol=1e-5, rtol=0)
    std = scores[:4].std()
    torch.testing.assert_close(per_response[:4], (scores[:4] - 0.5) / (std + 1e-6))


def test_adaptive_kl_in_reward_moves_the_coefficient(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=1e-9",
                           "algorithm.kl_ctrl.horizon=10", "algorithm.kl_penalty=abs",
                           "trainer.total_training_steps=3")
    trainer.fit()
    rows = trainer.metrics_log.read()
    coefficients = [row["actor/reward_kl_penalty_coeff"] for row in rows]
    assert coefficients[0] == pytest.approx(0.1)
    # Step 1 samples from the reference itself (KL 0, under target): the coefficient falls. After
    # an update the policy has drifted by more than the tiny target: it rises again.
    assert coefficients[1] < coefficients[0]
    assert coefficients[2] > coefficients[1]
    assert all(row["critic/rewards/mean"] <= row["critic/score/mean"] + 1e-6 for row in rows)


Sent = TypeVar("Sent")


class FakeDaemonLink:
    """Stands in for trainer/telemetry.py: records what the trainer sends, hands it queued commands."""

    def __init__(self):
        self.sent: list[UpMessage] = []
        self.inbox: list[DownMessage] = []

    def send(self, message: UpMessage) -> None:
        self.sent.append(message)

    def poll(self) -> list[DownMessage]:
        messages, self.inbox = self.inbox, []
        return messages

    def of_type(self, kind: type[Sent]) -> list[Sent]:
        return [message for message in self.sent if isinstance(message, kind)]


def test_live_settings_apply_at_the_next_step_and_are_acknowledged(tmp_path):
    link = FakeDaemonLink()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=3")
    trainer.control.telemetry = link
    applied = []
    trainer.settings.subscribe(applied.append)

    class ChangeAfterStepOne:
        def on_step(self, step, metrics):
            if step == 1:
                values = {**trainer.settings.current.public(), "dynamic_offload.gpu_memory_threshold": 0.6}
                link.inbox.append(SettingsMessage(version=4, values=LiveSettings.model_validate(values)))

    trainer.observers.append(ChangeAfterStepOne())
    trainer.fit()
    [ack] = link.of_type(SettingsAckMessage)
    assert (ack.version, ack.step, ack.values) == (4, 2, trainer.settings.current)
    assert trainer.settings.current.gpu_memory_threshold == 0.6
    assert [settings.gpu_memory_threshold for settings in applied] == [0.6]
    assert [message.step for message in link.of_type(StepMessage)] == [1, 2, 3]
    phases = [message.phase for message in link.of_type(PhaseMessage) if message.step == 1]
    assert phases[:3] == ["gen", "reward", "old_log_prob"] and phases[-1] == "update_actor"


def test_the_trainer_sends_heartbeats_from_its_loop_and_from_inside_its_phases(tmp_path, monkeypatch):
    import trainer.control

    monkeypatch.setattr(trainer.control, "HEARTBEAT_INTERVAL_S", 0.0)  # each chance to send one, sends one
    link = FakeDaemonLink()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=2")
    trainer.control.telemetry = link
    trainer.fit()
    sent = [(type(message).__name__, getattr(message, "phase", None)) for message in link.sent
            if isinstance(message, HeartbeatMessage | PhaseMessage)]
    # One at the safe point before each step, one as its rollout starts (after the gen phase began).
    assert sent[:3] == [("HeartbeatMessage", None), ("PhaseMessage", "gen"), ("HeartbeatMessage", None)]
    assert sorted({message.step for message in link.of_type(HeartbeatMessage)}) == [1, 2, 3]


def test_checkpoint_now_and_stop_from_the_daemon(tmp_path):
    link = FakeDaemonLink()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=10")
    trainer.control.telemetry = link

    class Commands:
        def on_step(self, step, metrics):
            if step == 1:
                link.inbox.append(CheckpointNowMessage())
            if step == 3:
                link.inbox.append(StopMessage())

    trainer.observers.append(Commands())
    trainer.fit()
    # Both are taken at the safe point after the step they arrive in: a checkpoint of step 1 at once,
    # and one of step 3 on the way out.
    assert [step for step, _ in list_checkpoints(trainer.checkpointer.directory)] == [1, 3]
    assert [message.step for message in link.of_type(CheckpointMessage)] == [1, 3]
    assert trainer.step == 3


def test_settings_sent_before_the_first_step_hold_from_step_one(tmp_path):
    link = FakeDaemonLink()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=1")
    trainer.control.telemetry = link
    values = {**trainer.settings.current.public(), "dynamic_offload.min_transformer_layers_on_gpu": 3}
    link.inbox.append(SettingsMessage(version=2, values=LiveSettings.model_validate(values)))
    assert trainer.control.receive_initial_settings(timeout_s=1.0)
    assert link.of_type(SettingsAckMessage)[0].step == 1
    assert trainer.settings.current.min_transformer_layers_on_gpu == 3
    assert not trainer.control.receive_initial_settings(timeout_s=0.05)


def test_a_placement_the_host_cannot_hold_is_refused_at_start_naming_the_settings(tmp_path):
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "critic.fsdp_config.param_offload=true"])
    with pytest.raises(RunSetupError) as error:
        # Room for the actor's placement (all on the "GPU": nothing on the host) but not the critic's.
        Trainer(config, log=lambda *_: None, host_available=lambda: (2 << 30) + 1000)
    message = str(error.value)
    assert message.startswith("the critic's offload placement needs ")
    # What is available: the 1000 bytes free plus the critic's own weights (packing gives those back).
    assert re.search(r" and [\d.]+ [KM]iB is available \(", message) and "and 0.98 KiB is" not in message
    assert message.endswith("is available (keeping 2.00 GiB free): place fewer groups on the CPU "
                            "(critic.fsdp_config.param_offload, .offload_policy, .optimizer_offload), keep their "
                            "gradients in bf16 (critic.fsdp_config.offload_grad_dtype) or use a machine with more "
                            "memory")
    assert "\n" not in message


def test_a_run_with_bf16_gradients_on_the_host_trains(tmp_path):
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    trainer = make_trainer(tmp_path, f"{fsdp}.model_dtype=bf16", f"{fsdp}.optimizer_offload=true",
                           f"{fsdp}.param_offload=true", f"{fsdp}.offload_grad_dtype=bf16",
                           "trainer.total_training_steps=2")
    engine = trainer.memory.engine("actor")
    assert engine.layout.dtypes.grad == torch.bfloat16 and engine.layout.dtypes.master == torch.float32
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert len(rows) == 2 and all(math.isfinite(row["actor/grad_norm"]) for row in rows)


def test_cpu_threads_sets_the_trainers_thread_pool(tmp_path):
    before = torch.get_num_threads()
    try:
        make_trainer(tmp_path, "trainer.cpu_threads=1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match=r"trainer\.cpu_threads: got 0"):
        load_config(None, ["trainer.cpu_threads=0"])


def test_the_trainer_process_starts_cuda_with_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    from trainer.main import ALLOCATOR_DEFAULTS, use_allocator_defaults

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    use_allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_DEFAULTS == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    use_allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    use_allocator_defaults()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_the_actor_loss_takes_the_entropy_gradient_only_with_an_entropy_bonus(entropy_coeff):
    """Without a bonus the entropy is a metric: no graph (its float32 softmax is not kept for the backward),
    and the gradient is the policy loss's alone."""
    from tests.trainer.offload.test_offload import policy
    from tests.trainer.test_memory import two_responses
    from trainer.config import ActorConfig
    from trainer.workers.actor import Actor

    model = policy()
    actor = Actor(model, ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                                     entropy_coeff=entropy_coeff), temperature=0.8, rollout_n=1,
                  log_prob_micro_batch_size=2, total_steps=1, seed=1)
    batch = two_responses()
    batch.old_log_probs = actor.compute_log_probs(batch) + 0.1
    batch.advantages = torch.linspace(-1, 1, 6).reshape(2, 3)
    loss, metrics = actor._loss(batch)
    gradients = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    from trainer.algorithms import compute_policy_loss, log_probs_from_logits, scaled_logits
    from trainer.workers.optimization import response_logits

    log_probs = log_probs_from_logits(scaled_logits(response_logits(model, batch), 0.8), batch.response_ids)
    config = actor.config
    low, high = config.clip_range
    policy_loss = compute_policy_loss(batch.old_log_probs, log_probs, batch.advantages, batch.response_mask,
                                      clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=config.clip_ratio_c,
                                      loss_agg_mode=config.loss_agg_mode).loss
    expected = torch.autograd.grad(policy_loss, list(model.parameters()), allow_unused=True)
    same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(gradients, expected, strict=True))
    assert same == (entropy_coeff == 0.0)
    assert metrics["entropy"] > 0


def test_a_delayed_update_samples_the_next_rollout_with_the_weights_before_it(tmp_path):
    """actor fsdp_config.delayed_update: step 1 (whose rollout comes before any update) is the plain run's to the
    number; from step 2 on each rollout samples with the weights from before the previous update. The update's
    learning rate is one large enough that the weights it leaves sample other responses from the same seed."""
    offload = ["model_dtype=bf16", "optimizer_offload=true", "offload_policy={embedding: cpu, lm_head: cpu}"]
    runs = {}
    for delayed in (False, True):
        config = load_config(None, [*TINY, *(f"actor_rollout_ref.actor.fsdp_config.{key}" for key in offload),
                                    f"actor_rollout_ref.actor.fsdp_config.delayed_update={str(delayed).lower()}",
                                    "trainer.total_training_steps=3", f"trainer.runs_dir={tmp_path}",
                                    "actor_rollout_ref.actor.optim.lr=3e-2",
                                    f"trainer.experiment_name=delayed-{delayed}"])
        trainer = Trainer(config, log=lambda *_: None)
        trainer.fit()
        runs[delayed] = trainer.metrics_log.read()
    plain, delayed = runs[False], runs[True]

    def computed(row):
        return {key: value for key, value in row.items() if not key.startswith(MACHINE_METRICS)}

    assert computed(delayed[0]) == computed(plain[0])
    assert computed(delayed[1]) != computed(plain[1])


def test_a_split_update_reports_each_steps_host_share_and_the_window_it_learned(tmp_path):
    """optimizer_update both: each step's metrics say how much of the actor's last update the host took and, once a
    second update has been planned, the window the split learned (its plan to the next read that needed it)."""
    offload = ["optimizer_offload=true", "optimizer_update=both", "offload_policy={embedding: cpu, lm_head: cpu}"]
    config = load_config(None, [*TINY, *(f"actor_rollout_ref.actor.fsdp_config.{key}" for key in offload),
                                "trainer.total_training_steps=3", f"trainer.runs_dir={tmp_path}"])
    trainer = Trainer(config, log=lambda *_: None)
    trainer.fit()
    rows = trainer.metrics_log.read()
    shares = [row["offload/actor/update_host_share"] for row in rows]
    assert all(0 <= share <= 1 for share in shares), shares
    assert all(row["offload/actor/update_window_s"] > 0 for row in rows[1:])
    assert "offload/critic/update_host_share" not in rows[0]  # the critic is not offloaded: no split


# ------------------------------------------------------------------------ full disks, bad inputs


def no_space_for_step(step: int, monkeypatch) -> None:
    """torch.save of the trainer state fails for `step` as on a full disk; the other saves go through."""
    real = torch.save

    def save(state, path, *args, **kwargs):
        if isinstance(state, dict) and state.get("step") == step:
            with open(path, "wb") as file:
                file.write(b"what fitted")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(state, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)


def test_a_checkpoint_the_disk_cannot_take_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    warnings: list[str] = []
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=3",
                                "trainer.save_freq=1"])
    trainer = Trainer(config, log=lambda *_: None, warn=warnings.append)
    no_space_for_step(2, monkeypatch)
    trainer.fit()  # ended the run with exit code 2
    rows = trainer.metrics_log.read()
    assert [row["step"] for row in rows] == [1, 2, 3]
    # A save's failure is in the next step's metrics (verl_trainer_checkpoint_failures_total counts them).
    assert [(row["checkpoint/failures"], row["checkpoint/failing"]) for row in rows] == [(0, 0), (0, 0), (1, 1)]
    assert [step for step, _ in list_checkpoints(trainer.checkpointer.directory)] == [1, 3], "the next save tried again"
    assert len(warnings) == 1
    assert warnings[0].startswith("CHECKPOINT NOT SAVED: could not write the checkpoint of step 2 to ")
    assert "([Errno 28] No space left on device) after " in warnings[0]
    assert warnings[0].endswith("training goes on and the next save tries again (the latest complete checkpoint, "
                                "which a restart resumes from: step 1)")


def test_a_final_checkpoint_the_disk_cannot_take_leaves_the_actors_weights(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1")
    no_space_for_step(2, monkeypatch)
    with pytest.raises(FinalCheckpointError) as error:
        trainer.fit()
    weights = trainer.run_dir / "checkpoints" / "weights_step_2"
    message = str(error.value)
    assert message.startswith("the final checkpoint of step 2 was not saved: could not write the checkpoint of step 2")
    assert message.endswith(f"; the actor's weights alone are in {weights} (safetensors; without optimizer states "
                            "they cannot resume the run); the latest complete checkpoint: step 1")
    loaded = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True)
    for name, tensor in trainer.actor.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_partial_metrics_line_does_not_stop_a_resume(tmp_path):
    make_trainer(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1").fit()
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("ab") as file:
        file.write(b'{"step": 3, "critic/score/me')  # what a full disk left of step 3's line
    warnings: list[str] = []
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=3"])
    resumed = Trainer(config, log=lambda *_: None, warn=warnings.append)
    resumed.fit()  # a JSONDecodeError at every restart, for ever
    assert [row["step"] for row in resumed.metrics_log.read()] == [1, 2, 3]
    assert any("dropped 1 partial or garbled line(s)" in warning for warning in warnings)


RAISING_REWARD = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 0
"""


def test_a_reward_function_that_raises_is_one_line_naming_it_and_where(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(RAISING_REWARD)
    trainer = make_trainer(tmp_path, f"custom_reward_function.path={reward}", "trainer.total_training_steps=1")
    with pytest.raises(RewardFunctionError) as error:
        trainer.fit()
    assert str(error.value) == (f"custom_reward_function 'compute_score' at {reward}:2 raised ZeroDivisionError: "
                                "division by zero (scoring a response of data_source 'counting'); fix the function, "
                                "or set custom_reward_function.on_error=zero to score such responses 0")
    assert error.value.traceback_text.startswith("Traceback (most recent call last):\n")
    assert f'File "{reward}", line 2, in compute_score' in error.value.traceback_text


def test_on_error_zero_scores_a_raising_reward_0_and_counts_it(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(RAISING_REWARD)
    warnings: list[str] = []
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", f"custom_reward_function.path={reward}",
                                "custom_reward_function.on_error=zero", "trainer.total_training_steps=2"])
    trainer = Trainer(config, log=lambda *_: None, warn=warnings.append)
    trainer.fit()
    rows = trainer.metrics_log.read()
    assert [row["reward/errors"] for row in rows] == [8, 8]  # every response of the 8 prompts
    assert [row["critic/score/mean"] for row in rows] == [0.0, 0.0]
    assert len(warnings) == 1 and warnings[0].startswith(f"custom_reward_function 'compute_score' at {reward}:2 "
                                                         "raised ZeroDivisionError")


def test_a_run_without_reward_errors_counts_none(tmp_path):
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=1")
    trainer.fit()
    assert trainer.metrics_log.read()[0]["reward/errors"] == 0


@pytest.mark.parametrize(("row", "error", "phrase"), [
    ({"prompt": "what is 1 plus 2", "reward_model": {"ground_truth": "3"}}, UnknownTokens,
     "60% of the prompt tokens of data.train_files (24 of 40) are unknown to the tokenizer ("),
    ({"prompt": "1 2 3 4 5 6 7 8 9", "reward_model": {"ground_truth": "3"}}, PromptTooLong,
     "line 1: the prompt has 9 tokens, more than data.max_prompt_length=8"),
    ({"prompt": "1 2"}, DataError, "line 1: reward_model.ground_truth is missing, but the built-in scorer"),
])
def test_prompts_are_checked_at_start_before_any_model_is_built(tmp_path, saved_policy, row, error, phrase):
    """The model directory's weights are truncated: building a model would fail, so the prompts' error coming
    instead shows they were checked first (it came after the daemon and every model had started)."""
    model = tmp_path / "model"
    shutil.copytree(saved_policy, model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:100])
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({**row, "data_source": "counting"}) + "\n" for _ in range(8)))
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", f"data.train_files={data}",
                                f"actor_rollout_ref.model.path={model}"])
    with pytest.raises(error) as raised:
        Trainer(config, log=lambda *_: None)
    assert phrase in str(raised.value)


def test_the_built_in_tokenizer_is_named_when_it_cannot_read_the_prompts(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "what is 1 plus 2", "data_source": "arith"}) + "\n")
    (tmp_path / "reward.py").write_text(RAISING_REWARD)
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", f"data.train_files={data}",
                                "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                                f"custom_reward_function.path={tmp_path / 'reward.py'}"])
    with pytest.raises(UnknownTokens, match=r"^60% of the prompt tokens .* \(builtin:tiny-qwen2's built-in "
                                            r"17-token tokenizer; e\.g\. 'what', 'is', 'plus' in data file .*"
                                            r"set actor_rollout_ref\.model\.tokenizer_path to a tokenizer"):
        Trainer(config, log=lambda *_: None)


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory):
    """A tiny policy and its tokenizer as a model directory (the built-in tokenizer)."""
    directory = tmp_path_factory.mktemp("policy")
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=0,
                override_config={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
                ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_an_update_skipped_on_a_non_finite_gradient_norm_is_a_loud_line_and_leaves_the_weights(tmp_path,
                                                                                              monkeypatch):
    warnings: list[str] = []
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.total_training_steps=2",
                                "trainer.save_freq=-1"])
    trainer = Trainer(config, log=lambda *_: None, warn=warnings.append)
    before = {name: parameter.detach().clone() for name, parameter in trainer.actor.model.named_parameters()}
    # The actor's norm is inf, as after an overflow (its optimizer clips inside its update: OffloadAdamW).
    real = OffloadAdamW.clip_grad_norm_
    monkeypatch.setattr(OffloadAdamW, "clip_grad_norm_", lambda self, max_norm: real(self, max_norm) * math.inf)
    trainer.fit()
    after = dict(trainer.actor.model.named_parameters())
    assert all(torch.equal(before[name], after[name].detach()) for name in before)
    rows = trainer.metrics_log.read()
    assert [row["actor/skipped_steps"] for row in rows] == [2.0, 2.0]  # two mini-batches: two updates a step
    skipped = [line for line in warnings if "actor skipped 2 optimizer update(s) on a non-finite gradient norm" in line]
    assert [line.split(":")[0] for line in skipped] == ["STEP 1", "STEP 2"]


def test_an_update_of_one_optimizer_step_takes_its_own_log_probs_as_the_old_ones(tmp_path, monkeypatch):
    """One mini-batch, one epoch, no KL in the reward: the step skips the separate old-log-prob pass (verl's actor
    takes its own log-probs, detached, as the old ones then) and trains the same actor and critic as a step that
    scores them, within fp32's rounding of the two passes; with two mini-batches or the KL in the reward it
    scores them."""
    on_policy = ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.total_training_steps=2"]
    scored_calls = []
    original = Trainer._scores_old_log_probs

    def counting(self, size):
        scored = original(self, size)
        scored_calls.append(scored)
        return scored

    monkeypatch.setattr(Trainer, "_scores_old_log_probs", counting)
    lines: list[str] = []
    config = load_config(None, [*TINY, f"trainer.runs_dir={tmp_path}", "trainer.experiment_name=skipped",
                                *on_policy])
    skipped = Trainer(config, log=lines.append)
    skipped.fit()
    assert scored_calls == [False, False]
    assert sum("old_log_prob: not scored in a pass of its own" in line for line in lines) == 1
    assert "timing_s/old_log_prob" in skipped.metrics_log.read()[0]

    monkeypatch.setattr(Trainer, "_scores_old_log_probs", lambda self, size: True)
    scored = make_trainer(tmp_path, *on_policy, name="scored")
    scored.fit()
    for role in ("actor", "critic"):
        expected = getattr(scored, role).model.state_dict()
        for key, value in getattr(skipped, role).model.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=f"{role} {key}")

    monkeypatch.setattr(Trainer, "_scores_old_log_probs", counting)
    scored_calls.clear()
    make_trainer(tmp_path, "trainer.total_training_steps=1", name="two-mini-batches").fit()
    make_trainer(tmp_path, *on_policy[:1], "trainer.total_training_steps=1", "algorithm.use_kl_in_reward=true",
                 name="kl-in-reward").fit()
    assert scored_calls == [True, True]
