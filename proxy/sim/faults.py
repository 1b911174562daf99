"""Fault injection: the simulator's stand-in for a serving engine with KV-cache bugs.

Each fault reproduces one leak shape seen in public reports (docs/background.md, "What a leak looks like"): a page of
another request's prompt or output spliced into the answer, another user's entities, a whole
mis-routed response, or a corrupted page that degenerates into garbage. Every injected fault
is written as one JSON line to a truth file, so detectors can be scored against it.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from proxy.engine.checksums import luhn_ok
from proxy.sim.answers import count_units, is_mostly_cjk, question_part, split_units

FAULT_KINDS: tuple[str, ...] = ("prompt_page", "output_page", "entities", "misroute", "degenerate")
# Not in the default mix (the e2e tests' floors were measured without it): a prompt page
# with about one word in twelve replaced, as when a page is only partly overwritten.
EXTRA_FAULT_KINDS: tuple[str, ...] = ("noisy_page",)
ALL_FAULT_KINDS = FAULT_KINDS + EXTRA_FAULT_KINDS
#: Faults that copy a run of another tenant's text: judged by its private words.
PAGE_KINDS: tuple[str, ...] = ("prompt_page", "output_page", "misroute")
NOISE_RATE = 1 / 12
POSITIONS: tuple[str, ...] = ("prefix", "middle", "suffix", "whole")

# How many of the most recent foreign exchanges a fault may draw from: a KV page is reused
# soon after it is freed, so leaks come from requests that ran moments before.
RECENT_WINDOW = 32

# Entity patterns, most specific first: a card number must not be claimed by the phone regex.
ENTITY_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("api_key", re.compile(r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)?[A-Za-z0-9_]{16,}")),
    ("email", re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")),
    ("iban", re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){3,7}(?: ?[A-Z0-9]{1,3})?\b")),
    ("card", re.compile(r"\b\d{4}(?:[ -]?\d{4}){2}[ -]?\d{1,7}\b")),
    ("phone", re.compile(r"\+\d{1,3}(?:[ -]?\(?\d{1,4}\)?){2,5}\d")),
    ("account", re.compile(r"\b[A-Z]{2,5}-\d{5,}(?:-\d+)*\b")),
)

_ENTITY_SENTENCES: tuple[str, ...] = (
    "Your account {e} has been updated.",
    "We have sent the confirmation to {e}.",
    "The payment linked to {e} is now pending.",
    "For verification we used {e}.",
    "Contact details on file: {e}.",
    "The record for {e} was matched successfully.",
)

# Short phrases a corrupted decode loops on; rare and mixed-script characters for token soup.
_LOOP_PHRASES: tuple[str, ...] = (
    "the the", "and then", "of the", "I I", "```", "0.0.0.", "的的", "。。", "......", "Sure,",
)  # fmt: skip
_SOUP_CHARS = (
    "ѮѯѰѱ҂Ҋҋ", "ꙮꙭꙬ", "ⴰⴱⴲⴳ", "ᚠᚡᚢᚣ", "ꓐꓑꓒꓓ", "\u0f3a\u0f3b", "\ufffd", "ℤℚ∮∯",
    "ゐゑ", "ㄅㄆㄇ", "\u200b", "ﾊﾋﾌ", "▓▒░", "⸘⸙", "ἀἁἂ", "ᐁᐂᐃ", "𝔄𝔅", "꧁꧂",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault; serialised as one JSON line in the truth file.

    `leaked_text` is exactly the text inserted into the answer, at character `offset` of
    the answer as sent (a judge needs it when a proxy cut the stream before the leak's
    end). For "entities" it is the whole inserted sentence and `entities` lists the
    foreign values inside it. `leaked_words` counts foreign units: words, or characters
    for CJK sources (for "entities": the entities' words).
    """

    request_id: str
    victim_tenant: str
    source_tenant: str | None
    source_request_id: str | None
    kind: str
    leaked_text: str
    leaked_words: int
    position: str
    entities: tuple[str, ...] = field(default=())
    offset: int = 0

    def to_json(self) -> dict:
        """Plain-JSON view of the fault (lists instead of tuples)."""
        data = asdict(self)
        data["entities"] = list(self.entities)
        return data


@dataclass(frozen=True, slots=True)
class Exchange:
    """A completed request remembered for later leaks."""

    tenant: str
    request_id: str
    prompt: str
    output: str
    private: str


def luhn_valid(digits: str) -> bool:
    """Luhn checksum of a card number of 12 digits or more (spaces and dashes ignored)."""
    nums = "".join(c for c in digits if "0" <= c <= "9")
    return len(nums) >= 12 and luhn_ok(nums)


def extract_entities(text: str) -> list[str]:
    """Emails, IBANs, phones, Luhn-valid card numbers, account ids and API keys in `text`."""
    found: list[tuple[int, int, str]] = []
    for kind, pattern in ENTITY_PATTERNS:
        for m in pattern.finditer(text):
            if any(m.start() < e and s < m.end() for s, e, _ in found):
                continue
            value = m.group(0)
            if kind == "card" and not luhn_valid(value):
                continue
            found.append((m.start(), m.end(), value))
    return [v for _, _, v in sorted(found)]


_NONBLANK_RE = re.compile(r"\S+")


def _slice_units(
    text: str, spans: list[tuple[int, int]], n: int, rng: random.Random, at_end: bool
) -> tuple[str, int]:
    """Slice n consecutive units (given by their spans) out of the original text.

    Slicing the original string, rather than re-joining words, keeps newlines and spacing,
    so the page is verbatim source text.
    """
    if not spans:
        return "", 0
    n = min(n, len(spans))
    first = len(spans) - n if at_end else rng.randint(0, len(spans) - n)
    return text[spans[first][0] : spans[first + n - 1][1]], n


def take_page(text: str, n: int, rng: random.Random, *, at_end: bool = False) -> tuple[str, int]:
    """A contiguous page of n units of `text`: words, or characters when mostly CJK.

    With `at_end` the page is the last n units (the KV page holding the end of a prompt).
    """
    if is_mostly_cjk(text):
        spans = [(i, i + 1) for i, c in enumerate(text) if not c.isspace()]
    else:
        spans = [m.span() for m in _NONBLANK_RE.finditer(text)]
    return _slice_units(text, spans, n, rng, at_end)


def splice(answer: str, insert: str, rng: random.Random) -> tuple[str, str, int]:
    """Insert `insert` at a random unit boundary of `answer`; returns (new answer,
    position, character offset of `insert` in the new answer).

    Styles vary like real corruption: glued mid-sentence with no punctuation, or as its own
    paragraph. The inserted text itself is never altered, so it stays findable verbatim.
    """
    units = split_units(answer)
    cut = rng.randint(0, len(units))
    before, after = "".join(units[:cut]).rstrip(), "".join(units[cut:]).lstrip()
    cjk = is_mostly_cjk(answer)
    if rng.random() < 0.3:
        sep_l, sep_r = "\n\n", "\n\n"
    elif cjk:
        sep_l, sep_r = "", ""
    else:
        sep_l, sep_r = " ", " "
    if not before:
        return insert + (sep_r + after if after else ""), "prefix", 0
    head = before + sep_l
    if not after:
        return head + insert, "suffix", len(head)
    return head + insert + sep_r + after, "middle", len(head)


def add_noise(page: str, answer: str, rng: random.Random) -> str:
    """``page`` with about ``NOISE_RATE`` of its words replaced by words of ``answer``:
    a page only partly overwritten mixes the two requests' tokens."""
    fillers = _NONBLANK_RE.findall(answer) or ["the"]
    if is_mostly_cjk(page):
        return "".join(
            rng.choice(fillers)[:1] if not c.isspace() and rng.random() < NOISE_RATE else c
            for c in page
        )
    return _NONBLANK_RE.sub(
        lambda m: rng.choice(fillers) if rng.random() < NOISE_RATE else m.group(), page
    )


def degenerate_text(answer: str, rng: random.Random) -> tuple[str, str, str, int]:
    """Corrupt an answer into garbage; returns (new answer, garbage inserted, position,
    character offset of the garbage)."""
    style = rng.choice(("loop", "soup", "truncated"))
    units = split_units(answer)
    keep = "".join(units[: rng.randint(0, max(0, len(units) * 2 // 3))]).rstrip()
    if style == "loop":
        phrase = rng.choice(_LOOP_PHRASES)
        garbage = " ".join([phrase] * rng.randint(20, 80))
    elif style == "soup":
        garbage = "".join(
            rng.choice(_SOUP_CHARS) + ("" if rng.random() < 0.6 else " ")
            for _ in range(rng.randint(15, 60))
        )
    else:
        # A page from a freed block: the answer stops mid-sentence, then unrelated token ids.
        garbage = " ".join(
            rng.choice(("<|endoftext|>", "<unk>", "ĠĠ", "▁", "0x" + f"{rng.getrandbits(16):04x}"))
            for _ in range(rng.randint(5, 25))
        )
    garbage = garbage.strip()
    if not keep:
        return garbage, garbage, "whole", 0
    return keep + " " + garbage, garbage, "suffix", len(keep) + 1


class FaultInjector:
    """Corrupts answers with leaks from other tenants' recent exchanges, at a given rate.

    Not a model of any one engine bug: it reproduces the *shapes* leaks take at the proxy.
    Single event loop use; truth-file writes are serialised by a lock anyway.
    """

    def __init__(
        self,
        rate: float,
        *,
        seed: int = 0,
        kinds: Sequence[str] = FAULT_KINDS,
        page_words: Sequence[int] = (4, 8, 12, 16, 32, 64),
        history: int = 256,
        truth_path: str | Path | None = None,
    ) -> None:
        unknown = [k for k in kinds if k not in ALL_FAULT_KINDS]
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; expected some of {ALL_FAULT_KINDS}")
        if not kinds:
            raise ValueError("at least one fault kind is required")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {rate}")
        self.rate = rate
        self.kinds = tuple(kinds)
        self.page_words = tuple(page_words)
        self.truth_path = Path(truth_path) if truth_path is not None else None
        self._rng = random.Random(seed)
        self._ring: deque[Exchange] = deque(maxlen=history)
        self._lock = threading.Lock()
        # Bounded: the server runs for days; the truth file is the complete record.
        self.faults: deque[Fault] = deque(maxlen=4096)
        self.fault_count = 0

    def remember(
        self, tenant: str, request_id: str, prompt: str, output: str, *, private: str | None = None
    ) -> None:
        """Record a completed exchange. `private` is the last user message when known."""
        if private is None or not private.strip():
            private = question_part(prompt)
        self._ring.append(Exchange(tenant, request_id, prompt, output, private))

    def apply(
        self,
        tenant: str,
        request_id: str,
        prompt: str,
        answer: str,
        *,
        force: str | None = None,
        source: str | None = None,
        words: int | None = None,
    ) -> tuple[str, Fault | None]:
        """Maybe corrupt `answer`; returns (answer to send, fault or None).

        With `force` set to a kind name the fault is always attempted (the kind need not be in
        `kinds`). Leaks need a recent exchange of a different tenant; without one, no fault.
        Test hooks: `source` (a request id) leaks from that exchange only, and `words` sets
        a page's size.
        """
        del prompt  # the victim's own prompt is never the source of a cross-tenant leak
        if force is not None:
            if force not in ALL_FAULT_KINDS:
                raise ValueError(f"unknown fault kind {force!r}; expected one of {ALL_FAULT_KINDS}")
            kind = force
        else:
            if self.rate <= 0.0 or self._rng.random() >= self.rate:
                return answer, None
            kind = self._rng.choice(self.kinds)
        fault_answer = self._inject(kind, tenant, request_id, answer, source, words)
        if fault_answer is None:
            return answer, None
        new_answer, fault = fault_answer
        self._record(fault)
        return new_answer, fault

    def _candidates(self, tenant: str, source: str | None = None) -> list[Exchange]:
        if source is not None:
            # Named by a test: that exchange, whoever the requests claimed to be (a client
            # that sends another tenant's name is still another client).
            return [e for e in self._ring if e.request_id == source]
        return [e for e in self._ring if e.tenant != tenant][-RECENT_WINDOW:]

    def _pick(self, candidates: Sequence[Exchange]) -> Exchange:
        """One candidate, favouring the most recent (linear weights)."""
        weights = list(range(1, len(candidates) + 1))
        return self._rng.choices(candidates, weights=weights, k=1)[0]

    def _inject(
        self,
        kind: str,
        tenant: str,
        request_id: str,
        answer: str,
        source_id: str | None = None,
        words: int | None = None,
    ) -> tuple[str, Fault] | None:
        rng = self._rng
        if kind == "degenerate":
            new, garbage, position, offset = degenerate_text(answer, rng)
            return new, Fault(
                request_id,
                tenant,
                None,
                None,
                kind,
                garbage,
                count_units(garbage),
                position,
                offset=offset,
            )
        candidates = self._candidates(tenant, source_id)
        if not candidates:
            return None
        if kind == "entities":
            with_entities = [e for e in candidates if extract_entities(e.prompt)]
            if with_entities:
                return self._entities(tenant, request_id, answer, self._pick(with_entities))
            kind = "prompt_page"
        source = self._pick(candidates)
        if kind == "misroute":
            leaked = source.output
            return leaked, Fault(
                request_id,
                tenant,
                source.tenant,
                source.request_id,
                kind,
                leaked,
                count_units(leaked),
                "whole",
            )
        n = words or rng.choice(self.page_words)
        if kind in ("prompt_page", "noisy_page"):
            # The private part is what matters; a shared system prompt is no secret. When the
            # private part is shorter than a page, leak the page that ends the prompt: it holds
            # the whole private part plus the tail of what precedes it.
            if count_units(source.private) >= n:
                page, units = take_page(source.private, n, rng)
            else:
                page, units = take_page(source.prompt, n, rng, at_end=True)
        else:
            page, units = take_page(source.output, n, rng)
        if not page:
            return None
        if kind == "noisy_page":
            page = add_noise(page, answer, rng)
        new, position, offset = splice(answer, page, rng)
        return new, Fault(
            request_id,
            tenant,
            source.tenant,
            source.request_id,
            kind,
            page,
            units,
            position,
            offset=offset,
        )

    def _entities(
        self, tenant: str, request_id: str, answer: str, source: Exchange
    ) -> tuple[str, Fault]:
        rng = self._rng
        found = list(dict.fromkeys(extract_entities(source.prompt)))
        chosen = rng.sample(found, k=min(len(found), rng.randint(1, 3)))
        sentence = " ".join(rng.choice(_ENTITY_SENTENCES).format(e=e) for e in chosen)
        new, position, offset = splice(answer, sentence, rng)
        units = sum(len(e.split()) for e in chosen)
        return new, Fault(
            request_id,
            tenant,
            source.tenant,
            source.request_id,
            "entities",
            sentence,
            units,
            position,
            tuple(chosen),
            offset,
        )

    def _record(self, fault: Fault) -> None:
        """Keep the fault and append it to the truth file, flushed line by line."""
        self.faults.append(fault)
        self.fault_count += 1
        if self.truth_path is None:
            return
        line = json.dumps(fault.to_json(), ensure_ascii=False) + "\n"
        with self._lock, self.truth_path.open("a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
