"""The trainer<->daemon messages (trainer/config/messages.py, trainer/config/ipc.py): every type goes
through a line and back unchanged, the JSON keeps the protocol's field names, NaN goes out as null, and
a bad line is refused with a message that says what is wrong with it."""

from __future__ import annotations

import json
import math
import re
from typing import get_args

import pytest
from pydantic import BaseModel

from tests.support import REPO
from trainer.config.ipc import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ProtocolError, decode_down, decode_up, encode
from trainer.config.live import LiveSettings
from trainer.config.messages import (
    CheckpointMessage,
    CheckpointNowMessage,
    CopyCount,
    CopySample,
    DownMessage,
    DroppedMessage,
    HeartbeatMessage,
    HelloMessage,
    LogMessage,
    OffloadMessage,
    OffloadSummaryRow,
    Phase,
    PhaseMessage,
    PhasePlanRow,
    RankReport,
    RanksMessage,
    SettingsAckMessage,
    SettingsMessage,
    StepMessage,
    StopMessage,
    UpMessage,
    to_json,
)

SETTINGS = LiveSettings(gpu_memory_threshold=0.7, dynamic_offload_enabled=True)
UP = [
    HelloMessage(protocol=PROTOCOL_VERSION, token="t0ken", pid=4243, rank=0, run_dir="runs/x", start_step=3,
                 total_steps=10),
    StepMessage(step=4, metrics={"actor/pg_loss": -0.25, "timing_s/gen": 1.5, "val-core/x/reward/mean@1": None},
                time=1_800_000_000.5),
    PhaseMessage(step=5, phase=Phase.UPDATE_ACTOR, time=1.0),
    OffloadMessage(copies=[CopySample(direction="h2d", group="transformer", bytes=1 << 20, seconds=0.0004)],
                   counts=[CopyCount(direction="d2h", group="lm_head", copies=12, bytes=12 << 20)],
                   summary=[OffloadSummaryRow(role="critic", group="embedding", placement="cpu", device="cpu",
                                                     bytes=1 << 30)],
                   time=2.0),
    OffloadMessage(copies=[], counts=[], time=2.5),
    OffloadMessage(copies=[], counts=[], plans=[
        PhasePlanRow(phase="rollout/actor", layers_on_gpu={"actor": 36, "critic": 0}, working_bytes=None,
                     threshold=0.9),
        PhasePlanRow(phase="training/critic", layers_on_gpu={"actor": 0, "critic": 15}, working_bytes=5 << 30,
                     threshold=0.9)], time=2.75),
    LogMessage(level="warning", message="dynamic offload: 2 layers to CPU", time=3.0),
    SettingsAckMessage(version=2, step=6, values=SETTINGS, time=4.0),
    CheckpointMessage(step=6, path="runs/x/checkpoints/global_step_6", time=5.0),
    DroppedMessage(count=17, time=6.0),
    HeartbeatMessage(step=7, time=7.0),
    RanksMessage(step=7, ranks=[RankReport(rank=0, local_rank=0, node_rank=0, step=7, gpu_memory_bytes=3 << 30,
                                           copy_latency_mean_s=0.0021),
                                RankReport(rank=1, local_rank=0, node_rank=1, step=7, gpu_memory_bytes=None)],
                 time=8.0),
]
DOWN = [SettingsMessage(version=2, values=SETTINGS), CheckpointNowMessage(), StopMessage()]


def union_members(union: object) -> set[type]:
    members, _discriminator = get_args(union)
    return set(get_args(members))


def test_the_examples_cover_every_message_type() -> None:
    assert {type(message) for message in UP} == union_members(UpMessage)
    assert {type(message) for message in DOWN} == union_members(DownMessage)


@pytest.mark.parametrize("message", UP, ids=lambda message: message.type)
def test_every_up_message_comes_back_from_its_line_unchanged(message: BaseModel) -> None:
    line = encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_up(line) == message


@pytest.mark.parametrize("message", DOWN, ids=lambda message: message.type)
def test_every_down_message_comes_back_from_its_line_unchanged(message: BaseModel) -> None:
    assert decode_down(encode(message)) == message


def test_the_json_keeps_the_protocols_field_names() -> None:
    """Version 1 of the protocol as the dict-built messages wrote it: same keys, settings by public name."""
    assert json.loads(encode(UP[1])) == {"type": "step", "step": 4, "time": 1_800_000_000.5, "metrics": {
        "actor/pg_loss": -0.25, "timing_s/gen": 1.5, "val-core/x/reward/mean@1": None}}
    assert json.loads(encode(UP[3]))["copies"] == [{"direction": "h2d", "group": "transformer", "bytes": 1 << 20,
                                                    "seconds": 0.0004}]
    down = json.loads(encode(DOWN[0]))
    assert down == {"type": "settings", "version": 2, "values": SETTINGS.public()}
    assert down["values"]["dynamic_offload.enabled"] is True
    assert down["values"]["dynamic_offload.gpu_memory_threshold"] == 0.7  # version 7: the canonical names
    assert json.loads(encode(StopMessage())) == {"type": "stop"}
    # A line from before the models: the trainer filled in no time for a hello, the daemon none for down.
    old_hello = (b'{"type":"hello","protocol":%d,"token":"t0ken","pid":4243,"rank":0,"run_dir":"runs/x",'
                 b'"start_step":3,"total_steps":10}\n' % PROTOCOL_VERSION)
    assert decode_up(old_hello) == UP[0]


def test_messages_stamp_their_time_when_built() -> None:
    before = PhaseMessage(step=1, phase=Phase.GEN).time
    assert abs(before - StepMessage(step=1, metrics={}).time) < 5.0 and before > 1_700_000_000


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_numbers_json_lacks_go_out_as_null(value: float) -> None:
    line = encode(StepMessage(step=1, metrics={"actor/pg_loss": value, "critic/score/mean": 0.5}))
    assert b'"actor/pg_loss":null' in line and b"NaN" not in line and b"Infinity" not in line
    assert decode_up(line).metrics == {"actor/pg_loss": None, "critic/score/mean": 0.5}


def test_the_same_function_nulls_them_in_plain_data_and_in_nested_models() -> None:
    """The daemon's event stream encodes dicts that hold models (trainer/config/messages.to_json)."""
    data = {"gpus": [{"power_watts": math.nan}], "step": StepMessage(step=1, metrics={"x": math.inf}, time=1.0)}
    assert json.loads(to_json(data)) == {"gpus": [{"power_watts": None}],
                                         "step": {"type": "step", "step": 1, "metrics": {"x": None}, "time": 1.0}}


@pytest.mark.parametrize(("line", "says"), [
    (b'{"type": "made_up"}', "not a message of this protocol: input tag 'made_up'"),
    (b'{"step": 1, "metrics": {}}', "not a message of this protocol: unable to extract tag using discriminator"),
    (b"[1, 2]", "not a message of this protocol: input should be an object"),
    (b"{broken", "not a JSON line"),
    (b'{"type": "step", "step": 1}', "bad step message: metrics: field required"),
    (b'{"type": "step", "step": "five", "metrics": {}}',
     "bad step message: step: input should be a valid integer, unable to parse string as an integer, got 'five'"),
    (b'{"type": "step", "step": 1, "metrics": {"actor/pg_loss": "low"}}',
     "bad step message: metrics.actor/pg_loss: input should be a valid number"),
    (b'{"type": "phase", "step": 1, "phase": "validate"}', "bad phase message: phase: input should be 'gen', "),
    (b'{"type": "offload", "copies": [{"direction": "sideways", "group": "norm", "bytes": 1, "seconds": 0.1}], '
     b'"counts": []}', "bad offload message: copies.0.direction: input should be 'h2d' or 'd2h', got 'sideways'"),
    (b'{"type": "dropped", "count": 3, "reason": "full"}',
     "bad dropped message: reason: extra inputs are not permitted"),
    (b'{"type": "settings_ack", "version": 1, "step": 2, "values": {"dynamic_offload.gpu_memory_threshold": 7}}',
     "bad settings_ack message: values.dynamic_offload.gpu_memory_threshold: input should be less than or equal to 1"),
    (b'{"type": "settings_ack", "version": 1, "step": 2, "values": {"gpu_memory_threshold": 0.5, '
     b'"dynamic_offload.gpu_memory_threshold": 0.6}}',
     "bad settings_ack message: values: value error, dynamic_offload.gpu_memory_threshold: given twice"),
])
def test_a_bad_line_is_refused_saying_what_is_wrong(line: bytes, says: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode_up(line)
    assert str(refused.value).startswith(says), str(refused.value)


def test_a_line_over_the_limit_and_an_up_message_sent_down_are_refused() -> None:
    with pytest.raises(ProtocolError, match="over the 1048576-byte limit"):
        decode_up(b" " * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ProtocolError, match="input tag 'step'"):
        decode_down(encode(UP[1]))


def test_the_phases_are_the_ones_the_trainer_sends() -> None:
    """Each Phase is the name of a timed phase or a phase message somewhere in trainer/, and back."""
    source = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "trainer").rglob("*.py"))
    phase_call = r"""(?:timer\.phase\(|self\._phase\(timer, |phase_started\()["'](\w+)["']"""
    sent = set(re.findall(phase_call, source)) - {"step"}
    assert sent == {phase.value for phase in Phase}
