"""The article this project answers ("verl CPU offloading实战"): each of its YAML snippets loads verbatim, placed
where the article places it, and sets what the article says it sets; examples/ppo_qwen2_7b.yaml is all of them in
one file. (Its runs on 1 and 2 CPU ranks: test_article_runs.py.)"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainer.config import ConfigError, RunConfig, load_config, load_config_with_notes

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ppo_qwen2_7b.yaml"
TINY = "actor_rollout_ref.model.path=builtin:tiny-qwen2"

# The snippets as the article prints them (issue 38 quotes them), by section.
SECTION_2_2 = """\
fsdp_config:
  wrap_policy:
    min_num_params: 0
  param_offload: true
  offload_policy:
    embedding: cpu
    lm_head: cpu
    transformer: gpu
    norm: gpu
"""
SECTION_3_1 = SECTION_2_2 + """\
  dynamic_offload:
    enabled: true
    gpu_memory_threshold: 0.85
    min_transformer_layers_on_gpu: 12
"""
SECTION_3_2 = """\
model:
  path: "Qwen/Qwen2-7B-Instruct"
  dtype: bfloat16
  enable_gradient_checkpointing: true
"""
SECTION_4_1 = """\
critic:
  fsdp_config:
    param_offload: true
    offload_policy: {embedding: cpu, lm_head: cpu, transformer: gpu}
reward_model:
  fsdp_config:
    param_offload: true
    offload_policy: {embedding: cpu, lm_head: cpu, transformer: gpu}
"""
SECTION_4_2 = """\
rollout:
  embedding_cache:
    enabled: true
    cache_size: 8192
    warmup_steps: 100
"""
SECTION_4_3 = """\
actor_rollout_ref:
  ulysses_sequence_parallel_size: 2
  fsdp_config:
    param_offload: true
    sequence_parallel_offload: true
"""


def placed(snippet: str, *parents: str) -> str:
    """The snippet, verbatim, under the sections the article shows it in (§2.2's fsdp_config is the actor's)."""
    text = snippet
    for parent in reversed(parents):
        text = f"{parent}:\n" + textwrap.indent(text, "  ")
    return text


def load(tmp_path: Path, text: str, *overrides: str) -> tuple[RunConfig, list[str]]:
    path = tmp_path / "article.yaml"
    path.write_text(text, encoding="utf-8")
    loaded = load_config_with_notes(path, [TINY, *overrides])
    return loaded.config, [str(warning) for warning in loaded.warnings]


def test_section_2_2_places_the_actors_groups(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, placed(SECTION_2_2, "actor_rollout_ref", "actor"))
    fsdp = config.actor_rollout_ref.actor.fsdp_config
    assert fsdp.param_offload and fsdp.wrap_policy.min_num_params == 0
    assert {group: fsdp.placement(group) for group in ("embedding", "lm_head", "transformer", "norm")} == {
        "embedding": "cpu", "lm_head": "cpu", "transformer": "gpu", "norm": "gpu"}
    assert warnings == []


def test_section_3_1_sets_the_run_wide_levels_from_the_actors_fsdp_config(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, placed(SECTION_3_1, "actor_rollout_ref", "actor"))
    assert config.actor_rollout_ref.actor.fsdp_config.dynamic_offload.enabled
    assert (config.dynamic_offload.gpu_memory_threshold, config.dynamic_offload.min_transformer_layers_on_gpu) == (
        0.85, 12)
    assert warnings == []


def test_section_3_2_sets_the_policys_dtype_path_and_checkpointing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))  # a machine without the 7B model
    path = tmp_path / "article.yaml"
    path.write_text(placed(SECTION_3_2, "actor_rollout_ref"), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:  # verbatim: the 7B model, which this machine does not hold
        load_config(path)
    assert [problem.path for problem in caught.value.problems] == ["actor_rollout_ref.model.path"]
    assert "'Qwen/Qwen2-7B-Instruct'" in caught.value.problems[0].message
    config, warnings = load(tmp_path, placed(SECTION_3_2, "actor_rollout_ref"))
    policy = config.actor_rollout_ref
    assert (policy.actor.fsdp_config.model_dtype, policy.ref.fsdp_config.model_dtype) == ("bf16", "bf16")
    assert policy.model.enable_gradient_checkpointing and policy.model.path == "builtin:tiny-qwen2"
    # The reference's dtype is the policy's: no warning that no reference is built. The critic (PPO's, by default)
    # does not checkpoint as the policy does (verl's default does): rules._critic_checkpoints_as_the_actor.
    assert [warning.split(":")[0] for warning in warnings] == ["critic.model.enable_gradient_checkpointing"]


def test_section_4_1_places_the_critic_and_the_reward_model(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, SECTION_4_1)
    for fsdp in (config.critic.fsdp_config, config.reward_model.model.fsdp_config):
        assert fsdp.param_offload
        assert [fsdp.placement(group) for group in ("embedding", "lm_head", "transformer", "norm")] == [
            "cpu", "cpu", "gpu", "cpu"], "norm follows param_offload"
    # The article's config builds no reward model (no reward_model.enable): verl ignores its placement, so do we.
    assert warnings == [
        "reward_model.fsdp_config: got param_offload=true, offload_policy.embedding='cpu', offload_policy.lm_head="
        "'cpu', offload_policy.transformer='gpu', but this run builds no reward model (reward_model.enable is false): "
        "they have no effect (leave them out, or set reward_model.enable=true)"]


def test_section_4_2_turns_the_embedding_cache_on(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, placed(SECTION_4_2, "actor_rollout_ref"))
    cache = config.actor_rollout_ref.rollout.embedding_cache
    assert (cache.enabled, cache.cache_size, cache.warmup_steps) == (True, 8192, 100)
    assert warnings == []


def test_section_4_3_sets_the_policys_ulysses_degree_and_offload(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, SECTION_4_3, "trainer.n_gpus_per_node=2")
    policy = config.actor_rollout_ref
    assert policy.actor.ulysses_sequence_parallel_size == 2 and policy.actor.sequence_parallel_offload
    assert policy.actor.fsdp_config.param_offload and policy.ref.fsdp_config.param_offload
    assert warnings == [], "the reference's placement is the policy's: no warning that no reference is built"
    path = tmp_path / "article.yaml"
    with pytest.raises(ConfigError) as caught:  # verl's device mesh needs 2 ranks for a degree of 2 as well
        load_config(path, [TINY])
    assert [problem.path for problem in caught.value.problems] == ["actor_rollout_ref.ulysses_sequence_parallel_size"]


def test_the_example_is_every_snippet_in_one_file(tmp_path: Path) -> None:
    example = load_config_with_notes(EXAMPLE, [TINY, "trainer.n_gpus_per_node=2"])
    # Every snippet where the article places it, under one actor_rollout_ref.
    policy_part = "".join(textwrap.indent(text, "  ") for text in (
        SECTION_3_2, placed(SECTION_3_1, "actor"), SECTION_4_2, SECTION_4_3.removeprefix("actor_rollout_ref:\n")
        .replace("\n  ", "\n").removeprefix("  ")))
    config, _ = load(tmp_path, "actor_rollout_ref:\n" + policy_part + SECTION_4_1, "trainer.n_gpus_per_node=2")
    assert config == example.config
    expected = example.config.model_dump()
    policy = expected["actor_rollout_ref"]
    assert policy["actor"]["fsdp_config"]["offload_policy"] == {"embedding": "cpu", "lm_head": "cpu",
                                                               "transformer": "gpu", "norm": "gpu"}
    assert policy["actor"]["fsdp_config"]["model_dtype"] == "bf16" and policy["actor"]["sequence_parallel_offload"]
    assert policy["actor"]["ulysses_sequence_parallel_size"] == 2 and policy["ref"]["fsdp_config"]["param_offload"]
    assert expected["dynamic_offload"] == {"gpu_memory_threshold": 0.85, "min_transformer_layers_on_gpu": 12}
    assert expected["critic"]["fsdp_config"]["offload_policy"]["transformer"] == "gpu"
    assert policy["rollout"]["embedding_cache"]["warmup_steps"] == 100
    assert [warning.path for warning in example.warnings] == [
        "actor_rollout_ref.rollout.embedding_cache.enabled", "reward_model.fsdp_config",
        "critic.model.enable_gradient_checkpointing"]
    text = EXAMPLE.read_text(encoding="utf-8")
    for section in ("§2.2", "§3.1", "§3.2", "§4.1", "§4.2", "§4.3"):
        assert f"# {section}" in text, f"each block names its section: {section}"
    for snippet in (SECTION_3_2, SECTION_4_2):
        assert textwrap.indent(snippet, "  ") in text, "the snippets verbatim"
    assert SECTION_4_1 in text and textwrap.indent(SECTION_2_2.removeprefix("fsdp_config:\n"), "    ") in text
