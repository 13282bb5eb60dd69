"""Megatron-LM, verl's other training engine, is not built here: a config that asks for it (verl's
ppo_megatron_trainer config, a strategy `megatron`, any setting under a model's `megatron` section) is one refusal
line, however many of its keys a launch script sets (verl.py finds them, loading.py says the one line)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from trainer.config.errors import ConfigProblem
from trainer.config.fields import show
from trainer.config.multi_turn import MEGATRON_NAMED_CONFIGS

# verl's Hydra configs of its PPO trainer: the FSDP one (its keys: verl_ppo_trainer.yaml) and the Megatron one.
CONFIG_NAMES = ("ppo_trainer", "ppo_megatron_trainer")
_MEGATRON = ("Megatron-LM is another training engine (verl's Megatron workers), not built here: the models train "
             "with this project's offload engine (FSDP2 sharding, per-group placement)")


def asks_for_megatron(config: Iterable[tuple[list[str], Any]], config_name: str | None) -> list[tuple[str, Any]]:
    """(key, value) of each setting that asks for Megatron, of a config's (location, value) settings and its
    --config-name: verl's ppo_megatron_trainer config, a strategy `megatron`, any setting under a model's
    `megatron` section."""
    settings: list[tuple[str, Any]] = []
    if config_name is not None and config_name.removesuffix(".yaml") in ("ppo_megatron_trainer",
                                                                          *MEGATRON_NAMED_CONFIGS):
        settings.append(("--config-name", config_name))
    for location, value in config:
        if ("megatron" in location and value != {}) or (location[-1] == "strategy" and value == "megatron"):
            settings.append((".".join(location), value))
    return settings


def single_megatron_problem(problems: Sequence[ConfigProblem],
                            megatron: Sequence[tuple[str, Any]]) -> list[ConfigProblem]:
    """`problems`, or where the config asks for Megatron, the one problem that says so: however many of its keys a
    launch script sets, the training engine is the one question (the others, batch sizes over Megatron's
    parallelism included, are moot until it is answered)."""
    if not megatron:
        return list(problems)
    keys = [key for key, _ in megatron]
    first, value = megatron[0]
    more = f" (and {len(keys) - 1} more Megatron settings: {', '.join(keys[1:4])}{', ...' if len(keys) > 4 else ''})" \
        if len(keys) > 1 else ""
    return [ConfigProblem(first, f"got {show(value)}, but {_MEGATRON}{more}; allowed: verl's ppo_trainer config, "
                          "strategy fsdp or fsdp2, and no *.megatron.* settings")]

