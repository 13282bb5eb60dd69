"""The run configuration (schema, loading with Hydra-grammar overrides, errors), the live settings and the
trainer<->daemon messages: everything the daemon shares with the trainer, none of it importing torch."""

from trainer.config.loading import load_config
from trainer.config.schema import (
    BUILTIN_DATASETS,
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    DATA_FILE_SUFFIXES,
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    ConfigError,
    ConfigProblem,
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
    check_semantics,
    dump_config,
    resolve_defaults,
    validate_config,
)

__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_MODELS", "BUILTIN_PREFIX", "DATA_FILE_SUFFIXES", "ActorConfig",
    "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError", "ConfigProblem", "CriticConfig", "DaemonConfig",
    "DataConfig", "DynamicOffloadConfig", "FSDPConfig", "LogLevel", "ModelConfig", "OptimConfig", "RolloutConfig",
    "RunConfig", "Section", "TelemetryConfig", "TrainerConfig", "check_semantics", "dump_config", "load_config",
    "resolve_defaults", "validate_config",
]
