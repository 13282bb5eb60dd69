"""verl's actor.freeze_vision_tower: a vision-language model's vision encoder left out of training."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.config import KEYS


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a vision-language model where verl looks for it (fsdp_workers.get_vl_model_vision_tower:
    `model.visual` since transformers 4.52, `visual` before); None for a text model."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module) and isinstance(getattr(inner, "visual", None), torch.nn.Module):
        return inner.visual
    tower = getattr(model, "visual", None)
    return tower if isinstance(tower, torch.nn.Module) else None


def freeze_vision_tower(model: torch.nn.Module, log: Callable[[str], None]) -> None:
    """Stop the gradients of `model`'s vision encoder, so that the optimizer leaves it as it is, as verl's actor
    does; a text model has none, and the setting has no effect (said in one NOTE line, as verl prints "No vision
    tower found")."""
    tower = vision_tower(model)
    key = KEYS.actor_rollout_ref.actor.freeze_vision_tower
    if tower is None:
        log(f"NOTE: {key}=true: no effect, the model has no vision tower (a text model)")
        return
    tower.requires_grad_(False)
    frozen = sum(parameter.numel() for parameter in tower.parameters())
    log(f"{key}: the vision tower's {frozen:,} parameters are frozen (not trained)")
