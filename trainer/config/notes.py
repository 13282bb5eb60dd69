"""The NOTE line a config's load says at the start of a run: verl's keys accepted here with no effect, or read
otherwise than verl reads them, one line for all of them. (Its WARNING lines, of settings that run as verl runs them
but likely not as their author meant, are errors.py's ConfigWarning.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer.config.fields import show
from trainer.config.ranks import world_size
from trainer.config.schema import RunConfig


@dataclass(frozen=True)
class Note:
    """One of verl's keys as this run reads it: given at `value`, with the effect `why` says (often none)."""

    key: str
    value: Any
    why: str

    def __str__(self) -> str:
        return f"{self.key}={show(self.value)}: {self.why}"


def note_line(notes: Sequence[Note]) -> str:
    """The one NOTE line of `notes`: the keys that share a why-line named together before it, in the order they
    came ("NOTE: a.b=1, a.c=true: why; d.e='x': why")."""
    groups: dict[str, list[Note]] = {}
    for note in notes:
        groups.setdefault(note.why, []).append(note)
    return "NOTE: " + "; ".join(", ".join(f"{note.key}={show(note.value)}" for note in group) + f": {why}"
                                for why, group in groups.items())


def engine_notes(config: RunConfig) -> list[Note]:
    """The notes of the rollout's verl keys that this run reads otherwise than verl: a named engine, a
    tensor-parallel degree, a context length below the longest prompt and response."""
    rollout, data = config.actor_rollout_ref.rollout, config.data
    prefix = "actor_rollout_ref.rollout"
    notes = []
    if rollout.name != "hf":
        notes.append(Note(f"{prefix}.name", rollout.name, f"the built-in rollout runs instead of {rollout.name}'s "
                          "engine: it decodes with the actor's own weights in the trainer process (no weights are "
                          "synced to a server)"))
    if rollout.tensor_model_parallel_size > 1:
        ranks = world_size(config)
        where = (f"runs data-parallel on the run's {ranks} ranks instead: each decodes its share of the prompts"
                 if ranks > 1 else "decodes on the run's one rank instead (on several, data-parallel: each its "
                                   "share of the prompts)")
        notes.append(Note(f"{prefix}.tensor_model_parallel_size", rollout.tensor_model_parallel_size,
                          f"the rollout {where}, with the whole weights (no tensor-parallel engine here)"))
    longest = data.max_prompt_length + data.max_response_length
    if rollout.max_model_len is not None and data.max_prompt_length <= rollout.max_model_len < longest:
        notes.append(Note(f"{prefix}.max_model_len", rollout.max_model_len,
                          f"a response stops at {rollout.max_model_len} tokens of prompt and response, as verl's "
                          f"engines stop it: before data.max_response_length ({data.max_response_length}) for a "
                          f"prompt over {rollout.max_model_len - data.max_response_length} tokens"))
    return notes
