"""The advantages of a step whose prompts' groups span ranks (RunWide.splits_groups: verl's split of the sequences,
not the prompts). verl computes advantages on its driver over the whole batch; here every data-parallel group
gathers what the estimator reads of every other's share, runs the estimator on the whole batch, and keeps its own
rows. Whitening and the other batch-level statistics are then the whole batch's by construction.

Where whole groups sit on each rank (the prompts divide among the ranks) none of this runs: the estimator reads
this rank's share, with the whitening and sums over every rank passed in (run_wide.py).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from trainer.algorithms import AdvantageInputs
from trainer.algorithms.advantages import Estimator, same_tensor
from trainer.algorithms.functional import masked_whiten
from trainer.config import AlgorithmConfig
from trainer.distributed.ranks import Ranks


def advantages_over_whole_groups(estimator: Estimator, inputs: AdvantageInputs, algorithm: AlgorithmConfig,
                                 ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """`estimator`'s (advantages, returns) of this rank's rows ([B, T] each), computed over the whole batch: every
    tensor of `inputs` gathered from each data-parallel group in rank order (the ranks of a sequence-parallel
    group hold the same rows: the first one's count), token columns padded with zeros to the widest rank's.
    `inputs.group_index` must name each group the same on every rank (StepShare.groups)."""
    names = [field.name for field in fields(AdvantageInputs)
             if isinstance(getattr(inputs, field.name), torch.Tensor)]
    mine = {name: getattr(inputs, name).detach().cpu() for name in names}
    every_rank = ranks.gather_objects(mine)[::ranks.sp_size]
    width = max(shares["response_mask"].shape[1] for shares in every_rank)
    whole = {name: torch.cat([_padded(shares[name], width) for shares in every_rank]).to(ranks.device)
             for name in names}
    advantages, returns = estimator(replace(inputs, **whole, whiten=masked_whiten, sum_over_batch=same_tensor),
                                    algorithm)
    first = sum(len(shares["group_index"]) for shares in every_rank[:ranks.dp_rank])
    rows, columns = len(inputs.group_index), inputs.response_mask.shape[1]
    return advantages[first:first + rows, :columns], returns[first:first + rows, :columns]


def _padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """A [B, T] tensor padded with zeros to `width` token columns ([B] tensors as they are)."""
    if tensor.dim() < 2 or tensor.shape[1] == width:
        return tensor
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))
