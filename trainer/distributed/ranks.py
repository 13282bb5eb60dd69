"""Which rank of the run this process is, from torchrun's environment, and the collectives the trainer uses.

`python -m torch.distributed.run` (and the verl daemon through it) starts one trainer per rank with RANK,
WORLD_SIZE, LOCAL_RANK and GROUP_RANK set. A process without them, or with WORLD_SIZE=1, is the whole run:
no process group is made and every helper below is the identity, so a one-rank run does exactly what it
did before several ranks existed.

    ranks = Ranks.from_environment("cpu")   # init_process_group and the ("dp",) mesh when WORLD_SIZE > 1
    ranks = Ranks.from_environment("cpu", sequence_parallel_size=2)   # and the (dp, sp) mesh of Ulysses
    try:
        ...
    finally:
        ranks.close()                       # destroy_process_group
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import KEYS
from trainer.errors import RunSetupError

DATA_PARALLEL = "dp"
"""The mesh dimension the prompts are split over (and, without sequence parallelism, the models sharded over)."""
SEQUENCE_PARALLEL = "sp"
"""The mesh dimension whose ranks share every sequence (Ulysses, trainer/distributed/ulysses.py)."""
FLATTENED = "dp_sp"
"""With sequence parallelism, the 1-D mesh of all ranks that the models are sharded over (FSDP2), as verl's
fsdp mesh beside its (dp, sp) Ulysses mesh: each rank holds and moves 1/world of every model."""


def host_threads_per_rank(ranks_per_node: int) -> int:
    """A rank's share of the cores this process may run on (its affinity), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, ranks_per_node))


def resolve_device(name: str) -> torch.device:
    """trainer.device as a torch device: auto is a GPU where one is visible."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RunSetupError(f"{KEYS.trainer.device}: cuda, but no CUDA GPU is visible; set "
                            f"{KEYS.trainer.device}=auto or cpu")
    return torch.device(name)


def gpus_per_node_problem(ranks_per_node: int, gpus: int) -> str | None:
    """The line for a node that runs more ranks than it shows GPUs (each rank takes one of its own); None when
    they fit."""
    if ranks_per_node <= gpus:
        return None
    return (f"{KEYS.trainer.n_gpus_per_node}: {ranks_per_node} ranks on this node, but it shows {gpus} GPU(s) "
            f"(each rank needs one of its own); allowed: at most {gpus}")


def environment_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's global rank as torchrun set it (0 when it did not start this process)."""
    return int(environ.get("RANK", "0"))


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: its global rank of `world_size`, its rank on its node, its node's
    rank, the device it computes on and, with several ranks, the 1-D mesh of all ranks the models are sharded
    over. With a sequence-parallel degree `sp_size` above 1 the ranks also form a (dp, sp) mesh: ranks
    r*sp_size ... (r+1)*sp_size - 1 are one sp group, which shares every sequence of the same samples, and
    the prompts split over the world_size / sp_size data-parallel groups."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    mesh: DeviceMesh | None = None
    sp_size: int = 1
    sequence_mesh: DeviceMesh | None = None
    """The (dp, sp) mesh when sp_size > 1; None otherwise."""

    @classmethod
    def single(cls, device: torch.device) -> Ranks:
        """The whole run in this one process: no process group."""
        return cls(device=device)

    @classmethod
    def from_environment(cls, device_name: str, environ: Mapping[str, str] = os.environ, *,
                         sequence_parallel_size: int = 1, timeout_s: float | None = None) -> Ranks:
        """This process's ranks from torchrun's variables, joining the process group when there are several.

        gloo carries CPU tensors even on GPU runs (the metrics' and control's objects), NCCL the GPU ones.
        `sequence_parallel_size` (the config checked it divides the world size) adds the (dp, sp) mesh."""
        world_size = int(environ.get("WORLD_SIZE", "1"))
        if world_size % sequence_parallel_size:
            raise RunSetupError(f"{KEYS.actor_rollout_ref.actor.ulysses_sequence_parallel_size}: the run's "
                                f"sequence-parallel degree {sequence_parallel_size} does not divide the {world_size} "
                                f"ranks torchrun started; set {KEYS.trainer.nnodes} x {KEYS.trainer.n_gpus_per_node} "
                                "to the ranks it starts")
        device = resolve_device(device_name)
        if world_size == 1:
            return cls.single(device)
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            # Every rank checks its node's rank count, not only those without a GPU of their own: rank 0 (the
            # one that prints a user error, trainer/main.py) then raises the line too. Without LOCAL_WORLD_SIZE
            # (not started by torchrun) this rank's own index is all there is to check.
            problem = gpus_per_node_problem(int(environ.get("LOCAL_WORLD_SIZE", local_rank + 1)),
                                            torch.cuda.device_count())
            if problem is not None:
                raise RunSetupError(problem)
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            # timeout_s (verl's nccl_timeout): how long a collective waits for a rank that is gone before it fails.
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                    timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
        sequence_mesh = None
        if sequence_parallel_size > 1:
            sequence_mesh = init_device_mesh(device.type, (world_size // sequence_parallel_size,
                                                           sequence_parallel_size),
                                             mesh_dim_names=(DATA_PARALLEL, SEQUENCE_PARALLEL))
        flat_name = FLATTENED if sequence_parallel_size > 1 else DATA_PARALLEL
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=(flat_name,))
        return cls(device=device, rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                   node_rank=int(environ.get("GROUP_RANK", "0")), mesh=mesh, sp_size=sequence_parallel_size,
                   sequence_mesh=sequence_mesh)

    @property
    def distributed(self) -> bool:
        """Whether other ranks share the run (collectives are real)."""
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """How many data-parallel groups the prompts split over (world_size without sequence parallelism)."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group: which share of the prompts it trains on (its sp group's)."""
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence-parallel group: which slice of each sequence it computes."""
        return self.rank % self.sp_size

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The ranks that share this rank's sequences (None without sequence parallelism)."""
        return None if self.sequence_mesh is None else self.sequence_mesh.get_group(SEQUENCE_PARALLEL)

    @property
    def is_main(self) -> bool:
        """Rank 0: it writes the run's files and the console's step lines, and holds the daemon's control."""
        return self.rank == 0

    def close(self) -> None:
        """Leave the process group (at exit; a no-op for a one-rank run), and collect the reference cycles that
        held sharded models (and through them the groups' tensors) while the interpreter is whole."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()

    # ------------------------------------------------------------------------------ collectives

    def sum(self, value: float) -> float:
        """`value` summed over the ranks."""
        return self._reduce([value], dist.ReduceOp.SUM)[0]

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks (a new tensor; autograd does not flow through it)."""
        if not self.distributed:
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def sum_tensor_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel groups, once per group: the S ranks of an sp group hold the
        same samples, so a sum over all ranks would count each S times."""
        if self.sequence_mesh is None:
            return self.sum_tensor(tensor)
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.sequence_mesh.get_group(DATA_PARALLEL))
        return total

    def broadcast_in_sequence_group(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The first rank of this rank's sp group's `tensors` (any shapes), on every rank of the group."""
        group = self.sp_group
        if group is None:
            return tensors
        box: list[Any] = [[tensor.cpu() for tensor in tensors]]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return [tensor.to(original.device) for tensor, original in zip(box[0], tensors, strict=True)]

    def max(self, value: int) -> int:
        return int(self._reduce([float(value)], dist.ReduceOp.MAX)[0])

    @property
    def count_agreement(self) -> Callable[[int], int] | None:
        """`max` where there are ranks to agree with (the token budget's micro-batch count, packing.plan_micro_batches);
        None on one rank."""
        return self.max if self.distributed else None

    def _reduce(self, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)  # on the CPU: gloo's side of the group
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def reduce_many(self, values: list[float], op: str) -> list[float]:
        """Each of `values` reduced over the ranks by `op` (sum, max or min), in one collective."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        return self._reduce(values, ops[op])

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def broadcast_from_main(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (the others' own values are ignored)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
