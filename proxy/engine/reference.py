"""The Python implementations that the compiled core (``proxy.engine._core``) replaced,
kept as the reference it is held to (``tests/test_core_parity.py``): never on the
detection path. Each returns exactly what the compiled function it names returns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.engine.fingerprint import _MASK, _PRIME, _mix64

_ASCII_UNIT_RE = re.compile(r"[^\W_]+", re.ASCII)


def ascii_units(text: str, offset: int = 0) -> tuple[list[str], list[int], list[int]]:
    """``_core.ascii_units``: the units of an ASCII text, by the regex the tokenizer used."""
    matches = list(_ASCII_UNIT_RE.finditer(text.lower()))
    return (
        [m.group() for m in matches],
        [m.start() + offset for m in matches],
        [m.end() + offset for m in matches],
    )


def kgrams(hashes: Sequence[int], k: int) -> list[int]:
    """``_core.kgrams``: ``Hasher.kgram`` of every window, one by one (the definition)."""
    out = []
    for i in range(len(hashes) - k + 1):
        h = 0
        for u in hashes[i : i + k]:
            h = (h * _PRIME + u) & _MASK
        out.append(_mix64(h))
    return out
