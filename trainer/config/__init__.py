"""The run configuration (schema, loading with Hydra-grammar overrides, errors), the live settings and the
trainer<->daemon messages: everything the daemon shares with the trainer, none of it importing torch.

By job: schema.py (the typed tree; its placement.py and running.py parts), rules.py (the rules between fields,
one pass; refused.py: for a config the schema refused), environment.py (the rules that read the disk and the
environment), errors.py (the messages, warnings among them), loading.py, aliases.py (verl's keys: the one alias
table) and verl.py (which applies it), notes.py (the NOTE line of a load), megatron.py (its one refusal line),
keys.py (KEYS: keys named through the schema), docs.py (docs/config.md and docs/verl.md).
"""

from trainer.config.errors import ConfigError, ConfigProblem, ConfigWarning
from trainer.config.keys import FSDP_CONFIG, KEYS, Key, fsdp_key, key_of
from trainer.config.loading import (
    LoadedConfig,
    dump_config,
    load_config,
    load_config_with_notes,
    resolve_defaults,
    validate_config,
)
from trainer.config.notes import Note, note_line
from trainer.config.rules import check_semantics
from trainer.config.schema import (
    BUILTIN_DATASETS,
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    DATA_FILE_SUFFIXES,
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    CriticConfig,
    DaemonConfig,
    DataConfig,
    DynamicOffloadConfig,
    FSDPConfig,
    LogLevel,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    Section,
    TelemetryConfig,
    TrainerConfig,
)

__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_MODELS", "BUILTIN_PREFIX", "DATA_FILE_SUFFIXES", "FSDP_CONFIG", "KEYS", "ActorConfig",
    "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError", "ConfigProblem", "ConfigWarning", "CriticConfig",
    "DaemonConfig", "DataConfig", "DynamicOffloadConfig", "FSDPConfig", "Key", "LoadedConfig", "LogLevel",
    "ModelConfig", "Note", "OptimConfig", "RolloutConfig", "RunConfig", "Section", "TelemetryConfig", "TrainerConfig",
    "check_semantics", "dump_config", "fsdp_key", "key_of", "load_config", "load_config_with_notes", "note_line",
    "resolve_defaults", "validate_config",
]
