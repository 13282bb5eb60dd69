"""verl's dialect of the config, translated in front of the schema: what a verl config file or launch script
writes that this project's schema spells differently, and the keys of verl's that this project accepts at
verl's default value only.

- ``critic.model.fsdp_config`` (verl's place) is read as ``critic.fsdp_config`` (the canonical place: beside
  ``model``, as for the actor and reference); giving both with different values is an error naming both.
- ``fsdp_config.ulysses_sequence_parallel_size`` (verl's newer place) is read as the model's own
  ``ulysses_sequence_parallel_size`` (the canonical place, where verl's example scripts set it): the actor's
  ``actor_rollout_ref.actor.fsdp_config``, the critic's ``critic.model.fsdp_config`` (or ``critic.fsdp_config``);
  both given with different values is one line naming both. The reference runs with the actor's degree, so its
  ``ref.fsdp_config`` key is accepted at that degree.
- A boolean ``fsdp_config.offload_policy`` (verl's FSDP2 switch): true puts every module group on the CPU and,
  for a model that trains, its optimizer too; false is verl's default and changes nothing.
- Every other key of verl's ``ppo_trainer.yaml`` (verl_ppo_trainer.yaml beside this module, verl's generated
  file as it ships) that the schema lacks is accepted at verl's default value and refused at any other, in one
  line saying why (``WHY``): it needs an engine or a feature this project does not have. A key in neither the
  schema nor verl's file is left to the schema, which reports it as unknown (with its did-you-mean), so a
  misspelt key is never taken for one of verl's.

A default that verl's file writes as an interpolation (``rollout.prompt_length: ${data.max_prompt_length}``)
is that interpolation's value in the user's config: the key is accepted where it mirrors its source.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.schema import ConfigProblem, RunConfig, Section, _section_type, _show

VERL_CONFIG_FILE = Path(__file__).with_name("verl_ppo_trainer.yaml")
CRITIC_FSDP = ("critic", "fsdp_config")
VERL_CRITIC_FSDP = ("critic", "model", "fsdp_config")
GROUPS = ("embedding", "lm_head", "transformer", "norm")
# The roles whose fsdp_config may hold verl's boolean offload_policy, and whether the model trains.
_FSDP_SECTIONS = {("actor_rollout_ref", "actor", "fsdp_config"): True,
                  ("actor_rollout_ref", "ref", "fsdp_config"): False,
                  CRITIC_FSDP: True, ("reward_model", "model", "fsdp_config"): False}

_ENGINE = "the rollout here is built in (it decodes with the actor's own weights in the trainer process): " \
          "a vLLM or SGLang engine setting has nothing to act on"
_SHARDING = ("it shapes sharding or parallelism over several GPUs, which is fixed here: each model is sharded "
             "(FSDP2) over all the run's ranks, one unit per decoder layer and per group (embedding, final norm, "
             "head), and sequence parallelism is the actor's and critic's ulysses_sequence_parallel_size")
_KERNELS = "it is a kernel, compile or memory option of verl's FSDP workers that is not built here"
_NO_RAY = "there is no Ray here: the trainer is one process, supervised by the daemon"
_PROFILER = ("verl's profiler is not built here (timings: timing_s/* in metrics.jsonl; every offload copy is timed "
             "with CUDA events)")

# (pattern of a dotted key of verl's file, why a value other than verl's default cannot be honoured); the first
# pattern that matches a key gives its line. tests/trainer/test_verl_keys.py checks that each key has one.
WHY: tuple[tuple[str, str], ...] = (
    ("*._target_", "it names the class verl's Hydra instantiates; this project builds its own"),
    ("*profiler*", _PROFILER),
    ("*.megatron*", "Megatron is not an engine here (HuggingFace models with this project's offload engine)"),
    ("*strategy", "the models here train with this project's offload engine (FSDP-style per-group placement); "
                  "Megatron is not an engine here"),
    ("actor_rollout_ref.actor.use_remove_padding", "the padding-free forward here is set once for the actor and "
                                                   "the reference: set actor_rollout_ref.model.use_remove_padding"),
    ("reward_model.model.use_remove_padding", "the reward model's forward is padded here (the padding-free forward "
                                              "covers the actor, the reference and the critic)"),
    ("*lora_*", "LoRA here is actor_rollout_ref.model's and critic.model's lora_rank, lora_alpha and target_modules"),
    ("*micro_batch_size", "it is verl's deprecated size over all GPUs; set the *_micro_batch_size_per_gpu key"),
    ("critic.forward_micro_batch_size_per_gpu", "the critic's values here are computed in "
                                                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    ("*rollout_n", "it mirrors actor_rollout_ref.rollout.n; set that"),
    ("*.rollout.prompt_length", "it mirrors data.max_prompt_length; set that"),
    ("*.rollout.response_length", "it mirrors data.max_response_length; set that"),
    ("actor_rollout_ref.rollout.val_kwargs.*", "validation here decodes greedily, one response per prompt (verl's "
                                               "default val_kwargs)"),
    ("actor_rollout_ref.rollout.multi_turn.*", "multi-turn and tool-calling rollouts are not built"),
    ("*tool_config_path", "multi-turn and tool-calling rollouts are not built"),
    ("actor_rollout_ref.rollout.agent.*", "verl's agent loop is not built"),
    ("reward_model.rollout.*", "a generative reward model (served by a rollout engine) is not built"),
    ("actor_rollout_ref.rollout.skip_*", "replaying dumped rollouts is not built"),
    ("actor_rollout_ref.rollout.*", _ENGINE),
    ("reward_model.ulysses_sequence_parallel_size", "the reward model scores whole sequences on every rank (no "
                                                    "sequence parallelism)"),
    ("*.fsdp_config.*", _SHARDING),
    ("*ulysses_sequence_parallel_size", _SHARDING),
    ("actor_rollout_ref.hybrid_engine", "the actor and the rollout always share one set of weights here"),
    ("*.checkpoint.*", "a checkpoint here always holds the models, their optimizers and the trainer's state, "
                       "written at once and atomically"),
    ("*.optim.*", "the optimizer here is AdamW (torch's, or the offload engine's CPU AdamW), clipped at grad_clip "
                  "and scheduled by the optim keys it has"),
    ("*.policy_loss.*", "the policy loss here is PPO's clipped loss (with dual-clip clip_ratio_c); verl's other "
                        "loss modes are not built"),
    ("actor_rollout_ref.actor.tau_*", "the policy loss here is PPO's clipped loss; verl's other loss modes are "
                                      "not built"),
    ("actor_rollout_ref.actor.loss_scale_factor", "the loss here is aggregated by loss_agg_mode alone"),
    ("*router_replay.*", "mixture-of-experts router replay is not built"),
    ("*mtp*", "multi-token prediction is not built"),
    ("*use_torch_compile", _KERNELS),
    ("*fused_kernel*", _KERNELS),
    ("*use_liger", _KERNELS),
    ("*entropy_*", _KERNELS),
    ("*sum_pi_squared*", _KERNELS),
    ("*tiled_mlp.*", _KERNELS),
    ("*activation_offload", _KERNELS),
    ("*use_shm", _KERNELS),
    ("*calculate_entropy", _KERNELS),
    ("*use_prefix_grouper", _KERNELS),
    ("*freeze_vision_tower", "vision-language models are not built"),
    ("*data_loader_seed", "the order of sequences in mini-batches follows trainer.seed (and actor.shuffle)"),
    ("critic.shuffle", "the critic's mini-batches here follow the actor's order"),
    ("*external_lib", "model code comes from transformers, or the model directory with trust_remote_code"),
    ("*hf_config_path", "the model's config.json is read from its own directory"),
    ("*custom_chat_template", "prompts use the tokenizer's own chat template"),
    ("reward_model.model.input_tokenizer", "responses are decoded with the actor's tokenizer"),
    ("reward_model.model.override_config", "the reward model is built from its directory as it is"),
    ("reward_model.max_length", "reward-model inputs here are cut at data.max_prompt_length + "
                                "data.max_response_length"),
    ("reward_model.*", "verl's reward loop, resource pools and sandbox are not built (a reward model here is one "
                       "sequence-classification model in the trainer process)"),
    ("reward_manager.*", "the reward here is verl's naive manager: each response scored by its data source's "
                         "function, or custom_reward_function"),
    ("algorithm.rollout_correction.*", "rollout-correction importance weights are not built (the rollout samples "
                                       "with the actor's own weights)"),
    ("algorithm.*pf_ppo*", "policy-filtration PPO is not built"),
    ("data.tokenizer", "the prompts are tokenized with actor_rollout_ref.model.tokenizer_path"),
    ("data.*max_samples", "each data file is read whole"),
    ("data.reward_fn_key", "each row's scorer is picked by its data_source column"),
    ("data.validation_shuffle", "validation prompts are taken in the order of their files"),
    ("data.filter_overlong_prompts_workers", "filtering runs once, in the trainer process"),
    ("data.dataloader_num_workers", "prompts are read once, in the trainer process"),
    ("data.trust_remote_code", "the tokenizer follows actor_rollout_ref.model.trust_remote_code"),
    ("data.return_*", "the rollout takes the chat messages and templates them itself"),
    ("data.apply_chat_template_kwargs", "prompts use the tokenizer's chat template with its defaults"),
    ("data.image_*", "vision-language models are not built"),
    ("data.video_key", "vision-language models are not built"),
    ("data.custom_cls.*", "a custom dataset class is not built (data files in verl's parquet layout or JSONL)"),
    ("data.sampler.*", "a custom sampler (curriculum) is not built"),
    ("data.datagen.*", "dynamic data generation is not built"),
    ("trainer.balance_batch", "each data-parallel rank trains on the rollouts it sampled from its own share of the "
                              "prompts; no batch is exchanged between ranks, so there is none to balance"),
    ("trainer.log_val_generations", "validation generations are not logged"),
    ("trainer.*_data_dir", "dumping generations to files is not built"),
    ("trainer.esi_redundant_time", "it plans saves before a cloud instance's expiry; save with trainer.save_freq"),
    ("trainer.default_hdfs_dir", "checkpoints are written to local disk only (trainer.default_local_dir)"),
    ("trainer.del_local_ckpt_after_load", "checkpoints are kept after a resume (retention: max_ckpt_to_keep)"),
    ("trainer.ray_*", _NO_RAY),
    ("trainer.use_legacy_worker_impl", _NO_RAY),
    ("ray_kwargs.*", _NO_RAY),
    ("transfer_queue.*", _NO_RAY),
)

# Keys accepted at values other than (or besides) verl's default, with the same line when refused:
# balance_batch does nothing here, whichever way it is set (each rank trains on what it sampled from its own share
# of the prompts: no batch crosses ranks to be balanced); the reward model's padded forward is accepted with verl's
# padding-free switch off.
ACCEPTED: dict[str, tuple[Any, ...]] = {
    "trainer.balance_batch": (True, False),
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.ref.strategy": ("fsdp", "fsdp2"),
    "critic.strategy": ("fsdp", "fsdp2"),
    "reward_model.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.actor.use_remove_padding": (False,),
    "reward_model.model.use_remove_padding": (False,),
}


def why(key: str) -> str | None:
    """The line of WHY for a dotted key of verl's file (None: no pattern matches it)."""
    return next((reason for pattern, reason in WHY if fnmatch.fnmatchcase(key, pattern)), None)


@functools.cache
def verl_only_defaults() -> dict[str, Any]:
    """verl's file as a tree of the keys the schema lacks (critic.model.fsdp_config read as critic.fsdp_config),
    each at verl's default (interpolations kept as written)."""
    tree = yaml.safe_load(VERL_CONFIG_FILE.read_text(encoding="utf-8"))
    _move_critic_fsdp(tree)
    # verl's Megatron trainer (ppo_megatron_trainer.yaml) puts each model's engine settings under `megatron`:
    # accepted empty, so that any of them is refused as needing Megatron rather than as a key unknown.
    for section in (tree["actor_rollout_ref"]["actor"], tree["actor_rollout_ref"]["ref"], tree["critic"]):
        section["megatron"] = {}
    return _unknown_to(tree, RunConfig)


def _unknown_to(tree: dict[str, Any], section: type[Section] | None) -> dict[str, Any]:
    pruned: dict[str, Any] = {}
    for key, value in tree.items():
        field = section.model_fields.get(key) if section is not None else None
        if field is None:
            pruned[key] = value
            continue
        child = _section_type(field.annotation)
        if child is not None and isinstance(value, dict):
            below = _unknown_to(value, child)
            if below:
                pruned[key] = below
    return pruned


def knows(parts: Sequence[str]) -> bool:
    """Whether a dotted key (split) is one of verl's keys outside the schema, or verl's critic.model.fsdp_config."""
    if tuple(parts[:3]) == VERL_CRITIC_FSDP:
        return True
    node: Any = verl_only_defaults()
    for part in parts:
        if not isinstance(node, dict):
            return False
        if part not in node:
            return node == {} and node is not verl_only_defaults()  # under a mapping verl leaves empty
        node = node[part]
    return True


# --------------------------------------------------------------------------------------- translation


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[ConfigProblem], dict[str, str]]:
    """verl's dialect in `raw` (interpolations resolved) -> (the tree the schema reads, the problems of verl's
    keys, {canonical prefix: the prefix the user wrote} for naming problems as the user wrote the keys)."""
    tree = copy.deepcopy(raw)
    problems: list[ConfigProblem] = []
    aliases: dict[str, str] = {}
    critic = raw.get("critic")
    canonical_given = isinstance(critic, dict) and "fsdp_config" in critic
    if _move_critic_fsdp(tree, problems) and not canonical_given:
        aliases["critic.fsdp_config"] = "critic.model.fsdp_config"
    _sequence_parallel_degrees(raw, tree, problems, aliases)
    for path, trains in _FSDP_SECTIONS.items():
        problems += _offload_policy(tree, path, trains)
    context = _Context(raw)
    problems += _drop_verl_keys(tree, RunConfig, verl_only_defaults(), [], context)
    return tree, problems, aliases


def _move_critic_fsdp(tree: dict[str, Any], problems: list[Any] | None = None) -> bool:
    """critic.model.fsdp_config -> critic.fsdp_config, leaf by leaf; a leaf set in both with different values is
    a problem naming both. True when verl's place held anything."""
    critic = tree.get("critic")
    if not isinstance(critic, dict):
        return False
    model = critic.get("model")
    if not isinstance(model, dict) or "fsdp_config" not in model:
        return False
    verl_place = model.pop("fsdp_config")
    if not isinstance(verl_place, dict):
        model["fsdp_config"] = verl_place  # not a mapping: the schema names it as a section given a value
        return False
    canonical = critic.setdefault("fsdp_config", {})
    if not isinstance(canonical, dict):
        model["fsdp_config"] = verl_place  # the schema names critic.fsdp_config's value, and this unknown key
        return False
    for location, value in _leaves(verl_place, []):
        _set_leaf(canonical, location, value, problems)
    return True


SEQUENCE_PARALLEL_KEY = "ulysses_sequence_parallel_size"


def _sequence_parallel_degrees(raw: dict[str, Any], tree: dict[str, Any], problems: list[ConfigProblem],
                               aliases: dict[str, str]) -> None:
    """fsdp_config.ulysses_sequence_parallel_size -> the model's own key (after critic.model.fsdp_config moved to
    critic.fsdp_config); the reference's keys (its own and its fsdp_config's) accepted at the actor's degree,
    which the reference runs with, and refused at any other."""
    for section_path, written_places in ((("actor_rollout_ref", "actor"), ["actor_rollout_ref.actor.fsdp_config"]),
                                         (("critic",), ["critic.model.fsdp_config", "critic.fsdp_config"])):
        section = _node(tree, section_path)
        fsdp = section.get("fsdp_config") if section is not None else None
        if section is None or not isinstance(fsdp, dict) or SEQUENCE_PARALLEL_KEY not in fsdp:
            continue
        value = fsdp.pop(SEQUENCE_PARALLEL_KEY)
        written = next((place for place in written_places
                        if isinstance(_node(raw, (*place.split("."), SEQUENCE_PARALLEL_KEY)), int)),
                       written_places[-1]) + "." + SEQUENCE_PARALLEL_KEY
        canonical = ".".join((*section_path, SEQUENCE_PARALLEL_KEY))
        if SEQUENCE_PARALLEL_KEY in section and not _same(section[SEQUENCE_PARALLEL_KEY], value):
            problems.append(ConfigProblem(written, f"got {_show(value)}, but {canonical} is "
                                          f"{_show(section[SEQUENCE_PARALLEL_KEY])}: the two are one setting "
                                          f"({canonical} is its canonical place); allowed: one of them, or the "
                                          "same value"))
            continue
        if SEQUENCE_PARALLEL_KEY not in section:
            aliases[canonical] = written
        section[SEQUENCE_PARALLEL_KEY] = value
    actor = _node(tree, ("actor_rollout_ref", "actor"))
    degree = actor.get(SEQUENCE_PARALLEL_KEY, 1) if isinstance(actor, dict) else 1  # 1: the schema's default
    for place in (("actor_rollout_ref", "ref"), ("actor_rollout_ref", "ref", "fsdp_config")):
        reference = _node(tree, place)
        if not isinstance(reference, dict) or SEQUENCE_PARALLEL_KEY not in reference:
            continue
        value = reference.pop(SEQUENCE_PARALLEL_KEY)
        if not _same(value, degree):
            problems.append(ConfigProblem(".".join((*place, SEQUENCE_PARALLEL_KEY)), f"got {_show(value)}, but the "
                                          "reference runs with the actor's sequence-parallel degree, "
                                          f"actor_rollout_ref.actor.{SEQUENCE_PARALLEL_KEY}: {_show(degree)}; "
                                          "allowed: that degree, or leave the key out"))


def _node(tree: Any, path: Sequence[str]) -> Any:
    """The value at `path` in nested mappings, or None where a step is missing or not a mapping."""
    node = tree
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _set_leaf(node: dict[str, Any], location: list[str], value: Any, problems: list[ConfigProblem] | None) -> None:
    for part in location[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return
        node = child
    key = location[-1]
    if key in node and not _same(node[key], value):
        if problems is not None:
            dotted = ".".join(location)
            problems.append(ConfigProblem(f"critic.model.fsdp_config.{dotted}", f"got {_show(value)}, but "
                                          f"critic.fsdp_config.{dotted} is {_show(node[key])}: the two are one "
                                          "setting (critic.fsdp_config is its canonical place); allowed: one of "
                                          "them, or the same value"))
        return
    node[key] = value


def _leaves(node: Any, location: list[str]) -> Iterator[tuple[list[str], Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, [*location, str(key)])
    else:
        yield location, node


def _offload_policy(tree: dict[str, Any], path: tuple[str, ...], trains: bool) -> list[ConfigProblem]:
    """verl's offload_policy: true|false at `path` -> this project's per-group mapping (and optimizer_offload)."""
    node: Any = tree
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or not isinstance(node.get("offload_policy"), bool):
        return []
    prefix = ".".join(path)
    if not node["offload_policy"]:
        del node["offload_policy"]  # verl's default: nothing offloaded by it
        return []
    node["offload_policy"] = dict.fromkeys(GROUPS, "cpu")
    if not trains:
        return []
    if node.get("optimizer_offload") is False and "optimizer_offload" in node:
        return [ConfigProblem(f"{prefix}.optimizer_offload", f"got false, but {prefix}.offload_policy is true, "
                              "which offloads everything, optimizer states included (verl's FSDP2 "
                              "CPUOffloadPolicy); allowed: true or unset, or a mapping for offload_policy")]
    node["optimizer_offload"] = True
    return []


class _Context:
    """The user's config laid over the schema's defaults, for the value of an interpolated verl default."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw
        self._tree: Any = None

    def value_of(self, location: list[str], interpolation: str) -> Any:
        """What `interpolation` gives at `location` in the user's config (_UNRESOLVED when it cannot)."""
        if self._tree is None:
            self._tree = OmegaConf.create(merged_over_defaults(self.raw))
        probe = copy.deepcopy(self._tree)
        key = ".".join(location)
        try:
            OmegaConf.update(probe, key, interpolation, force_add=True)
            value = OmegaConf.select(probe, key, throw_on_missing=True)
            return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value
        except (OmegaConfBaseException, ValueError):
            return _UNRESOLVED


_UNRESOLVED = object()


def merged_over_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` laid over the schema's defaults, mapping by mapping: what an interpolation resolves against."""
    merged: dict[str, Any] = _merged(RunConfig().model_dump(mode="json"), raw)
    return merged


def _merged(defaults: Any, raw: Any) -> Any:
    if not (isinstance(defaults, dict) and isinstance(raw, dict)):
        return raw
    merged = dict(defaults)
    for key, value in raw.items():
        merged[key] = _merged(defaults[key], value) if key in defaults else value
    return merged


def _drop_verl_keys(node: dict[str, Any], section: type[Section] | None, verl: Any, location: list[str],
                    context: _Context) -> list[ConfigProblem]:
    """Remove from `node` each key of verl's the schema lacks; a problem for each one away from its default."""
    problems: list[ConfigProblem] = []
    for key in list(node):
        field = section.model_fields.get(key) if section is not None else None
        value = node[key]
        if field is not None:
            child = _section_type(field.annotation)
            if child is not None and isinstance(value, dict):
                below = verl.get(key) if isinstance(verl, dict) else None
                problems += _drop_verl_keys(value, child, below if isinstance(below, dict) else {}, [*location, key],
                                            context)
            continue
        if isinstance(verl, dict) and key in verl:
            del node[key]
            problems += _compare([*location, key], value, verl[key], context)
    return problems


def _compare(location: list[str], value: Any, default: Any, context: _Context) -> list[ConfigProblem]:
    key = ".".join(location)
    if isinstance(default, str) and "${" in default:
        # verl's key mirrors another (actor.use_remove_padding: ${...model.use_remove_padding}): where it does,
        # its source's own line speaks for it.
        default = context.value_of(location, default)
        if _same(value, default):
            return []
    if key in ACCEPTED:
        allowed = ACCEPTED[key]
        if any(_same(value, choice) for choice in allowed):
            return []
        return [ConfigProblem(key, f"got {_show(value)}, but {why(key)}; allowed: "
                              f"{' or '.join(_show(choice) for choice in allowed)}")]
    if isinstance(default, dict) and isinstance(value, dict):
        problems: list[ConfigProblem] = []
        for name, item in value.items():
            below = [*location, str(name)]
            if name in default:
                problems += _compare(below, item, default[name], context)
            else:
                problems.append(_refused(".".join(below), item, None, key))
        return problems
    if _same(value, default):
        return []
    return [_refused(key, value, default, key)]


def _refused(key: str, value: Any, default: Any, pattern_key: str) -> ConfigProblem:
    reason = why(key) or why(pattern_key) or "this project has no counterpart of it"
    allowed = ("verl's default (leave the key out)" if default is None or default is _UNRESOLVED
               else f"verl's default {_show(default)} (or leave the key out)")
    return ConfigProblem(key, f"got {_show(value)}, but {reason}; allowed: {allowed}")


def _same(value: Any, other: Any) -> bool:
    """Equal as YAML values: 1 and 1.0 are, true and 1 are not, a tuple equals the same list."""
    if isinstance(value, bool) or isinstance(other, bool):
        return isinstance(value, bool) and isinstance(other, bool) and value == other
    if isinstance(value, dict) and isinstance(other, dict):
        return value.keys() == other.keys() and all(_same(value[key], other[key]) for key in value)
    if isinstance(value, list | tuple) and isinstance(other, list | tuple):
        return len(value) == len(other) and all(_same(a, b) for a, b in zip(value, other, strict=True))
    return bool(value == other)


