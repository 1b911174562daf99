"""Work that waits until the event loop has nothing else to do.

Shadow mode forwards every chunk as it comes and nothing waits on its verdict, but the
engine's work (observing a prompt, scanning a batch of output, finishing a response)
still runs on mitmproxy's single event loop. Done inline, in the hook or the stream
callable, it delays that chunk and every chunk of every other stream that arrives while
it runs. ``IdleQueue`` runs that work later, one item at a time, and only while no
socket is ready and no other callback is waiting: forwarding goes first. An item that
has started still runs to its end (Python cannot pre-empt it), so a chunk arriving
meanwhile waits for it; smaller items wait less.

An item may be a generator function: its generator runs one step per turn and stays
at the head of the queue until it ends, so a long item (observing a large prompt)
lets the loop serve sockets between its steps without anything overtaking it.

Order is the point: items run first in, first out, so a prompt observed before a
response's chunks is in the engine before they are scanned. Code that must use the
engine synchronously (enforce mode, whole bodies) calls ``drain`` first.

Bounded: an item never waits longer than ``max_delay`` seconds nor behind more than
``max_items`` others; past either, items run whatever the loop is doing (the work is
then paid inline, as without this queue). ``drain`` at shutdown loses nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

DEFAULT_MAX_DELAY = 0.05  # seconds an item may wait for an idle loop
DEFAULT_MAX_ITEMS = 10_000
DEFAULT_SLICE = 0.002  # seconds of items per turn of the loop, at most (then yield)


class IdleQueue:
    """An ordered queue of callables run when the asyncio loop is idle (see module)."""

    def __init__(
        self,
        *,
        max_delay: float = DEFAULT_MAX_DELAY,
        max_items: int = DEFAULT_MAX_ITEMS,
        slice_seconds: float = DEFAULT_SLICE,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.max_delay = max_delay
        self.max_items = max_items
        self.slice_seconds = slice_seconds
        self.on_error = on_error  # told of each item that raised (then it is dropped)
        # (when queued, a callable or a generator under way, the callable's arguments,
        # whether it was counted overdue already)
        self._items: deque[
            tuple[float, Callable[..., Any] | Generator[Any, None, Any], tuple[Any, ...], bool]
        ] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        #: Items run before the loop was idle (``max_delay`` / ``max_items`` reached),
        #: each counted once however many steps of it ran so.
        self.overdue = 0
        #: Items whose callable raised: counted and passed to ``on_error``, never
        #: propagated to the loop.
        self.errors = 0
        #: Items pushed so far: unchanged since an item was pushed means nothing can run
        #: after it yet, so work added to that item keeps its place in the order.
        self.pushed = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after every item pushed before it. Outside a running loop
        (tests, replay) it runs at once."""
        self.pushed += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._items.append((time.monotonic(), fn, args, False))
            self.drain()
            return
        self._items.append((time.monotonic(), fn, args, False))
        if not self._scheduled or loop is not self._loop:
            self._loop = loop
            self._scheduled = True
            loop.call_soon(self._turn)

    def drain(self) -> None:
        """Run every queued item now, in order (generators to their end)."""
        while self._items:
            self._run_head()

    def _run_head(self) -> None:
        """Run the first item, or one step of it when it is (or returned) a generator;
        an unfinished generator goes back to the head."""
        enqueued, item, args, counted = self._items.popleft()
        try:
            steps = item if isinstance(item, Generator) else item(*args)
            if isinstance(steps, Generator):
                next(steps)
                self._items.appendleft((enqueued, steps, (), counted))
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 -- never the loop's problem
            self.errors += 1
            if self.on_error is not None:
                self.on_error(e)

    def _turn(self) -> None:
        self._scheduled = False
        started = time.monotonic()
        while self._items:
            now = time.monotonic()
            enqueued, item, args, counted = self._items[0]
            overdue = now - enqueued > self.max_delay or len(self._items) > self.max_items
            if not overdue and (now - started > self.slice_seconds or self._loop_busy()):
                break
            if overdue and not counted:
                self.overdue += 1
                self._items[0] = (enqueued, item, args, True)
            self._run_head()
        loop = self._loop
        if self._items and loop is not None and not loop.is_closed():
            self._scheduled = True
            loop.call_soon(self._turn)

    def _loop_busy(self) -> bool:
        """Whether the loop has other work: a ready callback, or a socket ready to read
        or write. Uses the selector event loop's internals (asyncio's default on Linux,
        which mitmproxy runs on); on another loop it answers busy only for callbacks."""
        loop = self._loop
        if getattr(loop, "_ready", None):
            return True
        selector = getattr(loop, "_selector", None)
        if selector is None:
            return False
        try:
            return bool(selector.select(0))
        except (OSError, ValueError):
            return False
