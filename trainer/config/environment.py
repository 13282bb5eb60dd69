"""The rules of a config that read the disk and the environment: model and tokenizer directories (or the hub
cache), data files, the reward function's file, and the libraries a setting needs (peft, the trackers). They run
in the same pass as the rules between fields (trainer/config/rules.py lists them all). And the launch keys a
several-node run takes from the environment (torchrun's and Slurm's variables) where the config leaves them out.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.config.errors import ConfigProblem
from trainer.config.fields import show
from trainer.config.hub import HubModelNotCached, resolve_model_path
from trainer.config.schema import (
    BUILTIN_DATASETS,
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    DATA_FILE_SUFFIXES,
    CriticModelConfig,
    ModelConfig,
    RunConfig,
)

# The trackers' libraries (the `trackers` extra), by the module each imports.
TRACKER_MODULES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "swanlab": "swanlab"}
TRACKERS_EXTRA = "pip install 'verl-offload[trackers]'"


def check_actor_model_paths(config: RunConfig) -> list[ConfigProblem]:
    model = config.actor_rollout_ref.model
    return _check_model_candidates([("actor_rollout_ref.model.path", model.path, True),
                                    ("actor_rollout_ref.model.tokenizer_path", model.tokenizer_path, False)])


def check_critic_model_paths(config: RunConfig) -> list[ConfigProblem]:
    if not config.use_critic:
        return []
    model = config.critic.model
    return _check_model_candidates([("critic.model.path", model.path, True),
                                    ("critic.model.tokenizer_path", model.tokenizer_path, False)])


def check_reward_model_paths(config: RunConfig) -> list[ConfigProblem]:
    if not config.reward_model.enable:
        return []
    model = config.reward_model.model
    if model.path is None:
        return [ConfigProblem("reward_model.model.path", "is not set, but reward_model.enable is true; allowed: "
                              "the directory of a sequence-classification model with one output (num_labels=1)")]
    return _check_model_candidates([("reward_model.model.path", model.path, True),
                                    ("reward_model.model.tokenizer_path", model.tokenizer_path, False)])


def _check_model_candidates(candidates: Sequence[tuple[str, str | None, bool]]) -> list[ConfigProblem]:
    """(key, value, whether it names a model rather than a tokenizer) -> the problems of the values set."""
    problems = [_check_model_path(key, value, is_model) for key, value, is_model in candidates if value is not None]
    return [problem for problem in problems if problem is not None]


def _check_model_path(key: str, value: str, is_model: bool) -> ConfigProblem | None:
    what = "model" if is_model else "tokenizer"
    builtins = ", ".join(BUILTIN_PREFIX + model for model in BUILTIN_MODELS)
    if value.startswith(BUILTIN_PREFIX):
        if value.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
            return ConfigProblem(key, f"got {value!r}, which is not a built-in model; allowed: {builtins}, "
                                 f"or a local HuggingFace {what} directory")
        return None
    if value.endswith(GGUF_SUFFIX):
        return _check_gguf_path(key, value)
    try:
        directory = Path(resolve_model_path(value)).expanduser()
    except HubModelNotCached as error:
        return ConfigProblem(key, f"got {error}")
    if not directory.is_dir():
        return ConfigProblem(key, f"got {value!r}, which is not a directory (models are never downloaded); "
                             f"allowed: a local HuggingFace {what} directory, a hub model id in the local cache, "
                             f"or {builtins}")
    if is_model and not (directory / "config.json").is_file():
        where = "" if str(directory) == value else f" (its cached snapshot {str(directory)!r})"
        return ConfigProblem(key, f"got {value!r}{where}, a directory without config.json; allowed: a model "
                             "directory written by save_pretrained")
    return None


GGUF_SUFFIX = ".gguf"
GGUF_EXTRA = "pip install 'verl-offload[real-model]' (or `make real-model`)"


def _check_gguf_path(key: str, value: str) -> ConfigProblem | None:
    """A GGUF file (llama.cpp's format) is read through transformers' GGUF support, which needs the gguf package;
    the trainer checks the file itself when it converts it (trainer/models/gguf.py)."""
    if not Path(value).expanduser().is_file():
        return ConfigProblem(key, f"got {value!r}, which is not a file; allowed: a GGUF model file, a local "
                             "HuggingFace model directory or a hub model id in the local cache")
    if importlib.util.find_spec("gguf") is None:
        return ConfigProblem(key, f"got the GGUF file {value!r}, but the gguf package that reads it is not "
                             f"installed; {GGUF_EXTRA}")
    return None


def check_train_files(config: RunConfig) -> list[ConfigProblem]:
    if not config.data.train_files:
        return [ConfigProblem("data.train_files", f"got an empty list; allowed: {_DATA_FILES_ALLOWED}")]
    return _check_data_file_list("train_files", config.data.train_files)


def check_val_files(config: RunConfig) -> list[ConfigProblem]:
    return _check_data_file_list("val_files", config.data.val_files)


def _check_data_file_list(key: str, files: Sequence[str]) -> list[ConfigProblem]:
    problems = [_check_data_file(f"data.{key}[{index}]", value) for index, value in enumerate(files)]
    return [problem for problem in problems if problem is not None]


def check_reward_function_file(config: RunConfig) -> list[ConfigProblem]:
    function = config.custom_reward_function
    if function.path is not None and not Path(function.path).expanduser().is_file():
        return [ConfigProblem("custom_reward_function.path", f"got {function.path!r}, which is not a file; "
                              f"allowed: a Python file that defines {function.name}")]
    return []


PACKAGE_PREFIX, FILE_PREFIX = "pkg://", "file://"
"""verl's two spellings of where a user's class lives (verl/utils/import_utils.py: load_module): a module to import,
or a Python file (the prefix optional)."""


def check_user_classes(config: RunConfig) -> list[ConfigProblem]:
    """data.custom_cls and data.sampler: both keys or neither, and a file that exists (a pkg:// module is imported
    when the run starts)."""
    problems = []
    for section, (path_key, name_key) in ((config.data.custom_cls, ("path", "name")),
                                          (config.data.sampler, ("class_path", "class_name"))):
        prefix = "data.custom_cls" if path_key == "path" else "data.sampler"
        path, name = getattr(section, path_key), getattr(section, name_key)
        if (path is None) != (name is None):
            given, missing = (path_key, name_key) if name is None else (name_key, path_key)
            problems.append(ConfigProblem(f"{prefix}.{missing}", f"got null, but {prefix}.{given} is set; allowed: "
                                          "both keys (a Python file or pkg://module, and the class's name in it), or "
                                          "neither"))
        elif path is not None and not path.startswith(PACKAGE_PREFIX):
            file = Path(path.removeprefix(FILE_PREFIX)).expanduser()
            if not file.is_file():
                problems.append(ConfigProblem(f"{prefix}.{path_key}", f"got {path!r}, which is not a file; allowed: "
                                              f"a Python file that defines {name}, or pkg://a.module"))
    return problems


def check_lora_adapter_path(config: RunConfig) -> list[ConfigProblem]:
    """actor_rollout_ref.model.lora_adapter_path: a directory with a saved adapter's adapter_config.json."""
    path = config.actor_rollout_ref.model.lora_adapter_path
    if path is not None and not (Path(path).expanduser() / "adapter_config.json").is_file():
        return [ConfigProblem("actor_rollout_ref.model.lora_adapter_path",
                              f"got {path!r}, which is not a saved LoRA adapter (no adapter_config.json in it); "
                              "allowed: a directory peft's save_pretrained wrote, e.g. a LoRA checkpoint's actor "
                              "adapter")]
    return []


_DATA_FILES_ALLOWED = (f"{', '.join(DATA_FILE_SUFFIXES)} files (verl's parquet layout or JSONL), "
                       f"or {', '.join(BUILTIN_PREFIX + name for name in BUILTIN_DATASETS)}")


def _check_data_file(key: str, value: str) -> ConfigProblem | None:
    if value.startswith(BUILTIN_PREFIX):
        if value.removeprefix(BUILTIN_PREFIX) not in BUILTIN_DATASETS:
            return ConfigProblem(key, f"got {value!r}, which is not a built-in dataset; "
                                 f"allowed: {_DATA_FILES_ALLOWED}")
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        return ConfigProblem(key, f"got {value!r}, which is a directory; allowed: {_DATA_FILES_ALLOWED} "
                             "(list each file of a folder of shards)")
    if path.suffix not in DATA_FILE_SUFFIXES:
        return ConfigProblem(key, f"got {value!r}, a file format that cannot be read; "
                             f"allowed: {_DATA_FILES_ALLOWED}")
    if not path.is_file():
        return ConfigProblem(key, f"got {value!r}, which does not exist; allowed: an existing file")
    return None


def trackers_installed(config: RunConfig) -> list[ConfigProblem]:
    """A tracker asked for whose library is missing is refused before the run starts, rather than when the
    trainer gets to it."""
    backends = config.trainer.logger
    missing = [name for name in backends
               if name in TRACKER_MODULES and importlib.util.find_spec(TRACKER_MODULES[name]) is None]
    if not missing:
        return []
    return [ConfigProblem("trainer.logger", f"got {show(backends)}, but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed; install the trackers extra: "
                          f"{TRACKERS_EXTRA}")]


def actor_peft_installed(config: RunConfig) -> list[ConfigProblem]:
    return _peft_installed("actor_rollout_ref.model", config.actor_rollout_ref.model)


def critic_peft_installed(config: RunConfig) -> list[ConfigProblem]:
    return _peft_installed("critic.model", config.critic.model)


def _peft_installed(prefix: str, model: ModelConfig | CriticModelConfig) -> list[ConfigProblem]:
    """A LoRA adapter (lora_rank > 0, or a saved one) needs peft."""
    saved = getattr(model, "lora_adapter_path", None) is not None
    if (model.lora_rank == 0 and not saved) or importlib.util.find_spec("peft") is not None:
        return []
    return [ConfigProblem(f"{prefix}.lora_rank", f"got {model.lora_rank}, but LoRA needs peft, which is not "
                          "installed; allowed: 0, or install the lora extra (pip install 'verl-offload[lora]')")]


# ------------------------------------------------------------------------------------- launch keys


NODE_RANK_ENVIRONMENT = ("NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID")
"""Where trainer.node_rank comes from when the config leaves it unset (torchrun's names, then Slurm's)."""
RDZV_ENDPOINT_ENVIRONMENT = "PET_RDZV_ENDPOINT"
"""torchrun's name for --rdzv-endpoint; else MASTER_ADDR and MASTER_PORT (or PET_MASTER_ADDR/PET_MASTER_PORT)."""


def launch_keys_from_environment(raw: dict[str, Any], environment: Mapping[str, str]) -> list[ConfigProblem]:
    """Fill trainer.node_rank and trainer.rdzv_endpoint of a several-node run from the environment where the
    config leaves them out, as torchrun and Slurm users expect; a key the config sets always wins. A value
    read here is written into the resolved config, so every process of the run sees the same one."""
    trainer = raw.get("trainer")
    if not isinstance(trainer, dict) or not _several_nodes(trainer.get("nnodes")):
        return []
    problems = []
    if "node_rank" not in trainer:
        name = next((name for name in NODE_RANK_ENVIRONMENT if environment.get(name, "").strip()), None)
        if name is not None:
            value = environment[name].strip()
            if value.isdigit():
                trainer["node_rank"] = int(value)
            else:
                problems.append(ConfigProblem("trainer.node_rank", f"got {value!r} from ${name}; allowed: a whole "
                                              "number from 0 (or set trainer.node_rank)"))
    if "rdzv_endpoint" not in trainer:
        address = environment.get("MASTER_ADDR") or environment.get("PET_MASTER_ADDR")
        port = environment.get("MASTER_PORT") or environment.get("PET_MASTER_PORT")
        if environment.get(RDZV_ENDPOINT_ENVIRONMENT):
            trainer["rdzv_endpoint"] = environment[RDZV_ENDPOINT_ENVIRONMENT].strip()
        elif address and port:
            trainer["rdzv_endpoint"] = f"{address.strip()}:{port.strip()}"
    return problems


def _several_nodes(nnodes: Any) -> bool:
    try:
        return int(nnodes) > 1
    except (TypeError, ValueError):
        return False
