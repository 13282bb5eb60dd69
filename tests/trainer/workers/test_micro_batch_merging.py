"""fsdp_config.merge_micro_batches (issue 14): while a model's update streams layers from the CPU, a mini-batch runs
as one micro-batch, with the gradient of the configured micro-batches; a merged one that runs out of memory is split
and later ones hold at most what fitted (a configured one too); a model whose layers stay on the device keeps its
micro-batches."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.offload.test_offload import offloaded, policy
from tests.trainer.workers.test_oom_recovery import Loss, Memory, rollout_batch
from trainer.config import FSDPConfig
from trainer.workers.merging import MicroBatchMerging
from trainer.workers.optimization import run_updates

ALL_CPU = {"param_offload": True}
"""Every layer on the CPU: the update streams them."""
LAYERS_RESIDENT = {"offload_policy": {"embedding": "cpu"}}
"""An offloaded embedding, the layers on the device: nothing to merge for."""


class SizedLoss(Loss):
    """Loss, recording the sequences of each micro-batch it is called on."""

    def __init__(self, model, fail_on: int | None = None):
        super().__init__(model, fail_on)
        self.sizes: list[int] = []

    def __call__(self, batch):
        self.sizes.append(len(batch))
        return super().__call__(batch)


def update(settings: dict, merging: MicroBatchMerging | None, *, fail_on: int | None = None,
           max_token_len: int | None = None, steps: int = 1):
    torch.manual_seed(0)
    model = policy()
    engine = offloaded(model, settings)
    optimizer = engine.optimizer(lr=1e-2)
    loss = SizedLoss(model, fail_on)
    metrics = []
    for _ in range(steps):
        metrics.append(run_updates(model, optimizer, rollout_batch(), loss, mini_batch_size=4, micro_batch_size=2,
                                   epochs=1, grad_clip=1.0, shuffle_generator=None, memory=Memory(engine),
                                   max_token_len=max_token_len, merging=merging))
    engine.wait_for_updates()
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return metrics, weights, loss.sizes


def assert_same_step(metrics, weights, expected_metrics, expected_weights):
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    # One loss per mini-batch, the mini-batch's, however it was cut (mini_batch_metrics).
    assert len(metrics["loss"]) == 2
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=1e-5)
    # As in test_oom_recovery: the merged micro-batch sums the same gradients in another order, which Adam turns
    # into weight differences of a small fraction of the lr (1e-2); a dropped or doubled micro-batch moves a weight
    # by about the lr.
    torch.testing.assert_close(weights, expected_weights, rtol=1e-4, atol=1e-4)


def test_streamed_layers_merge_each_mini_batch_into_one_micro_batch_with_the_same_gradient():
    (expected,), expected_weights, configured = update(ALL_CPU, None)
    merging = MicroBatchMerging()
    (metrics,), weights, merged = update(ALL_CPU, merging)
    assert configured == [2, 2, 2, 2]
    assert merged == [4, 4]  # two mini-batches of 4, one micro-batch each
    assert_same_step(metrics, weights, expected, expected_weights)
    assert len(merging.news) == 1 and "micro-batches of 4 sequences instead of ppo_micro_batch_size_per_gpu 2" \
        in merging.news[0]


def test_a_token_budget_merges_up_to_the_mini_batch_tokens():
    rows = rollout_batch()
    per_sequence = int(rows.attention_mask[0].sum())
    (expected,), expected_weights, configured = update(ALL_CPU, None, max_token_len=2 * per_sequence)
    merging = MicroBatchMerging()
    (metrics,), weights, merged = update(ALL_CPU, merging, max_token_len=2 * per_sequence)
    assert configured == [2, 2, 2, 2] and merged == [4, 4]
    assert_same_step(metrics, weights, expected, expected_weights)
    assert "runs in one token budget of the whole mini-batch" in merging.news[0]
    # Said once: the mini-batches' tokens change from step to step, not what is done with them.
    shorter = rollout_batch()
    shorter.response_mask[:, -1] = 0
    assert merging.sizes(shorter, 2, 2 * per_sequence, streaming=True) == (2, 8 * per_sequence - 8)
    assert len(merging.news) == 1


@pytest.mark.parametrize("settings, merging", [(LAYERS_RESIDENT, MicroBatchMerging()),
                                               (ALL_CPU, MicroBatchMerging(enabled=False))],
                         ids=["layers_on_the_device", "merge_micro_batches_false"])
def test_micro_batches_stay_as_configured(settings, merging):
    _, _, sizes = update(settings, merging)
    assert sizes == [2, 2, 2, 2]
    assert merging.news == []


def test_a_merged_micro_batch_that_runs_out_of_memory_is_split_and_later_ones_hold_half():
    (expected,), expected_weights, _ = update(ALL_CPU, None)
    merging = MicroBatchMerging()
    # Call 1: the first merged micro-batch (4 sequences) fails half-way through its backward; nothing can be freed,
    # so the recovery splits it in two, and the second mini-batch runs in micro-batches of 2.
    (metrics,), weights, sizes = update(ALL_CPU, merging, fail_on=1)
    assert sizes == [4, 2, 2, 2, 2]
    assert metrics["oom_recoveries"] == [1.0]
    assert merging.sequences == 2
    assert_same_step(metrics, weights, expected, expected_weights)
    assert "they hold at most 2 sequences from now on" in merging.news[-1]


def test_a_configured_micro_batch_that_runs_out_of_memory_is_learned_once_not_every_mini_batch():
    """long3b on an H100 (2026-12-08): micro-batches of the configured size ran out of memory in every step, each
    error redoing the mini-batch's micro-batches with layers streamed (8 recoveries a step). The size that fitted
    after the split now holds for the later micro-batches and mini-batches, below the configured one."""
    (expected,), expected_weights, _ = update(LAYERS_RESIDENT, None)
    merging = MicroBatchMerging()
    # The first micro-batch (2 sequences, as configured) fails; split, its twin in the mini-batch is cut too, and
    # the second mini-batch starts at one sequence: one recovery in all.
    (metrics,), weights, sizes = update(LAYERS_RESIDENT, merging, fail_on=1)
    assert sizes == [2, 1, 1, 1, 1, 1, 1, 1, 1]
    assert metrics["oom_recoveries"] == [1.0]
    assert merging.sequences == 1
    assert "at most 1 sequences from now on (ppo_micro_batch_size_per_gpu 2)" in merging.news[-1]
    assert_same_step(metrics, weights, expected, expected_weights)


def test_the_planner_counts_the_merged_micro_batches_of_an_update():
    """_passes("training") weighs a layer kept on the device by them: an update of 64 sequences in mini-batches of
    32 streams its layers in 2 micro-batches, not the 8 that ppo_micro_batch_size_per_gpu 8 would make."""
    assert MicroBatchMerging(False).micro_batches(64, 32, 8) == 8
    merging = MicroBatchMerging()
    assert merging.micro_batches(64, 32, 8) == 2
    assert merging.micro_batches(20, 32, 8) == 1  # a batch smaller than a mini-batch is one
    merging.ran_out_of_memory(16, None, 8, None)  # after an error, 16 sequences fitted
    assert merging.micro_batches(64, 32, 8) == 4
    assert merging.micro_batches(64, 32, 48) == 4  # below the configured size too: 16 fitted


def test_the_setting_defaults_on():
    # Off on a frozen model is an error (test_config.py: test_optimizer_settings_of_a_frozen_model_are_errors).
    assert FSDPConfig().merge_micro_batches is True


def test_a_mini_batchs_metrics_weigh_each_micro_batch_by_its_share():
    from trainer.workers.optimization import mini_batch_metrics

    # A loss of -0.1 over 40 tokens and 0.06 over 60: the mini-batch's token-mean is -0.004, not their mean -0.02.
    assert mini_batch_metrics([({"pg_loss": -0.1}, 0.4), ({"pg_loss": 0.06}, 0.6)])["pg_loss"] == \
        [pytest.approx(-0.004)]
    # On several ranks a rank's shares are of the global weight over the world size: its part of the global value,
    # which the mean over the ranks completes (test_ranks.py checks 2 ranks against 1 through verl train).
    assert mini_batch_metrics([({"pg_loss": 1.0}, 0.1), ({"pg_loss": 3.0}, 0.1)])["pg_loss"] == [pytest.approx(0.4)]
    assert mini_batch_metrics([({"pg_loss": 1.0}, 0.0)])["pg_loss"] == [0.0]  # no response tokens at all
