"""Policy-filtration PPO (verl's ``algorithm.use_pf_ppo``): after the advantages, the batch is resampled with
replacement, each response drawn in proportion to a weight of its score, so that the update learns more from the
responses whose reward is most reliable (Shen et al. 2024, "Policy Filtration in RLHF to Fine-Tune LLM for Code
Generation", arXiv 2409.06957, sec. 4).
"""

from __future__ import annotations

import torch

from trainer.config import KEYS

PF_PPO_METHODS = ("pow", "max_min", "max_random")

# Every response keeps a chance, however small its weight, so that multinomial always has one to draw.
_WEIGHT_FLOOR = 1e-8


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str, weight_pow: float) -> torch.Tensor:
    """``[B]`` scores -> ``[B]`` unnormalised sampling weights (verl's algorithm.pf_ppo.reweight_method):

        ``pow``: |score| ^ weight_pow;
        ``max_min``: 1 for the batch's best and worst scores, 0 for the rest (PF-PPO's BR + WR filter);
        ``max_random``: 0.4 for the best score, 0.1 for the rest.

    Each weight is then raised to at least 1e-8 (plus 1e-8), so that no response's chance is exactly 0.
    """
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        extreme = (scores == scores.max()) | (scores == scores.min())
        weights = extreme.to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown {KEYS.algorithm.pf_ppo.reweight_method} '{reweight_method}'; allowed: "
                         f"{', '.join(PF_PPO_METHODS)}")
    return (weights + _WEIGHT_FLOOR).clamp(min=_WEIGHT_FLOOR)


@torch.no_grad()
def pf_ppo_resample(scores: torch.Tensor, reweight_method: str, weight_pow: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B]`` response scores -> ``[B]`` long indices of the resampled batch: B draws with replacement, each
    response in proportion to its :func:`pf_ppo_weights` weight (from `generator`; None: torch's default one).
    The batch keeps its size; a response may appear several times or not at all."""
    weights = pf_ppo_weights(scores.float(), reweight_method, weight_pow)
    return torch.multinomial(weights.cpu(), len(scores), replacement=True, generator=generator).to(scores.device)
