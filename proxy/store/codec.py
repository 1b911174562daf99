"""The keyed records (``proxy.engine.records``) as bytes, in two encodings of one schema.

- A *journal line* (``journal_line`` / ``from_journal_line``): one JSON object, its
  arrays as base64 text; gzip packs a journal segment of them (``proxy.store.journal``).
- A *packed record* (``pack`` / ``unpack``): what replicas send each other through Redis
  (``proxy.store.redis_index``, which compresses it). The same JSON object without its
  arrays, whose raw little-endian bytes follow it: decoding is one small JSON parse and
  a view of each array, no base64. It starts with ``MAGIC``, which no JSON text or
  journal line starts with.

Both carry every field of a record; decoding raises ``ValueError``, ``OverflowError``,
``KeyError``, ``TypeError`` or ``IndexError`` on bytes that are not a record
(``DECODE_ERRORS``).
"""

from __future__ import annotations

import base64
import functools
import math
import struct
from collections.abc import Buffer
from typing import Any, Protocol

import numpy as np
import orjson

from proxy.engine.records import CanaryRecord, ChoiceRecord, OutputRecord, PromptRecord, Record
from proxy.store._codec import unit_columns

MAGIC = b"\x00ct1"
_HEAD = struct.Struct("<4sI")  # MAGIC, then the JSON header's length
_WIDTHS: dict[int, type] = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # bytes -> offsets' dtype
DECODE_ERRORS = (ValueError, OverflowError, KeyError, TypeError, IndexError, struct.error)


@functools.cache
def _little(dtype: type) -> np.dtype:
    """``dtype`` in little-endian byte order (made once: a dtype per array read cost a
    third of reading it)."""
    return np.dtype(dtype).newbyteorder("<")


class _Arrays(Protocol):
    """Where a record's arrays go: ``put`` returns what the JSON object holds in the
    array's place, ``get`` the array back from it. ``put_offsets`` / ``offsets``: the
    same for character offsets (non-negative, mostly small), read back as their
    little-endian bytes and the width of each."""

    def put(self, array: np.ndarray) -> Any: ...

    def get(self, ref: Any, dtype: type) -> np.ndarray: ...

    def put_offsets(self, array: np.ndarray) -> Any: ...

    def offsets(self, ref: Any) -> tuple[Buffer, int]: ...


class _Base64Arrays:
    """Arrays as base64 text inside the JSON object (journal lines)."""

    def put(self, array: np.ndarray) -> str:
        return base64.b64encode(array.astype(array.dtype.newbyteorder("<")).tobytes()).decode()

    def get(self, ref: Any, dtype: type) -> np.ndarray:
        return np.frombuffer(base64.b64decode(ref), dtype=_little(dtype)).astype(dtype)

    def put_offsets(self, array: np.ndarray) -> list[int]:
        return array.tolist()  # small numbers as JSON text: gzip packs them in a byte or two

    def offsets(self, ref: Any) -> tuple[Buffer, int]:
        return _column(ref, np.uint32).astype("<u4", copy=False).tobytes(), 4


class _RawArrays:
    """Arrays as raw little-endian bytes after the JSON object (packed records): the
    object holds ``[offset, count]``. Each array starts on a multiple of 8 bytes, so
    that the decoded arrays, read-only views of the bytes, are aligned for compiled
    code that reads them as 64-bit words."""

    def __init__(self, data: bytes = b"", base: int = 0) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.data, self.base = data, base

    def put(self, array: np.ndarray) -> list[int]:
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        ref = [self.size, len(array)]
        self.parts.append(raw + bytes(-len(raw) % 8))
        self.size += len(self.parts[-1])
        return ref

    def _start(self, ref: Any, itemsize: int) -> tuple[int, int]:
        """Where the array ``ref`` (``[offset, count, ...]``) starts in ``data``, and its
        count: ValueError when it does not lie within."""
        offset, count = int(ref[0]), int(ref[1])
        start = self.base + offset
        if offset < 0 or count < 0 or start + count * itemsize > len(self.data):
            raise ValueError("packed record: an array runs past the end")
        return start, count

    def get(self, ref: Any, dtype: type) -> np.ndarray:
        little = _little(dtype)
        start, count = self._start(ref, little.itemsize)
        return np.frombuffer(self.data, dtype=little, count=count, offset=start)

    def put_offsets(self, array: np.ndarray) -> list[int]:
        # As few bytes each as the largest needs (gaps between words and their lengths
        # mostly fit one): [offset, count, width].
        if len(array) and int(array.min()) < 0:
            raise ValueError("packed record: units out of order")
        largest = int(array.max()) if len(array) else 0
        width = 1 if largest <= 0xFF else 2 if largest <= 0xFFFF else 4
        return [*self.put(array.astype(_WIDTHS[width])), width]

    def offsets(self, ref: Any) -> tuple[Buffer, int]:
        width = int(ref[2])  # unit_columns refuses any but 1, 2 and 4
        start, count = self._start(ref, width)
        return memoryview(self.data)[start : start + count * width], width


# -- the schema -------------------------------------------------------------------------


def _choice_fields(c: ChoiceRecord, arrays: _Arrays) -> dict[str, Any]:
    # Offsets as gaps and lengths: small numbers.
    starts = c.starts.astype(np.int64)
    fields = {
        "c": c.choice,
        "u": arrays.put(c.units),
        "w": np.flatnonzero(c.weights == 1).tolist(),  # the few one-character units
        "n": np.flatnonzero(c.numbers).tolist(),
        "g": arrays.put_offsets(np.diff(starts, prepend=0)),
        "l": arrays.put_offsets(c.ends.astype(np.int64) - starts),
        "b": c.batches.tolist(),
        "q": np.diff(c.seqs.astype(np.int64), prepend=0).tolist(),
        "m": [list(m) for m in c.matches],
        "x": [list(x) for x in c.extracted],
        "ch": c.chars,
    }
    if c.foreign is not None:  # the few k-grams found another tenant's text
        fields["f"] = c.foreign.tolist()
    return fields


def _column(values: Any, dtype: type) -> np.ndarray:
    """A one-dimensional column of ``values``."""
    column: np.ndarray = np.array(values, dtype=dtype)
    if column.ndim != 1:
        raise ValueError("a column that is not a list")
    return column


def _choice_record(d: dict[str, Any], arrays: _Arrays) -> ChoiceRecord:
    # A replica ingests thousands of these a second: the unit columns in one compiled
    # pass (_codec.unit_columns).
    units = arrays.get(d["u"], np.uint64)
    weights, numbers, starts, ends = unit_columns(
        len(units), *arrays.offsets(d["g"]), *arrays.offsets(d["l"]), d["w"], d["n"]
    )
    return ChoiceRecord(
        int(d["c"]),
        units,
        weights,
        numbers,
        starts,
        ends,
        _column(d["b"], np.uint32),
        _running_sum(_column(d["q"], np.uint64)),
        tuple((int(s), int(e), str(i), int(f)) for s, e, i, f in d["m"]) if d["m"] else (),
        tuple((str(k), str(i), int(s), int(e)) for k, i, s, e in d["x"]) if d["x"] else (),
        int(d["ch"]),
        _foreign(d["f"], len(units)) if "f" in d else None,  # records before it: none
    )


def _tenants(values: Any) -> tuple[str, ...]:
    """A list of tenant names (ValueError else)."""
    if type(values) is not list or not all(type(t) is str for t in values):
        raise ValueError("tenants that are not a list of names")
    return tuple(values)


def _running_sum(gaps: np.ndarray) -> np.ndarray:
    """``numpy.cumsum`` of ``gaps``, but for a column of one (what a replica sends:
    ``collapsed``), which is its own sum: ~4 us less a choice."""
    return gaps if len(gaps) <= 1 else np.cumsum(gaps, dtype=np.uint64)


def _foreign(values: Any, units: int) -> np.ndarray:
    """A choice's ``foreign`` k-gram starts: increasing ints, each a unit of the choice
    (ValueError else: an ingesting engine indexes by them). Checked as a list: a few
    numbers, where numpy's calls cost more than the loop."""
    if type(values) is not list:
        raise ValueError("foreign k-grams that are not a list")
    previous = -1
    for value in values:
        if type(value) is not int or not previous < value < units:
            raise ValueError("foreign k-grams out of order or past the units")
        previous = value
    return np.array(values, dtype=np.uint32)


def _fields(record: Record, arrays: _Arrays) -> dict[str, Any]:
    if isinstance(record, PromptRecord):
        return {
            "t": "prompt",
            "time": record.time,
            "tenant": record.tenant,
            "rid": record.request_id,
            "u": arrays.put(record.units),
            "mu": arrays.put(record.model_units),
            "e": [list(e) for e in record.entities],
            "seq": record.seq,
            "lw": record.low_water,
            "tk": record.turns_known,
        }
    if isinstance(record, OutputRecord):
        return {
            "t": "output",
            "time": record.time,
            "tenant": record.tenant,
            "rid": record.request_id,
            "choices": [_choice_fields(c, arrays) for c in record.choices],
            "lw": record.low_water,
            "ps": record.prompt_seq,
            **({"cr": list(record.carries)} if record.carries else {}),
        }
    return {
        "t": "canary",
        "time": record.time,
        "tenant": record.tenant,
        "id": record.entity_id,
        "seq": record.seq,
    }


def _time(value: Any) -> float:
    when = float(value)
    if not math.isfinite(when):
        raise ValueError(f"time {value!r}")
    return when


def _record(d: dict[str, Any], arrays: _Arrays) -> Record:
    kind = d["t"]
    if kind == "prompt":
        return PromptRecord(
            str(d["tenant"]),
            str(d["rid"]),
            _time(d["time"]),
            arrays.get(d["u"], np.uint64),
            arrays.get(d["mu"], np.uint64),
            tuple((str(k), str(i)) for k, i in d["e"]),
            int(d["seq"]),
            int(d["lw"]),
            bool(d.get("tk", False)),  # journals before it: unknown, as plain completions
        )
    if kind == "output":
        return OutputRecord(
            str(d["tenant"]),
            str(d["rid"]),
            _time(d["time"]),
            tuple(_choice_record(c, arrays) for c in d["choices"]),
            int(d["lw"]),
            int(d["ps"]),
            _tenants(d.get("cr", [])),
        )
    if kind == "canary":
        return CanaryRecord(str(d["tenant"]), str(d["id"]), _time(d["time"]), int(d["seq"]))
    raise ValueError(f"unknown record type {kind!r}")


# -- the two encodings --------------------------------------------------------------------


def journal_line(record: Record) -> bytes:
    """One journal line (JSON, newline-terminated)."""
    return orjson.dumps(_fields(record, _Base64Arrays())) + b"\n"


def from_journal_line(line: bytes) -> Record:
    """A record from one journal line."""
    return _record(orjson.loads(line), _Base64Arrays())


def pack(record: Record) -> bytes:
    """``record`` packed: ``MAGIC``, the header's length, the JSON header, the arrays."""
    arrays = _RawArrays()
    head = orjson.dumps(_fields(record, arrays))
    head += b" " * (-len(head) % 8)  # the arrays start on a multiple of 8 bytes
    return b"".join((_HEAD.pack(MAGIC, len(head)), head, *arrays.parts))


def is_packed(data: bytes) -> bool:
    """Whether ``data`` is a packed record (not, say, a compressed journal line)."""
    return data[: len(MAGIC)] == MAGIC


def unpack(data: bytes) -> Record:
    """The record ``pack`` made; its arrays are read-only views of ``data``."""
    magic, size = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a packed record")
    body = _HEAD.size + size
    if body > len(data):
        raise ValueError("packed record: the header runs past the end")
    return _record(orjson.loads(data[_HEAD.size : body]), _RawArrays(data, body))
