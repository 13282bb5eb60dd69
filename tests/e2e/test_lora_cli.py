"""LoRA through the real `verl train` command: verl's key on the command line, the adapter in the checkpoint."""

from __future__ import annotations

import json

from tests.e2e.test_cli import QUICKSTART, SMALL, verl


def test_train_with_lora_rank_writes_the_adapter_checkpoint(tmp_path):
    result = verl("train", "--config", QUICKSTART, *SMALL, "actor_rollout_ref.model.lora_rank=8",
                  "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                  "trainer.total_training_steps=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "actor: LoRA adapter rank 8, alpha 16 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" \
        in output
    assert "reference policy: the actor with its LoRA adapter disabled" in output
    run = tmp_path / "runs" / "quickstart"
    actor = run / "checkpoints" / "global_step_2" / "actor"
    assert sorted(path.name for path in actor.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((actor / "adapter_config.json").read_text())["lora_alpha"] == 16
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and "actor/kl_loss" in rows[-1]


def test_a_lora_target_the_model_lacks_is_one_line_with_exit_code_2(tmp_path):
    result = verl("train", "--config", QUICKSTART, *SMALL, "actor_rollout_ref.model.lora_rank=8",
                  "actor_rollout_ref.model.target_modules=[q_proj,query]", "trainer.total_training_steps=1",
                  cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert ("actor_rollout_ref.model.target_modules: got ['q_proj', 'query'], but the model has no module 'query'; "
            "its linear layers: ") in result.stderr
