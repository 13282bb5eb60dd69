"""verl's vision-language settings (its geo3k examples): the image column, the built-in tiny Qwen2-VL, and what stays
refused (videos)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config, load_config_with_notes

# verl's examples/grpo_trainer/run_qwen2_5_vl-7b.sh, its model and data made local.
QWEN2_5_VL_7B = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=512", "data.max_prompt_length=1024",
    "data.max_response_length=2048", "data.filter_overlong_prompts=True", "data.truncation=error",
    "data.image_key=images", "actor_rollout_ref.model.path=builtin:tiny-qwen2-vl",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_epochs=15",
]


def test_verls_qwen2_5_vl_script_loads_with_the_tiny_vision_language_model(tmp_path: Path) -> None:
    config, _, _ = load_config_with_notes(None, [*QWEN2_5_VL_7B, f"trainer.runs_dir={tmp_path}"])
    assert config.actor_rollout_ref.model.path == "builtin:tiny-qwen2-vl"
    assert config.data.image_key == "images"
    assert config.actor_rollout_ref.rollout.n == 5


def test_an_image_column_of_another_name_is_read(tmp_path: Path) -> None:
    assert load_config(None, ["data.image_key=pictures", f"trainer.runs_dir={tmp_path}"]).data.image_key == "pictures"


def test_the_image_patch_size_is_noted_as_the_processors_own(tmp_path: Path) -> None:
    _, notes, _ = load_config_with_notes(None, ["+data.image_patch_size=16", f"trainer.runs_dir={tmp_path}"])
    [note] = [note for note in notes if note.key == "data.image_patch_size"]
    assert "image processor" in note.why


def test_videos_stay_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["+data.video_key=clips", f"trainer.runs_dir={tmp_path}"])
    [problem] = caught.value.problems
    assert problem.path == "data.video_key" and "videos in the prompts are not built" in problem.message


def test_an_unknown_builtin_model_names_the_vision_language_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["actor_rollout_ref.model.path=builtin:tiny-llava", f"trainer.runs_dir={tmp_path}"])
    assert "builtin:tiny-qwen2-vl" in str(caught.value)
