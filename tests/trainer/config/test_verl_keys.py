"""verl's keys with their meaning here: a corpus of verl-style override lines, verl's own launch scripts and its
generated ppo_trainer.yaml, loaded as verl loads them (or refused in one round, one line per key that verl itself
refuses or that needs a feature this project lacks). No torch here, except through `verl train --check`'s
subprocess. (A larger corpus of verl's scripts: tests/trainer/config/test_verl_scripts.py.)

The corpus is written from verl's documented keys (tests/trainer/config/assets/verl_ppo_trainer_source.yaml) and the
lines of its example scripts (tests/trainer/config/assets/verl_examples/).
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from trainer.config import ConfigError, ConfigProblem, load_config, load_config_with_notes
from trainer.config.aliases import why
from trainer.config.verl import VERL_CONFIG_FILE, verl_only_defaults

ARO = "actor_rollout_ref"
ASSETS = Path(__file__).parent / "assets"
EXAMPLES = ASSETS / "verl_examples"
VERL = Path(sys.executable).parent / "verl"



def problems_of(path: Path | None, overrides: list[str] | tuple[str, ...]) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    return caught.value.problems


# ------------------------------------------------------------------------------------ the corpus

# (override lines, {dotted attribute of the loaded config: the value it must have}).
GOOD: list[tuple[list[str], dict[str, Any]]] = [
    ([f"{ARO}.rollout.name=hf"], {f"{ARO}.rollout.name": "hf"}),
    ([f"{ARO}.rollout.tensor_model_parallel_size=1"], {f"{ARO}.rollout.tensor_model_parallel_size": 1}),
    ([f"{ARO}.rollout.gpu_memory_utilization=0.6"], {f"{ARO}.rollout.gpu_memory_utilization": 0.6}),
    (["data.filter_overlong_prompts=True", "data.truncation='error'"],
     {"data.filter_overlong_prompts": True, "data.truncation": "error"}),
    (["data.return_raw_chat=True"], {"data.return_raw_chat": True}),
    (["data.return_raw_chat=False"], {"data.return_raw_chat": False}),
    (["data.val_batch_size=null"], {"data.val_batch_size": None}),
    (["data.seed=null", "trainer.seed=7"], {"data.seed": None, "prompt_order_seed": 7}),
    (["trainer.val_before_train=False"], {"trainer.val_before_train": False}),
    (["trainer.val_only=True", "data.val_files=[builtin:counting]"], {"trainer.val_only": True}),
    (["trainer.critic_warmup=3"], {"trainer.critic_warmup": 3}),
    (["trainer.critic_warmup=0", "algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=4"], {"trainer.critic_warmup": 0}),
    (["trainer.default_local_dir=/tmp/verl_checkpoints/run1"],
     {"trainer.checkpoint_dir": Path("/tmp/verl_checkpoints/run1")}),
    (["trainer.project_name=verl_examples", "trainer.experiment_name=gsm8k",
      "trainer.default_local_dir=checkpoints/${trainer.project_name}/${trainer.experiment_name}"],
     {"trainer.checkpoint_dir": Path("checkpoints/verl_examples/gsm8k")}),
    ([], {"trainer.checkpoint_dir": Path("runs/run/checkpoints"), "checkpoints_to_keep": None}),
    (["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"], {"checkpoints_to_keep": 3}),
    (["trainer.max_actor_ckpt_to_keep=2"], {"checkpoints_to_keep": 2}),
    (["algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=4", "trainer.max_actor_ckpt_to_keep=1"],
     {"checkpoints_to_keep": 1}),
    (["trainer.max_ckpt_to_keep=2", "trainer.max_actor_ckpt_to_keep=2"], {"checkpoints_to_keep": 2}),
    # critic.model.fsdp_config is verl's place; critic.fsdp_config the canonical one
    (["critic.model.fsdp_config.param_offload=True", "critic.model.fsdp_config.optimizer_offload=True"],
     {"critic.fsdp_config.param_offload": True, "critic.fsdp_config.optimizer_offload": True}),
    (["critic.model.fsdp_config.param_offload=True", "critic.fsdp_config.param_offload=True"],
     {"critic.fsdp_config.param_offload": True}),
    (["critic.model.fsdp_config.offload_policy.embedding=cpu"], {"critic.fsdp_config.offload_policy.embedding": "cpu"}),
    # verl's boolean offload_policy, and this project's per-group mapping
    ([f"{ARO}.actor.fsdp_config.offload_policy=True"],
     {f"{ARO}.actor.fsdp_config.offload_policy.transformer": "cpu", f"{ARO}.actor.fsdp_config.offload_policy.embedding":
      "cpu", f"{ARO}.actor.fsdp_config.optimizer_offload": True}),
    ([f"{ARO}.actor.fsdp_config.offload_policy=False"],
     {f"{ARO}.actor.fsdp_config.offload_policy.transformer": None,
      f"{ARO}.actor.fsdp_config.optimizer_offload": False}),
    ([f"{ARO}.actor.use_kl_loss=True", f"{ARO}.ref.fsdp_config.offload_policy=True"],
     {f"{ARO}.ref.fsdp_config.offload_policy.lm_head": "cpu", f"{ARO}.ref.fsdp_config.optimizer_offload": False}),
    ([f"{ARO}.actor.fsdp_config.offload_policy={{transformer:cpu}}"],
     {f"{ARO}.actor.fsdp_config.offload_policy.transformer": "cpu",
      f"{ARO}.actor.fsdp_config.offload_policy.embedding": None}),
    # the LR schedule under verl's names
    ([f"{ARO}.actor.optim.lr_scheduler_type=cosine", f"{ARO}.actor.optim.min_lr_ratio=0.1",
      f"{ARO}.actor.optim.num_cycles=0.5", f"{ARO}.actor.optim.lr_warmup_steps_ratio=0.1"],
     {f"{ARO}.actor.optim.schedule": "cosine", f"{ARO}.actor.optim.min_lr_ratio": 0.1}),
    ([f"{ARO}.actor.optim.warmup_style=cosine"], {f"{ARO}.actor.optim.schedule": "cosine"}),
    (["critic.optim.lr_scheduler_type=cosine", "critic.optim.warmup_style=cosine"],
     {"critic.optim.schedule": "cosine"}),
    # verl's keys at verl's defaults (or at what their source mirrors)
    ([f"{ARO}.rollout.mode=async", f"{ARO}.rollout.free_cache_engine=True", f"{ARO}.rollout.load_format=dummy",
      f"{ARO}.rollout.enable_chunked_prefill=True", f"{ARO}.rollout.max_num_batched_tokens=8192"], {}),
    ([f"{ARO}.actor.strategy=fsdp", "critic.strategy=fsdp2", f"{ARO}.hybrid_engine=True"], {}),
    (["trainer.balance_batch=False", "trainer.use_legacy_worker_impl=auto", "trainer.log_val_generations=0"], {}),
    ([f"{ARO}.rollout.val_kwargs.do_sample=False", f"{ARO}.rollout.val_kwargs.temperature=0"], {}),
    ([f"{ARO}.actor.checkpoint.save_contents=[model,optimizer,extra]", f"{ARO}.actor.checkpoint.async_save=False"], {}),
    ([f"{ARO}.rollout.multi_turn.format=hermes", f"{ARO}.rollout.engine_kwargs.vllm={{}}"], {}),
    (["data.max_prompt_length=1024", f"{ARO}.rollout.prompt_length=1024"], {"data.max_prompt_length": 1024}),
    ([f"{ARO}.rollout.response_length=${{data.max_response_length}}"], {}),
    ([f"{ARO}.rollout.n=5", f"{ARO}.actor.rollout_n=5", "critic.rollout_n=5"], {f"{ARO}.rollout.n": 5}),
    ([f"+{ARO}.rollout.enable_prefix_caching=True", f"++{ARO}.rollout.max_num_seqs=256"], {}),
    ([f"{ARO}.rollout.mode=sync", f"~{ARO}.rollout.mode"], {}),
    ([f"{ARO}.actor.megatron={{}}"], {}),
    ([f"{ARO}.actor.optim._target_=verl.workers.config.FSDPOptimizerConfig"], {}),
    ([f"{ARO}.rollout.enforce_eager=True"], {f"{ARO}.rollout.enforce_eager": True}),
    # verl's engine keys: the built-in rollout runs (what each means: tests/trainer/config/test_front_door.py)
    ([f"{ARO}.rollout.name=vllm"], {f"{ARO}.rollout.name": "vllm"}),
    ([f"{ARO}.rollout.name=sglang"], {f"{ARO}.rollout.name": "sglang"}),
    ([f"{ARO}.rollout.tensor_model_parallel_size=2"], {f"{ARO}.rollout.tensor_model_parallel_size": 2}),
    ([f"{ARO}.rollout.max_num_batched_tokens=16384", f"{ARO}.rollout.max_num_seqs=256"],
     {f"{ARO}.rollout.max_num_batched_tokens": 16384, f"{ARO}.rollout.max_num_seqs": 256}),
    ([f"+{ARO}.rollout.engine_kwargs.vllm.swap_space=32", f"{ARO}.rollout.load_format=safetensors",
      f"{ARO}.rollout.layered_summon=True"], {}),
    ([f"{ARO}.actor.fsdp_config.fsdp_size=8", "critic.model.fsdp_config.fsdp_size=8"], {}),
    (["trainer.default_hdfs_dir=hdfs://cluster/checkpoints", "ray_kwargs.ray_init.num_cpus=8"], {}),
    ([f"{ARO}.rollout.agent.num_workers=2", f"{ARO}.rollout.skip_tokenizer_init=False"], {}),
    (["reward_model.max_length=64"], {"reward_model.max_length": 64}),
    (["data.train_max_samples=100", "data.val_max_samples=8"], {"data.train_max_samples": 100,
                                                                 "data.val_max_samples": 8}),
    # what verl runs with, said in a WARNING line
    (["trainer.critic_warmup=2", "algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=4"], {"trainer.critic_warmup": 2}),
    (["trainer.max_critic_ckpt_to_keep=1", "algorithm.adv_estimator=grpo", f"{ARO}.rollout.n=4"],
     {"trainer.max_critic_ckpt_to_keep": 1}),
    ([f"{ARO}.actor.optim.warmup_style=constant", f"{ARO}.actor.optim.lr_scheduler_type=cosine"],
     {f"{ARO}.actor.optim.schedule": "constant"}),
]

# (override lines, {the dotted key reported: a phrase of its line}): exactly these problems.
REFUSED: list[tuple[list[str], dict[str, str]]] = [
    ([f"{ARO}.rollout.name=???"], {f"{ARO}.rollout.name": "verl's mark of a value a config must give"}),
    ([f"{ARO}.rollout.gpu_memory_utilization=1.5"], {f"{ARO}.rollout.gpu_memory_utilization": "out of range"}),
    ([f"{ARO}.rollout.gpu_memory_utilisation=0.5"],
     {f"{ARO}.rollout.gpu_memory_utilisation": "did you mean 'gpu_memory_utilization'?"}),
    ([f"{ARO}.rollout.mode=sync"], {f"{ARO}.rollout.mode": "verl removed its sync rollout mode"}),
    ([f"{ARO}.rollout.multi_turn.format=llama3_json"],
     {f"{ARO}.rollout.multi_turn.format": "'hermes' or 'qwen' or 'gpt-oss'"}),
    ([f"{ARO}.actor.strategy=megatron"], {f"{ARO}.actor.strategy": "Megatron-LM is another training engine"}),
    ([f"+{ARO}.actor.megatron.tensor_model_parallel_size=2"],
     {f"{ARO}.actor.megatron.tensor_model_parallel_size": "Megatron-LM is another training engine"}),
    (["trainer.balance_batch=2"], {"trainer.balance_batch": "each data-parallel rank trains on the rollouts it "
                                                            "sampled from its own share of the prompts"}),
    ([f"{ARO}.actor.optim.optimizer=SGD"], {f"{ARO}.actor.optim.optimizer": "the optimizer here is AdamW"}),
    ([f"{ARO}.actor.optim._target_=my.Optimizer"], {f"{ARO}.actor.optim._target_": "Hydra instantiates"}),
    (["data.max_prompt_length=1024", f"{ARO}.rollout.prompt_length=512"],
     {f"{ARO}.rollout.prompt_length": "it mirrors data.max_prompt_length; set that; allowed: verl's default 1024"}),
    # a misspelt key is still the schema's unknown key, not one of verl's
    (["trainer.val_before_trian=False"], {"trainer.val_before_trian": "did you mean 'val_before_train'?"}),
    ([f"{ARO}.rollout.moed=async"], {f"{ARO}.rollout.moed": "got the unknown key 'moed'"}),
    # the keys with a meaning here, given what cannot be honoured
    (["trainer.critic_warmup=-1"], {"trainer.critic_warmup": "out of range"}),
    (["trainer.max_ckpt_to_keep=2", "trainer.max_actor_ckpt_to_keep=3"],
     {"trainer.max_actor_ckpt_to_keep": "but trainer.max_ckpt_to_keep is 2"}),
    (["trainer.val_only=True"], {"trainer.val_only": "data.val_files is empty"}),
    (["critic.model.fsdp_config.param_offload=True", "critic.fsdp_config.param_offload=False"],
     {"critic.model.fsdp_config.param_offload": "but critic.fsdp_config.param_offload is false"}),
    (["critic.model.fsdp_config.param_offload=maybe"],
     {"critic.model.fsdp_config.param_offload": "'maybe', not true or false"}),
    ([f"{ARO}.actor.fsdp_config.offload_policy=True", f"{ARO}.actor.fsdp_config.optimizer_offload=False"],
     {f"{ARO}.actor.fsdp_config.optimizer_offload": "offloads everything, optimizer states included"}),
    ([f"{ARO}.actor.optim.lr_scheduler_type=linear"],
     {f"{ARO}.actor.optim.lr_scheduler_type": "'constant' or 'cosine'"}),
]


@pytest.mark.parametrize(("overrides", "expected"), GOOD, ids=[" ".join(case[0]) or "defaults" for case in GOOD])
def test_a_verl_override_line_means_what_it_means_in_verl(overrides: list[str], expected: dict[str, Any]) -> None:
    config = load_config(None, overrides)
    assert {key: operator.attrgetter(key)(config) for key in expected} == expected


@pytest.mark.parametrize(("overrides", "expected"), REFUSED, ids=[" ".join(case[0]) for case in REFUSED])
def test_a_verl_line_that_cannot_be_honoured_is_one_line_saying_why(overrides: list[str],
                                                                    expected: dict[str, str]) -> None:
    problems = problems_of(None, overrides)
    assert {problem.path for problem in problems} == set(expected), problems
    for problem in problems:
        assert expected[problem.path] in problem.message, problem
        assert "; allowed: " in problem.message and "\n" not in str(problem)


def test_every_key_of_verls_file_the_schema_lacks_has_its_why_line() -> None:
    def leaves(node: dict[str, Any], prefix: str) -> list[str]:
        return [key for name, value in node.items() for key in (
            leaves(value, f"{prefix}{name}.") if isinstance(value, dict) and value else [f"{prefix}{name}"])]

    keys = leaves(verl_only_defaults(), "")
    assert len(keys) > 300, "verl's file holds some 500 keys; the schema knows about a third"
    assert [key for key in keys if why(key) is None] == []


# ---------------------------------------------------------------------------- verl's generated file

# What verl's generated ppo_trainer.yaml leaves for a launch script to give (a rollout name: `???`; the micro-batch
# sizes: null; paths that exist), and the keys at verl's defaults that need an engine this project lacks.
GENERATED_REFUSED = {
    f"{ARO}.rollout.name": "verl's mark of a value a config must give",
    f"{ARO}.actor.ppo_micro_batch_size_per_gpu": "got null",
    f"{ARO}.rollout.log_prob_micro_batch_size_per_gpu": "got null",
    f"{ARO}.ref.log_prob_micro_batch_size_per_gpu": "got null",
    "reward_model.micro_batch_size_per_gpu": "got null",
    f"{ARO}.model.path": "'~/models/deepseek-llm-7b-chat', which is not a directory",
    "critic.model.path": "which is not a directory",
    "critic.model.tokenizer_path": "which is not a directory",
    "data.train_files[0]": "which does not exist",
    "data.val_files[0]": "which does not exist",
}
GENERATED_FIXES = [
    f"{ARO}.rollout.name=vllm", "trainer.n_gpus_per_node=1", f"{ARO}.actor.ppo_micro_batch_size_per_gpu=16",
    f"{ARO}.rollout.log_prob_micro_batch_size_per_gpu=16",
    f"{ARO}.ref.log_prob_micro_batch_size_per_gpu=16", "reward_model.micro_batch_size_per_gpu=16",
    f"{ARO}.model.path=builtin:tiny-qwen2", "critic.model.path=builtin:tiny-qwen2",
    "data.train_files=builtin:counting", "data.val_files=builtin:counting",
]


def test_verls_generated_file_loads_but_for_what_a_launch_script_gives() -> None:
    problems = (problems_of(VERL_CONFIG_FILE, []))
    assert {problem.path for problem in problems} == set(GENERATED_REFUSED), problems
    for problem in problems:
        assert GENERATED_REFUSED[problem.path] in problem.message, problem


def test_verls_generated_file_with_a_launch_scripts_lines_means_verls_defaults() -> None:
    config = load_config(VERL_CONFIG_FILE, [*GENERATED_FIXES])
    verl = yaml.safe_load(VERL_CONFIG_FILE.read_text(encoding="utf-8"))
    actor = config.actor_rollout_ref.actor
    assert (actor.optim.lr, actor.clip_ratio, actor.kl_loss_type, actor.ppo_mini_batch_size) == (
        verl[ARO]["actor"]["optim"]["lr"], 0.2, "low_var_kl", 256)
    assert (config.critic.optim.lr, config.critic.ppo_mini_batch_size) == (1e-5, 256), "interpolated from the actor"
    assert config.actor_rollout_ref.rollout.gpu_memory_utilization == 0.5
    assert (config.trainer.total_epochs, config.trainer.val_before_train, config.trainer.critic_warmup) == (30, True, 0)
    assert config.trainer.checkpoint_dir == Path("checkpoints/verl_examples/gsm8k"), "verl's default_local_dir"
    assert config.data.return_raw_chat is True and config.data.val_batch_size is None
    assert config.critic.model.tokenizer_path == "builtin:tiny-qwen2", "verl's interpolation of the actor's path"
    assert config.actor_rollout_ref.actor.fsdp_config.offload_policy.transformer is None, "offload_policy: false"


def test_a_non_default_value_in_verls_file_is_one_line(tmp_path: Path) -> None:
    text = VERL_CONFIG_FILE.read_text(encoding="utf-8")
    changed = tmp_path / "ppo_trainer.yaml"
    assert text.count("  hybrid_engine: true\n") == 1
    changed.write_text(text.replace("  hybrid_engine: true\n", "  hybrid_engine: false\n"), encoding="utf-8")
    problems = (problems_of(changed, [*GENERATED_FIXES]))
    assert [str(problem) for problem in problems] == [
        f"{ARO}.hybrid_engine: got false, but the actor and the rollout always share one set of weights here; "
        "allowed: verl's default true (or leave the key out)"]


# ----------------------------------------------------------------------------------- verl's launch scripts

HUB_IDS = ("deepseek-ai/deepseek-llm-7b-chat", "Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2.5-3B-Instruct")

# Each script's keys that name an engine this project lacks (vLLM, tensor parallelism): read otherwise here (the
# built-in rollout, data-parallel on the run's ranks; vLLM's own settings with no effect), each in the NOTE line.
ENGINE = {f"{ARO}.rollout.name", f"{ARO}.rollout.tensor_model_parallel_size"}
SCRIPTS: dict[str, set[str]] = {
    "ppo_trainer_run_deepseek7b_llm.sh": ENGINE,
    "ppo_trainer_run_qwen2-7b_seq_balance.sh": ENGINE,
    "grpo_trainer_run_qwen2-7b.sh": ENGINE,
    "grpo_trainer_run_deepseek7b_llm.sh": ENGINE,
    "grpo_trainer_run_qwen2_5-3b_gsm8k_grpo_lora.sh": {*ENGINE, f"{ARO}.rollout.load_format",
                                                       f"{ARO}.rollout.layered_summon"},
}


def write_gsm8k(path: Path, rows: int = 8) -> None:
    """A parquet file in verl's gsm8k layout (plain-text prompts the built-in tokenizer reads: digits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": f"{index} {index + 1} {index + 2}", "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(index)}, "extra_info": {"index": index}}
        for index in range(rows)]), path)


@pytest.fixture
def verl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME with the scripts' data files ($HOME/data/...), and a Hugging Face cache holding their hub ids."""
    home = tmp_path / "home"
    for name in ("gsm8k", "math"):
        for split in ("train", "test"):
            write_gsm8k(home / "data" / name / f"{split}.parquet")
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    for hub_id in HUB_IDS:
        repo = cache / f"models--{hub_id.replace('/', '--')}"
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "config.json").write_text("{}", encoding="utf-8")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision, encoding="utf-8")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def script_overrides(script: str, home: Path, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The override lines a verl launch script passes to `python3 -m verl.trainer.main_ppo`, as bash expands
    them (its variables, quotes and $HOME), with `extra` appended as the script's $@."""
    shim = 'python3() { printf "%s\\0" "$@"; }; script="$1"; shift; source "$script" "$@"'
    result = subprocess.run(["bash", "-c", shim, "bash", str(EXAMPLES / script), *extra], capture_output=True,
                            env={**os.environ, "HOME": str(home)}, check=True)
    arguments = result.stdout.decode().split("\0")[:-1]
    assert arguments[:2] == ["-m", "verl.trainer.main_ppo"], arguments[:2]
    return arguments[2:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_verl_script_loads_as_it_is_its_engine_keys_noted(script: str, verl_home: Path) -> None:
    config, notes, _ = load_config_with_notes(None, script_overrides(script, verl_home))
    assert {note.key for note in notes} == SCRIPTS[script], notes
    assert config.data.filter_overlong_prompts is True and config.trainer.critic_warmup == 0
    assert config.data.train_files[0] == str(verl_home / "data" / "gsm8k" / "train.parquet")
    assert config.actor_rollout_ref.rollout.gpu_memory_utilization in (0.4, 0.5, 0.6)
    assert config.actor_rollout_ref.model.path in HUB_IDS, "a hub id, read from the local cache"
    assert config.actor_rollout_ref.rollout.name == "vllm"
    if config.use_critic:
        assert config.critic.fsdp_config.param_offload is False, "read from critic.model.fsdp_config"


def test_verl_train_check_passes_a_verl_script_as_it_is(verl_home: Path, tmp_path: Path) -> None:
    script = "grpo_trainer_run_deepseek7b_llm.sh"
    local_models = [f"{ARO}.model.path=builtin:tiny-qwen2", f"trainer.runs_dir={tmp_path / 'runs'}"]
    passed = subprocess.run([str(VERL), "train", "--check", *script_overrides(script, verl_home, local_models)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert passed.returncode == 0, passed.stderr
    [note] = [line for line in passed.stderr.splitlines() if line.startswith("NOTE: ")]
    assert f"{ARO}.rollout.name='vllm': the built-in rollout runs" in note
    assert f"{ARO}.rollout.tensor_model_parallel_size=2: the rollout runs data-parallel on the run's 8 ranks" in note
    resolved = yaml.safe_load(passed.stdout)
    assert resolved["actor_rollout_ref"]["rollout"]["n"] == 5 and resolved["data"]["filter_overlong_prompts"] is True
    assert json.dumps(resolved)  # plain YAML values only
