"""The frozen reference policy: the log-probs the KL terms compare the actor with."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import PreTrainedModel

from trainer.config.messages import Role
from trainer.config.schema import RefConfig
from trainer.distributed.ranks import Ranks
from trainer.rollout.batch import RolloutBatch
from trainer.workers.actor import compute_log_probs
from trainer.workers.recovery import WorkerMemory
from trainer.workers.sequence_split import SequenceSplit


class Reference:
    """The reference policy: a model of its own, or with LoRA the actor's with its adapter disabled (the frozen
    base weights, as verl does: no second copy of the weights)."""

    def __init__(self, model: PreTrainedModel, config: RefConfig, *, temperature: float, remove_padding: bool,
                 memory: WorkerMemory | None, sequence_split: SequenceSplit | None, ranks: Ranks | None,
                 adapter: Any = None, fused_head: bool = False):
        self.model = model
        self.config = config
        self.temperature = temperature
        self.remove_padding = remove_padding
        self.memory = memory
        self.sequence_split = sequence_split  # the actor's degree: the reference runs with it
        self.ranks = ranks
        self.adapter = adapter  # LoRA: peft's wrapper of the actor, whose adapter is disabled while scoring
        # The model placed as which role: its own, or the actor's (whose weights the memory manager stages).
        self.role = Role.REF if adapter is None else Role.ACTOR
        self.fused_head = fused_head  # model.use_fused_kernels, where the model can: log-probs never from the logits

    def compute_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, R] log-probs of the responses under the reference policy, at the sampling temperature."""
        config = self.config
        adapter_off = self.adapter.disable_adapter() if self.adapter is not None else contextlib.nullcontext()
        with adapter_off:
            return compute_log_probs(self.model, batch, micro_batch_size=config.log_prob_micro_batch_size_per_gpu,
                                     temperature=self.temperature, memory=self.memory,
                                     sequence_split=self.sequence_split, remove_padding=self.remove_padding,
                                     max_token_len=config.log_prob_max_token_len_per_gpu
                                     if config.log_prob_use_dynamic_bsz else None, ranks=self.ranks,
                                     fused_head=self.fused_head)
