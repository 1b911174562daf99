"""Distinctive entities: strings that identify a person or an account.

``extract_entities`` finds them in a text (emails, phone numbers, IBANs, card numbers,
national ids, API keys and tokens, long digit ids, URLs carrying secrets), validating
checksums where the format has one so that ordinary numbers are not mistaken for cards
or IBANs. ``EntityIndex`` keeps the live ones in pyahocorasick automata, rebuilt in
generations (a large *base* rebuilt rarely, a small *recent* one rebuilt often, and a
short pending list scanned directly until the next rebuild), and ``EntityScanner`` scans
an output stream against them with the automaton state carried across deltas.

Matching is on lowercased text, exactly: a leaked page is a verbatim copy.
"""

from __future__ import annotations

import itertools
import re
import string
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import ahocorasick

from proxy.engine._entities import (
    CASE_NEEDS,
    ENTITY_NEEDS,
    EntityFeed,
    EntityIndexFields,
    entity_needs,
)
from proxy.engine._records import EntityOwner
from proxy.engine._tables import untracked
from proxy.engine.checksums import luhn_ok

MIN_ENTITY_CHARS = 6
# pyahocorasick 2.x crashes (segfault) when an iterator continued with set(..., False)
# meets characters outside the Basic Multilingual Plane; no entity contains one, so
# they are replaced one-for-one (offsets are unchanged).
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
MAX_ENTITY_CHARS = 256


def iban_ok(iban: str) -> bool:
    s = iban.replace(" ", "").upper()
    if not 15 <= len(s) <= 34:
        return False
    rearranged = s[4:] + s[:4]
    try:
        return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1
    except ValueError:
        return False


_NON_DIGIT = re.compile(r"\D")


def _digits(s: str) -> str:
    return _NON_DIGIT.sub("", s)


def _any(_: str) -> bool:
    return True


def fold(text: str) -> str:
    """Lowercase without changing the length (``"İ".lower()`` has two characters), so
    that offsets into the folded stream are offsets into the output."""
    if text.isascii():
        return text.lower()
    return "".join(low if len(low := ch.lower()) == 1 else ch for ch in text)


def _word_char(ch: str) -> bool:
    """Entities are ASCII: a CJK character next to one is a boundary, not a word."""
    return ch.isascii() and ch.isalnum()


def _is_number(key: str) -> bool:
    """Whether ``key`` is written as a number: digits and digit-group separators only."""
    return key.strip("0123456789,.") == "" and key[0].isdigit() and key[-1].isdigit()


def _on_boundaries(text: str, start: int, end: int, key: str) -> bool:
    """Whether ``key``, found at ``text[start:end]``, stands alone: not inside a longer
    word, nor a number inside a longer one (``449.51`` in ``2,449.51``: a digit group's
    separator between digits joins them). An identifier (``ref-76859772``, letters or
    hyphens in it) is not a number: a period and digits after it are the next
    sentence's (``ref-76859772.25日までに``, a CJK sentence written without a space)."""
    before = text[start - 1] if start > 0 else " "
    after = text[end] if end < len(text) else " "
    if (_word_char(key[0]) and _word_char(before)) or (_word_char(key[-1]) and _word_char(after)):
        return False
    if not _is_number(key):
        return True
    if before in ",." and start > 1 and text[start - 2].isdigit():
        return False
    return not (after in ",." and text[end + 1 : end + 2].isdigit())


@dataclass(frozen=True, slots=True)
class AnchoredPattern:
    """A pattern tried only near its *anchor*: ``finditer`` finds what the pattern's own
    ``finditer`` finds, given that every match holds a whole match of ``anchor`` (which
    ``anchor.search`` from the previous match's end finds whole) beginning at most
    ``lead`` characters after the match's start. Then the leftmost match from ``pos``
    begins within ``lead`` characters before the first anchor from ``pos``, or before a
    later one; ``match`` at a position answers as ``finditer`` would there (both see the
    whole string, so ``\\b`` and look-behinds read the characters before it). For a
    pattern that would try every word start, most of a text is then skipped."""

    pattern: re.Pattern[str]
    anchor: re.Pattern[str]
    lead: int

    def search(self, text: str) -> re.Match[str] | None:
        return self.pattern.search(text)

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        pos = 0
        while found := self.anchor.search(text, pos):
            for start in range(max(pos, found.start() - self.lead), found.start() + 1):
                if m := self.pattern.match(text, start):
                    yield m
                    pos = m.end()
                    break
            else:
                pos = found.end()  # no match holds this anchor: one must begin after it


@dataclass(frozen=True, slots=True)
class RunBeforePattern:
    """A pattern whose every match begins with a run of ``run`` characters followed by
    the character ``at``, which ``run`` does not hold (an email's local part and its
    "@"): tried only at the start of the run before each ``at``. ``finditer`` finds what
    the pattern's own ``finditer`` finds, when the pattern reads nothing before a match
    (no ``\b``, no look-behind): a match that holds that ``at`` can only begin in the
    run; the leftmost begins where the run does (from ``pos``), and where it fails, a
    later start in the run fails too (the rest is the same text). An email pattern tried
    at every word start took ~45 us a kilobyte that holds an "@"."""

    pattern: re.Pattern[str]
    at: str
    run: frozenset[str]

    def search(self, text: str) -> re.Match[str] | None:
        return self.pattern.search(text)

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        pos = 0
        while (at := text.find(self.at, pos)) != -1:
            start = at
            while start > pos and text[start - 1] in self.run:
                start -= 1
            if start < at and (m := self.pattern.match(text, start)):
                yield m
                pos = m.end()
            else:
                pos = at + 1


# (kind, pattern, validator). Order matters: the first kind to claim a span wins.
_PATTERNS: list[
    tuple[str, re.Pattern[str] | AnchoredPattern | RunBeforePattern, Callable[[str], bool]]
] = [
    (
        "email",
        RunBeforePattern(
            re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-z]{2,}", re.I | re.A),
            at="@",
            run=frozenset(string.ascii_letters + string.digits + "_.+-"),  # re.A's \w
        ),
        _any,
    ),
    (
        "url_secret",
        re.compile(
            r"https?://[^\s\"'<>]*?(?:[?&](?:token|key|sig|signature|secret|password|"
            r"access_token|api_key|auth)=[^\s&\"'<>]{6,}|//[^\s/@:]+:[^\s/@]+@)[^\s\"'<>]*",
            re.I | re.A,
        ),
        _any,
    ),
    (
        "api_key",
        re.compile(
            r"\b(?:sk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|"
            r"AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}|"
            r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})",
            re.A,
        ),
        _any,
    ),
    (
        "iban",
        re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b", re.A),
        iban_ok,
    ),
    ("card", re.compile(r"\b\d(?:[ -]?\d){12,18}\b", re.A), lambda s: luhn_ok(_digits(s))),
    ("national_id", re.compile(r"\b\d{3}-\d{2}-\d{4}\b|\b[A-Z]{2}\d{6}[A-D]\b", re.A), _any),
    # Anchored at its "+" or "(", where every match begins: its look-behind made the
    # pattern try every position of a text (~45 us a kilobyte that holds a "+" or "(").
    (
        "phone",
        AnchoredPattern(
            re.compile(
                r"(?<![\w+])\+\d{1,3}[ .-]?\(?\d{1,4}\)?(?:[ .-]?\d{2,4}){2,4}\b"
                r"|\(\d{3}\) ?\d{3}-\d{4}\b"
            ),
            anchor=re.compile(r"[+(]"),
            lead=0,
        ),
        lambda s: 8 <= len(_digits(s)) <= 15,
    ),
    # Long numbers, and shorter ones that a prefix marks as an account's or a customer's
    # (CUS-8591332, ACC1234567): seven digits alone are amounts and counts too often.
    # Anchored at its run of digits, which it holds whole (a digit before the run would
    # fail its \b, the greedy run ends at its last digit) at most five characters
    # ([A-Z]{2,4}-?) from its start: with re.I every word start was a candidate, ~80 us
    # an answer that held a long number.
    (
        "digit_id",
        AnchoredPattern(
            re.compile(r"\b(?:[A-Z]{2,4}-?\d{7,}|[A-Z]{0,4}-?\d{8,})\b", re.I | re.A),
            anchor=re.compile(r"\d{7,}", re.A),
            lead=5,
        ),
        _any,
    ),
    (
        "token",  # generic secrets: long mixed-case alphanumerics with digits
        re.compile(
            r"\b(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[a-z])(?=[A-Za-z0-9_-]*[A-Z])[A-Za-z0-9_-]{24,}\b"
        ),
        _any,
    ),
]


# What a text must contain for a kind's pattern to match at all, found in one compiled
# pass (``_entities.entity_needs``: exact, each condition is implied by its pattern). Most
# texts hold no entity of most kinds: their patterns, whose leading \b or look-behind
# makes them try every position, never run (the phone pattern took 36-44 us a kilobyte
# of text that holds no phone number).
_NEEDS: dict[str, int] = ENTITY_NEEDS


def needs(kind: str, text: str) -> bool:
    """Whether ``kind``'s pattern can match in ``text`` (False: it cannot)."""
    return bool(entity_needs(text) & _NEEDS[kind])


# Strings shaped like entities that belong to nobody: what documentation, tutorials and
# models write as examples for everyone (docs/background.md, "Shared text that is not a
# leak"). Reserved example domains (RFC 2606, RFC 6761) and placeholder mailboxes:
_EXAMPLE_DOMAIN = re.compile(
    r"(?:^|\.)(?:example(?:\.[a-z]{2,3}){1,2}|[a-z0-9-]+\.(?:example|test|invalid|localhost)|"
    r"localhost|domain\.com|email\.com|yourcompany\.com|company\.com)$"
)
_PLACEHOLDER_MAILBOX = re.compile(
    r"^(?:john|jane)[._]?doe|^(?:your|my)[._]?(?:name|email)|^(?:user|username|name|someone|"
    r"test|foo|bar|email|me|you)$"
)
# A role mailbox (support@, info@...) at a free-mail provider is what a model writes
# when it invents a contact address: no tenant's help desk is ``support@gmail.com``.
# The same role at any other domain may be a tenant's company and stays an entity.
_ROLE_MAILBOX = re.compile(
    r"^(?:support|help|helpdesk|info|contact|admin|office|service|customerservice|"
    r"customer[._-]?service|sales|billing|hello|team|noreply|no[._-]?reply|enquiries|"
    r"inquiries)$"
)
_FREE_MAIL_DOMAIN = re.compile(
    r"^(?:gmail|googlemail|yahoo|ymail|outlook|hotmail|live|msn|aol|icloud|me|mail|gmx|"
    r"web|proton|protonmail|yandex|zoho|t-online|free|orange|laposte|libero|virgilio|"
    r"seznam|wp|onet|qq|163)\.(?:[a-z]{2,3})(?:\.[a-z]{2})?$"
)
# Published test and documentation numbers: card networks' and payment processors' test
# cards, the IBANs of standards and bank documentation, the SSNs of famous misuse.
_DOCUMENTED = frozenset(
    {
        "4111111111111111", "4242424242424242", "4012888888881881", "4000056655665556",
        "4000000000000002", "5555555555554444", "5105105105105100", "2223003122003222",
        "378282246310005", "371449635398431", "6011111111111117", "6011000990139424",
        "3056930009020004", "36227206271667", "3566002020360505", "6200000000000005",
        "gb82west12345698765432", "gb29nwbk60161331926819", "de89370400440532013000",
        "fr1420041010050500013m02606", "es9121000418450200051332", "nl91abna0417164300",
        "it60x0542811101000000123456", "ch9300762011623852957", "be68539007547034",
        "at611904300234573201", "123456789", "078051120", "219099999",
    }
)  # fmt: skip


def public_number_texts() -> set[str]:
    """Digit groups that are public by convention, never a specific of anyone's: the
    groups of the documented numbers above, the fictional 555 exchange and its 0100-0199
    lines, repeated digits and counting runs. A run of another tenant's output is not
    made specific by one of them (``_ChoiceState.specific``)."""
    groups = {g for value in _DOCUMENTED for g in re.findall(r"\d{3,}", value)}
    for value in ("4111 1111 1111 1111", "4242 4242 4242 4242", "5555 5555 5555 4444"):
        groups.update(value.split())
    groups.update(f"0{line}" for line in range(100, 200))
    groups.update(d * n for d in "0123456789" for n in range(3, 11))
    groups.update("1234567890"[:n] for n in range(3, 11))
    groups.update("0123456789"[:n] for n in range(3, 11))
    groups.add("555")
    return groups


_FILLER = re.compile(
    r"x{4,}|your[-_]?(?:api[-_]?)?(?:key|token|secret)|example|placeholder|dummy", re.I
)


_NOT_ALNUM = re.compile(r"[^a-z0-9]")
_SPACE_OR_HYPHEN = re.compile(r"[\s-]")
_SECRET_PREFIX = re.compile(r"^(?:sk-(?:proj-|ant-)?|gh[pousr]_|xox[abpr]-|akia)")


def _monotonous(text: str) -> bool:
    """Token soup: few distinct characters, one short pattern repeated, or a counting run
    (``12345678``, ``abcdefgh``) -- what a filler value or a broken model writes."""
    body = _NOT_ALNUM.sub("", text.lower())
    n = len(body)
    if n < MIN_ENTITY_CHARS:
        return False
    if len(set(body)) <= max(2, n // 8):
        return True
    if any(body == (body[:p] * (n // p + 1))[:n] for p in range(1, 5)):
        return True
    # A counting run: each character the one after (or before) the one before it.
    first = ord(body[0])
    return body in (_counting_run(first, n, 1), _counting_run(first, n, -1))


def _counting_run(first: int, n: int, step: int) -> str:
    """``n`` characters from code point ``first`` on, ``step`` apart (fewer where they
    would leave Unicode's range)."""
    return "".join(map(chr, range(first, max(-1, min(first + step * n, 0x110000)), step)))


def is_placeholder(kind: str, value: str) -> bool:
    """Whether an entity-shaped ``value`` of ``kind`` is an example that belongs to nobody:
    a reserved example domain, a placeholder mailbox or a role mailbox at a free-mail
    provider, a published test or documentation
    number, an invalid US SSN, a fictional 555 phone number, filler (``xxxx``,
    ``EXAMPLE``, ``your-api-key``) or token soup."""
    low = value.lower()
    if kind == "email":
        mailbox, _, domain = low.partition("@")
        return bool(
            _EXAMPLE_DOMAIN.search(domain)
            or _PLACEHOLDER_MAILBOX.search(mailbox)
            or (_ROLE_MAILBOX.match(mailbox) and _FREE_MAIL_DOMAIN.match(domain))
        )
    digits = _digits(value)
    if _SPACE_OR_HYPHEN.sub("", low) in _DOCUMENTED or (digits and digits in _DOCUMENTED):
        return True
    if kind == "national_id" and len(digits) == 9:
        area, group, serial = digits[:3], digits[3:5], digits[5:]
        return area in ("000", "666") or area[0] == "9" or group == "00" or serial == "0000"
    if kind == "phone":
        national = digits[1:] if len(digits) == 11 and digits[0] == "1" else digits
        return len(national) == 10 and "555" in (national[:3], national[3:6])
    if _FILLER.search(value):
        return True
    if kind in ("api_key", "token", "digit_id", "card", "url_secret"):
        return _monotonous(_SECRET_PREFIX.sub("", low))
    return False


@dataclass(frozen=True, slots=True)
class Entity:
    kind: str
    text: str
    start: int
    end: int


def extract_entities(text: str, present: int | None = None) -> list[Entity]:
    """Entities in ``text``, non-overlapping, in order of position. Placeholders
    (``is_placeholder``) claim their span but are not returned: nobody owns them.
    ``present``: ``entity_needs(text)``, when the caller has it."""
    claimed: list[tuple[int, int]] = []
    found: list[Entity] = []
    present = entity_needs(text) if present is None else present
    for kind, pattern, valid in _PATTERNS:
        if not present & _NEEDS[kind]:
            continue
        for m in pattern.finditer(text):
            s, e = m.span()
            value = m.group(0).rstrip(".,;:)")
            e = s + len(value)
            if not MIN_ENTITY_CHARS <= len(value) <= MAX_ENTITY_CHARS or not valid(value):
                continue
            if any(s < ce and cs < e for cs, ce in claimed):
                continue
            claimed.append((s, e))
            if not is_placeholder(kind, value):
                found.append(Entity(kind, value, s, e))
    found.sort(key=lambda ent: ent.start)
    return found


class EntityIndex(EntityIndexFields):
    """Live entities of the window, by id (the keyed hash of the folded entity), with
    their owners.

    An entity seen in this process also has its folded text, which goes into the
    automata that scan outputs; one known only by id (from a journal or another replica)
    is matched by id, against the entities found in an output.
    """

    def __init__(self, *, recent_max: int = 4096, rebuild_interval: float = 0.2) -> None:
        # generation, pending (id, text) not in an automaton yet, longest, _last_rebuild,
        # rebuild_interval: fields of _entities.EntityIndexFields, which every delta's entity
        # step reads.
        super().__init__(MIN_ENTITY_CHARS, rebuild_interval)
        self.table: dict[str, EntityOwner] = {}
        self._texts: dict[str, str] = {}  # id -> folded text, for the automata
        self._by_time: deque[tuple[float, str, str]] = deque()  # (time, id, tenant)
        self.recent_max = recent_max
        self.base: ahocorasick.Automaton | None = None
        # Keys added since the base was built, in automata of decreasing size: each
        # rebuild makes one of the new keys, merged with the newer levels no larger
        # than it (a binary counter), so a key is rebuilt into an automaton about
        # log2(recent_max) times, not at every rebuild (one of all recent keys took
        # 4-6 ms, on the delta that ran it).
        self._levels: list[tuple[list[tuple[str, str]], ahocorasick.Automaton | None]] = []

    def add(
        self,
        entity_id: str,
        kind: str,
        tenant: str,
        value: int,
        now: float,
        *,
        text: str | None = None,
        pin: bool = False,
    ) -> None:
        if text is not None and _ASTRAL.search(text):
            text = None  # cannot go into an automaton (see _ASTRAL); matched by id only
        # The tuples kept below live as long as the entity: untracked, a young collection
        # does not walk each once on its way to the oldest generation (issue 16).
        owner = self.table.get(entity_id)
        if owner is None:
            owner = self.table[entity_id] = EntityOwner(kind)
        if text is not None and entity_id not in self._texts:
            self._texts[entity_id] = text
            self.pending.append(untracked((entity_id, text)))
            # Its end in the prefilter now, not at the rebuild: a delta where no key's
            # end is skips the pending keys' search as well as the automata.
            self.add_finals((text,))
            self.longest = max(self.longest, len(text))
        owner.tenants[tenant] = untracked((value, now))
        owner.prompted |= not value & 1
        owner.pinned |= pin
        if not owner.pinned:
            self._by_time.append(untracked((now, entity_id, tenant)))
        self._count_id_only()

    def expire(self, older_than: float) -> int:
        """Forget uses older than ``older_than``, oldest first (amortised: each use is
        looked at once); returns entities dropped. The automata still hold dropped keys
        until the next base rebuild: a match on a key no longer in ``table`` is
        ignored."""
        dropped = 0
        queue = self._by_time
        while queue and queue[0][0] < older_than:
            _, entity_id, tenant = queue.popleft()
            owner = self.table.get(entity_id)
            if owner is None or owner.pinned:
                continue
            use = owner.tenants.get(tenant)
            if use is not None and use[1] < older_than:  # not renewed since
                del owner.tenants[tenant]
                if not owner.tenants:
                    del self.table[entity_id]
                    self._texts.pop(entity_id, None)
                    dropped += 1
        self._count_id_only()
        return dropped

    def _count_id_only(self) -> None:
        """``id_only``: the live keys with no text, which the compiled delta step reads
        to know whether streams must look keys up by id (``EntityScanner.match_ids``)."""
        self.id_only = len(self.table) - len(self._texts)

    def forget_texts(self) -> None:
        """Keep every live key by id only, as a replica holds the entities it ingested
        from others (Redis and the journal carry no text): ``bench/engine.py
        --remote-entities`` measures the by-id scan so."""
        self._texts.clear()
        self.pending, self.base, self._levels = [], None, []
        self.clear_finals()
        self.generation += 1
        self._count_id_only()

    def maybe_rebuild(self, now: float | None = None) -> None:
        """Move pending keys into an automaton, at most every ``rebuild_interval`` s."""
        if not self.pending:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_rebuild < self.rebuild_interval and len(self.pending) < 256:
            return
        self._last_rebuild = now
        moved, self.pending = self.pending, []
        if sum(len(keys) for keys, _ in self._levels) + len(moved) > self.recent_max:
            self.base = _automaton(self._texts.items())
            self._levels = []
            self.clear_finals()  # keys expired since the last base go with it
            self.add_finals(self._texts.values())
        else:
            entries = moved
            while self._levels and len(self._levels[-1][0]) <= len(entries):
                entries = self._levels.pop()[0] + entries
            self._levels.append((entries, _automaton(entries)))  # their ends: marked by add
        self.generation += 1

    def automata(self) -> list[ahocorasick.Automaton]:
        return [a for a in (self.base, *(level for _, level in self._levels)) if a is not None]


def _automaton(entries: Iterable[tuple[str, str]]) -> ahocorasick.Automaton | None:
    """An automaton over ``(id, text)`` entries; a match yields ``(id, text)``."""
    a = ahocorasick.Automaton()
    for entity_id, text in entries:
        a.add_word(text, untracked((entity_id, text)))
    if len(a) == 0:
        return None
    a.make_automaton()
    return a


# ``EntityScanner.match_ids``: the context kept before the new text (keys longer than it
# that began before are found by ``finish``'s extraction, as before).
_ID_CARRY = 64


class EntityScanner(EntityFeed):
    """Scans one output stream (lowercased deltas) for live entities.

    A delta is searched with the last ``longest - 1`` characters before it, so that an
    entity cut across deltas (or by a swap of the automata) is still found; the automata
    run only when some key's last characters end in it (``EntityIndexFields``'
    prefilter), which most deltas fail. Keys still pending (added since the last
    rebuild, their ends in the prefilter already) are searched in that window directly.
    A match must stand on word boundaries (so ``12345678`` does not match inside
    ``9123456789``); a match that ends exactly at the end of the text so far is confirmed
    by the next delta or by ``finish``. ``feed`` is compiled (``_entities.EntityFeed``; ``reference.entity_feed`` is
    the Python it replaced).
    """

    def __init__(
        self,
        index: EntityIndex,
        keys_of: Callable[[str], Iterable[tuple[str, str]]] | None = None,
        id_of: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__(index, fold, _ASTRAL.sub)
        # The by-id scan (``match_ids``; none without ``id_of``): the engine's key
        # extraction and keyed hash, and the raw text from ``_ID_CARRY`` characters
        # before ``ids_done`` on (with the deltas not joined yet).
        self._keys_of = iter_entity_keys if keys_of is None else keys_of
        self._id_of = id_of
        self._ids_carry = ""
        self._ids_joined = 0  # deltas of ``_raw`` in the carry

    @property
    def text(self) -> str:
        """The folded stream (what entity keys are matched against)."""
        return "".join(self._text)

    @property
    def raw_text(self) -> str:
        """The stream as received (entity extraction needs the original case)."""
        return "".join(self._raw)

    def finish(self) -> list[tuple[int, int, str]]:
        found = self._confirm([], final=True)
        if self._index.id_only:
            found += self.match_ids(final=True)
        return found

    def match_ids(self, *, final: bool = False) -> list[tuple[int, int, str]]:
        """Matches of the keys known by id only (another replica's or a journal's
        entities: no text to put in an automaton), found by extracting the stream's
        own keys as the engine extracts a prompt's and looking up their keyed hashes.
        ``_scan.feed_delta`` calls it every ``ID_STRIDE`` (8) units of the choice, on the
        text up to its last boundary (whitespace or a non-ASCII character, after which
        an ASCII key cannot go on), and ``finish`` on all of it: a key is found within
        about eight words of its end, half an enforce holdback. Extraction reads
        ``_ID_CARRY`` characters before the new text as context (a name's first word,
        a reference's prefix). A scanner made without ``id_of`` finds none."""
        id_of = self._id_of
        if id_of is None:
            return []
        raw = self._ids_carry + "".join(self._raw[self._ids_joined :])
        self._ids_joined = len(self._raw)
        base = self._length - len(raw)  # the stream offset of raw[0]
        end = len(raw)
        if not final:
            done = self.ids_done - base
            # Back over the word the next delta may go on with, at most _ID_CARRY
            # characters: a longer run with no boundary (a JSON array, base64) is cut
            # there, and a key across the cut is found by the next run, whose context
            # reaches back as far. Unbounded, each run walked the whole run again.
            floor = max(done, end - _ID_CARRY)
            while end > floor and raw[end - 1].isascii() and not raw[end - 1].isspace():
                end -= 1
            if end <= done:
                self._ids_carry = raw
                return []
        # A key that ends in the new text has what its kind needs there, or just before.
        may_hold = entity_needs(raw[max(0, self.ids_done - base - 32) : end])
        found = self._ids_in(raw[:end], base, id_of) if may_hold else []
        self.ids_done = base + end
        self._ids_carry = raw[max(0, end - _ID_CARRY) :]
        return found

    def _ids_in(
        self, raw: str, base: int, id_of: Callable[[str], str]
    ) -> list[tuple[int, int, str]]:
        """``match_ids``' matches in ``raw`` (at stream offset ``base``) that end after
        ``ids_done``, in text order. A key is hashed only when it ends there: the
        context's keys were looked up by the run before."""
        index = self._index
        folded = fold(raw)
        done = self.ids_done - base
        out: list[tuple[int, int, str]] = []
        for _, key in self._keys_of(raw):
            n = len(key)
            ends = []
            at = folded.find(key, max(0, done - n + 1))
            while at != -1:
                if _on_boundaries(folded, at, at + n, key):
                    ends.append(base + at + n)
                at = folded.find(key, at + 1)
            if not ends:
                continue
            entity_id = id_of(key)
            if entity_id not in index.table or entity_id in index._texts:
                continue  # not live, or in the automata (``_feed`` meets it)
            for end in ends:
                if (end, entity_id) not in self._seen:
                    self._seen.add((end, entity_id))
                    out.append((end - n, end, entity_id))
        out.sort()
        return out

    def _may_go_on(self, end: int, key: str) -> bool:
        """Whether the next delta may still put a match ending at ``end`` inside a longer
        word or number: it ends the text so far with a word character, or it is a
        number and a separator ends the text (``48213377.`` then ``5``). Such a match
        waits for that delta (or ``finish``), so no cut of the stream decides it."""
        if end == self._length:
            return _word_char(key[-1])
        return end == self._length - 1 and self._text[-1][-1] in ",." and _is_number(key)

    def _confirm(
        self, new: list[tuple[int, str, str]], *, final: bool
    ) -> list[tuple[int, int, str]]:
        text = None
        out: list[tuple[int, int, str]] = []
        undecided: list[tuple[int, str, str]] = []
        for end, entity_id, key in self._undecided + new:
            if (end, entity_id) in self._seen:
                continue
            if not final and self._may_go_on(end, key):
                undecided.append((end, entity_id, key))
                continue
            if text is None:
                text = self.text
            start = end - len(key)
            if not _on_boundaries(text, start, end, key):
                continue
            self._seen.add((end, entity_id))
            out.append((start, end, entity_id))
        self._undecided = undecided
        # In text order, whichever way each was found: the automata and the search of
        # the pending keys list them in an order that depends on when the automata were
        # last rebuilt (a clock), and the first match of a source is its finding's
        # evidence. A replay of the same capture must report the same evidence.
        out.sort()
        return out


# What a person writes about their own case, beyond the formats above: what a model
# that answers on another request's cached context copies into its own prose (docs/
# real-model.md: ticket and invoice numbers, full names, companies, street names,
# amounts, scattered through fresh sentences). Taken from prompts only: the same shapes
# in a model's answers are its own inventions, written for many tenants.
_REFERENCE = re.compile(
    # letters then five or more digits (TCK-629869, INV-23399, P5012275, D73944A),
    # '#' then five or more digits, digit groups joined by hyphens or spaces that hold
    # nine or more digits (an order 879-8541208, a phone 0879 552 5835)
    r"(?<![\w#-])(?:[A-Z]{1,5}-?\d{5,}[A-Z]?|#\d{5,}|\d{2,6}(?:[- ]\d{3,8}){1,3})(?![\w-])",
    re.A,
)
# The currencies an amount is written with, symbol or code -> ISO code: the one table
# ``_AMOUNT`` and ``same_currency`` read.
_CURRENCIES = {"$": "USD", "€": "EUR", "£": "GBP", "¥": "JPY",
               **{code: code for code in ("USD", "EUR", "GBP", "CHF", "JPY")}}  # fmt: skip
# Signs a model writes for an amount in any currency when it copies one (Gemma 3 wrote
# "$777.55" for a ticket's "€777.55": real-model bench, seed 10): beside a number they
# say nothing about which currency it is in.
_LOOSE_SIGNS = frozenset("$")
_SYMBOLS = re.escape("".join(c for c in _CURRENCIES if len(c) == 1))
_CODES = "|".join(c for c in _CURRENCIES if len(c) > 1)
_NUMBER = r"\d{1,3}(?:[,.]\d{3})*(?:[.,]\d{2})?"
_AMOUNT = re.compile(
    rf"(?:(?P<before>[{_SYMBOLS}]|\b(?:{_CODES}))\s?)(?P<number>{_NUMBER})(?!\d)"
    rf"|(?<![\d.,])(?P<number_first>{_NUMBER})\s?(?P<after>€|(?:{_CODES})\b)"
)
# A currency written right before or after a matched amount (``same_currency``).
_CURRENCY_BEFORE = re.compile(rf"(?:[{_SYMBOLS}]|\b(?:{_CODES}))\s?$")
_CURRENCY_AFTER = re.compile(rf"^\s?(?:€|(?:{_CODES})\b)")
# Capitalised words in a row, or joined by a hyphen: names of people, companies,
# streets and places (Suzanne Woodward, Freeman Group, Jacobs Fords, Pearson-Kramer).
_CAPITALISED = re.compile(r"\b[A-Z][a-z]+(?:['’][a-z]+)?(?:(?:-| )[A-Z][a-z]+(?:['’][a-z]+)?)+\b")
_COMPOUND = re.compile(r"[A-Z][a-z'’]+(?:-[A-Z][a-z'’]+)+")
# A firm named after people: "Perkins and Sons", "Hale & Partners".
_FIRM = re.compile(r"\b([A-Z][a-z'’]+) (?:and|&) (?:Sons|Partners|Associates|Brothers|Daughters)\b")
# A company by its legal form: "Morales LLC", "Green Inc." -- a surname that is also a
# plain word ("Green", "Morales") makes no rare pair, yet with its legal form it names
# one firm. ``company_head`` lets an answer whose own prompt names the firm use it.
_LEGAL_FORMS = ("Inc", "LLC", "Ltd", "PLC", "GmbH", "AG", "Corp", "LLP", "SARL", "S.A", "B.V")
_COMPANY = re.compile(
    rf"\b[A-Z][a-z'’]+(?:-[A-Z][a-z'’]+)? (?:{'|'.join(map(re.escape, _LEGAL_FORMS))})\b"
)
# A rare name and the word of an organisation ("Blair Group", "Okafor Holdings"): a
# plain name with it ("Support Group", "Focus Group") is everyone's.
_ORGANISATION_WORDS = ("Group", "Holdings", "Partners", "Associates", "Consulting",
                       "Solutions", "Services", "Logistics", "Industries", "Capital")  # fmt: skip
_ORGANISATION = re.compile(rf"\b([A-Z][a-z'’]+) (?:{'|'.join(_ORGANISATION_WORDS)})\b")
# A firm of three surnames: "Davis, Coleman and Branch", "Short, Washington & Green";
# its head too ("Davis, Coleman"): a model cuts it as it cuts a compound.
_FIRM_OF_THREE = re.compile(r"\b([A-Z][a-z'’]+), ([A-Z][a-z'’]+),? (?:and|&) ([A-Z][a-z'’]+)\b")
# What each group of patterns above needs somewhere in a text (implied by each of them),
# found by the compiled pass that serves the format kinds (``_entities.CASE_NEEDS``):
# three digits in a row (a reference), a currency (an amount), a capitalised word then a
# capital after a space, a hyphen, a comma or "and" (every name pattern). Most texts
# lack some: their patterns, which try every position, are not run (~3 us each a hundred
# characters, the amount's 9; the pass reads them in ~0.4 us).
_REFERENCE_NEEDS = CASE_NEEDS["reference"]
_AMOUNT_NEEDS = CASE_NEEDS["amount"]
_NAME_NEEDS = CASE_NEEDS["name"]
_FOLDED_FORMS = frozenset(form.lower() for form in (*_LEGAL_FORMS, *_ORGANISATION_WORDS))
# Words that stand before a legal form without naming a firm: "Your LLC must file", "a
# Delaware LLC", "a Single-Member LLC", "a Swiss AG" (kinds of company, not one).
_NOT_A_FIRM = frozenset((
    "your", "my", "our", "their", "his", "her", "its", "the", "a", "an", "this", "that",
    "these", "each", "every", "any", "no", "new", "single", "single-member", "multi-member",
    "member", "series", "public", "private", "limited", "holding", "parent", "shell",
    "delaware", "nevada", "wyoming", "texas", "florida", "california", "york", "swiss",
    "german", "british", "english", "american", "french", "dutch", "irish", "uk", "us", "eu",
))  # fmt: skip
#: A name made only of plain words that are also frequent surnames ("Hill-Thompson",
#: "Short, Washington and Green", "Wood Group"): a name only where it is written as one
#: (``written_as_name``), whereas "short, washington and green" in prose is not.
PROPER_NAME = "proper"
#: An amount's kind is ``amount:<ISO code>`` ("amount:EUR" for "€3,813.95"): another
#: currency beside the same number is another amount (``same_currency``).
AMOUNT = "amount"
CASE_KINDS = frozenset({"reference", AMOUNT, "name", PROPER_NAME})


def is_case_kind(kind: str) -> bool:
    """Whether ``kind`` (``iter_case_keys``') is a case identifier's, an amount's too."""
    return kind.partition(":")[0] in CASE_KINDS


def same_currency(kind: str, raw: str, start: int, end: int) -> bool:
    """Whether an amount key of ``kind`` matched at ``raw[start:end]`` is written in its
    own currency there, in none, or with a loose sign (``_LOOSE_SIGNS``): "CHF 1,815.87"
    is not "€1,815.87" (a simulated answer's made-up figure beside another tenant's
    ticket; human-text bench, seed 3), "$1,815.87" may be."""
    currency = kind.partition(":")[2]
    if not kind.startswith(f"{AMOUNT}:") or not currency:
        return True
    written = _CURRENCY_BEFORE.search(raw[max(0, start - 4) : start]) or _CURRENCY_AFTER.search(
        raw[end : end + 5]
    )
    sign = written.group(0).strip() if written else None
    return sign is None or sign in _LOOSE_SIGNS or _CURRENCIES[sign] == currency


def standalone_digits(raw: str, start: int, end: int) -> bool:
    """Whether the digits at ``raw[start:end]`` (a reference's digits alone, "959486" of
    "#959486") stand as a number of their own ("ticket 959486"), not as the last group
    of a longer code ("ORD-2026-959486"): a model makes up such codes for everyone, and
    six random digits meet another tenant's ticket by chance (human-text bench, seed 9,
    warm, flagged a clean answer so)."""
    before = raw[max(0, start - 2) : start]
    return not (len(before) == 2 and before[1] in "-/" and before[0].isalnum())


#: Letters past a compound name's last hyphen that its cut head keeps (``iter_case_keys``).
COMPOUND_HEAD_LETTERS = 3
#: Significant digits an amount needs: a round or small one (500.00, 49.99) is written
#: for many people; 3,425.49 is somebody's.
AMOUNT_DIGITS = 4


def _significant_digits(amount: str) -> int:
    return len(_digits(amount).rstrip("0"))


def iter_case_keys(
    text: str,
    claimed: list[tuple[int, int]],
    common_word: Callable[[str], bool] | None = None,
    surname: Callable[[str], bool] | None = None,
    first_name: Callable[[str], bool] | None = None,
    present: int | None = None,
) -> Iterator[tuple[str, str]]:
    """``(kind, key)`` of the case identifiers in ``text`` outside ``claimed`` spans:
    ``reference`` (the folded token, and its digit run alone when that has six or more
    digits: people write "ticket 629869" for "TCK-629869"), ``amount`` (its number
    without the currency, when it has ``AMOUNT_DIGITS`` significant digits) and
    ``name`` (each pair of adjacent capitalised words, a hyphenated compound, a firm
    "Perkins and Sons"). ``common_word`` (the engine's vocabulary) drops pairs with a
    common word ("United States", "Docker Compose", "Dear Amy") and compounds made only
    of common words. Those made only of common words that ``surname`` (the engine's
    frequent surnames) all passes ("Hill-Thompson", "Short, Washington and Green",
    "Wood Group") are ``PROPER_NAME`` keys instead: names only where written as one; so
    is a pair of a ``first_name`` and a surname ("Richard Williams"). ``present``:
    ``entity_needs(text)``, when the caller has it."""

    def free(s: int, e: int) -> bool:
        return not any(s < ce and cs < e for cs, ce in claimed)

    present = entity_needs(text) if present is None else present
    references = _REFERENCE.finditer(text) if present & _REFERENCE_NEEDS else ()
    for m in references:
        token = m.group(0)
        digits = _digits(token)
        if not free(*m.span()) or (token[0].isdigit() and len(digits) < 9):
            continue
        if len(digits) >= 6 and not token[0].isdigit() and not _monotonous(digits):
            yield "reference", digits
        # The whole token is judged, not its digits: "ZD-216216" is a ticket, though
        # "216216" alone repeats a pattern as filler does (human-text bench, seed 4).
        if not token.isdigit() and not _monotonous(token):
            yield "reference", fold(token.lstrip("#"))
    amounts = _AMOUNT.finditer(text) if present & _AMOUNT_NEEDS else ()
    for m in amounts:
        number = m.group("number") or m.group("number_first")
        if free(*m.span()) and _significant_digits(number) >= AMOUNT_DIGITS:
            currency = _CURRENCIES[m.group("before") or m.group("after")]
            yield f"{AMOUNT}:{currency}", number
    common = common_word or (lambda _: False)
    surname = surname or (lambda _: False)
    first_name = first_name or (lambda _: False)
    if not present & _NAME_NEEDS:
        return  # every name pattern below needs a capitalised word and a capital after it
    for m in _CAPITALISED.finditer(text):
        if not free(*m.span()):
            continue
        run = m.group(0)
        for compound in _COMPOUND.findall(run):
            parts = compound.split("-")
            kind = _name_kind(parts, common, surname)
            if kind is None:
                continue
            yield kind, fold(compound)
            # As a model's tokenizer may write it: "Hill- Thompson", "Hill - Thompson".
            yield kind, fold(compound.replace("-", "- "))
            yield kind, fold(compound.replace("-", " - "))
            # Its head to three letters past the last hyphen: a model cuts a rare word at
            # a token boundary ("Reply from the Wilson-Hod"), as a page cut mid-IBAN
            # keeps its head.
            head, _, last = compound.rpartition("-")
            if len(last) > COMPOUND_HEAD_LETTERS:
                yield kind, fold(f"{head}-{last[:COMPOUND_HEAD_LETTERS]}")
        parts = run.split(" ")
        for a, b in zip(parts, parts[1:], strict=False):
            # Both words rare: a pair with a plain word is what many people write
            # ("Customer Service", "Docker Compose", a sentence's "About Novak").
            if not (common(a) or common(b)):
                yield "name", fold(f"{a} {b}")
            elif first_name(a) and surname(b):
                # A person's full name of plain words: who "Richard Williams" is, a
                # prompt says; a model writing it for another tenant leaks that
                # (human-text bench, seed 8, delivered one before its end).
                yield PROPER_NAME, fold(f"{a} {b}")
    for pattern in (_FIRM, _ORGANISATION):
        for m in pattern.finditer(text):
            if free(*m.span()) and (kind := _name_kind([m.group(1)], common, surname)):
                yield kind, fold(m.group(0))
                # A firm's head with its "and", as a model cuts it ("Reply from the
                # Griffin and"; real-model bench, seed 11), when its name is rare: a
                # plain surname and "and" ("Brown and") is anyone's.
                if pattern is _FIRM and kind == "name":
                    yield kind, fold(m.group(0).rpartition(" ")[0])
    for m in _COMPANY.finditer(text):
        if free(*m.span()) and fold(m.group(0).rpartition(" ")[0]) not in _NOT_A_FIRM:
            yield "name", fold(m.group(0))
    for m in _FIRM_OF_THREE.finditer(text):
        if free(*m.span()) and (kind := _name_kind(m.groups(), common, surname)):
            yield kind, fold(m.group(0))
            # Its head, as a model cuts it. Two plain words that are not both surnames
            # are anyone's list ("Red, White"); two that are, with their "and" ("Short,
            # Washington and"), as two surnames alone are many answers' examples.
            head_kind = _name_kind(m.groups()[:2], common, surname)
            if head_kind == "name":
                yield head_kind, fold(f"{m.group(1)}, {m.group(2)}")
            elif head_kind == PROPER_NAME:
                yield head_kind, fold(m.group(0)[: m.start(3) - m.start()].rstrip())


def _name_kind(
    words: Sequence[str], common: Callable[[str], bool], surname: Callable[[str], bool]
) -> str | None:
    """The kind of key a name made of ``words`` gives: ``"name"`` with a rare word,
    ``PROPER_NAME`` when all are plain and all are surnames, else None (everyone's)."""
    if not all(map(common, words)):
        return "name"
    if all(map(surname, words)):
        return PROPER_NAME
    return None


#: Where a name is written in lower case as itself: a mail or web host (``@hill-thompson.``).
_HOST_BEFORE = frozenset("@./")


def written_as_name(raw: str, start: int, end: int) -> bool:
    """Whether ``raw[start:end]`` (a ``PROPER_NAME`` key's match) is written as a name:
    each of its words capitalised but "and" ("Short, Washington and Green"), or in lower
    case inside a mail or web host ("support@king-lewis.co.uk"). "the short, washington
    and green" of prose is not."""
    words = re.findall(r"[^\W\d_]+", raw[start:end])
    if all(w[0].isupper() for w in words if w != "and"):
        return True
    after = raw[end : end + 2]
    return start > 0 and raw[start - 1] in _HOST_BEFORE and after[:1] == "." and after[1:].isalpha()


def company_head(key: str) -> str | None:
    """The name before the legal form of a company key ("green" of "green inc"), or
    None for any other key."""
    name, _, form = key.rpartition(" ")
    return name if name and " " not in name and form in _FOLDED_FORMS else None


def name_words(text: str) -> list[str]:
    """The words of ``text`` inside runs of two or more capitalised words ("Jessica
    Miller", "Hill-Thompson"): parts of a person's or a place's name, not a firm named
    alone. A sentence's first word is capitalised for the sentence ("Does Green sell
    phones?"), so it does not count towards a run."""
    out = []
    for m in _CAPITALISED.finditer(text):
        words = re.split(r"[- ]", m.group(0))
        before = text[: m.start()].rstrip(" \t")
        if not before or before[-1] in ".!?:\n\"'“(":
            words = words[1:]
        if len(words) >= 2:
            out += words
    return out


def iter_model_names(text: str) -> Iterator[tuple[str, int, int, tuple[str, ...]]]:
    """``(key, start, end, words)`` of the capitalised pairs and compounds a model wrote
    (``iter_case_keys``' names, unfiltered), with the keys of their words: names models
    write for many tenants are nobody's, nor are the words they make them of."""
    for m in _CAPITALISED.finditer(text):
        parts = m.group(0).split(" ")
        at = m.start()
        for a, b in zip(parts, parts[1:], strict=False):
            end = at + len(a) + 1 + len(b)
            yield fold(f"{a} {b}"), at, end, (fold(a), fold(b))
            at += len(a) + 1
        for c in _COMPOUND.finditer(m.group(0)):
            yield fold(c.group(0)), m.start() + c.start(), m.start() + c.end(), ()


#: Characters (spaces included) of an IBAN's head that are keyed on their own: a page
#: cut mid-IBAN still carries country, check digits, bank and most of the account.
IBAN_HEAD_CHARS = 19


def iter_entity_keys(
    text: str,
    common_word: Callable[[str], bool] | None = None,
    surname: Callable[[str], bool] | None = None,
    first_name: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, str]]:
    """``(kind, key)`` for every entity in ``text``; key is the lowercased text. A long
    IBAN also yields its head (``IBAN_HEAD_CHARS``, ending on a whole group): a leaked
    page that cuts the IBAN short is still that account's."""
    present = entity_needs(text)  # one pass for both kinds of pattern
    entities = extract_entities(text, present)
    for ent in entities:
        key = fold(ent.text)
        yield ent.kind, key
        if ent.kind == "iban" and len(key) > IBAN_HEAD_CHARS:
            head = key[:IBAN_HEAD_CHARS].rstrip()
            if " " not in key or key[len(head)] == " ":
                yield ent.kind, head
    claimed = [(e.start, e.end) for e in entities]
    case_keys = iter_case_keys(text, claimed, common_word, surname, first_name, present)
    for kind, key in itertools.chain(case_keys, iter_mailbox_names(text, entities)):
        if len(key) >= MIN_ENTITY_CHARS:
            yield kind, key


_MAILBOX_SEPARATORS = re.compile(r"[._-]")


def iter_mailbox_names(text: str, entities: Sequence[Entity]) -> Iterator[tuple[str, str]]:
    """``("name", key)`` for each capitalised name in ``text`` that spells the mailbox of
    an email address in it ("George Ramirez" beside george.ramirez@proton.me): whoever
    owns that address is called so, though a first name and a frequent surname are
    plain words that ``iter_case_keys`` leaves to everyone (real-model bench, seed 11:
    "Reply from the George Ramirez support team" to another tenant)."""
    for ent in entities:
        if ent.kind != "email":
            continue
        parts = _MAILBOX_SEPARATORS.split(ent.text.partition("@")[0])
        if not 2 <= len(parts) <= 3 or not all(p.isalpha() and len(p) > 1 for p in parts):
            continue
        spelled = re.compile(r"(?<!\w)" + r"[ -]".join(map(re.escape, parts)) + r"(?!\w)", re.I)
        for m in spelled.finditer(text):
            if m.group(0)[0].isupper():
                yield "name", fold(m.group(0))
