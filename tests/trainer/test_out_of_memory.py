"""An out-of-memory error the trainer cannot recover from (one sequence, nothing left to move or split) ends the run
with one ERROR line naming the phase, the memory, the micro-batch and the settings that lower that phase's memory,
and exit code 2, which the daemon does not restart. On the CPU the error is injected from a patched forward."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import Qwen2ForTokenClassification

from trainer.config import load_config
from trainer.config.exit_codes import EXIT_USAGE
from trainer.out_of_memory import describe, lowering_keys, memory_said
from trainer.workers.recovery import SequenceOutOfMemory

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
# The message torch raised in the long3b run's critic update (benchmarks/results/e2e-long3b-h100-2026-12-07T1913.json).
H100_MESSAGE = ("CUDA out of memory. Tried to allocate 88.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
                "66.30 GiB is free. Including non-PyTorch memory, this process has 12.71 GiB memory in use. 12.00 GiB "
                "allowed; Of the allocated memory 11.94 GiB is allocated by PyTorch, with 9.00 MiB allocated in "
                "private pools (e.g., CUDA Graphs), and 32.31 MiB is reserved by PyTorch but unallocated.")
TINY = ["actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "data.max_prompt_length=8",
        "data.max_response_length=6", "trainer.device=cpu", "trainer.total_training_steps=1", "trainer.save_freq=-1"]


def test_the_memory_torch_reported_is_one_clause() -> None:
    assert memory_said(H100_MESSAGE) == ("this process had 12.71 GiB in use, of 12.00 GiB allowed, and asked for "
                                         "88.00 MiB more")
    assert memory_said("CUDA out of memory (injected)") == "torch said: CUDA out of memory (injected)"


def test_the_advice_is_the_phases_own_and_skips_what_is_set_already() -> None:
    # long3b's offloaded critic: the optimizer on the CPU and dynamic offload on, gradient checkpointing off.
    config = load_config(None, ["critic.fsdp_config.optimizer_offload=true",
                                "critic.fsdp_config.dynamic_offload.enabled=true", "data.max_response_length=4096"])
    advice = lowering_keys("update_critic", config)
    assert advice[0].startswith("critic.model.enable_gradient_checkpointing=true")
    assert "a shorter data.max_response_length (now 4096)" in advice
    assert not any("optimizer_offload" in line or "param_offload" in line for line in advice)
    assert any(line.startswith("critic.ulysses_sequence_parallel_size=2 or more") for line in advice)
    checkpointed = load_config(None, ["critic.model.enable_gradient_checkpointing=true"])
    assert not any("checkpointing" in line for line in lowering_keys("update_critic", checkpointed))
    # The actor's update names the actor's keys; a no-grad phase has no backward to checkpoint.
    actor = lowering_keys("update_actor", config)
    assert actor[0].startswith("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    assert any("actor_rollout_ref.actor.fsdp_config.param_offload=true" in line for line in actor)
    assert not any("checkpointing" in line for line in lowering_keys("values", config))
    error = SequenceOutOfMemory(torch.OutOfMemoryError(H100_MESSAGE), (16, 4096))
    assert describe("update_critic", error, config).startswith(
        "out of device memory in the critic's update (update_critic) on a micro-batch of 1 sequence of 4112 tokens "
        "(prompt 16, response 4096), with nothing left to move to the CPU or split: this process had 12.71 GiB in "
        "use, of 12.00 GiB allowed, and asked for 88.00 MiB more. To lower this phase's memory: "
        "critic.model.enable_gradient_checkpointing=true")


def test_the_real_trainer_reports_the_critics_update_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys) -> None:
    import trainer.main
    from trainer.config.ipc import ENV_SOCKET, ENV_TOKEN

    forward = Qwen2ForTokenClassification.forward
    calls = []

    def out_of_memory_in_backward_passes(self, *args, **kwargs):
        if torch.is_grad_enabled():  # the critic's update; its values are scored without gradients
            calls.append(kwargs.get("input_ids", args[0] if args else None).shape[0])
            raise torch.OutOfMemoryError(H100_MESSAGE)
        return forward(self, *args, **kwargs)

    monkeypatch.delenv(ENV_SOCKET, raising=False)
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.setattr(Qwen2ForTokenClassification, "forward", out_of_memory_in_backward_passes)
    code = trainer.main.main(["--config", str(QUICKSTART), *TINY, f"trainer.runs_dir={tmp_path}"])
    assert code == EXIT_USAGE  # the daemon does not restart it (test_supervisor: exit 2 is not restarted)
    assert calls == [2, 1]  # the micro-batch of 2 split in two before giving up: recovery ran first
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    found = re.fullmatch(r"ERROR: out of device memory in the critic's update \(update_critic\) on a micro-batch of "
                         r"1 sequence of (\d+) tokens \(prompt (\d+), response (\d+)\), with nothing left to move to "
                         r"the CPU or split: this process had 12\.71 GiB in use, of 12\.00 GiB allowed, and asked for "
                         r"88\.00 MiB more\. To lower this phase's memory: (.*)", errors[0])
    assert found is not None, errors[0]
    total, prompt, response = (int(found.group(index)) for index in (1, 2, 3))
    assert total == prompt + response and 1 <= prompt <= 8 and 1 <= response <= 6
    assert found.group(4).startswith("critic.model.enable_gradient_checkpointing=true")
    assert "a shorter data.max_response_length (now 6)" in found.group(4)
    log = (tmp_path / "quickstart" / "logs" / "trainer.log").read_text()
    assert "out of device memory in the critic's update" in log and "Traceback" not in log
