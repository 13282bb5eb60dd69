"""One mechanism puts a model's weights where a phase of the step reads them.

A phase is a rollout (decoding, no gradients), a scoring (log-probs, values or rewards, no gradients) or a training
(an update). For each one `Staging` does, in this order:

1. the memory manager places the run's models for the phase (memory.placed_for): the running model's dynamically
   offloaded layers and the others' as the phase planner decides, its CPU-resident head and embedding kept on the
   GPU within the room below the live threshold, a rollout reading the weights from before a delayed update;
2. a scoring reads the weights as updated: a sharded model's HostAdamW update still computed in the background
   (delayed_update, the critic's) is published first;
3. on several ranks, a phase without gradients has each rank hold the sharded model's whole weights where they fit,
   gathered once, not at every forward (sharding.whole_weights); a rollout then runs the plain modules' forwards,
   FSDP2's hooks off (sharding.plain_forwards), so that a rank decodes alone and in CUDA graphs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Literal

from trainer.build import Models
from trainer.config import RunConfig
from trainer.config.messages import Role
from trainer.distributed.ranks import Ranks
from trainer.distributed.sharding import WHOLE_WEIGHTS_SHARE, plain_forwards, whole_weights
from trainer.memory import MemoryManager
from trainer.offload import format_bytes
from trainer.workers.optimization import publish_pending

StagedPhase = Literal["rollout", "scoring", "training"]


class Staging:
    """Puts a model's weights where a phase reads them, and says how often the phase reads them."""

    def __init__(self, config: RunConfig, memory: MemoryManager, models: Models, ranks: Ranks,
                 log: Callable[[str], None]):
        self.config = config
        self.memory = memory
        self.models = models
        self.ranks = ranks
        self.log = log
        self._whole_said: dict[str, bool] = {}  # several ranks: each model's last whole-weights decision

    @contextlib.contextmanager
    def __call__(self, phase: StagedPhase, role: Role, size: int) -> Iterator[bool]:
        """Run `phase` of the model placed as `role` over `size` sequences with its weights staged. Yields whether
        this rank's forwards need no other rank's (several ranks: the whole weights held, and for a rollout FSDP2's
        hooks off); False on one rank, and for a training phase."""
        with self.memory.placed_for(phase, role, self.passes(phase, role, size)):
            if phase == "training":
                yield False
                return
            if phase == "scoring":
                publish_pending(self.models.optimizer_of(role))
            with self._whole_weights(role) as whole:
                if phase != "rollout" or not whole:
                    yield whole
                    return
                with plain_forwards(self.models.sharded[role].model) as plain:
                    yield plain

    def publish_updates(self) -> None:
        """Every delayed update (fsdp_config.delayed_update) applied, waiting for the host's arithmetic: a sharded
        model's (HostAdamW) and one rank's engine's. Before a checkpoint and validation, so that the run after a
        checkpoint samples as one resumed from it does (elsewhere each of an engine's units publishes at its first
        read, while the later ones still update)."""
        for role in (Role.ACTOR, Role.CRITIC):
            publish_pending(self.models.optimizer_of(role))
            engine = self.memory.engine(role)
            if engine is not None:
                engine.publish_updates()

    def passes(self, phase: StagedPhase, role: Role, size: int) -> int:
        """How many times `phase` runs each layer of the model placed as `role` over `size` sequences: the tokens a
        rollout decodes, a scoring's micro-batches, an update's forward and backward passes. What a layer kept on
        the GPU for the phase saves in copies (the memory manager's phase plans weigh it)."""
        config, models = self.config, self.models
        if phase == "rollout":
            return config.data.max_response_length
        if phase == "training":
            worker = models.critic if role == Role.CRITIC else models.actor
            assert worker is not None
            return 2 * worker.config.ppo_epochs * worker.update_micro_batches(size)
        # The micro-batches each scoring runs in (the workers' own sizes where they keep them).
        micro_batch = {Role.ACTOR: models.actor.log_prob_micro_batch_size,
                       Role.REF: config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                       Role.CRITIC: models.critic.forward_micro_batch_size if models.critic is not None else size,
                       Role.REWARD: config.reward_model.micro_batch_size_per_gpu}[role]
        return math.ceil(size / max(1, micro_batch))

    @contextlib.contextmanager
    def _whole_weights(self, role: str) -> Iterator[bool]:
        """Several ranks: the sharded model's whole weights on every rank where they fit (sharding.whole_weights);
        the decision is said when it changes. Yields whether they are held; one rank: nothing (False)."""
        sharded = self.models.sharded.get(role)
        if sharded is None:
            yield False
            return
        with whole_weights(sharded, self.ranks) as whole:
            if whole != self._whole_said.get(role):
                self._whole_said[role] = whole
                size = format_bytes(sharded.whole_bytes)
                self.log(f"{role}: every rank holds the whole weights ({size}) for the forwards without gradients "
                         "(rollout, scoring): one gather of each unit a phase, not one a forward" if whole else
                         f"{role}: the whole weights ({size}) take more than {WHOLE_WEIGHTS_SHARE:.0%} of some rank's "
                         "free device memory: each forward without gradients gathers every unit's shards")
            yield whole
