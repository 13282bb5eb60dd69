"""Split a HuggingFace decoder model into the module groups that offload_policy places.

Groups: ``embedding`` (the token embedding), ``transformer`` (the decoder blocks), ``norm`` (the
final norm) and ``lm_head`` (the output head: ``lm_head`` of a causal LM, ``score`` of the critic
and reward model). Parameters in none of them (rare: extra projections) stay with the compute
device, under the group ``other``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from trainer.config import FSDP_CONFIG
from trainer.config.messages import Group

# The groups offload_policy places; the names are the wire's (one source: trainer.config.messages.Group).
GROUPS: tuple[str, ...] = tuple(group.value for group in Group if group is not Group.OTHER)
TITLES = {"embedding": "Embedding", "transformer": "Transformer", "norm": "Norm", "lm_head": "LM head",
          "other": "Other parameters"}
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")
_HEAD_NAMES = ("score", "classifier", "v_head", "value_head")


class UnsupportedModel(ValueError):
    """A model whose layout the offload engine does not recognise; the message says what is missing."""


@dataclass
class Entry:
    """One parameter, and every (module, attribute) pair that holds it (two when weights are tied)."""

    name: str
    parameter: nn.Parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class ModelParts:
    embedding: nn.Module
    layers: list[nn.Module]
    norm: nn.Module | None
    head: nn.Module | None
    tied: bool
    """The head's weight is the embedding's weight (tie_word_embeddings)."""

    @property
    def embedding_weight(self) -> nn.Parameter:
        return _weight(self.embedding)

    @property
    def head_weight(self) -> nn.Parameter:
        if self.head is None:
            raise UnsupportedModel("the model has no output head")
        return _weight(self.head)


def _weight(module: nn.Module) -> nn.Parameter:
    weight = module.weight
    if not isinstance(weight, nn.Parameter):
        raise UnsupportedModel(f"{type(module).__name__} has no weight parameter")
    return weight


def find_parts(model: nn.Module, layer_classes: Sequence[str] | None = None) -> ModelParts:
    """The embedding, decoder blocks, final norm and head of a HF decoder model."""
    input_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = input_embeddings() if input_embeddings is not None else None
    if embedding is None:
        raise UnsupportedModel(f"{type(model).__name__} has no input embedding (get_input_embeddings())")
    classes = set(layer_classes or getattr(model, "_no_split_modules", None) or ())
    if not classes:
        raise UnsupportedModel(f"cannot tell the transformer blocks of {type(model).__name__}: set "
                               f"{FSDP_CONFIG.wrap_policy.transformer_layer_cls_to_wrap} to their class name")
    # By the class's name, which FSDP2 prefixes when it shards a block (Qwen2DecoderLayer: FSDPQwen2DecoderLayer).
    # A vision-language model's vision blocks are no decoder blocks: its vision tower is in no group (`other`).
    tower = getattr(getattr(model, "model", None), "visual", None)
    in_tower = {id(module) for module in tower.modules()} if isinstance(tower, nn.Module) else set()
    layers = [module for module in model.modules()
              if type(module).__name__.removeprefix("FSDP") in classes and id(module) not in in_tower]
    if not layers:
        raise UnsupportedModel(f"no module of class {sorted(classes)} in {type(model).__name__}: set "
                               f"{FSDP_CONFIG.wrap_policy.transformer_layer_cls_to_wrap} to the block class name")
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    base = getattr(base, "language_model", None) or base  # a vision-language model's decoder holds the final norm
    norm = next((getattr(base, name) for name in _NORM_NAMES if isinstance(getattr(base, name, None), nn.Module)),
                None)
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if output_embeddings is not None else None
    if head is None:
        head = next((getattr(model, name) for name in _HEAD_NAMES if isinstance(getattr(model, name, None), nn.Module)),
                    None)
    tied = head is not None and getattr(head, "weight", None) is not None and head.weight is embedding.weight
    return ModelParts(embedding=embedding, layers=layers, norm=norm, head=head, tied=tied)


def parameter_groups(parts: ModelParts) -> dict[int, str]:
    """Each parameter's group (embedding, transformer, norm, lm_head) by id; a parameter of none is not there."""
    holders = [("embedding", [parts.embedding]), ("transformer", parts.layers),
               ("norm", [parts.norm] if parts.norm is not None else []),
               ("lm_head", [parts.head] if parts.head is not None else [])]
    groups: dict[int, str] = {}
    for group, modules in holders:
        for module in modules:
            for parameter in module.parameters():
                groups.setdefault(id(parameter), group)  # a tied head's weight is the embedding's
    return groups


def entries_of(modules: Sequence[nn.Module], prefix_of: dict[int, str]) -> list[Entry]:
    """The parameters held by `modules` and their submodules, each once, in registration order."""
    entries: dict[int, Entry] = {}
    for root in modules:
        for module in root.modules():
            for attribute, parameter in module._parameters.items():
                if parameter is None:
                    continue
                entry = entries.get(id(parameter))
                if entry is None:
                    entry = entries[id(parameter)] = Entry(f"{prefix_of.get(id(module), '?')}.{attribute}".lstrip("."),
                                                           parameter)
                if (module, attribute) not in [(owner, name) for owner, name in entry.owners]:
                    entry.owners.append((module, attribute))
    return list(entries.values())


def owners_in(model: nn.Module, entries: Sequence[Entry]) -> None:
    """Add every other module of `model` that holds one of `entries` (a weight tied across groups)."""
    by_id = {id(entry.parameter): entry for entry in entries}
    for module in model.modules():
        for attribute, parameter in module._parameters.items():
            entry = by_id.get(id(parameter)) if parameter is not None else None
            if entry is not None and not any(owner is module and name == attribute for owner, name in entry.owners):
                entry.owners.append((module, attribute))
