"""LoRA adapters through peft: a low-rank adapter trains beside the frozen weights of the policy or the critic.

    adapted = apply_lora(model, LoraSettings.of(config.actor_rollout_ref.model, "actor_rollout_ref.model"),
                         role="actor", seed=seed)
    engine = attach_offload(adapted.get_base_model(), ...)   # the adapter is in place before the engine's layout
    with adapted.disable_adapter():                           # the reference policy: the same weights, no adapter
        ...
    save_adapter(adapted, directory)                          # peft's format: PeftModel.from_pretrained loads it

The adapter is applied before the offload engine lays the model out, so each adapter weight is one more entry of
the unit (transformer block, head) its module belongs to: it lives and streams where that group lives, and only it
has a gradient and optimizer states (the engine allocates those for trainable entries only). peft is an optional
extra (`pip install 'verl-offload[lora]'`); it is imported only when a model gets an adapter.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from trainer.models.loading import ModelLoadError
from trainer.offload.layout import format_bytes

if TYPE_CHECKING:
    from peft import PeftModel

ALL_LINEAR = "all-linear"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Heads a value model trains whole beside its adapter (peft's TOKEN_CLS task saves these modules).
_VALUE_HEADS = ("score", "classifier")


@dataclass(frozen=True)
class LoraSettings:
    """One model's LoRA keys (ModelConfig, CriticModelConfig), and where they are set (named in errors)."""

    rank: int
    alpha: int
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    setting: str
    """The config section the keys are in, e.g. "actor_rollout_ref.model"."""
    adapter_path: str | None = None
    """A saved adapter to start from (verl's lora_adapter_path): its own rank, alpha and modules, not the keys'."""

    @classmethod
    def of(cls, model_config: Any, setting: str) -> LoraSettings | None:
        """The settings of a model config section; None when it asks for no adapter (lora_rank 0, no
        lora_adapter_path)."""
        adapter_path = getattr(model_config, "lora_adapter_path", None)
        if model_config.lora_rank == 0 and adapter_path is None:
            return None
        return cls(rank=model_config.lora_rank, alpha=model_config.lora_alpha,
                   target_modules=model_config.target_modules,
                   exclude_modules=getattr(model_config, "exclude_modules", None), setting=setting,
                   adapter_path=adapter_path)


def apply_lora(model: nn.Module, settings: LoraSettings, *, role: Literal["actor", "critic"], seed: int) -> PeftModel:
    """`model` with a LoRA adapter on its target modules, every other weight frozen; the critic's value head
    trains whole (it starts random). The adapter starts as a no-op (peft zeroes lora_B), its lora_A drawn from
    `seed` alone, so that a run rebuilds the same adapter whatever the global RNG did; it has the model's dtype
    (with fp32 masters on the CPU when the optimizer is offloaded, as every trained weight)."""
    from peft import LoraConfig, TaskType, get_peft_model

    if settings.adapter_path is not None:
        return saved_adapter(model, settings)
    head = _value_head(model) if role == "critic" else None
    _check_modules(model, settings, head)
    exclude = settings.exclude_modules
    if head is not None:
        # A value head of one output gains nothing from a low-rank adapter: peft trains it whole instead.
        exclude = [head] if exclude is None else [head, *exclude] if isinstance(exclude, list) else \
            rf"(?:{exclude})|{re.escape(head)}"
    config = LoraConfig(task_type=TaskType.CAUSAL_LM if role == "actor" else TaskType.TOKEN_CLS,
                        r=settings.rank, lora_alpha=settings.alpha, target_modules=settings.target_modules,
                        exclude_modules=exclude, modules_to_save=[head] if head is not None else None, bias="none")
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(seed)
            # peft reads transformers' deprecated is_gradient_checkpointing (a FutureWarning per model).
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config, autocast_adapter_dtype=False)
    except (ValueError, TypeError) as error:
        raise ModelLoadError(f"{settings.setting}.target_modules: got {settings.target_modules!r}: "
                             f"{_one_line(error)}; {_linear_layers(model)}") from None


def saved_adapter(model: nn.Module, settings: LoraSettings) -> PeftModel:
    """`model` with the adapter saved at `settings.adapter_path` (peft's format: adapter_config.json beside its
    weights), trainable, every other weight frozen: verl's lora_adapter_path, which continues a LoRA run. The
    adapter's own config sets its rank, alpha and modules (as in verl, lora_rank and target_modules are not read);
    its weights keep the model's dtype."""
    from peft import PeftModel

    key = f"{settings.setting}.lora_adapter_path"
    directory = Path(str(settings.adapter_path)).expanduser()
    if not (directory / ADAPTER_CONFIG).is_file():
        raise ModelLoadError(f"{key}: got {settings.adapter_path!r}, which is not a saved LoRA adapter (no "
                             f"{ADAPTER_CONFIG} in it); allowed: a directory peft's save_pretrained wrote, e.g. "
                             "a LoRA checkpoint's actor adapter")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return PeftModel.from_pretrained(model, str(directory), is_trainable=True, autocast_adapter_dtype=False)
    except (ValueError, TypeError, KeyError, RuntimeError, OSError) as error:
        raise ModelLoadError(f"{key}: got {settings.adapter_path!r}, which does not fit the model "
                             f"({_one_line(error)}); allowed: an adapter saved for this model") from None


def with_adapter(model: nn.Module, settings: LoraSettings | None, *, role: Literal["actor", "critic"],
                 seed: int) -> tuple[nn.Module, PeftModel | None]:
    """The model the trainer places and trains (the HF model, with the adapter's layers in it when `settings`
    asks for one) and its peft wrapper (None without an adapter), which disables, saves and loads the adapter."""
    if settings is None:
        return model, None
    adapted = apply_lora(model, settings, role=role, seed=seed)
    return adapted.get_base_model(), adapted


def _value_head(model: nn.Module) -> str | None:
    return next((name for name in _VALUE_HEADS if isinstance(getattr(model, name, None), nn.Module)), None)


def _check_modules(model: nn.Module, settings: LoraSettings, head: str | None) -> None:
    """Every name in target_modules and exclude_modules names a module of the model (peft passes over a name
    that matches nothing), and a regex matches one: a typo would otherwise train less than the user meant."""
    names = [name for name, _ in model.named_modules() if name]
    for key, value in (("target_modules", settings.target_modules), ("exclude_modules", settings.exclude_modules)):
        if value is None or value == ALL_LINEAR:
            continue
        if isinstance(value, str):
            if not any(re.fullmatch(value, name) for name in names):
                raise ModelLoadError(f"{settings.setting}.{key}: got {value!r}, a regex that matches no module name "
                                     f"of the model (it must match a whole name such as {names[-1]!r}); "
                                     f"{_linear_layers(model)}")
            continue
        missing = [item for item in value if not any(name == item or name.endswith(f".{item}") for name in names)]
        if missing:
            raise ModelLoadError(f"{settings.setting}.{key}: got {value!r}, but the model has no module "
                                 f"{' or '.join(map(repr, missing))}; {_linear_layers(model)}")
        if key == "target_modules" and head is not None and head in value:
            raise ModelLoadError(f"{settings.setting}.target_modules: got {value!r}, but the critic's value head "
                                 f"{head!r} trains whole, without an adapter; allowed: the backbone's modules "
                                 f"({_linear_layers(model)})")


def _linear_layers(model: nn.Module) -> str:
    """The names of the model's linear layers, each once (what target_modules usually lists)."""
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, nn.Linear) and name})
    return f"its linear layers: {', '.join(leaves)}"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# ------------------------------------------------------------------------------------------- using it


def is_adapted(model: nn.Module) -> bool:
    """Whether `model` is a peft model (peft not imported: no model can be one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_parameters(model: PeftModel) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters: the adapter's (and a critic's value head)."""
    return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]


def describe_adapter(model: PeftModel, role: str) -> str:
    """One line for the start-of-run log: the adapter's shape and what it trains of the model."""
    config = model.peft_config[model.active_adapter]
    trainable = adapter_parameters(model)
    count = sum(parameter.numel() for _, parameter in trainable)
    nbytes = sum(parameter.numel() * parameter.element_size() for _, parameter in trainable)
    total = sum(parameter.numel() for parameter in model.parameters())
    # The modules that have an adapter (peft's resolved target_modules still lists the excluded ones), by the
    # last part of their names.
    targets = ", ".join(sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                                if isinstance(getattr(module, "lora_A", None), nn.ModuleDict)}))
    saved = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)})
    whole = f", {' and '.join(saved)} whole" if saved else ""
    return (f"{role}: LoRA adapter rank {config.r}, alpha {config.lora_alpha} on {targets}{whole}: {count:,} "
            f"trainable parameters ({format_bytes(nbytes)}, {100 * count / max(1, total):.2f}% of {total:,}); the "
            "base weights are frozen")


def save_adapter(model: PeftModel, directory: Path) -> None:
    """The adapter in peft's format (adapter_config.json, adapter_model.safetensors), for a checkpoint and for
    `PeftModel.from_pretrained(base_model, directory)`."""
    # save_embedding_layers=False: "auto" would look the base model up on the Hub (its path is a local one or the
    # built-in preset); the base embedding is not trained here, so it never needs saving.
    model.save_pretrained(str(directory), safe_serialization=True, save_embedding_layers=False)
    # peft writes a model card too; a checkpoint keeps what resumes it.
    (Path(directory) / "README.md").unlink(missing_ok=True)


def load_adapter(model: PeftModel, directory: Path) -> list[str]:
    """Load a saved adapter into `model` in place; the names of the adapter tensors it lacked or had in excess
    (empty: it fits)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(directory) / ADAPTER_WEIGHTS))  # load_state_dict copies them where the model is
    expected = _saved_names(model)
    unfit = sorted(set(weights) ^ expected)
    if unfit:
        return unfit
    with torch.no_grad():
        set_peft_model_state_dict(model, weights)
    return []


def _saved_names(model: PeftModel) -> set[str]:
    from peft import get_peft_model_state_dict

    return set(get_peft_model_state_dict(model, save_embedding_layers=False))


def adapter_state_bytes(model: PeftModel) -> int:
    """Bytes of the adapter tensors a checkpoint writes."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return sum(int(tensor.nbytes) for tensor in state.values())
