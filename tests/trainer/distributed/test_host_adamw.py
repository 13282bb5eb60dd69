"""HostAdamW: torch.optim.AdamW's update with the moments and their arithmetic on the CPU (optimizer_offload on
several ranks). Its sharded use is in test_sharding.py (2 ranks) and test_ranks.py (through verl train)."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.distributed.host_adamw import HostAdamW

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")


def steps(optimizer_class, device: str, **settings) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Five steps on three parameters, the learning rate falling, the second one without a gradient at step 3."""
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.randn(shape, generator=generator).to(device).requires_grad_()
                  for shape in ((7, 5), (5,), (3, 2, 4))]
    optimizer = optimizer_class(parameters, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, **settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    for step in range(5):
        for index, parameter in enumerate(parameters):
            skipped = step == 3 and index == 1
            parameter.grad = None if skipped else torch.randn(parameter.shape, generator=generator).to(device)
        optimizer.step()
        scheduler.step()
    return parameters, optimizer


def test_five_steps_equal_torchs_adamw_with_weight_decay_a_schedule_and_a_missing_gradient():
    expected, adamw = steps(torch.optim.AdamW, "cpu", eps=1e-8)
    actual, host = steps(HostAdamW, "cpu", eps=1e-8)
    for mine, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    # The same states under the same keys: checkpoints read them as AdamW's.
    for parameter, reference in zip(actual, expected, strict=True):
        state, expected_state = host.state[parameter], adamw.state[reference]
        assert set(state) == set(expected_state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == float(expected_state["step"])
        torch.testing.assert_close(state["exp_avg_sq"], expected_state["exp_avg_sq"])
    assert float(host.state[actual[1]]["step"]) == 4  # the step without a gradient left it alone
    # The check can fail: the parameters moved by far more than the tolerance.
    start = torch.randn((7, 5), generator=torch.Generator().manual_seed(0))
    assert (actual[0].detach() - start).abs().max() > 1e-3


def test_a_state_dict_round_trip_resumes_the_same_steps():
    parameters, optimizer = steps(HostAdamW, "cpu")
    saved = copy.deepcopy(optimizer.state_dict())  # (a state dict holds the optimizer's own tensors)
    copies = [parameter.detach().clone().requires_grad_() for parameter in parameters]
    resumed = HostAdamW(copies, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    resumed.load_state_dict(saved)
    for optimizer_, tensors in ((optimizer, parameters), (resumed, copies)):
        for tensor in tensors:
            tensor.grad = torch.ones_like(tensor)
        optimizer_.step()
    for mine, theirs in zip(copies, parameters, strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("grad_dtype", "update"), [(torch.float32, "cpu"), (torch.bfloat16, "cpu"),
                                                    (torch.float32, "gpu"), (torch.float32, "both")],
                         ids=["fp32", "bf16", "on_the_device", "split"])
def test_on_a_gpu_the_parameters_stay_there_and_the_moments_live_on_the_cpu(grad_dtype, update, monkeypatch):
    """The host's update (its gradients down in fp32 or bf16), the device's (optimizer_update gpu: the moments
    streamed up and back in slices of 8 elements through a ring of 2 buffers here, so that the ring turns within a
    parameter and across them) and the two at once (both: the split learns from the steps' timings)."""
    from trainer.distributed import host_adamw

    monkeypatch.setattr(host_adamw, "DEVICE_SLICE_ELEMENTS", 8)
    monkeypatch.setattr(host_adamw, "DEVICE_RING", 2)
    expected, _ = steps(torch.optim.AdamW if grad_dtype == torch.float32 else RoundedAdamW, "cuda")
    actual, host = steps(HostAdamW, "cuda", grad_dtype=grad_dtype, update=update)
    host.publish()  # (the moments' last copies back)
    for mine, theirs in zip(actual, expected, strict=True):
        assert mine.device.type == "cuda"
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    devices = {value.device.type for state in host.state.values() for key, value in state.items() if key != "step"}
    assert devices == {"cpu"}
    assert all(buffer.is_pinned() for buffer in host._buffers.values())
    if update != "cpu":
        assert all(state["exp_avg"].is_pinned() for state in host.state.values())
    if update == "gpu":
        assert not host._buffers
    if update == "both":
        assert host.split is not None and host.split.measured == {"device", "host"}


def test_each_step_counts_a_gradient_copy_down_and_an_update_up_per_parameter_by_group_for_the_offload_report():
    from trainer.offload import offload_message

    parameters = [torch.zeros(4, 3, requires_grad=True), torch.zeros(5, requires_grad=True)]
    optimizer = HostAdamW(parameters, lr=1e-2, groups={id(parameters[0]): "transformer"})
    for _ in range(2):
        for parameter in parameters:
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
    message = offload_message([], with_summary=False, logs=[optimizer.copies])
    counts = {(row.direction, row.group): (row.copies, row.bytes) for row in message.counts}
    assert counts == {("d2h", "transformer"): (2, 2 * 48), ("h2d", "transformer"): (2, 2 * 48),
                      ("d2h", "other"): (2, 2 * 20), ("h2d", "other"): (2, 2 * 20)}
    assert message.copies and all(copy.seconds >= 0 for copy in message.copies)  # timed on the host's clock here
    assert offload_message([], with_summary=False, logs=[optimizer.copies]).counts == []  # drained


def test_a_delayed_step_leaves_the_weights_until_it_is_published_and_then_equals_the_immediate_one():
    """fsdp_config.delayed_update on several ranks: step() returns with the update still being computed on the host
    (a thread of its own); the weights change only at publish(), or at the next step() or state_dict(), to what the
    immediate step gives, at the learning rate of the step (the scheduler has moved on by then)."""
    immediate, _ = steps(HostAdamW, "cpu")
    delayed, optimizer = steps(HostAdamW, "cpu", delayed=True)
    assert optimizer.pending  # the fifth step's update
    before = [parameter.detach().clone() for parameter in delayed]
    for parameter, unchanged in zip(delayed, before, strict=True):
        assert torch.equal(parameter, unchanged)
    optimizer.state_dict()  # a checkpoint's read publishes it first
    assert not optimizer.pending
    assert any(not torch.equal(parameter, unchanged) for parameter, unchanged in zip(delayed, before, strict=True))
    for mine, theirs in zip(delayed, immediate, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    optimizer.publish()  # nothing pending: nothing happens
    for mine, theirs in zip(delayed, immediate, strict=True):
        assert torch.equal(mine, theirs)


class RoundedAdamW(torch.optim.AdamW):
    """torch's AdamW of each gradient rounded to bf16 first: what HostAdamW(grad_dtype=bf16) computes."""

    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.grad = parameter.grad.bfloat16().float()
        return super().step(closure)


def test_bf16_gradients_go_down_at_half_the_bytes_and_update_as_adamw_of_the_rounded_gradient(monkeypatch):
    """offload_grad_dtype bf16 on several ranks: each gradient shard goes down in bf16 (half the bytes, counted so
    for the offload report) into the first half of its fp32 buffer, and is widened in place a slice at a time on the
    host (slices of 8 elements here, so a parameter spans several, and the first slice's bytes lie under its own
    widening): the update is AdamW's of the gradient rounded to bf16, and differs from the fp32 one."""
    from trainer.distributed import host_adamw

    monkeypatch.setattr(host_adamw, "UPDATE_SLICE_ELEMENTS", 8)
    expected, _ = steps(RoundedAdamW, "cpu")
    actual, host = steps(HostAdamW, "cpu", grad_dtype=torch.bfloat16)
    for mine, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    exact, _ = steps(torch.optim.AdamW, "cpu")
    assert max((mine - theirs).abs().max().item() for mine, theirs in zip(actual, exact, strict=True)) > 1e-6
    assert all(buffer.dtype == torch.float32 for buffer in host._buffers.values())  # no host buffer beside them
    assert host.copies is not None
    down = {row["group"]: row for row in host.copies.drain_counts() if row["direction"] == "d2h"}
    assert down["other"]["bytes"] == 2 * sum(parameter.numel() for parameter in actual) * 5 - 2 * 5  # (one skipped)
    with pytest.raises(ValueError, match="grad_dtype must be torch.float32 or torch.bfloat16"):
        HostAdamW(actual, lr=1e-2, grad_dtype=torch.float16)


@pytest.mark.parametrize("update", ["gpu", "both"])
def test_the_update_where_the_shards_are_or_split_with_the_host_equals_torchs_adamw(update):
    """optimizer_update gpu on several ranks: the update runs on each shard's device over AdamW's host moments (on a
    CPU, in place), no host buffer; both: each step splits the parameters between that and the host's arithmetic by
    each path's seconds per element, learned from the steps before. The same steps and states as torch's AdamW."""
    expected, adamw = steps(torch.optim.AdamW, "cpu")
    actual, host = steps(HostAdamW, "cpu", update=update)
    for mine, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    for parameter, reference in zip(actual, expected, strict=True):
        assert float(host.state[parameter]["step"]) == float(adamw.state[reference]["step"])
        torch.testing.assert_close(host.state[parameter]["exp_avg"], adamw.state[reference]["exp_avg"])
    if update == "gpu":
        assert not host._buffers and host.split is None
    else:
        assert host.split is not None and host.split.measured  # it learned from the steps' timings
    with pytest.raises(ValueError, match="update must be cpu, gpu or both"):
        HostAdamW(actual, lr=1e-2, update="auto")


def test_a_split_update_whose_host_share_runs_in_the_background_is_torchs_adamw_once_published():
    """The critic's HostAdamW on several ranks with optimizer_update both: the device's share changes the shards at
    once, the host's runs in a thread of its own and lands at `publish` (the next values, the next step); published,
    the same as torch's AdamW, and the split learned the host's seconds from that thread."""
    expected, _ = steps(torch.optim.AdamW, "cpu")
    actual, host = steps(HostAdamW, "cpu", update="both", delayed=True)
    host.publish()
    for mine, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert host.split is not None and "host" in host.split.measured


def test_a_split_update_sends_each_parameter_down_the_path_the_split_assigns_it():
    """both: a parameter the split gives the host is updated from its gradient sent down (it has a host buffer), one
    it gives the device is not; the step the host would end last goes to the device."""
    from trainer.offload.update_split import UpdateSplit

    parameters = [torch.zeros(100, requires_grad=True), torch.zeros(10, requires_grad=True)]
    optimizer = HostAdamW(parameters, lr=1e-2, update="both")
    optimizer.split = UpdateSplit({"device": 1e-9, "host": 1e-9})  # equal speeds: 100 to the device, 10 to the host
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    assert set(optimizer._buffers) == {parameters[1]}
    assert optimizer.split.last_assignment == ["device", "host"]
    assert all(float(optimizer.state[parameter]["step"]) == 1 for parameter in parameters)


def test_a_delayed_split_learns_its_window_from_the_step_to_the_publish_and_gives_the_host_what_fits_in_it():
    """Delayed with both: the window runs from a step to the publish that needs it (a read of the weights as
    updated), here 0.3 s; the next step's split then gives the host every parameter it ends within 0.75 of that,
    where the balanced split (equal speeds) would give the device the larger one."""
    import time

    from trainer.offload.update_split import UpdateSplit

    parameters = [torch.zeros(100, requires_grad=True), torch.zeros(10, requires_grad=True)]
    optimizer = HostAdamW(parameters, lr=1e-2, update="both", delayed=True)
    optimizer.split = UpdateSplit({"device": 1e-4, "host": 1e-4})  # 10 ms and 1 ms by the estimates
    optimizer.split.learn = lambda timings: None  # this machine's timings would move the estimates
    for step in range(2):
        for parameter in parameters:
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        assert optimizer.split.last_assignment == (["device", "host"] if step == 0 else ["host", "host"])
        time.sleep(0.3)
        optimizer.publish()
        assert optimizer.split.window is not None and 0.3 <= optimizer.split.window < 2
    assert all(float(optimizer.state[parameter]["step"]) == 2 for parameter in parameters)
