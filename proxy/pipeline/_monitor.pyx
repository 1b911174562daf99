# cython: language_level=3, boundscheck=False, wraparound=False
"""An exchange monitor's per-event path, compiled (issue 16).

Every event of every stream takes this path: a chunk is decoded, its SSE events read,
each event's output deltas counted, handed to the observers and batched for the
engine. In Python that was ten or so calls an event, ~1.8 us of a replayed event's
~3.3 us, while the engine is called once per batch of ~64 characters. Here the fields
those steps read and write are C fields of ``MonitorFields``, which
``pipeline.exchange.ExchangeMonitor`` extends (its docstring and fields say what each
is for), and the steps are its methods. What runs once a batch or less (a scan call, a
failure, the end of a stream) stays in Python, in the monitor, and is called from here;
so do enforce mode's gate and the live proxy's deferred shadow path (``defer``: its
queue, ``_run_queued``, is Python, a call a chunk, which then takes this path).

``on_chunk`` calls the steps below as C functions: replacing ``_shadow_chunk`` or
``_deliver`` on a monitor (a spy, a benchmark's timer) catches only the calls that go
through Python (the deferred path, enforce mode, ``on_body``).
"""

import time
from dataclasses import MISSING


cdef class MonitorFields:
    """The fields of ``ExchangeMonitor`` that every delta reads or writes, and the steps
    that do. The dataclass declares them, each with a default; ``expose`` makes its class
    read them here. Not ``scan``: a field without a default,
    which the dataclass would take a C field's descriptor for. The counts and limits are
    C integers (``None`` is not "no limit": 0 is), the dicts plain dicts."""

    cdef public object detector_error
    cdef public object pending_observe
    cdef public object enforcement
    cdef public object on_delta
    cdef public object defer
    cdef public object first_output
    cdef public object _sse
    cdef public object _decode
    cdef public object _parser
    cdef public object _gate
    cdef public bint keep_text
    cdef public bint scan_capped
    cdef public Py_ssize_t output_chars
    cdef public Py_ssize_t max_scan_chars
    cdef public Py_ssize_t scan_batch_chars
    cdef public Py_ssize_t _batched_chars
    cdef public dict _texts
    cdef public dict _batched

    def on_chunk(self, chunk):
        """One raw chunk of the SSE body as received (``b""`` at the end); returns what
        to send to the client now."""
        if self.first_output is None and chunk:
            self.first_output = time.monotonic()
        if self._gate is None:  # shadow, or enforcement that failed open
            # _must_fail_closed (Python) is asked only after a failure: not a call a chunk.
            if self.detector_error is not None and self._must_fail_closed():
                return self._cut_failed()
            if self.defer is None:
                self._shadow(chunk)
            else:
                self._queue_chunk(chunk)
            return [chunk] if chunk else []
        return self._gated_chunk(chunk)

    def _shadow_chunk(self, chunk):
        """Parse (and, until the detector fails, scan) one chunk already passed on.
        After a failure the stream is still parsed, so that the exchange line's counts,
        model and errors describe all of it; a failure once scanning has stopped can only
        be the parsing's own, and the rest passes unparsed."""
        self._shadow(chunk)

    cdef _shadow(self, chunk):
        if self._sse is None or self._decode is None:
            return
        try:
            plain = self._decode(chunk)
            events = self._sse.feed(plain) if chunk else self._sse.close()
            for event in events:
                self._deliver_all(self._parser.feed(event))
            if not chunk:
                self._end_of_stream()
        except Exception as e:
            if self.detector_error is None:
                self._fail(e)
            else:
                self._sse = None

    def _deliver(self, deltas):
        """Count each delta, hand it to ``on_delta``, and scan it while the detector has
        not failed and there is a scan, or a prompt still to observe (``pending_observe``:
        batched meanwhile): in batches of ``scan_batch_chars`` in shadow mode, else a
        call a delta."""
        self._deliver_all(deltas)

    cdef _deliver_all(self, deltas):
        cdef Py_ssize_t length
        for delta in deltas:
            choice, text = delta
            length = len(text)
            self.output_chars += length
            if self.keep_text:
                self._texts.setdefault(choice, []).append(text)
            if self.on_delta is not None:
                try:
                    self.on_delta(choice, text)
                except Exception:
                    # An observer's failure is not the detector's: it is switched off
                    # for the exchange, and the scan goes on.
                    self.on_delta = None
            if self.detector_error is not None:
                continue  # failed (open): counted, never scanned again
            if self.scan is None and self.pending_observe is None:
                continue  # no prompt to scan against (unparsed request, failed observe)
            if self.max_scan_chars and self.output_chars > self.max_scan_chars:
                text = self._cut_at_cap(text)
                length = len(text)
            if not length:
                continue
            # A failure stops the scan, not the count of this event's later deltas;
            # the caller sees ``detector_error`` and fails open or closed.
            try:
                self._scan_delta(text, choice, length)
            except Exception as e:
                self._fail(e)

    cdef _scan_delta(self, text, choice, Py_ssize_t length):
        cdef list batch
        if self.scan_batch_chars and self.enforcement is None:
            batch = self._batched.get(choice)
            if batch is None:
                self._batched[choice] = [text]
            else:
                batch.append(text)
            self._batched_chars += length
            if self._batched_chars >= self.scan_batch_chars:
                self._feed_batched()
        elif self.scan is not None:
            self._scan(self.scan.feed, text, choice)

    cdef _cut_at_cap(self, text):
        """The part of a delta (already counted in ``output_chars``, which is past
        ``max_scan_chars``) that is still within it, maybe none; the exchange is capped."""
        self.scan_capped = True
        return text[: max(0, len(text) - (self.output_chars - self.max_scan_chars))]


def expose(cls):
    """Let ``cls``, a dataclass over ``MonitorFields``, read and write the fields here:
    the dataclass leaves each field's default as a class attribute, which would hide
    them (its ``__init__`` keeps the defaults). Raises TypeError when the dataclass
    declares one of them without a default (it would take the C field's descriptor for
    its default). A C field the dataclass does not declare keeps its C default."""
    c_fields = [
        name for name, value in vars(MonitorFields).items()
        if type(value).__name__ in ("getset_descriptor", "member_descriptor")
    ]
    declared = cls.__dataclass_fields__
    for name in c_fields:
        field = declared.get(name)
        if field is None:
            continue  # not the dataclass's: the C default (None, 0, False) stands
        if field.default is vars(MonitorFields)[name] or (
            field.default is MISSING and field.default_factory is MISSING
        ):
            raise TypeError(f"{cls.__name__}.{name}: a field of MonitorFields needs a default")
        if name in cls.__dict__:
            delattr(cls, name)
    return cls
