"""What the RL step does across ranks: each rank's share of the prompts (or of their sequences, StepShare), prompts
padded alike, the step's metrics and
GAE's whitening over every rank's tokens, and rank 0's report of every rank to the daemon of node 0.

On one rank every function here is the identity (or close to it), so the loop calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from trainer.algorithms.functional import WHITEN_EPSILON, masked_mean, masked_whiten
from trainer.config import RunConfig
from trainer.config.messages import RankReport, RanksMessage, UpMessage
from trainer.data import rank_share, sequence_share
from trainer.distributed.ranks import Ranks
from trainer.metrics import combine_rank_metrics, rank_reduction

Record = TypeVar("Record")


@dataclass(frozen=True)
class StepShare:
    """This rank's part of a step's batch: the prompts it samples, how many responses each, and each one's group."""

    prompts: list[int]
    """Indices of the prompts this rank samples; with `copies` 1 one entry per sequence (a prompt may repeat)."""
    copies: int
    """Responses sampled per entry of `prompts`: rollout.n, or 1 where the ranks split the step's sequences."""
    groups: list[int] | None = None
    """Each entry's group, the same on every rank (its prompt's position in the step's batch); None: its own
    position in `prompts`, a group whole on this rank."""

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.copies


class RunWide:
    """The run's ranks as the RL step sees them."""

    def __init__(self, ranks: Ranks, config: RunConfig, send: Callable[[UpMessage], None]):
        self.ranks = ranks
        self.config = config
        self.send = send

    def share_of(self, batch: list[int]) -> StepShare:
        """This rank's part of the global batch (all of it on one rank): a slice of each actor mini-batch, of whole
        prompts where they divide among the ranks, otherwise of the sequences, as verl splits them (`splits_groups`).
        The ranks of a sequence-parallel group take the same share: they split its sequences instead."""
        n = self.config.actor_rollout_ref.rollout.n
        if not self.ranks.distributed:
            return StepShare(batch, n)
        mini_batch_size = self.config.actor_rollout_ref.actor.ppo_mini_batch_size
        if not self.splits_groups:
            return StepShare(rank_share(batch, rank=self.ranks.dp_rank, world_size=self.ranks.dp_size,
                                        mini_batch_size=mini_batch_size), n)
        prompts, groups = sequence_share(batch, copies=n, rank=self.ranks.dp_rank, world_size=self.ranks.dp_size,
                                         mini_batch_size=mini_batch_size * n // self.ranks.dp_size,
                                         global_mini_batch=mini_batch_size * n)
        return StepShare(prompts, 1, groups)

    @property
    def splits_groups(self) -> bool:
        """Whether a prompt's responses may be on several ranks: the prompts of a step or of an actor mini-batch are
        fewer than the data-parallel groups, or not a multiple of them (verl accepts it: it splits the sequences).
        The group estimators then gather what they read over the ranks (distributed/whole_groups.py)."""
        ranks = self.ranks.dp_size
        return ranks > 1 and bool(self.config.data.train_batch_size % ranks
                                  or self.config.actor_rollout_ref.actor.ppo_mini_batch_size % ranks)

    def validation_share(self, records: Sequence[Record]) -> tuple[list[Record], int]:
        """This rank's slice of a validation batch and how many of it count. Every rank generates as many
        sequences (the sharded model's forwards are collective, and so are the pieces a batch decodes in): a
        short slice is filled up with the batch's first prompt, unscored. By data-parallel group: the ranks of a
        sequence-parallel group generate alike, and their repeated scores leave each source's mean as it is."""
        share = math.ceil(len(records) / self.ranks.dp_size)
        mine = list(records[self.ranks.dp_rank * share:(self.ranks.dp_rank + 1) * share])
        return mine + [records[0]] * (share - len(mine)), len(mine)

    def pad_like_other_ranks(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad_id: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """With several ranks, every rank's prompts left-padded to the longest of all of them: each sequence then
        has the same positions and padding as in a one-rank run of the whole batch."""
        width = self.ranks.max(prompt_ids.shape[1])
        padding = width - prompt_ids.shape[1]
        if padding == 0:
            return prompt_ids, prompt_mask
        return (torch.nn.functional.pad(prompt_ids, (padding, 0), value=pad_id),
                torch.nn.functional.pad(prompt_mask, (padding, 0), value=0))

    def fewest(self, count: int) -> int:
        """The smallest of every rank's `count` (a collective on several ranks)."""
        return int(self.ranks.reduce_many([float(count)], "min")[0]) if self.ranks.distributed else count

    def whiten(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`values` whitened over the whole batch, every rank's masked tokens (as one rank whitens its whole batch:
        masked_whiten's unbiased variance), not over this rank's share alone. GAE's advantages are whitened so."""
        if not self.ranks.distributed:
            return masked_whiten(values, mask)
        values = values * mask
        count, total, squares = self.ranks.sum_tensor_over_data(torch.stack(
            [mask.sum(), values.sum(), (values ** 2).sum()]).double()).tolist()
        mean = total / max(count, 1.0)
        variance = max(squares / max(count, 1.0) - mean ** 2, 0.0) * count / max(count - 1, 1.0)
        return ((values - mean) * (variance + WHITEN_EPSILON) ** -0.5 * mask).to(values.dtype)

    def masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The mean of `values` over every rank's masked positions (the whole batch's), a 0-dim tensor: rollout
        correction's importance weights are normalised by it."""
        if not self.ranks.distributed:
            return masked_mean(values, mask)
        sums = torch.stack([(values * mask).sum(), mask.sum()]).double()
        total, count = self.ranks.sum_tensor_over_data(sums).tolist()
        return values.new_tensor(total / max(count, 1.0))

    def metrics(self, local: dict[str, float], *, sequences: int, step: int,
                copy_latency_mean_s: float | None) -> dict[str, float]:
        """The step's metrics over every rank (the same keys; metrics.rank_reduction says how each combines); rank 0
        of a run of several nodes reports every rank to its daemon on the way."""
        if not self.ranks.distributed:
            return local
        tokens = local.get("perf/total_num_response_tokens", 0.0)
        everyone = self.ranks.gather_objects((local, float(sequences), float(tokens),
                                              self._report_figures(copy_latency_mean_s)))
        self._report_ranks([(figures, reported) for figures, _, _, reported in everyone], step)
        gathered = [(figures, counted, tokens) for figures, counted, tokens, _ in everyone]
        combined = combine_rank_metrics(gathered)
        if self.ranks.sp_size > 1:
            # The ranks of a sequence-parallel group (consecutive ranks) hold the same sequences: counts and other
            # sums take each group's once; means and extremes are unchanged by the repeats.
            once = combine_rank_metrics(gathered[::self.ranks.sp_size])
            combined.update({key: value for key, value in once.items() if rank_reduction(key) == "sum"})
        return combined

    def _report_figures(self, copy_latency_mean_s: float | None) -> dict[str, float | None]:
        """What this rank adds to rank 0's report of a run of several nodes (RankReport): the mean time of its latest
        timed copies, and NVML's utilization of its GPU now. Nothing is read for a run of one node."""
        if self.config.trainer.nnodes <= 1:
            return {}
        utilization = None
        device = self.ranks.device
        if device.type == "cuda":
            # torch reads it through pynvml (nvidia-ml-py, a dependency), for the GPU CUDA_VISIBLE_DEVICES maps.
            with contextlib.suppress(Exception):  # no NVML (a driver without it): the row shows no utilization
                utilization = float(torch.cuda.utilization(device))
        return {"copy_latency_mean_s": copy_latency_mean_s, "gpu_utilization_percent": utilization}

    def _report_ranks(self, every_rank: list[tuple[dict[str, float], dict[str, float | None]]], step: int) -> None:
        """Rank 0 of a run of several nodes: every rank's own figures of the step, the mean time of its latest timed
        copies and its GPU's utilization to node 0's daemon, which shows the other nodes' ranks beside its own and
        compares their copy times (RanksMessage)."""
        trainer = self.config.trainer
        if not self.ranks.is_main or trainer.nnodes <= 1 or not every_rank:
            return
        reports = [RankReport(rank=rank, local_rank=rank % trainer.n_gpus_per_node,
                              node_rank=rank // trainer.n_gpus_per_node, step=step,
                              gpu_memory_bytes=_bytes_of_gib(figures.get("perf/max_memory_allocated_gb")),
                              copy_latency_mean_s=reported.get("copy_latency_mean_s"),
                              gpu_utilization_percent=reported.get("gpu_utilization_percent"))
                   for rank, (figures, reported) in enumerate(every_rank)]
        self.send(RanksMessage(step=step, ranks=reports))


def _bytes_of_gib(gib: float | None) -> float | None:
    return None if gib is None or gib != gib else max(0.0, gib) * 2**30
