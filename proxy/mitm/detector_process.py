"""Shadow-mode detection in a child process: the proxy's side.

In shadow mode nothing waits on the detector, yet on the proxy's event loop its work
(parsing every SSE event, fingerprinting, scanning, the garbage its objects make) still
competes with forwarding: measured with ``bench/passthrough.py``, the same work moved to
another process cost a fraction of the time to first token (docs/modes.md, "Detector
process"). So, unless a policy enforces (``policy.shadow_detector``), the proxy only
forwards and copies each LLM exchange, as it passes, to a detector process: the request
as the client sent it, the response headers, each chunk, the end or the error. The child
(``proxy.mitm.detector_worker``) runs the same addons on those copies in the same order, so it
makes the same findings and logs the same events that inline shadow mode would.

The child runs at a lower CPU priority (``policy.shadow_detector_nice``): when the
machine is short of CPU, forwarding goes first and detection falls behind. What it
has not read waits in the pipe and then in this process, up to ``max_backlog`` bytes;
beyond that, new exchanges are not copied (``detector.lagging``, a warning, once per
episode) until the child has caught up: the proxy fails open rather than hold traffic
or memory. If the child dies, every exchange from then on passes unscanned and
``detector.error`` says so, once.

Wire format, both ways: a 4-byte big-endian length, then a pickled tuple whose first
item names the message. The pipe is private to the two processes; the text it carries
(prompts and outputs) is never written anywhere by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from proxy.mitm.flowstate import CLAIMS_TRUSTED_KEY

_LENGTH = struct.Struct("!I")
MAX_FRAME = 1 << 30
DEFAULT_MAX_BACKLOG = 256 << 20  # bytes copied but not yet read by the child
READ_SIZE = 1 << 16
FLUSH_DELAY = 0.02  # seconds a copied frame may wait to be written with later ones
FLUSH_BYTES = 1 << 16  # ... or until this many bytes wait
IOV_MAX = 1024
STOP_TIMEOUT = 30.0  # seconds the child may take to finish its queue at shutdown
EXIT_WAIT = 1.0  # seconds between the child's end of pipe and its exit status


def encode(*message: Any) -> bytes:
    """One frame: ``message`` (a tuple whose first item is its kind), length-prefixed."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


# -O: mitmproxy type-checks every message it builds only under ``__debug__``, and each
# check of an optional field that is None raises and catches a TypeError whose
# traceback holds the frames that built the message. Every copy the worker rebuilds
# would then be a reference cycle, freed by the collector alone: all the exchanges of
# the last minutes at once, in one full collection that stalls every stream.
WORKER_FLAGS = ("-O",)


class FrameDecoder:
    """Frames from a byte stream cut anywhere: ``feed`` returns the complete ones."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        buffer = self._buffer
        buffer += data
        messages = []
        offset = 0
        while len(buffer) - offset >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, offset)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes")
            end = offset + _LENGTH.size + size
            if len(buffer) < end:
                break
            messages.append(pickle.loads(buffer[offset + _LENGTH.size : end]))
            offset = end
        del buffer[:offset]
        return messages


def _lower_priority(nice: int) -> Callable[[], None]:
    def preexec() -> None:
        os.nice(nice)

    return preexec


class DetectorProcess:
    """The child that detects, and the pipe that copies exchanges to it (see module).

    ``send`` never blocks and never raises: it returns False when the child is gone.
    ``accepting`` says whether a new exchange should be copied at all: not while more
    than ``max_backlog`` bytes wait for the child (until half of that is left).
    ``on_event`` is told of state changes once per episode: ``("lagging",
    backlog_bytes)``, ``("caught_up", backlog_bytes)``, ``("exited", reason)``.
    """

    def __init__(
        self,
        hello: dict[str, Any],
        *,
        nice: int = 10,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        on_event: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.hello = hello
        self.nice = nice
        self.max_backlog = max_backlog
        self.on_event = on_event
        self.proc: subprocess.Popen[bytes] | None = None
        self.alive = False
        self.lagging = False
        self._out: deque[memoryview] = deque()
        self._backlog = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False
        self._flush_timer: asyncio.TimerHandle | None = None
        self._decoder = FrameDecoder()
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._ready: asyncio.Future[str | None] | None = None

    def start(self) -> None:
        """Start the child and hand it its configuration (the first frame)."""
        self.proc = subprocess.Popen(
            [sys.executable, *WORKER_FLAGS, "-m", "proxy.mitm.detector_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=_lower_priority(self.nice) if self.nice else None,
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # PIPE: set
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.alive = True
        self._ready = asyncio.get_running_loop().create_future()
        self._enqueue(encode("hello", self.hello))

    async def ready(self, timeout: float) -> str | None:
        """Wait until the child is configured: None, or why it could not be."""
        if self._ready is None:
            return "not started"
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            return f"not ready after {timeout:.0f} s"

    @property
    def backlog(self) -> int:
        """Bytes written for the child that it has not read yet (held in this process)."""
        return self._backlog

    def accepting(self) -> bool:
        """Whether a new exchange should be copied: alive and not lagging."""
        return self.alive and not self.lagging

    def send(self, *message: Any) -> bool:
        if not self.alive:
            return False
        self._enqueue(encode(*message))
        if self._backlog > self.max_backlog and not self.lagging:
            self.lagging = True
            self._tell("lagging", self._backlog)
        return self.alive

    async def ask(self, *message: Any, timeout: float) -> Any:
        """Send ``message`` (kind, exchange id, ...) at once and wait for the child's
        reply about that exchange: None on timeout, or when the child is gone."""
        exchange = message[1]
        future = self._replies[exchange] = asyncio.get_running_loop().create_future()
        try:
            if not self.send(*message):
                return None
            self._write_some()  # a client waits on the answer
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return None
        finally:
            self._replies.pop(exchange, None)

    def close(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """Ask the child to finish what it was sent and exit; wait for it (bounded).
        Returns its exit status (None if it had to be killed)."""
        proc = self.proc
        if proc is None:
            return None
        if self.alive:
            self._enqueue(encode("stop"))
            self._flush_blocking(timeout)
        self._stop_io()
        assert proc.stdin is not None  # started with stdin=PIPE
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
        finally:
            self.alive = False

    # -- internals ---------------------------------------------------------------------

    def _tell(self, event: str, detail: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, detail)

    def _enqueue(self, frame: bytes, *, now: bool = False) -> None:
        """Queue ``frame``; written within ``FLUSH_DELAY`` together with the frames that
        follow it (``now``: at once). Every write wakes the child, and on a busy machine
        each wake-up costs both processes more than the bytes do."""
        self._out.append(memoryview(frame))
        self._backlog += len(frame)
        if self._writing:
            return  # the pipe is full: add_writer writes as soon as it drains
        if now or self._loop is None or self._backlog >= FLUSH_BYTES:
            self._write_some()
        elif self._flush_timer is None:
            self._flush_timer = self._loop.call_later(FLUSH_DELAY, self._write_some)

    def _write_some(self) -> None:
        """Write what the pipe takes now; wait for it to drain (add_writer) otherwise."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        try:
            self._write_available()
        except OSError as e:  # BrokenPipeError: the child is gone
            self._died(f"{type(e).__name__}: {e}")
            return
        self._watch(writing=bool(self._out))

    def _write_available(self) -> None:
        """Write queued frames, up to ``IOV_MAX`` per system call, until the pipe is
        full (a partly written frame keeps its rest at the head) or nothing is left."""
        assert self.proc is not None and self.proc.stdin is not None  # start() set them
        fd = self.proc.stdin.fileno()
        out = self._out
        while out:
            try:
                written = os.writev(fd, list(itertools.islice(out, IOV_MAX)))
            except BlockingIOError:
                return
            self._backlog -= written
            if self.lagging and self._backlog <= self.max_backlog // 2:
                self.lagging = False
                self._tell("caught_up", self._backlog)
            while out and written >= len(out[0]):
                written -= len(out.popleft())
            if written:
                out[0] = out[0][written:]
                return

    def _watch(self, *, writing: bool) -> None:
        """Register the pipe ends with the running loop (once it runs)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next write on the loop registers
        assert self.proc is not None and self.proc.stdin is not None  # start() set them
        assert self.proc.stdout is not None
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self.proc.stdout.fileno(), self._read_some)
        if writing and not self._writing:
            loop.add_writer(self.proc.stdin.fileno(), self._write_some)
        elif not writing and self._writing:
            loop.remove_writer(self.proc.stdin.fileno())
        self._writing = writing

    def _read_some(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None  # start() set them
        try:
            data = os.read(self.proc.stdout.fileno(), READ_SIZE)
        except BlockingIOError:
            return
        except OSError as e:
            self._died(f"{type(e).__name__}: {e}")
            return
        if not data:  # the child exits (or closed its end): it is reaped in a moment
            try:
                self._died(f"exited (status {self.proc.wait(EXIT_WAIT)})")
            except subprocess.TimeoutExpired:
                self._died("closed its pipe")
            return
        for message in self._decoder.feed(data):
            if message[0] in ("ready", "failed"):
                self._settle_ready(message[1] if message[0] == "failed" else None)
            elif message[0] == "reply":
                future = self._replies.get(message[1])
                if future is not None and not future.done():
                    future.set_result(message[2])
            elif message[0] == "logged":
                self._tell("logged", message[1])

    def _died(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self._out.clear()
        self._backlog = 0
        self._stop_io()
        for future in self._replies.values():
            if not future.done():
                future.set_result(None)
        self._settle_ready(reason)
        self._tell("exited", reason)

    def _settle_ready(self, failure: str | None) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(failure)

    def _stop_io(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # A loop is watched only once started (_watch): the pipes are set.
        assert self.proc is not None and self.proc.stdin is not None
        assert self.proc.stdout is not None
        loop.remove_reader(self.proc.stdout.fileno())
        loop.remove_writer(self.proc.stdin.fileno())
        self._writing = False
        self._loop = None

    def _flush_blocking(self, timeout: float) -> None:
        """At shutdown: write the rest as the child reads it, for at most ``timeout``."""
        deadline = time.monotonic() + timeout
        assert self.proc is not None and self.proc.stdin is not None  # start() set them
        fd = self.proc.stdin.fileno()
        with contextlib.suppress(OSError):
            while self._out and (left := deadline - time.monotonic()) > 0:
                if select.select([], [fd], [], left)[1]:
                    self._write_available()
        self._out.clear()
        self._backlog = 0


MIRROR_KEY = "crosstalk.detector_copy"  # flow.metadata: the exchange's id in the copy
REPLY_TIMEOUT = 5.0  # seconds a buffered response waits for its verdict header


class FlowMirror:
    """Copies each LLM exchange to the detector process, hook by hook, as it passes.

    The addon calls it from its hooks for the flows it recognised; it sends what the
    child needs to run the same hooks on its copy: the request as the client sent it
    (before any rewrite), the response headers, every chunk as it is forwarded, the
    end. A buffered (non-streamed) response waits for the child's verdict, at most
    ``REPLY_TIMEOUT`` seconds, as inline mode scans it before sending it on.
    """

    def __init__(self, process: DetectorProcess) -> None:
        self.process = process
        self.skipped = 0  # exchanges not copied: the child was lagging or gone
        self._next_id = 0
        # Copied exchanges whose ``exchange`` line the child has not confirmed: if it
        # dies, the proxy logs them itself (``orphans``), so none vanishes unrecorded.
        self.open: dict[int, Any] = {}

    def logged(self, xid: int) -> None:
        """The child wrote this exchange's line."""
        self.open.pop(xid, None)

    def orphans(self) -> list[Any]:
        """The flows the child will never log (it died): taken out of ``open``."""
        flows, self.open = list(self.open.values()), {}
        return flows

    def request(self, flow: Any) -> bool:
        """Copy the request; False when the child cannot take it (lagging or gone)."""
        if not self.process.accepting():
            self.skipped += 1
            return False
        self._next_id += 1
        flow.metadata[MIRROR_KEY] = self._next_id
        self.open[self._next_id] = flow
        trusted = bool(flow.metadata.get(CLAIMS_TRUSTED_KEY))
        state = (flow.request.get_state(), flow.client_conn.peername, trusted)
        self.process.send("request", self._next_id, state, time.monotonic())
        return True

    def responseheaders(self, flow: Any, streamed: bool) -> None:
        xid = flow.metadata.get(MIRROR_KEY)
        if xid is None:
            return
        send = self.process.send
        send("responseheaders", xid, flow.response.get_state(), time.monotonic())
        if not streamed:
            return

        def stream(chunk: bytes) -> bytes:
            send("chunk", xid, chunk, time.monotonic())
            return chunk

        flow.response.stream = stream

    async def response(self, flow: Any) -> str | None:
        """Copies the end (and a buffered body); returns the verdict of a buffered one."""
        xid = flow.metadata.get(MIRROR_KEY)
        if xid is None:
            return None
        now = time.monotonic()
        if flow.response.stream:
            self.process.send("response", xid, None, now)
            return None
        body = flow.response.raw_content
        return await self.process.ask("response", xid, body, now, timeout=REPLY_TIMEOUT)

    def error(self, flow: Any) -> None:
        xid = flow.metadata.get(MIRROR_KEY)
        if xid is not None:
            message = flow.error.msg if flow.error else "error"
            self.process.send("error", xid, message, time.monotonic())
