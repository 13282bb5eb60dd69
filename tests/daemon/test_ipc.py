"""The daemon's IPC server: only an authenticated trainer gets in; messages go both ways; the real client
(trainer/telemetry.py) reconnects when the daemon comes back."""

from __future__ import annotations

import asyncio
import json
import stat
import tempfile
import time
from pathlib import Path

import pytest

from daemon.ipc import IpcServer
from trainer.config.ipc import PROTOCOL_VERSION
from trainer.config.live import LiveSettings
from trainer.config.messages import CheckpointNowMessage, DroppedMessage, SettingsMessage, StepMessage
from trainer.telemetry import TelemetryClient

TOKEN = "the-token"


class Recorder:
    """The daemon's handlers, recording what they were called with."""

    def __init__(self):
        self.hellos, self.messages, self.invalid, self.disconnects = [], [], [], []

    def server(self, path: Path) -> IpcServer:
        return IpcServer(path, TOKEN, on_hello=self.hellos.append,
                         on_message=lambda connection, message: self.messages.append(message),
                         on_disconnect=self.disconnects.append,
                         on_invalid=lambda connection, problem: self.invalid.append(problem),
                         hello_timeout_s=1.0)


@pytest.fixture
def socket_path():
    # Not tmp_path: pytest's folders can be longer than a Unix socket path may be.
    with tempfile.TemporaryDirectory(prefix="verl-test-") as folder:
        yield Path(folder) / "ipc.sock"


def hello(**changes) -> bytes:
    message = {"type": "hello", "protocol": PROTOCOL_VERSION, "token": TOKEN, "pid": 123, "rank": 0,
               "run_dir": "runs/x", "start_step": 0, "total_steps": 5, **changes}
    return json.dumps(message).encode() + b"\n"


async def eventually(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


async def closed_by_server(path: Path, first_line: bytes) -> bool:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(first_line)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 3.0) == b""
    finally:
        writer.close()


@pytest.mark.parametrize("first_line", [
    hello(token="wrong"),
    hello(token=None),
    hello(protocol=PROTOCOL_VERSION + 1),
    b'{"type": "step", "step": 1, "metrics": {}}\n',
    b"not json at all\n",
])
def test_a_connection_without_a_good_hello_is_closed(socket_path: Path, first_line: bytes) -> None:
    recorder = Recorder()

    async def scenario():
        server = recorder.server(socket_path)
        await server.start()
        try:
            assert await closed_by_server(socket_path, first_line)
            assert server.connections == []
        finally:
            await server.close()

    asyncio.run(scenario())
    assert recorder.hellos == [] and recorder.messages == []


def test_silence_after_connecting_is_closed_after_the_hello_timeout(socket_path: Path) -> None:
    async def scenario():
        server = Recorder().server(socket_path)
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(socket_path))
            started = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 5.0) == b""
            assert 0.5 < time.monotonic() - started < 4.0
            writer.close()
        finally:
            await server.close()

    asyncio.run(scenario())


def test_socket_is_private_and_removed_on_close(socket_path: Path) -> None:
    async def scenario():
        server = Recorder().server(socket_path)
        await server.start()
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
        await server.close()
        assert not socket_path.exists()

    asyncio.run(scenario())


def test_messages_are_dispatched_bad_lines_skipped_and_down_messages_delivered(socket_path: Path) -> None:
    recorder = Recorder()

    async def scenario():
        server = recorder.server(socket_path)
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(socket_path))
            writer.write(hello(pid=77, rank=0))
            writer.write(b'{"type": "step", "step": 1, "metrics": {"actor/pg_loss": 0.5}}\n')
            writer.write(b'{"type": "made_up"}\n')
            writer.write(b"{broken\n")
            writer.write(b'{"type": "step", "step": 1}\n')  # a field missing
            writer.write(b'{"type": "phase", "step": "two", "phase": "gen"}\n')  # a field of the wrong type
            writer.write(hello())
            writer.write(b'{"type": "phase", "step": 2, "phase": "gen"}\n')
            await writer.drain()
            await eventually(lambda: len(recorder.messages) == 2)
            assert [connection.pid for connection in recorder.hellos] == [77]
            assert [message.type for message in recorder.messages] == ["step", "phase"]
            assert recorder.messages[0].metrics == {"actor/pg_loss": 0.5}
            # Each bad line is skipped with what is wrong with it; the connection carries on.
            assert recorder.invalid == [
                "not a message of this protocol: input tag 'made_up' found using 'type' does not match any of the "
                "expected tags: 'hello', 'step', 'phase', 'offload', 'log', 'settings_ack', 'checkpoint', 'dropped', "
                "'heartbeat', 'ranks'",
                "not a JSON line (invalid JSON: key must be a string at line 1 column 2)",
                "bad step message: metrics: field required",
                "bad phase message: step: input should be a valid integer, unable to parse string as an integer, "
                "got 'two'",
                "a second hello on one connection"]
            assert len(server.connections) == 1 and recorder.disconnects == []
            assert server.send(CheckpointNowMessage()) == 1
            line = await asyncio.wait_for(reader.readline(), 3.0)
            assert json.loads(line) == {"type": "checkpoint_now"}
            writer.close()
            await eventually(lambda: len(recorder.disconnects) == 1)
            assert server.connections == []
        finally:
            await server.close()

    asyncio.run(scenario())


def test_the_real_client_talks_to_the_server_and_reconnects_after_a_daemon_restart(socket_path: Path) -> None:
    recorder = Recorder()

    async def scenario():
        server = recorder.server(socket_path)
        await server.start()
        client = TelemetryClient(str(socket_path), TOKEN, start_step=0, total_steps=10,
                                 reconnect_interval_s=0.05)
        try:
            await eventually(lambda: recorder.hellos)
            assert recorder.hellos[0].hello.start_step == 0
            sent = StepMessage(step=1, metrics={"actor/pg_loss": 0.25})
            client.send(sent)
            await eventually(lambda: recorder.messages)
            assert recorder.messages == [sent]  # its time too: stamped when the trainer built it
            settings = SettingsMessage(version=1, values=LiveSettings(gpu_memory_threshold=0.5))
            server.send(settings)
            await eventually(lambda: client._received)
            assert client.poll() == [settings]
            assert client.poll() == []

            await server.close()  # the daemon goes away...
            await eventually(lambda: not client.connected)
            for step in range(2, 6):
                client.send(StepMessage(step=step, metrics={}))
            await eventually(lambda: client.dropped >= 4)
            server = recorder.server(socket_path)  # ...and comes back
            await server.start()
            await eventually(lambda: len(recorder.hellos) == 2)
            assert recorder.hellos[1].hello.start_step == 5  # the latest step it sent
            client.send(StepMessage(step=6, metrics={}))
            await eventually(lambda: getattr(recorder.messages[-1], "step", None) == 6)
            dropped = [message.count for message in recorder.messages if isinstance(message, DroppedMessage)]
            assert sum(dropped) == client.dropped
        finally:
            client.close(timeout=1.0)
            await server.close()

    asyncio.run(scenario())


def test_one_client_per_rank_and_down_messages_to_one_rank(socket_path: Path, monkeypatch) -> None:
    recorder = Recorder()
    monkeypatch.setenv("VERL_IPC_SOCKET", str(socket_path))
    monkeypatch.setenv("VERL_IPC_TOKEN", TOKEN)

    async def scenario():
        server = recorder.server(socket_path)
        await server.start()
        clients = []
        for rank in (0, 1):  # as torch.distributed's launcher starts each rank: RANK and LOCAL_RANK set
            monkeypatch.setenv("RANK", str(rank + 2))
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            clients.append(TelemetryClient.from_env(start_step=0, total_steps=10, reconnect_interval_s=0.05))
        try:
            await eventually(lambda: len(recorder.hellos) == 2)
            assert sorted((connection.rank, connection.hello.local_rank) for connection in recorder.hellos) == [
                (2, 0), (3, 1)]
            assert server.send(CheckpointNowMessage(), rank=2) == 1
            await eventually(lambda: clients[0]._received)
            await asyncio.sleep(0.2)
            assert clients[0].poll() == [CheckpointNowMessage()] and clients[1].poll() == []
            assert server.send(CheckpointNowMessage()) == 2  # no rank: every trainer
        finally:
            for client in clients:
                client.close(timeout=1.0)
            await server.close()

    asyncio.run(scenario())
