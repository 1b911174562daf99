"""Check digits of identifiers (ISO/IEC 7812 Luhn): what makes a digit run a card
number rather than any 16 digits. One copy, used by the entity patterns, the simulator
that writes cards and the probe that plants one."""

from __future__ import annotations


def luhn_ok(digits: str) -> bool:
    """Whether a run of ASCII digits (nothing else) passes the Luhn check."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def luhn_complete(prefix: str) -> str:
    """``prefix`` (ASCII digits) with its Luhn check digit appended."""
    for check in "0123456789":
        if luhn_ok(prefix + check):
            return prefix + check
    raise AssertionError("one of ten check digits always fits")
