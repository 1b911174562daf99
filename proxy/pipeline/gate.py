"""Holdback for enforce mode: the newest words of a stream wait until they are checked.

The gate receives whole SSE events in order, each with the number of output words it
carries, and releases the oldest ones as soon as the events still held carry at most
``holdback_words`` words. Events without words (the role chunk, usage, ``[DONE]``) keep
their place in line. When a leak is found the gate is *cut*: nothing it holds is ever
released, and the stream ends with one error event. Holding N words delays the client by
the time the engine takes to generate N words, never more.
"""

from __future__ import annotations

from collections import deque


class StreamGate:
    """Ordered holdback of raw SSE events, bounded by words."""

    def __init__(self, holdback_words: float) -> None:
        if holdback_words < 0:
            raise ValueError("holdback_words must be >= 0")
        self.holdback_words = holdback_words
        self._held: deque[tuple[bytes, float]] = deque()
        self._held_words = 0.0
        self.cut_done = False

    @property
    def held_words(self) -> float:
        return self._held_words

    def push(self, event: bytes, words: float) -> None:
        if not self.cut_done:
            self._held.append((event, words))
            self._held_words += words

    def release(self) -> list[bytes]:
        """Events that may go to the client now (oldest first)."""
        out = []
        while self._held and (self._held_words > self.holdback_words or self._held[0][1] == 0):
            event, words = self._held.popleft()
            self._held_words -= words
            out.append(event)
        return out

    def flush(self) -> list[bytes]:
        """End of a clean stream: everything still held, in order."""
        out = [event for event, _ in self._held]
        self._held.clear()
        self._held_words = 0.0
        return out

    def cut(self) -> None:
        """Drop everything held, for good: nothing more is ever released."""
        self.cut_done = True
        self._held.clear()
        self._held_words = 0.0
