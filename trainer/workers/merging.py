"""The micro-batches of an update whose layers stream from the CPU: fewer, larger ones (fsdp_config.
merge_micro_batches), and the size an out-of-memory error taught (optimization.run_updates applies both)."""

from __future__ import annotations

import math

from trainer.config import FSDP_CONFIG
from trainer.rollout.batch import RolloutBatch


class MicroBatchMerging:
    """One model's micro-batches while its update streams layers (fsdp_config.merge_micro_batches, issue 14).

    A micro-batch's forward and backward copy every streamed layer to the device twice and send its gradients
    to the host once, where a later micro-batch's are added to the earlier ones' on the host's cores: the cost
    is paid per micro-batch, while the compute is the same in fewer, larger ones. With gradient checkpointing
    a larger micro-batch needs little more memory (the 7B GRPO headline's update learned 3.6 GiB of working
    memory at 8 sequences and 3.8 GiB at 32, in one). So while the layers stream, a mini-batch runs as one
    micro-batch; the gradient is the same (accumulate_gradients weighs each micro-batch by its share). One that
    runs out of memory is split by the recovery as any other, and from then on micro-batches hold at most as many
    sequences as fitted after the split (or half the failed token budget), fewer than configured too.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.sequences: int | None = None
        """The most sequences a merged micro-batch may hold (None: the whole mini-batch)."""
        self.tokens: int | None = None
        """The largest token budget of merged micro-batches by token budget (None: the whole mini-batch's)."""
        self.news: list[str] = []
        """What changed, for the run's log (the training loop takes it): the first merge, a limit after an error."""
        self._announced = False

    def sizes(self, mini_batch: RolloutBatch, micro_batch_size: int, max_token_len: int | None,
              streaming: bool) -> tuple[int, int | None]:
        """(micro-batch size, token budget) for `mini_batch`: the configured ones, or merged while `streaming`."""
        if not (self.enabled and streaming):  # a limit learned from an error holds here too
            return (min(micro_batch_size, self.sequences or micro_batch_size),
                    None if max_token_len is None else min(max_token_len, self.tokens or max_token_len))
        if max_token_len is None:
            most = max(micro_batch_size, len(mini_batch))
            merged: tuple[int, int | None] = (min(most, self.sequences or most), None)
            what = (f"micro-batches of {merged[0]} sequences instead of ppo_micro_batch_size_per_gpu "
                    f"{micro_batch_size}")
        else:
            tokens = int(mini_batch.attention_mask.sum())
            most = max(max_token_len, tokens)
            merged = (micro_batch_size, min(most, self.tokens or most))
            what = f"one token budget of the whole mini-batch instead of ppo_max_token_len_per_gpu {max_token_len}"
        # Said once (a mini-batch's tokens change every step); a new limit is said where it is set.
        larger = merged[0] > micro_batch_size or (merged[1] or 0) > (max_token_len or 0)
        if larger and not self._announced:
            self._announced = True
            self.news.append(f"the update streams layers from the CPU, so a mini-batch of {len(mini_batch)} "
                             f"sequences runs in {what} (the same gradient; {FSDP_CONFIG.merge_micro_batches})")
        return merged

    def micro_batches(self, size: int, mini_batch_size: int, micro_batch_size: int) -> int:
        """How many micro-batches an update of `size` sequences runs in while it streams layers: merged ones where
        merging is on (within its limit after an error), the configured ones otherwise. What the phase planner
        weighs a layer kept on the device by (token budgets are counted as the sequences they hold)."""
        mini_batch = max(1, min(mini_batch_size, size))
        per = max(micro_batch_size, mini_batch) if self.enabled else micro_batch_size
        per = min(per, self.sequences or per)  # a limit learned from an error
        return math.ceil(size / mini_batch) * math.ceil(mini_batch / max(1, per))

    def ran_out_of_memory(self, fitting: int, budget: int | None, micro_batch_size: int,
                          max_token_len: int | None) -> None:
        """A mini-batch's micro-batches ran out of memory and were split until `fitting` sequences fit (or, by token
        budget, of `budget` tokens): later mini-batches start there, below the configured size too (each error
        redoes the mini-batch's micro-batches: one learned once, not every step)."""
        if budget is None or max_token_len is None:
            self.sequences = fitting if self.sequences is None else min(self.sequences, fitting)
            limit, configured = f"{self.sequences} sequences", f"ppo_micro_batch_size_per_gpu {micro_batch_size}"
        else:
            self.tokens = max(1, budget // 2)
            limit, configured = f"{self.tokens} tokens", f"ppo_max_token_len_per_gpu {max_token_len}"
        self.news.append(f"micro-batches ran out of device memory: they hold at most {limit} from now on "
                         f"({configured})")
