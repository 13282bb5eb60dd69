"""The trainer's side of the telemetry link: sends up to the daemon, never waits on it.

Usage in the trainer (every rank: each reports to its node's daemon with its rank)::

    client = TelemetryClient.from_env()          # None when not started by a daemon
    if client is not None:
        client.hello(start_step=trainer.step, total_steps=trainer.total_steps, run_dir=str(run_dir))
        client.send(PhaseMessage(step=step + 1, phase=Phase.GEN))
        client.send(StepMessage(step=step, metrics=metrics))
        for message in client.poll():            # at a safe point, between steps
            ...                                  # SettingsMessage, CheckpointNowMessage or StopMessage
        client.close()                           # flushes what is queued (at most `timeout` s)

``send`` only encodes the message and puts it on a bounded queue (a few microseconds); a
background thread writes the queue to the daemon's Unix socket. When the daemon is absent,
slow or gone, messages are dropped and counted (``dropped``), the count is reported to the
daemon with a DroppedMessage once it is reachable again, and the thread reconnects quietly
(hello again, with the latest step sent as ``start_step``). ``poll`` returns the down messages
received since the last poll, oldest first, without waiting. The messages are the models of
trainer/config/messages.py (each stamps its ``time`` when it is built).

A daemon that is gone (its socket refuses a reconnect, or is removed) cannot ask for a stop: the
client then hands the trainer a StopMessage of its own, so the trainer checkpoints at its next safe
point and exits instead of training on as an orphan nobody sees (`daemon_gone` says it happened).
`die_with_daemon` covers the same case through Linux's parent-death signal, and
`dump_stacks_on_signal` lets the daemon see where a hung trainer is stuck.

Only the standard library, pydantic and trainer.config: this module is imported before torch
work starts and must cost nothing when telemetry is off.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import queue
import signal
import socket
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from trainer.config.ipc import (
    ENV_DAEMON_PID,
    ENV_SOCKET,
    ENV_TOKEN,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    STACK_DUMP_SIGNAL,
    ProtocolError,
    decode_down,
    encode,
)
from trainer.config.messages import DownMessage, DroppedMessage, HelloMessage, StepMessage, StopMessage, UpMessage

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class TelemetryClient:
    """A non-blocking line-JSON link to the daemon (see the module docstring)."""

    def __init__(self, socket_path: str, token: str, *, rank: int = 0, local_rank: int = 0, run_dir: str = "",
                 start_step: int | None = None, total_steps: int | None = None, queue_size: int = 4096,
                 reconnect_interval_s: float = 1.0, send_timeout_s: float = 1.0):
        self.socket_path = socket_path
        self._token = token
        self._hello_fields: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "run_dir": run_dir,
                                              "start_step": start_step, "total_steps": total_steps}
        self._hello_ready = threading.Event()
        if start_step is not None and total_steps is not None:
            self._hello_ready.set()
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_size)
        self._received: deque[DownMessage] = deque()
        self._reconnect_interval_s = reconnect_interval_s
        self._send_timeout_s = send_timeout_s
        self._lock = threading.Lock()  # guards the drop counters and the current socket
        self._dropped_total = 0
        self._dropped_unreported = 0
        self._last_step: int | None = None
        self._socket: socket.socket | None = None
        self._connected = threading.Event()
        self._was_connected = False
        self._daemon_gone = threading.Event()
        self._closing = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="verl-telemetry", daemon=True)
        self._writer.start()

    @classmethod
    def from_env(cls, **hello_fields: Any) -> TelemetryClient | None:
        """A client for the daemon named by VERL_IPC_SOCKET/VERL_IPC_TOKEN, or None when unset.

        `hello_fields` (rank, local_rank, run_dir, start_step, total_steps) go to the constructor; give start_step
        and total_steps here or later through `hello`: the client connects once both are known. rank and local_rank
        default to torch.distributed's RANK and LOCAL_RANK (0 outside a launched group).
        """
        path = os.environ.get(ENV_SOCKET)
        if not path:
            return None
        for field, variable in (("rank", "RANK"), ("local_rank", "LOCAL_RANK")):
            if field not in hello_fields and os.environ.get(variable, "").isdigit():
                hello_fields[field] = int(os.environ[variable])
        return cls(path, os.environ.get(ENV_TOKEN, ""), **hello_fields)

    # -------------------------------------------------------------------------------- trainer API

    def hello(self, *, start_step: int, total_steps: int, run_dir: str | None = None,
              rank: int | None = None) -> None:
        """Say where the run stands; the first call lets the client connect (messages wait until then)."""
        updates = {"start_step": start_step, "total_steps": total_steps}
        if run_dir is not None:
            updates["run_dir"] = run_dir
        if rank is not None:
            updates["rank"] = rank
        self._hello_fields.update(updates)
        self._hello_ready.set()

    def send(self, message: UpMessage) -> None:
        """Queue one up message; returns at once. Dropped (and counted) when the queue is full.

        A model always encodes (it was validated when built), so the trainer thread pays only for
        the encoding, in pydantic's compiled serializer.
        """
        if isinstance(message, StepMessage):
            self._last_step = message.step
        try:
            self._queue.put_nowait(encode(message))
        except queue.Full:
            self._count_dropped(1)

    def poll(self) -> list[DownMessage]:
        """Down messages (settings, checkpoint_now, stop) received since the last poll, oldest first."""
        messages = []
        while self._received:
            messages.append(self._received.popleft())
        return messages

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (waiting at most `timeout` seconds while connected), then disconnect."""
        self._closing.set()
        self._hello_ready.set()  # unblocks a writer still waiting for hello; it then drops the queue
        self._writer.join(timeout)
        self._disconnect(self._socket)

    @property
    def dropped(self) -> int:
        """Messages dropped since the client was made (daemon absent or slow, queue full)."""
        return self._dropped_total

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def daemon_gone(self) -> bool:
        """The daemon this client reached has exited (its socket refuses connections or is gone)."""
        return self._daemon_gone.is_set()

    # --------------------------------------------------------------------------- background thread

    def _write_loop(self) -> None:
        self._hello_ready.wait()
        while True:
            if not self._connected.is_set():
                if self._closing.is_set() or not self._connect():
                    self._drop_queued()
                    if self._closing.is_set():
                        return
                    self._closing.wait(self._reconnect_interval_s)
                    continue
            if self._closing.is_set() and self._queue.empty():
                return
            try:
                self._write(self._queue.get(timeout=0.1))
            except queue.Empty:
                pass
            if self._dropped_unreported:
                self._report_dropped()

    def _connect(self) -> bool:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(self._send_timeout_s)
        fields = self._hello_fields
        start_step = fields["start_step"] if self._last_step is None else self._last_step
        hello = encode(HelloMessage(protocol=PROTOCOL_VERSION, token=self._token, pid=os.getpid(),
                                    rank=fields["rank"], local_rank=fields["local_rank"], run_dir=fields["run_dir"],
                                    start_step=start_step,
                                    total_steps=fields["total_steps"]))
        try:
            connection.connect(self.socket_path)
            connection.sendall(hello)
        except OSError as error:
            connection.close()
            if self._was_connected and isinstance(error, ConnectionRefusedError | FileNotFoundError):
                self._lost_daemon()
            return False
        with self._lock:
            self._socket = connection
            self._connected.set()
            self._was_connected = True
        threading.Thread(target=self._read_loop, args=(connection,), name="verl-telemetry-read",
                         daemon=True).start()
        self._report_dropped()
        return True

    def _write(self, line: bytes, *, count_failure: bool = True) -> bool:
        connection = self._socket
        try:
            if connection is None:
                raise ConnectionError("not connected")
            connection.sendall(line)  # bounded by the send timeout: a stuck daemon costs a reconnect
        except OSError:
            if count_failure:
                self._count_dropped(1)
            self._disconnect(connection)
            return False
        return True

    def _read_loop(self, connection: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    self._received.append(decode_down(line))
                except ProtocolError as error:  # the trainer goes on with what it has; say why it ignores this
                    print(f"WARNING: ignored a message from the daemon: {error}", file=sys.stderr)
            if len(buffer) > MAX_MESSAGE_BYTES:
                break
        self._disconnect(connection)

    def _lost_daemon(self) -> None:
        """A live daemon always listens: one that refuses a reconnect has exited (killed, most likely)."""
        if self._daemon_gone.is_set():
            return
        self._daemon_gone.set()
        print(f"WARNING: the verl daemon is gone (its socket {self.socket_path} refuses connections); the trainer "
              "stops at its next safe point, after a checkpoint", file=sys.stderr, flush=True)
        self._received.append(StopMessage())

    def _disconnect(self, connection: socket.socket | None) -> None:
        """Close `connection`; when it is the current one, the writer reconnects."""
        if connection is None:
            return
        with self._lock:
            if self._socket is connection:
                self._socket = None
                self._connected.clear()
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        connection.close()

    # ------------------------------------------------------------------------------------ counting

    def _drop_queued(self) -> None:
        dropped = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            dropped += 1
        if dropped:
            self._count_dropped(dropped)

    def _count_dropped(self, count: int) -> None:
        with self._lock:
            self._dropped_total += count
            self._dropped_unreported += count

    def _report_dropped(self) -> None:
        with self._lock:
            count, self._dropped_unreported = self._dropped_unreported, 0
        if not count:
            return
        report = encode(DroppedMessage(count=count))
        if not self._write(report, count_failure=False):
            with self._lock:  # not lost: the next report carries it
                self._dropped_unreported += count


# ---------------------------------------------------------------------------------- process ties


def die_with_daemon() -> bool:
    """In a trainer a daemon started (VERL_DAEMON_PID set): ask Linux to send SIGTERM when the daemon dies, so
    the trainer checkpoints at its next safe point and exits (before its signal handlers are installed,
    SIGTERM ends it at once). False when the daemon has died already; True otherwise (also when run by hand).
    """
    daemon = os.environ.get(ENV_DAEMON_PID, "")
    if not daemon.isdigit():
        return True
    if sys.platform.startswith("linux"):
        # No Python API for prctl; set before the check below, so a daemon dying in between is caught by one.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), 0, 0, 0)
    return os.getppid() == int(daemon) or _process_exists(int(daemon))


def dump_stacks_on_signal(log_path: Path) -> TextIO:
    """Write every thread's Python stack to `log_path` on STACK_DUMP_SIGNAL (the daemon sends it to a trainer that
    hangs). faulthandler keeps the file open (it holds a reference) and writes to its descriptor from the
    signal handler, so the dump comes even while the main thread is stuck in C code."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    file = log_path.open("a", encoding="utf-8")
    faulthandler.register(STACK_DUMP_SIGNAL, file=file, all_threads=True)
    return file


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
