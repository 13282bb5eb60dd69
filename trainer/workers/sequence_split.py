"""The workers' forwards on sequence shards: Ulysses sequence parallelism (trainer/distributed/ulysses.py) in
the actor's, reference's and critic's log-prob, value and update passes.

The S ranks of a sequence-parallel group hold the same micro-batch (the data is split over the data-parallel
groups only). Each rank pads the [B, T] sequences on the right to a multiple of S, takes its [B, T/S] slice
of the positions, and runs the model on it with `ulysses_sdpa` attention: the embedding, the MLPs, the norms
and the head see the local positions only, and attention sees the whole sequence for 1/S of the heads. What
comes out of the head stays local: log-probs, entropies and values are computed on each shard, and only those
[B, T/S] figures are gathered along the sequence, never the [B, T, V] logits. The gathered [B, T] tensors are
cut to the response positions, as the padded forward's `response_logits` cuts its logits.

With use_remove_padding (verl runs Ulysses on its padding-free forward only, so its configs set both), the real
tokens of the micro-batch's sequences are first packed into one [1, N] row, each sequence's position ids from 0
(packing.PackedRow), and that row is split: attention keeps the packed sequences apart with the block-diagonal
mask transformers builds from the gathered position ids, and the gathered [1, N] figures are picked at the
positions that predict response tokens, as the one-rank padding-free forward picks its logits.

A vision-language model (Qwen2-VL, Qwen2.5-VL) is split at its decoder's entry instead, as verl splits it: every
rank runs the vision tower on the micro-batch's images and merges them into the whole sequence's embeddings, the
multimodal RoPE positions ([3, B, T]) are computed once beforehand from the tokens and image grids (the model's
get_rope_index, `multimodal_position_ids`), and the decoder's embeddings and positions are cut to the rank's
positions there. Its forwards are padded (the sequences' images and positions are placed per padded row), as one
rank's are, whatever use_remove_padding says.

Every rank of the group then computes the same loss; the gathers' backward sums their gradients back onto
each rank's positions, so FSDP2's average over all ranks is one rank's gradient of the whole sequence (see
ulysses.py). The rollout does not go through here: generation runs whole sequences on every rank.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from trainer.algorithms import log_probs_and_entropy_from_logits, scaled_logits, sum_pi_squared_from_logits
from trainer.algorithms.functional import EAGER_KERNELS, ChunkKernels
from trainer.config import KEYS
from trainer.distributed.ranks import Ranks
from trainer.distributed.ulysses import SequenceParallel, SequenceShard, use_ulysses_attention
from trainer.errors import RunSetupError
from trainer.models.vision_language import image_inputs, is_vision_language, multimodal_position_ids, rope_index_owner
from trainer.rollout.batch import RolloutBatch
from trainer.workers.packing import PackedRow


class SequenceSplit:
    """One rank's side of its sequence-parallel group for the workers' forwards."""

    def __init__(self, parallel: SequenceParallel, pad_token_id: int, *, remove_padding: bool = False):
        self.parallel = parallel
        self.pad_token_id = pad_token_id
        self.remove_padding = remove_padding

    @classmethod
    def of(cls, ranks: Ranks, pad_token_id: int, *, remove_padding: bool = False) -> SequenceSplit | None:
        """The split of `ranks`' sp group; None without sequence parallelism (the padded forward runs). With
        `remove_padding` it splits each micro-batch's padding-free row."""
        if ranks.sequence_mesh is None:
            return None
        return cls(SequenceParallel.from_mesh(ranks.sequence_mesh), pad_token_id, remove_padding=remove_padding)

    @staticmethod
    def prepare(model: PreTrainedModel,
                setting: str = KEYS.actor_rollout_ref.actor.ulysses_sequence_parallel_size) -> str:
        """Switch `model` to Ulysses attention (generation without sharded inputs runs it as plain SDPA). A model
        whose directory asks for another attention than SDPA cannot (the config check sees override_config only):
        one line naming `setting`, the model's degree."""
        try:
            return use_ulysses_attention(model)
        except ValueError as error:
            raise RunSetupError(f"{setting}: {error}; set override_config.attn_implementation=sdpa for the model, "
                                "or the degree 1") from None

    @staticmethod
    def check_splittable(model: PreTrainedModel, setting: str, degree: int) -> None:
        """Refuse, in one line naming `setting` (the model's degree, `degree`), a vision-language model whose
        sequences cannot be split before its decoder: one without the multimodal positions of the whole sequence
        (get_rope_index) and a decoder (language_model) to split at."""
        if is_vision_language(model) and rope_index_owner(model) is None:
            raise RunSetupError(f"{setting}: {degree}, but {type(model).__name__} is a vision-language model without "
                                "a get_rope_index and a language_model to split its sequences at (Ulysses splits "
                                "Qwen2-VL's and Qwen2.5-VL's); allowed: 1 for this model")

    def log_probs_and_entropy(self, model: PreTrainedModel, batch: RolloutBatch, temperature: float, *,
                              entropy: bool, entropy_graph: bool = False,
                              kernels: ChunkKernels = EAGER_KERNELS) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, R] log-probs of the responses at `temperature` and, with `entropy`, [B, R] entropies of the
        policy at each response position (with their autograd graph only when `entropy_graph`; `kernels`: the
        chunk functions, compiled ones with actor.use_torch_compile)."""
        logits, shard, row = self._forward(model, batch)
        if not entropy:
            return self._responses(shard.log_probs(scaled_logits(logits, temperature)), batch, row), None
        # Chunk by chunk in float32, keeping the logits as the model gave them (as one rank's update does).
        local_log_probs, local_entropies = log_probs_and_entropy_from_logits(logits, shard.labels, temperature,
                                                                             entropy_graph=entropy_graph,
                                                                             kernels=kernels)
        return (self._responses(shard.gather(local_log_probs), batch, row),
                self._responses(shard.gather(local_entropies), batch, row))

    def log_probs_and_sum_pi_squared(self, model: PreTrainedModel, batch: RolloutBatch,
                                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] log-probs of the responses at `temperature` and the policy's sum of squared probabilities at each
        response position, each computed on this rank's positions and gathered (never the logits)."""
        logits, shard, row = self._forward(model, batch)
        squares = sum_pi_squared_from_logits(logits, temperature)
        log_probs = shard.log_probs(scaled_logits(logits, temperature))
        return self._responses(log_probs, batch, row), self._responses(shard.gather(squares), batch, row)

    def values(self, model: PreTrainedModel, batch: RolloutBatch) -> torch.Tensor:
        """[B, R] a value model's one output at the position before each response token."""
        outputs, shard, row = self._forward(model, batch)
        return self._responses(shard.gather(outputs.squeeze(-1)), batch, row)

    def _forward(self, model: PreTrainedModel,
                 batch: RolloutBatch) -> tuple[torch.Tensor, SequenceShard, PackedRow | None]:
        """The model's output on this rank's positions ([B, T/S, ...], or [1, N/S, ...] of the padding-free row),
        the shard that gathers it, and the row's layout when padding-free."""
        if batch.multi_modal_inputs is not None:
            return self._vision_forward(model, batch)
        if self.remove_padding:
            row = PackedRow.of(batch)
            shard = self.parallel.shard(model, input_ids=row.pack(batch.input_ids), attention_mask=None,
                                        position_ids=row.pack(batch.position_ids), pad_token_id=self.pad_token_id)
        else:
            row = None
            shard = self.parallel.shard(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                        position_ids=batch.position_ids, pad_token_id=self.pad_token_id)
        return shard.forward(model).logits, shard, row

    def _vision_forward(self, model: PreTrainedModel,
                        batch: RolloutBatch) -> tuple[torch.Tensor, SequenceShard, None]:
        """A vision-language model's padded forward, split at its decoder: the whole sequence's embeddings (the
        images' merged in) and multimodal positions are cut there, so its output is this rank's [B, T/S, ...]."""
        owner = rope_index_owner(model)
        assert owner is not None, "check_splittable refuses a vision-language model without get_rope_index"
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        images = image_inputs(batch.multi_modal_inputs or [], input_ids.device)
        shard = self.parallel.shard(model, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=multimodal_position_ids(model, input_ids, attention_mask, images),
                                    pad_token_id=self.pad_token_id, decoder=owner.language_model)
        return shard.forward(model, **images).logits, shard, None

    @staticmethod
    def _responses(per_position: torch.Tensor, batch: RolloutBatch, row: PackedRow | None) -> torch.Tensor:
        """[B, T] figures of each position -> [B, R] those of the positions that predict the response tokens
        (position t predicts token t + 1: the last prompt position predicts the first response token); from a
        padding-free row's [1, N], those of its kept positions, zeros where the response is padding."""
        if row is not None:
            return row.unpack(per_position[0, row.keep])
        start = batch.prompt_ids.shape[1] - 1
        return per_position[:, start:start + batch.response_ids.shape[1]]
