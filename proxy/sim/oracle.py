"""Ground truth for measuring detection: how much of a leak was *private*.

A leaked unit is private when it sits in a 4-unit shingle that the source used and no
other tenant ever used anywhere in the measured traffic (prompts, and answers minus the
text leaked into them). A shingle nobody used (noise in a partly overwritten page) is
no one's private text. This is an oracle with full hindsight, independent of the detector:
benchmarks and tests use it to decide which injected leaks must be found.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from proxy.engine.tokens import WORD_WEIGHT, units_of, words_in

ORACLE_K = 4


@dataclass(frozen=True, slots=True)
class Observed:
    """One exchange as the oracle needs it."""

    tenant: str
    prompt: str
    answer: str  # what the client received (or the engine sent)
    leaked_text: str = ""  # text a fault inserted into ``answer`` (not the tenant's use)


def shingles(text: str) -> list[tuple[str, ...]]:
    units = [u.text for u in units_of(text)]
    return [tuple(units[i : i + ORACLE_K]) for i in range(len(units) - ORACLE_K + 1)]


class PrivacyOracle:
    def __init__(self, exchanges: Iterable[Observed]) -> None:
        self.users: dict[tuple[str, ...], set[str]] = defaultdict(set)
        for ex in exchanges:
            own = ex.answer.replace(ex.leaked_text, "\n") if ex.leaked_text else ex.answer
            for text in (ex.prompt, own):
                for gram in shingles(text):
                    self.users[gram].add(ex.tenant)

    def private_mask(self, source: str, leaked: str) -> list[tuple[str, bool, int]]:
        """``(unit, private, weight)`` for each unit of ``leaked``."""
        units = units_of(leaked)
        private = [False] * len(units)
        for i in range(len(units) - ORACLE_K + 1):
            gram = tuple(u.text for u in units[i : i + ORACLE_K])
            if len(set(gram)) < 3:
                continue  # "I I I I": a loop says nothing about whose text it is
            if self.users.get(gram) == {source}:
                for j in range(i, i + ORACLE_K):
                    private[j] = True
        return [(u.text, p, u.weight) for u, p in zip(units, private, strict=True)]

    def private_run(self, source: str, leaked: str) -> float:
        """Longest run of private units of ``leaked``, in words (CJK character = 1/2)."""
        best = run = 0
        for _, private, weight in self.private_mask(source, leaked):
            run = run + weight if private else 0
            best = max(best, run)
        return best / WORD_WEIGHT

    def private_shingles(self, source: str, leaked: str) -> set[tuple[str, ...]]:
        """Shingles of ``leaked`` that only ``source`` used: none may reach a client
        once the leak is blocked."""
        return {g for g in shingles(leaked) if len(set(g)) >= 3 and self.users.get(g) == {source}}

    def words_to_detection(self, source: str, leaked: str, answer: str, detected_at: int) -> float:
        """Words of ``answer`` from the leak's first private word to ``detected_at`` (the
        output offset where the detector had enough, a finding's ``detected_at``): what an
        enforcing holdback must cover. 0 when the leak is not in ``answer`` as is."""
        start = answer.find(leaked)
        if start < 0:
            return 0.0
        units = units_of(leaked)
        mask = self.private_mask(source, leaked)
        first = next((u.start for u, (_, p, _) in zip(units, mask, strict=True) if p), 0)
        begin = start + first
        return words_in(answer[begin : max(begin, detected_at)])
