"""The daemon's end of the trainer link: an authenticated Unix socket of JSON lines.

The socket lives in the 0700 runtime directory and is itself mode 0600; the first line of a
connection must be a ``hello`` with the run's token and protocol version, else the connection
is closed. After that, each line is decoded into its message model (trainer/config/messages.py)
and handed to the daemon's handler; a line that is no message goes to the invalid-line handler
instead, and the connection carries on. One connection per trainer process: with several ranks, one per
rank (its hello names it). Down messages (settings, checkpoint_now, stop) go to every connected trainer, or
to one rank's, without waiting: a trainer that stops reading is disconnected rather than
allowed to stall the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path

from trainer.config.ipc import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ProtocolError, decode_up, encode
from trainer.config.messages import DownMessage, HelloMessage, UpMessage

log = logging.getLogger("verl.daemon.ipc")

# Unix socket paths are limited to 108 bytes (sun_path) on Linux.
MAX_SOCKET_PATH_BYTES = 107


class TrainerConnection:
    """One authenticated trainer process: its hello and a way to send it down messages."""

    def __init__(self, hello: HelloMessage, writer: asyncio.StreamWriter, max_buffered_bytes: int):
        self.hello = hello
        self.pid = hello.pid
        self.rank = hello.rank
        self._writer = writer
        self._max_buffered_bytes = max_buffered_bytes

    def send(self, message: DownMessage) -> bool:
        """Queue a down message on the socket; False (and the connection closed) when the trainer is not reading."""
        if self._writer.is_closing():
            return False
        if self._writer.transport.get_write_buffer_size() > self._max_buffered_bytes:
            log.warning("trainer pid %s stopped reading its socket; disconnecting it", self.pid)
            self._writer.close()
            return False
        self._writer.write(encode(message))
        return True

    def close(self) -> None:
        self._writer.close()


class IpcServer:
    """Accepts trainer connections on `path`; calls the handlers on the event loop.

    on_hello(connection) after a good hello, on_message(connection, message) for each later line,
    on_disconnect(connection) when it ends, on_invalid(connection, problem) for a bad line after the hello
    (that line is skipped).
    """

    def __init__(self, path: Path, token: str, *,
                 on_hello: Callable[[TrainerConnection], None],
                 on_message: Callable[[TrainerConnection, UpMessage], None],
                 on_disconnect: Callable[[TrainerConnection], None] = lambda connection: None,
                 on_invalid: Callable[[TrainerConnection, str], None] = lambda connection, problem: None,
                 hello_timeout_s: float = 10.0, max_buffered_bytes: int = 1 << 20):
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        self.path = Path(path)
        self._token = token.encode("utf-8")
        self._on_hello, self._on_message = on_hello, on_message
        self._on_disconnect, self._on_invalid = on_disconnect, on_invalid
        self._hello_timeout_s = hello_timeout_s
        self._max_buffered_bytes = max_buffered_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: list[TrainerConnection] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path),
                                                       limit=MAX_MESSAGE_BYTES + 1)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self.path.unlink(missing_ok=True)

    @property
    def connections(self) -> list[TrainerConnection]:
        return list(self._connections)

    def send(self, message: DownMessage, *, rank: int | None = None) -> int:
        """Send a down message to every connected trainer, or to those of global rank `rank`; how many it
        reached."""
        return sum(connection.send(message) for connection in list(self._connections)
                   if rank is None or connection.rank == rank)

    # --------------------------------------------------------------------------------- per client

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            hello = await self._authenticate(reader)
            if hello is None:
                return
            connection = TrainerConnection(hello, writer, self._max_buffered_bytes)
            self._connections.append(connection)
            try:
                self._on_hello(connection)
                await self._dispatch(reader, connection)
            finally:
                self._connections.remove(connection)
                self._on_disconnect(connection)
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _authenticate(self, reader: asyncio.StreamReader) -> HelloMessage | None:
        try:
            line = await asyncio.wait_for(reader.readline(), self._hello_timeout_s)
            hello = decode_up(line)
        except (TimeoutError, ValueError, ConnectionError) as error:  # ProtocolError is a ValueError
            log.warning("IPC connection refused: no hello (%s)", error or "timed out")
            return None
        if not isinstance(hello, HelloMessage):
            log.warning("IPC connection refused: the first line is a %s message, not a hello", hello.type)
            return None
        if not hmac.compare_digest(hello.token.encode("utf-8"), self._token):
            log.warning("IPC connection refused: wrong token (pid %s)", hello.pid)
            return None
        if hello.protocol != PROTOCOL_VERSION:
            log.warning("IPC connection refused: protocol %r, expected %d", hello.protocol, PROTOCOL_VERSION)
            return None
        return hello

    async def _dispatch(self, reader: asyncio.StreamReader, connection: TrainerConnection) -> None:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, ConnectionError) as error:  # a line over the limit, or a reset
                log.warning("IPC connection of pid %s closed: %s", connection.pid, error)
                return
            if not line:
                return
            try:
                message = decode_up(line)
            except ProtocolError as error:
                self._on_invalid(connection, str(error))
                continue
            if isinstance(message, HelloMessage):
                self._on_invalid(connection, "a second hello on one connection")
                continue
            try:
                self._on_message(connection, message)
            except Exception:  # a handler's bug must not cut the trainer off
                log.exception("IPC handler failed on a %s message", message.type)
