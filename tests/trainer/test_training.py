"""The RL loop as a user runs it: it learns, it resumes exactly, PPO and GRPO variants run."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import TypeVar

import pytest
import torch

from trainer.checkpoint import latest_checkpoint, list_checkpoints
from trainer.config import ConfigError, load_config
from trainer.config.live import LiveSettings
from trainer.config.messages import (
    CheckpointMessage,
    CheckpointNowMessage,
    DownMessage,
    PhaseMessage,
    SettingsAckMessage,
    SettingsMessage,
    StepMessage,
    StopMessage,
    UpMessage,
)
from trainer.loop import RunSetupError, Trainer
from trainer.rewards.manager import place_on_last_token

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
MACHINE_METRICS = ("timing_s/", "perf/")


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
    shutil.rmtree(latest_checkpoint(trainer.run_dir))
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
                trainer.request_stop()

    trainer.observers.append(StopAfterTwo())
    trainer.fit()
    assert [step for step, _ in list_checkpoints(trainer.run_dir)] == [2]
    assert len(trainer.metrics_log.read()) == 2


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
    batch = trainer.generate(trainer.records[:4])
    scores = torch.tensor([0.0, 1.0, 0.5, 0.5] * 4)
    batch.token_level_scores = place_on_last_token(scores, batch.response_mask)
    trainer.compute_advantages(batch)
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
    trainer.telemetry = link
    applied = []
    trainer.settings_listeners.append(applied.append)

    class ChangeAfterStepOne:
        def on_step(self, step, metrics):
            if step == 1:
                values = {**trainer.live_settings.public(), "gpu_memory_threshold": 0.6}
                link.inbox.append(SettingsMessage(version=4, values=LiveSettings.model_validate(values)))

    trainer.observers.append(ChangeAfterStepOne())
    trainer.fit()
    [ack] = link.of_type(SettingsAckMessage)
    assert (ack.version, ack.step, ack.values) == (4, 2, trainer.live_settings)
    assert trainer.live_settings.gpu_memory_threshold == 0.6
    assert [settings.gpu_memory_threshold for settings in applied] == [0.6]
    assert [message.step for message in link.of_type(StepMessage)] == [1, 2, 3]
    phases = [message.phase for message in link.of_type(PhaseMessage) if message.step == 1]
    assert phases[:3] == ["gen", "reward", "old_log_prob"] and phases[-1] == "update_actor"


def test_checkpoint_now_and_stop_from_the_daemon(tmp_path):
    link = FakeDaemonLink()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=10")
    trainer.telemetry = link

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
    assert [step for step, _ in list_checkpoints(trainer.run_dir)] == [1, 3]
    assert [message.step for message in link.of_type(CheckpointMessage)] == [1, 3]
    assert trainer.step == 3


def test_settings_sent_before_the_first_step_hold_from_step_one(tmp_path):
    link = FakeDaemonLink()
    trainer = make_trainer(tmp_path, "trainer.total_training_steps=1")
    trainer.telemetry = link
    values = {**trainer.live_settings.public(), "min_transformer_layers_on_gpu": 3}
    link.inbox.append(SettingsMessage(version=2, values=LiveSettings.model_validate(values)))
    assert trainer.receive_initial_settings(timeout_s=1.0)
    assert link.of_type(SettingsAckMessage)[0].step == 1
    assert trainer.live_settings.min_transformer_layers_on_gpu == 3
    assert not trainer.receive_initial_settings(timeout_s=0.05)


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
    from tests.trainer.test_memory import two_responses
    from tests.trainer.test_offload import policy
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
    number; from step 2 on each rollout samples with the weights from before the previous update."""
    offload = ["model_dtype=bf16", "optimizer_offload=true", "offload_policy={embedding: cpu, lm_head: cpu}"]
    runs = {}
    for delayed in (False, True):
        config = load_config(None, [*TINY, *(f"actor_rollout_ref.actor.fsdp_config.{key}" for key in offload),
                                    f"actor_rollout_ref.actor.fsdp_config.delayed_update={str(delayed).lower()}",
                                    "trainer.total_training_steps=3", f"trainer.runs_dir={tmp_path}",
                                    f"trainer.experiment_name=delayed-{delayed}"])
        trainer = Trainer(config, log=lambda *_: None)
        trainer.fit()
        runs[delayed] = trainer.metrics_log.read()
    plain, delayed = runs[False], runs[True]

    def computed(row):
        return {key: value for key, value in row.items() if not key.startswith(MACHINE_METRICS)}

    assert computed(delayed[0]) == computed(plain[0])
    assert computed(delayed[1]) != computed(plain[1])
