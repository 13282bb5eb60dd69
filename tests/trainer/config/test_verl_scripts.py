"""verl's own launch scripts run here as they are, with only their paths changed: a corpus of verl's examples
(tests/trainer/config/assets/verl_examples/: PPO, GRPO, RLOO, REINFORCE++, ReMax, GPG, GSPO, CISPO, GMPO, OTB, rollout
correction, LoRA tuning, reward-model runs, DAPO's reward manager, gpt-oss's chat-template keywords, the prefix
grouper; vLLM, SGLang and TensorRT-LLM rollouts), each expanded by bash with `python3` standing in for a function
that prints its arguments.

Each script loads (its engine keys in the NOTE line), or, where it asks for Megatron, is refused in one line. A
script added before the feature it needs is marked as waiting on it (Script.waits_on): a strict xfail, so that it
fails the moment the feature lets it pass. Four of them also go through `verl train --check` as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.config import ConfigError, LoadedConfig, load_config_with_notes

EXAMPLES = Path(__file__).resolve().parent / "assets" / "verl_examples"
# verl's examples/sglang_multiturn/config/{tool_config,interaction_config}/*.yaml, which its multi-turn scripts name.
TOOL_CONFIGS = EXAMPLES / "sglang_multiturn_config"
VERL = Path(sys.executable).parent / "verl"
TINY = "builtin:tiny-qwen2"

# Commands a script runs besides verl's trainer, stubbed: its data preparation, conda, Ray. The trainer's lines are
# written to $VERL_ARGUMENTS, NUL-separated (those of `python3 -m verl.trainer.main_ppo` only: a script may pipe its
# output through tee, and trace itself with set -x).
SHIM = ('python3() { if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then printf "%s\\0" "$@" > "$VERL_ARGUMENTS"; fi; }; '
        'python() { :; }; conda() { :; }; ray() { :; }; '
        'script="$1"; shift; source "$script" "$@"')
# A script's own parameters, as a user on one node sets them (the DAPO and GSPO scripts read these).
ENVIRONMENT = {"NNODES": "1", "SLURM_JOB_NUM_NODES": "1"}



@dataclass(frozen=True)
class Script:
    engine: str = "vllm"
    """The rollout it names (noted: the built-in rollout runs)."""
    waits_on: tuple[str, ...] = ()
    """The features, built in parallel, without which it is refused today."""
    megatron: bool = False
    """It asks for Megatron: one refusal line."""


CORPUS: dict[str, Script] = {
    "cispo_trainer_run_cispo_qwen2_5_0_5b_gsm8k.sh": Script(),
    "gmpo_trainer_run_qwen2_5-7b_math.sh": Script(),
    "gmpo_trainer_test_dapo_7b_math.sh": Script(),
    "gpg_trainer_run_qwen2-7b_math.sh": Script(),
    "gspo_trainer_test_gspo_3b_math.sh": Script(),
    "otb_trainer_run_qwen2_5-7b.sh": Script(),  # calculate_sum_pi_squared too
    "reinforce_plus_plus_trainer_run_qwen2-7b_math_rf.sh": Script(),
    "reinforce_plus_plus_trainer_run_qwen2-7b_math_rf_baseline.sh": Script(),
    "remax_trainer_run_qwen2.5-3b_seq_balance.sh": Script(),
    "rloo_trainer_run_qwen2-7b.sh": Script(),
    "rollout_correction_run_with_rollout_corr.sh": Script(),
    "ppo_trainer_run_qwen2-7b_rm.sh": Script(),
    "ppo_trainer_run_qwen2-7b_rm_legacy.sh": Script(),
    "ppo_trainer_run_qwen2-7b_rm_seq_balance.sh": Script(),
    "ppo_trainer_run_qwen2-7b_rm_seq_balance_fused_kernels.sh": Script(),
    "ppo_trainer_run_qwen2-7b_sglang_seq_balance.sh": Script(engine="sglang"),
    "ppo_trainer_run_deepseek7b_llm_sp2.sh": Script(),
    "ppo_trainer_run_gemma.sh": Script(),
    "ppo_trainer_run_deepseek_math_gsm8k_megatron.sh": Script(megatron=True),
    "grpo_trainer_run_qwen2-7b_math.sh": Script(),
    "grpo_trainer_run_qwen2-7b_math_trtllm.sh": Script(engine="trtllm"),
    "grpo_trainer_run_deepseek7b_llm_seq_balance.sh": Script(),
    "grpo_trainer_run_qwen3-8b.sh": Script(),
    "tuning_0.5b_qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": Script(),
    "tuning_7b_qwen2-7b_grpo-lora_1_h100_fsdp_vllm.sh": Script(),
    "grpo_trainer_run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh": Script(),  # lora_adapter_path
    "grpo_trainer_run_gptoss_20b.sh": Script(engine="sglang"),  # data.apply_chat_template_kwargs
    "prefix_grouper_run_qwen3_prefix_grouper.sh": Script(),
    "grpo_trainer_run_mistral13b_skyworkrm_hhrlhf.sh": Script(),
    "ppo_trainer_run_qwen2-7b_rm_reward_loop_colocate.sh": Script(),
    "ppo_trainer_run_qwen2.5-32b.sh": Script(),  # 4 nodes, no rendezvous endpoint (verl's Ray): a WARNING line
    # FSDP's mixed_precision (noted) and 2 nodes, with use_torch_compile=False
    "grpo_trainer_run_qwen3-32b_npu.sh": Script(),
    # verl's multi-turn and tool-calling examples (examples/sglang_multiturn/): a named config of its own
    # (--config-name=gsm8k_multiturn_grpo ...) with a tool or interaction config file
    "sglang_multiturn_run_qwen2.5-3b_gsm8k_multiturn.sh": Script(engine="sglang"),
    "sglang_multiturn_run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh": Script(engine="sglang"),
    "sglang_multiturn_run_qwen2.5-3b_gsm8k_multiturn_server.sh": Script(engine="sglang"),
    "sglang_multiturn_search_r1_like_run_qwen2.5-3b_instruct_search_multiturn.sh": Script(engine="sglang"),
    "sglang_multiturn_run_qwen2.5-3b_megatron_gsm8k_multiturn.sh": Script(engine="sglang", megatron=True),
    # Qwen2.5-VL on geo3k's images, with verl's Geo3kTool (--config-name=geo3k_multiturn_grpo)
    "sglang_multiturn_geo3k_run_qwen2.5-3b_geo3k_multiturn.sh": Script(engine="sglang"),
    "sglang_multiturn_geo3k_run_qwen2.5-3b_geo3k_multiturn_4xgpu.sh": Script(engine="sglang"),
    "grpo_trainer_run_qwen2_5_vl-7b_freeze_vision.sh": Script(),  # actor.freeze_vision_tower (a NOTE on a text model)
    "ppo_trainer_run_deepseek7b_llm_sandbox_fusion.sh": Script(),  # reward_model.sandbox_fusion, the prime manager
    # The five of tests/trainer/test_verl_keys.py
    "ppo_trainer_run_deepseek7b_llm.sh": Script(),
    "ppo_trainer_run_qwen2-7b_seq_balance.sh": Script(),
    "grpo_trainer_run_qwen2-7b.sh": Script(),
    "grpo_trainer_run_deepseek7b_llm.sh": Script(),
    "grpo_trainer_run_qwen2_5-3b_gsm8k_grpo_lora.sh": Script(),
}


def write_parquet(path: Path, rows: int = 8) -> Path:
    """A data file in verl's gsm8k layout (plain-text prompts the built-in tokenizer reads: digits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": f"{index} {index + 1} {index + 2}", "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(index)}, "extra_info": {"index": index}}
        for index in range(rows)]), path)
    return path


@dataclass(frozen=True)
class Launch:
    """A script's arguments to verl's trainer, its paths made local."""

    config_name: str | None
    overrides: list[str]

    def command_line(self) -> list[str]:
        return [*([f"--config-name={self.config_name}"] if self.config_name else []), *self.overrides]


def launch_of(script: str, tmp_path: Path) -> Launch:
    """The script's lines to `python3 -m verl.trainer.main_ppo` as bash expands them, with each model path the
    built-in tiny model, the data files local and the checkpoints in `tmp_path` (nothing else changed)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    written = tmp_path / "arguments"
    result = subprocess.run(["bash", "-c", SHIM, "bash", str(EXAMPLES / script)], capture_output=True, timeout=30,
                            env={**os.environ, **ENVIRONMENT, "HOME": str(home), "VERL_ARGUMENTS": str(written)},
                            stdin=subprocess.DEVNULL, cwd=tmp_path)
    arguments = written.read_bytes().decode().split("\0")[:-1] if written.exists() else []
    assert arguments[:2] == ["-m", "verl.trainer.main_ppo"], (arguments[:2], result.stderr.decode()[-2000:])
    train, test = write_parquet(tmp_path / "data" / "train.parquet"), write_parquet(tmp_path / "data" / "test.parquet")
    config_name, overrides = None, []
    for argument in arguments[2:]:
        if argument.startswith("--config-path"):
            continue
        if argument.startswith("--config-name="):
            config_name = argument.partition("=")[2]
            continue
        key, _, _ = argument.lstrip("+~").partition("=")
        if key.endswith(("model.path", "model.tokenizer_path")):
            argument = f"{argument.partition('=')[0]}={TINY}"
        elif key in ("data.train_files", "data.val_files"):
            argument = f"{key}=[{train if key == 'data.train_files' else test}]"
        elif key == "trainer.default_local_dir":
            argument = f"{key}={tmp_path / 'checkpoints'}"
        elif key.endswith(("tool_config_path", "interaction_config_path")):  # verl's files, copied beside the scripts
            argument = f"{argument.partition('=')[0]}={TOOL_CONFIGS / Path(argument.partition('=')[2]).name}"
        elif key.endswith("lora_adapter_path"):
            adapter = tmp_path / "lora_adapter"
            adapter.mkdir(exist_ok=True)
            (adapter / "adapter_config.json").write_text("{}")  # read at start (the load checks that it is there)
            argument = f"{argument.partition('=')[0]}={adapter}"
        overrides.append(argument)
    return Launch(config_name, [*overrides, f"trainer.runs_dir={tmp_path / 'runs'}"])


def load(launch: Launch) -> LoadedConfig:
    return load_config_with_notes(None, launch.overrides, launch.config_name)


def marked(script: str) -> object:
    waits_on = CORPUS[script].waits_on
    if not waits_on:
        return script
    return pytest.param(script, marks=pytest.mark.xfail(reason=f"waits on {' and '.join(waits_on)}", strict=True,
                                                        raises=ConfigError))


def test_the_corpus_is_the_assets_folder() -> None:
    assert sorted(CORPUS) == sorted(path.name for path in EXAMPLES.glob("*.sh"))
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("script", [marked(script) for script in CORPUS if not CORPUS[script].megatron])
def test_a_verl_script_loads_as_it_is(script: str, tmp_path: Path) -> None:
    config, notes, _ = load(launch_of(script, tmp_path))
    engine = CORPUS[script].engine
    assert config.actor_rollout_ref.rollout.name == engine
    assert f"actor_rollout_ref.rollout.name={engine!r}" in [f"{note.key}={note.value!r}" for note in notes]
    assert config.actor_rollout_ref.model.path == TINY


@pytest.mark.parametrize("script", [script for script in CORPUS if CORPUS[script].megatron])
def test_a_megatron_script_is_refused_in_one_line(script: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(launch_of(script, tmp_path))
    [problem] = caught.value.problems
    assert problem.path == "--config-name" and "Megatron-LM is another training engine" in problem.message


# What verl's multi-turn configs set, with the script's own settings over them (as Hydra composes them).
MULTI_TURN = {
    "sglang_multiturn_run_qwen2.5-3b_gsm8k_multiturn.sh": ("gsm8k_tool_config.yaml", None, 5, None, "hermes"),
    "sglang_multiturn_run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh": (None, "gsm8k_interaction_config.yaml",
                                                                           None, 5, "hermes"),
    "sglang_multiturn_run_qwen2.5-3b_gsm8k_multiturn_server.sh": ("gsm8k_tool_config.yaml", None, 5, None, "hermes"),
    "sglang_multiturn_search_r1_like_run_qwen2.5-3b_instruct_search_multiturn.sh": ("search_tool_config.yaml", None,
                                                                                    2, None, "qwen"),
    "sglang_multiturn_geo3k_run_qwen2.5-3b_geo3k_multiturn.sh": ("geo3k_tool_config.yaml", None, 5, None, "hermes"),
    "sglang_multiturn_geo3k_run_qwen2.5-3b_geo3k_multiturn_4xgpu.sh": ("geo3k_tool_config.yaml", None, 5, None,
                                                                       "hermes"),
}


@pytest.mark.parametrize("script", MULTI_TURN)
def test_a_multi_turn_script_turns_the_multi_turn_rollout_on(script: str, tmp_path: Path) -> None:
    config, _, _ = load(launch_of(script, tmp_path))
    tools, interaction, assistant_turns, user_turns, format_ = MULTI_TURN[script]
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable
    assert (multi_turn.tool_config_path and Path(multi_turn.tool_config_path).name) == tools
    assert (multi_turn.interaction_config_path and Path(multi_turn.interaction_config_path).name) == interaction
    assert (multi_turn.max_assistant_turns, multi_turn.max_user_turns, multi_turn.format) == (assistant_turns,
                                                                                              user_turns, format_)
    assert config.data.max_response_length == (3072 if "interaction" in script else 3000 if "search" in script
                                               else 2048 if "geo3k" in script
                                               else 1024)  # the script's, over the named config's


# One PPO run with a critic, a reward model's, GRPO on TensorRT-LLM's rollout, Megatron's refusal, and multi-turn
# runs with verl's gsm8k tool and with its geo3k tool (its Geo3kTool built, its chat template set).
CHECKED = ["ppo_trainer_run_gemma.sh", "ppo_trainer_run_qwen2-7b_rm.sh", "grpo_trainer_run_qwen2-7b_math_trtllm.sh",
           "ppo_trainer_run_deepseek_math_gsm8k_megatron.sh", "sglang_multiturn_run_qwen2.5-3b_gsm8k_multiturn.sh",
           "sglang_multiturn_geo3k_run_qwen2.5-3b_geo3k_multiturn.sh"]


@pytest.mark.slow
@pytest.mark.parametrize("script", CHECKED)
def test_verl_train_check_takes_a_verl_script_as_it_is(script: str, tmp_path: Path) -> None:
    finished = subprocess.run([str(VERL), "train", "--check", "--config-path=config",
                               *launch_of(script, tmp_path).command_line()],
                              capture_output=True, text=True, cwd=tmp_path, timeout=180)
    errors = [line for line in finished.stderr.splitlines() if line.startswith("ERROR: ")]
    if CORPUS[script].megatron:
        assert finished.returncode == 2 and len(errors) == 1, finished.stderr
        assert errors[0].startswith("ERROR: --config-name: got 'ppo_megatron_trainer'")
        return
    assert finished.returncode == 0, finished.stderr
    [note] = [line for line in finished.stderr.splitlines() if line.startswith("NOTE: ")]
    assert f"actor_rollout_ref.rollout.name='{CORPUS[script].engine}': the built-in rollout runs" in note
    assert "config OK" in finished.stderr
