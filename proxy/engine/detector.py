"""The detection engine: observe every tenant's prompts and outputs, scan every
response as it streams, report text that belongs to another tenant.

Three signals:

* fragment -- runs of the victim's output whose k-gram fingerprints belong to one
  foreign request (its prompt or its output), scored by containment;
* entity -- a distinctive string (email, IBAN, card, key, ...) of a foreign request;
* canary -- a string registered for a tenant; certain proof of a leak.

What is *not* foreign, and never counted: the victim tenant's own recent text (its
prompt, its earlier requests), text that several tenants used (live count in the window,
plus a decaying sketch over hours), operator baselines, and a foreign request's output
when the victim asked the same question (temperature-0 engines answer identical prompts
identically: an identical answer is not a leak).

Everything stored is a keyed hash except the live entities, which stay in memory only
while their window lasts. No mitmproxy imports: the proxy addon, replay, the probe and
the benchmarks all drive this same API.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from proxy.engine import _records, _scan, _tables, _vocabulary
from proxy.engine._records import EntityOwner, RequestRecord
from proxy.engine.baseline import Baseline
from proxy.engine.entities import (
    PROPER_NAME,
    EntityIndex,
    EntityScanner,
    company_head,
    extract_entities,
    fold,
    is_case_kind,
    iter_case_keys,
    iter_entity_keys,
    iter_model_names,
    name_words,
    public_number_texts,
    same_currency,
    standalone_digits,
    written_as_name,
)
from proxy.engine.fingerprint import Hasher
from proxy.engine.index import CommonnessSketch, FingerprintIndex, PairFilter
from proxy.engine.records import (
    CanaryRecord,
    ChoiceRecord,
    OutputRecord,
    PromptRecord,
    collapsed_choice,
)
from proxy.engine.tokens import (
    WORD_WEIGHT,
    StreamTokenizer,
    ascii_form,
    other_unit_texts,
    unit_batch,
    unit_texts,
)

#: Fingerprints of a prompt classified per step of ``Engine.observe_prompt_steps``.
OBSERVE_STEP = 128
#: Distinct non-plain units of a prompt kept per request (a hash-ordered sample beyond):
#: what makes text of that request's output specific to it (``_ChoiceState.specific``).
PROMPT_UNITS_KEPT = 512
_NO_UNITS = np.zeros(0, dtype=np.uint64)


def run_steps[T](steps: Generator[None, None, T]) -> T:
    """Run a stepped computation (``observe_prompt_steps``) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


FRAGMENT, ENTITY, CANARY = "fragment", "entity", "canary"
#: ``extracted`` kind of a capitalised pair a model wrote: marks the name, owns nothing.
MODEL_NAME = "model_name"
#: A prompt's name whose every word models wrote (a quoted earlier answer): the tenant
#: holds it, and it is no evidence of a leak (it joins ``Engine.model_names``).
QUOTED_NAME = "quoted_name"
#: Kinds of prompt key that name a person, a firm or a place.
NAME_KINDS = frozenset({"name", PROPER_NAME})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Detection parameters. Defaults are tuned on ``bench/quality.py`` (docs/benchmarks.md)."""

    key: bytes | None = None  # fingerprint key; None generates one at start
    k: int = 4  # units per shingle
    min_run_words: float = 8.0  # contiguous foreign run that makes a fragment finding
    # A run made only of plain words (which most tenants use) must be this many times
    # longer. From a prompt: 2; a completions prompt is one string, so the earlier
    # assistant turns in it count as the user's words, and an 8-word run of a model's
    # plain phrasing from one flagged fresh engines (bench/quality.py: 4 of the first
    # 300 clean responses at 1, 1 at 2, recall unchanged). From a model's output: 0,
    # never: a model's plain-word run is its boilerplate.
    plain_run_factor: float = 2.0
    # The same from a prompt whose turns are known (a chat's user messages, a rendered
    # conversation whose template was read): its text is its user's words, and people's
    # private words are mostly plain ("six years and my manager wants me to"):
    # bench/human_leaks.py missed such 8-word runs at 2.
    plain_user_factor: float = 1.0
    plain_output_factor: float = 0.0
    plain_share: float = 0.5  # a word is plain once this share of tenants used it
    # Scattered coverage this many times min_run_words needs no distinctive word (a
    # mis-routed answer made of plain words); 0: always needs two.
    plain_cover_factor: float = 4.0
    containment: float = 0.5  # share of its span that scattered coverage must fill
    # Share of an output's uncommon k-grams that one foreign request must hold for a
    # whole-answer match (mis-route) without distinctive words; 0: off.
    exclusive: float = 0.8
    common_tenants: int = 3  # text used by this many tenants is shared, not private
    same_prompt_similarity: float = 0.9  # prompts this similar excuse identical outputs
    window_seconds: float = 600.0
    max_fingerprints: int = 4_000_000
    # Words used by too few tenants to be plain yet, tracked with their tenants (about
    # 100 B each); at this many the tracking starts over (plain words are kept).
    max_rare_words: int = 1_000_000
    sketch_width_bits: int = 21
    sketch_half_life: float = 3600.0
    entities: bool = True
    # Case identifiers of prompts (``entities.iter_case_keys``: references, amounts,
    # names): what a model answering on another request's context copies into its prose.
    case_identifiers: bool = True
    prompt_signature_size: int = 256


@dataclass(frozen=True, slots=True)
class Finding:
    """Evidence that part of a response belongs to another tenant."""

    kind: str  # fragment | entity | canary
    source_tenant: str
    source_request_id: str
    score: float  # fragment: share of the response's units that are foreign; else 1.0
    foreign_units: float  # words of foreign text (a CJK character counts half)
    start: int  # span of the victim's output (characters of that choice's text)
    end: int
    choice: int = 0
    evidence: str = ""  # keyed hash of the matched fingerprints or entity
    detected_at: int = 0  # characters of that choice's output scanned when it was made


class Engine(_scan.EngineClock):
    """Multi-tenant leak detector. Single-threaded: call it from one thread/loop."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        baseline: Iterable[str] = (),
        plain_words: Iterable[str] = (),
        surnames: Iterable[str] = (),
        first_names: Iterable[str] = (),
    ):
        self.config = config = config or EngineConfig()
        #: Frequent surnames, lowercased: a name made only of plain words that are all
        #: surnames ("Hill-Thompson") is a case key where written as a name
        #: (``entities.PROPER_NAME``). Without them such names are nobody's.
        self.surnames = frozenset(w.lower() for w in surnames)
        #: Frequent first names, lowercased: one before a frequent surname ("Richard
        #: Williams") makes a full name of plain words a ``PROPER_NAME`` key too.
        self.first_names = frozenset(w.lower() for w in first_names)
        self.hasher = Hasher(config.key or os.urandom(32), config.k)
        self.index = FingerprintIndex(max_fingerprints=config.max_fingerprints)
        self.sketch = CommonnessSketch(
            width_bits=config.sketch_width_bits, half_life=config.sketch_half_life
        )
        self.entities = EntityIndex()
        self.pairs = PairFilter(period=config.sketch_half_life)
        self._tenant_keys: dict[str, int] = {}
        self.vocabulary = Vocabulary(
            config.common_tenants, config.plain_share, config.max_rare_words
        )
        #: Baseline texts' k-grams (``add_baseline``), in C: the delta step asks it for
        #: every private k-gram without an int object.
        self.baseline = _tables.HotTable()
        #: Baseline files' fingerprints (``add_baseline_file``), sorted: a large corpus
        #: costs 8 bytes a fingerprint here, not a Python set's ~60.
        self.baseline_sorted = np.zeros(0, dtype=np.uint64)
        #: Unit hashes of numbers that are public by convention (test cards, 555).
        self.public_numbers = frozenset(self.hasher.units(sorted(public_number_texts())))
        self.exchange_555 = self.hasher.unit("555")
        # Numbers that tie an answer to nobody (a list's "1.", a count, a year): restated
        # by an answer they prove nothing. The same rule as outputs' (is_specific_number).
        numbers = [str(n) for n in range(10_000)] + [f"{n:02d}" for n in range(10)]
        self.trivial_numbers = frozenset(
            self.hasher.units([n for n in numbers if not is_specific_number(n)])
        )
        self._baseline_entities: set[str] = set()
        #: Ids of the capitalised pairs models wrote in the window, with when: a name a
        #: model writes is no prompt's case identifier (``entities.iter_model_names``).
        self.model_names: dict[str, float] = {}
        self._delta_scanner: _scan.DeltaScanner | None = None
        self._requests: dict[int, RequestRecord] = {}  # untracked by the GC
        self._order: deque[int] = deque()  # slots by time, for expiry
        self._next_slot = 1
        self._last_sweep = 0.0
        #: ``sequence`` (a field of ``_scan.EngineClock``, ``tick``) orders prompts and
        #: feeds across concurrent scans (see ``records``). Starts at the clock in
        #: microseconds, so that a restarted process keeps numbering after the last one
        #: (a journal spans restarts).
        super().__init__(time.time_ns() // 1000)
        self._in_flight: dict[int, int] = {}  # slot -> sequence number of its prompt
        # (seq, slot) of the in-flight scans, a heap: the low water without a scan
        # of every scan still open (a request that never finishes stays until its
        # window ends, and each prompt asks). Finished ones leave it lazily.
        self._in_flight_heap: list[tuple[int, int]] = []
        #: Requests this engine learned from (loaded state included): how much it knows
        #: about what is common. A policy can wait for enough before blocking.
        self.observed_requests = 0
        for text in baseline:
            self.add_baseline(text)
        self.add_plain_words(plain_words)

    # -- inputs -------------------------------------------------------------------

    def add_plain_words(self, words: Iterable[str]) -> None:
        """Words (or characters) of a language that are never distinctive on their own:
        the cold-start prior of the learned vocabulary (``proxy/defaults/vocabulary/``)."""
        self.vocabulary.add_plain(self.hasher.unit(u) for w in words for u in unit_texts(w))

    def add_baseline(self, text: str) -> None:
        """Text that is shared by design (system prompts, templates, public documents,
        boilerplate): never counted as anyone's private text."""
        hashes = self.unit_hashes(text)
        self.baseline.add_new(self.hasher.kgrams_of_hashes(hashes), 1)
        self.vocabulary.add_plain(hashes)
        self._baseline_entities.update(self.entity_id(key) for _, key in iter_entity_keys(text))

    def add_baseline_file(self, baseline: Baseline) -> None:
        """A public corpus in keyed form (``crosstalk baseline build``): its text is never
        anyone's private text, its words are plain, its entities nobody's. Raises
        BaselineError when it was made with another key or shingle size."""
        baseline.check(self.hasher)
        self.baseline_sorted = np.union1d(self.baseline_sorted, baseline.kgrams)
        self._delta_scanner = None  # it reads the corpus in place
        self.vocabulary.add_plain(baseline.units.tolist())
        self._baseline_entities.update(baseline.entities)

    def unit_hashes(self, text: str) -> list[int]:
        """The unit hashes of a whole text (``hasher.units(unit_texts(text))``). Text
        that is ASCII once separators are set aside takes the delta step's tokenizer and
        short-word cache, which answer most words without making a string."""
        ascii_text = ascii_form(text)
        if ascii_text is None:
            return self.hasher.units(other_unit_texts(text))
        return (self._delta_scanner or self.delta_scanner()).ascii_unit_hashes(ascii_text)

    def delta_scanner(self) -> _scan.DeltaScanner:
        """The compiled per-delta step over this engine's tables (built on first use,
        and again after the baseline corpus changes)."""
        if self._delta_scanner is None:
            self._delta_scanner = _scan.DeltaScanner(
                self.hasher,
                self.sketch,
                self.index,
                self.baseline,
                self.baseline_sorted,
                unit_batch,
                is_specific_number,
                WORD_WEIGHT,
                requests=self._requests,
                config=self.config,
                no_units=_NO_UNITS,
            )
        return self._delta_scanner

    def entity_id(self, folded: str) -> str:
        """An entity's id: the keyed hash of its folded text (also its evidence)."""
        return self.hasher.digest(folded.encode())

    def low_water(self) -> int:
        """Every sequence number below this belongs to a finished scan or a prompt."""
        heap, in_flight = self._in_flight_heap, self._in_flight
        while heap and in_flight.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # finished or swept
        return heap[0][0] if heap else self.sequence + 1

    def _open_scan(self, slot: int, seq: int) -> None:
        """``slot``'s scan is open since its prompt's ``seq`` (``low_water``)."""
        self._in_flight[slot] = seq
        heap = self._in_flight_heap
        if len(heap) > 2 * len(self._in_flight) + 64:  # mostly finished entries: rebuild
            heap[:] = [(s, k) for k, s in self._in_flight.items()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (seq, slot))

    def register_canary(self, tenant: str, canary: str) -> CanaryRecord:
        """A string only ``tenant`` uses; seen anywhere else it is a certain leak."""
        key = fold(canary)
        record = CanaryRecord(tenant, self.entity_id(key), seq=self.tick())
        self.ingest_canary(record, text=key)
        return record

    def ingest_canary(self, record: CanaryRecord, *, text: str | None = None) -> None:
        """A canary registered elsewhere (known by id: found in outputs by extraction)."""
        slot = self._new_slot(record.tenant, f"canary:{record.entity_id}", 0.0)
        self.entities.add(
            record.entity_id, CANARY, record.tenant, slot << 1, 0.0, text=text, pin=True
        )

    def observe_prompt(
        self,
        tenant: str,
        request_id: str,
        text: str,
        now: float | None = None,
        *,
        model_text: str = "",
        turns_known: bool = False,
    ) -> ResponseScan:
        """Record a request's prompt and return the scanner for its response.

        ``model_text`` is the part of ``text`` a model wrote (earlier assistant turns of a
        conversation): it is indexed like an output, so its boilerplate is judged as a
        model's, not as a user's words. ``turns_known``: the caller knew the prompt's
        turns (a chat, a conversation rendered by a template it read), so the rest of
        ``text`` is its users' words (``EngineConfig.plain_user_factor``); a plain
        completions string may quote a model unmarked. Call before the request goes upstream: a page of
        this prompt can leak into a response that is already streaming. The scan's
        ``prompt`` is what was learned, in keyed form (for a journal or other replicas).
        """
        return run_steps(
            self.observe_prompt_steps(
                tenant, request_id, text, now, model_text=model_text, turns_known=turns_known
            )
        )

    def observe_prompt_steps(
        self,
        tenant: str,
        request_id: str,
        text: str,
        now: float | None = None,
        *,
        model_text: str = "",
        turns_known: bool = False,
    ) -> Generator[None, None, ResponseScan]:
        """``observe_prompt`` in steps: a generator that yields between pieces of work
        (reading the text; classifying each ``OBSERVE_STEP`` fingerprints; learning) and
        returns the scan. A caller on an event loop can serve other connections at each
        yield. Nothing but the expiry of old entries is written to the engine before the
        last step, so calls that run in between see it as if this prompt had not come
        yet."""
        now = time.time() if now is None else now
        hashes = self.unit_hashes(text)
        model_hashes = self.unit_hashes(model_text) if model_text else []
        texts: dict[str, str] = {}
        entities: list[tuple[str, str]] = []
        if self.config.entities:
            # A case identifier that an earlier assistant turn holds is the model's; the
            # names in those turns explain this answer's (``ResponseScan.own_model_names``).
            model_keys = {key for _, key in iter_case_keys(model_text, [])} if model_text else set()
            if model_text and self.config.case_identifiers:
                for key, *_ in iter_model_names(model_text):
                    entity_id = self.entity_id(key)
                    texts[entity_id] = key
                    entities.append((MODEL_NAME, entity_id))
            for kind, key in self.entity_keys(text):
                if is_case_kind(kind) and (not self.config.case_identifiers or key in model_keys):
                    continue
                if kind in NAME_KINDS and self._model_written(key, kind):
                    kind = QUOTED_NAME
                entity_id = self.entity_id(key)
                texts[entity_id] = key
                entities.append((kind, entity_id))
        seq = self.tick()
        record = PromptRecord(
            tenant,
            request_id,
            now,
            uint64_array(hashes),
            uint64_array(model_hashes),
            tuple(entities),
            seq,
            min(self.low_water(), seq),
            turns_known,
        )
        yield
        scan = yield from self._observe(record, hashes, model_hashes, texts)
        if self.config.entities and self.config.case_identifiers:
            scan.own_name_units = frozenset(
                self.hasher.units(unit_texts(" ".join(name_words(text))))
            )
        self._open_scan(scan.slot, seq)
        return scan

    def entity_keys(self, text: str) -> Iterator[tuple[str, str]]:
        """``(kind, key)`` of the entities in ``text``, extracted as a prompt's are (the
        engine's vocabulary, surnames and first names decide the names)."""
        return iter_entity_keys(text, self._common_word, self._surname, self._first_name)

    def _common_word(self, word: str) -> bool:
        """Whether a capitalised word of a prompt is plain (``entities.iter_case_keys``):
        "United States" and "Customer Service" are written for everyone; a name with one
        rare word ("Suzanne Woodward") is somebody's."""
        return all(self.vocabulary.is_plain(h) for h in self.hasher.units(unit_texts(word)))

    def _surname(self, word: str) -> bool:
        """Whether ``word`` is one of the engine's frequent surnames (``surnames``)."""
        return word.lower() in self.surnames

    def _first_name(self, word: str) -> bool:
        """Whether ``word`` is one of the engine's frequent first names (``first_names``)."""
        return word.lower() in self.first_names

    def _model_written(self, name: str, kind: str = "name") -> bool:
        """Whether models wrote every word of ``name`` in capitalised names of the window
        (``model_names``): a prompt that quotes an earlier answer (a conversation sent
        as one completions string) names the people the model made up, and a model
        writing such names for another tenant leaks nobody's. A ``PROPER_NAME`` made of
        plain surnames that models write in many names ("King", "Lewis") is one only if
        a model wrote it whole ("King-Lewis"), but a person's full name ("Elias Brennan")
        by its words, as a rare pair is: models make up people from such words."""
        names = self.model_names
        # A company by its legal form ("Lee Inc"): the form is every firm's word and a
        # plain surname many a name's, so only the firm's whole name written by a model
        # makes it one (human-text bench, seed 8: "Lee Inc" went unfound so).
        whole = kind == PROPER_NAME and not self._full_name(name)
        if whole or company_head(name) is not None:
            return self.entity_id(name) in names
        return all(self.entity_id(w) in names for w in name.replace("-", " ").split())

    def _full_name(self, key: str) -> bool:
        """Whether ``key`` is a first name and a surname ("richard williams")."""
        first, _, last = key.partition(" ")
        return first in self.first_names and last in self.surnames

    def learn_words(self, tenant: str, text: str) -> None:
        """Count ``tenant`` among the users of ``text``'s words, and nothing else: the
        one thing the engine never forgets (a word used by enough tenants stays plain),
        taught by traffic a replay partition does not replay (``proxy.forensics``)."""
        self.vocabulary.learn(tenant, self.unit_hashes(text))

    def ingest_prompt(self, record: PromptRecord) -> ResponseScan:
        """``observe_prompt`` from a record: the same state as if the text had been seen
        (entities are then known by id only)."""
        return run_steps(
            self._observe(record, record.units.tolist(), record.model_units.tolist(), {})
        )

    def _observe(
        self,
        record: PromptRecord,
        hashes: list[int],
        model_hashes: list[int],
        entity_texts: dict[str, str],
    ) -> Generator[None, None, ResponseScan]:
        tenant, now = record.tenant, record.time
        self._sweep(now)
        fps = self.hasher.kgrams_of_hashes(hashes)
        # Classified a piece at a time (reads only; the same answers as all at once when
        # nothing runs in between), then learned in one go.
        private: list[int] = []
        unowned: list[int] = []
        for i in range(0, len(fps), OBSERVE_STEP):
            if i:
                yield
            piece_private, piece_unowned = self._classify_prompt(fps, i, i + OBSERVE_STEP)
            private += piece_private
            unowned += piece_unowned
        self.observed_requests += 1
        self.vocabulary.learn(tenant, hashes)
        self._count_use(tenant, unowned, now)
        model_fps = set(self.hasher.kgrams_of_hashes(model_hashes))
        signature = sorted_unique(private)
        # The user's words: what earlier assistant turns of the prompt wrote is a model's.
        users = beyond(hashes, model_hashes) if model_hashes else hashes
        rare = set(self.vocabulary.plain.absent(users)).difference(self.trivial_numbers)
        slot = self._new_slot(
            tenant,
            record.request_id,
            now,
            # a copy: a slice would keep the whole array alive
            signature=signature[: self.config.prompt_signature_size].copy(),
            # No prompt (a log that kept none) asks nothing: never "the same question"
            # as another request without one, whose answers would then excuse each other.
            digest=self.hasher.digest(record.units.tobytes()).encode()
            if len(record.units)
            else f"no prompt {self._next_slot}".encode(),
            prompt_units=sorted_unique(list(rare))[:PROMPT_UNITS_KEPT],
            turns_known=record.turns_known,
        )
        value = slot << 1
        if model_fps:  # earlier assistant turns: indexed as this request's output
            self.index.add_many([fp for fp in private if fp not in model_fps], value, now)
            self.index.add_many([fp for fp in private if fp in model_fps], value | 1, now)
        else:
            self.index.add_many(private, value, now)
        for kind, entity_id in record.entities:
            if kind == MODEL_NAME or entity_id in self._baseline_entities:
                continue
            if kind == QUOTED_NAME:  # this tenant's, and no evidence against anyone
                kind = "name"
                self.model_names.pop(entity_id, None)
                self.model_names[entity_id] = now
            self.entities.add(entity_id, kind, tenant, value, now, text=entity_texts.get(entity_id))
        return ResponseScan(self, record, slot)

    # -- internals shared with ResponseScan -----------------------------------------

    def _classify(
        self, tenant: str, fps: list[int]
    ) -> tuple[list[bool], list[tuple[int, ...]], list[int]]:
        """Per fingerprint: whether it is still private (not baseline, not common) and
        its current owners in the index; and the fingerprints whose use by ``tenant``
        the commonness sketch must count (common text no longer needs counting; nor
        does text this tenant already owns in the index): ``_scan.DeltaScanner.classify``."""
        if not fps:
            return [], [], []
        scanner = self._delta_scanner or self.delta_scanner()
        return scanner.classify(self._requests, tenant, fps)

    def _classify_prompt(
        self, fps: list[int], start: int, stop: int
    ) -> tuple[list[int], list[int]]:
        """``_classify`` of a prompt's ``fps[start:stop]``, which needs no owners: the
        private fingerprints, and those whose use the sketch must count, in order."""
        scanner = self._delta_scanner or self.delta_scanner()
        return scanner.classify_prompt(fps, start, stop)

    def _count_use(self, tenant: str, fps: Sequence[int], now: float) -> None:
        """Count ``tenant``'s use of ``fps`` in the sketch, once per tenant (pair filter)."""
        if fps:
            first_use = self.pairs.first_seen(self._tenant_key(tenant), fps, now)
            if first_use:
                self.sketch.increment(first_use, now)

    def _tenant_key(self, tenant: str) -> int:
        key = self._tenant_keys.get(tenant)
        if key is None:
            if len(self._tenant_keys) > 100_000:
                self._tenant_keys.clear()
            digest = hashlib.blake2b(tenant.encode(), key=self.hasher.key, digest_size=8)
            key = self._tenant_keys[tenant] = int.from_bytes(digest.digest(), "little")
        return key

    def _new_slot(
        self,
        tenant: str,
        request_id: str,
        now: float,
        *,
        signature: np.ndarray | None = None,
        digest: bytes = b"",
        prompt_units: np.ndarray = _NO_UNITS,
        turns_known: bool = False,
    ) -> int:
        slot = self._next_slot
        self._next_slot += 1
        if signature is None:
            signature = _NO_UNITS
        self._requests[slot] = RequestRecord(
            tenant, request_id, now, signature, digest, prompt_units, turns_known
        )
        self._order.append(slot)
        return slot

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        horizon = now - self.config.window_seconds
        while self._order and self._requests[self._order[0]].time < horizon:
            slot = self._order.popleft()
            if not self._requests[slot].request_id.startswith("canary:"):
                del self._requests[slot]
                self._in_flight.pop(slot, None)  # never finished
            else:
                self._order.append(slot)
                if all(r.request_id.startswith("canary:") for r in self._requests.values()):
                    break
        self.index.evict(horizon)
        self.entities.expire(horizon)
        names = self.model_names
        while names and (oldest := next(iter(names))) and names[oldest] < horizon:
            del names[oldest]

    def similar_prompts(self, a: int, b: int) -> bool:
        """Whether requests ``a`` and ``b`` asked (nearly) the same thing (the same
        prompt, or signatures that share ``same_prompt_similarity``;
        ``_records.similar_prompts``, which the compiled scan calls too)."""
        return _records.similar_prompts(self._requests, a, b, self.config.same_prompt_similarity)

    # -- learned commonness, kept across restarts --------------------------------------

    def save_commonness(self, path: str | os.PathLike) -> None:
        """Write what the engine learned about shared text (the commonness sketch and the
        plain vocabulary: counters and keyed hashes, no text) to ``path`` (.npz).

        A restarted proxy that loads it does not relearn boilerplate from scratch: a
        fresh engine flags boilerplate that only one other tenant has used yet.
        """
        tmp = f"{os.fspath(path)}.tmp.npz"
        np.savez_compressed(
            tmp,
            key_id=np.array(self.hasher.key_id),
            k=np.array(self.config.k),
            sketch=self.sketch.counts_array,
            plain=np.array(self.vocabulary.plain.keys(), dtype=np.uint64),
            observed=np.array(self.observed_requests),
            pairs_current=np.frombuffer(self.pairs.generations[0], np.uint8),
            pairs_previous=np.frombuffer(self.pairs.generations[1], np.uint8),
            pairs_layout=np.array(self.pairs.LAYOUT),
        )
        os.replace(tmp, path)

    def load_commonness(self, path: str | os.PathLike) -> None:
        """Load a file written by ``save_commonness``. Raises ValueError when it was made
        with another key or shingle size (its hashes would silently mean nothing). A
        pair filter saved with another bit layout (``PairFilter.LAYOUT``) is dropped."""
        with np.load(path) as data:
            if str(data["key_id"]) != self.hasher.key_id or int(data["k"]) != self.config.k:
                raise ValueError(
                    f"{path}: made with key {data['key_id']} k={int(data['k'])}, "
                    f"not key {self.hasher.key_id} k={self.config.k}"
                )
            self.sketch.merge(data["sketch"])
            self.vocabulary.add_plain(data["plain"].tolist())
            if "observed" in data:
                self.observed_requests += int(data["observed"])
            # Pair bits of another layout would answer for other pairs: left out, the
            # filter starts empty (a tenant's text seen before may count once more).
            layout = int(data["pairs_layout"]) if "pairs_layout" in data else 1
            if "pairs_current" in data and layout == self.pairs.LAYOUT:
                self.pairs.load([data["pairs_current"].tobytes(), data["pairs_previous"].tobytes()])

    @property
    def fingerprints(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.sketch.nbytes + self.pairs.nbytes


class ResponseScan(_scan.ScanFields):
    """Scans one response, delta by delta, per choice. Also records the response's
    own output as a source for later responses (outputs leak as well as prompts)."""

    # ``feed(delta, choice=0, now=None)``, the step every delta takes, is
    # ``_scan.ScanFields.feed``: it returns the findings the delta completed.

    def __init__(self, engine: Engine, prompt: PromptRecord, slot: int):
        #: The request's prompt as the engine learned it (keyed; no text).
        self.prompt = prompt
        self.tenant = prompt.tenant
        self.request_id = prompt.request_id
        #: Unit hashes of this request's own prompt (``unit in own_units``, a compiled
        #: table): a name or number the victim wrote itself explains its answer, so it
        #: does not make a foreign match distinctive.
        self.own_units = _tables.HotTable()
        self.own_units.add_keys(np.ascontiguousarray(prompt.units, dtype=np.uint64), 1)
        #: Names in the prompt's earlier assistant turns: the conversation's own, which
        #: this answer may repeat whoever else holds them.
        self.own_model_names = {i for kind, i in prompt.entities if kind == MODEL_NAME}
        #: Unit hashes of the prompt's words that are part of a name ("Miller" of
        #: "Jessica Miller"): such a word does not name a firm the victim asked about.
        self.own_name_units: frozenset[int] = frozenset()
        # engine, _choices (choice -> _ChoiceState), slot, _now, _to_count (output
        # fingerprints to count in the sketch at the end) and _similar (slot -> asked
        # the same as this one): fields of _scan.ScanFields, which every delta's step
        # reads.
        super().__init__(engine, slot, prompt.time)
        self.findings: list[Finding] = []
        self._reported: set[tuple[str, str]] = set()  # (kind, source tenant)
        self._foreign_entities: set[str] = set()  # ids found here that are not ours
        # ... of which only answers to the same question held them: the model's answer
        # again, which this output shares with them (it renews the entity's life).
        self._echoed_entities: set[str] = set()
        #: This output's use of text other requests hold, fingerprint -> their index
        #: values: counted at its end, but for the text of a leak found in it.
        self._held_uses: dict[int, tuple[int, ...]] = {}
        #: Tenants whose answer this output was found to hold (``_carries``).
        self._answers_held: set[str] = set()
        self.finished = False

    def _met_entities(
        self, state: _ChoiceState, choice: int, matches: list[tuple[int, int, str]]
    ) -> list[Finding]:
        """Entities the choice's stream met, ``(start, end, entity id)``: recorded with
        the feed they came in, and judged. A firm the victim's own prompt names, a name
        of plain words not written as a name, and an amount written in another currency
        are dropped before they are recorded, so that a replay of the records agrees."""
        if matches and self.engine.config.case_identifiers and state.entities is not None:
            # Joined once: matches are rare, the stream long.
            folded, raw = state.entities.text, state.entities.raw_text
            matches = [
                m
                for m in matches
                if not self._names_own_company(folded, *m)
                and not self._names_own_person(folded, *m)
                and self._as_written(raw, *m)
            ]
        state.matches.extend((*m, len(state.batches)) for m in matches)
        return self._entity_findings(choice, matches)

    def finish(self, now: float | None = None) -> list[Finding]:
        """End of the response: flush held-back text and register the output's
        entities. Returns the findings completed by the end."""
        if self.finished:
            return []
        if now is not None:
            self._now = now
        found: list[Finding] = []
        seq = self.engine.tick()
        scanner = self.engine.delta_scanner()
        for choice, state in self._choices.items():
            found += scanner.scan_added(self, state, choice, scanner.flush(self, state), True)
            if state.entities is not None:
                found += self._met_entities(state, choice, state.entities.finish())
                raw = state.entities.raw_text
                state.chars = len(raw)
                engine = self.engine
                for e in extract_entities(raw):
                    key = fold(e.text)
                    entity_id = engine.entity_id(key)
                    state.extracted.append((e.kind, entity_id, e.start, e.end))
                    state.texts[entity_id] = key
                if engine.config.case_identifiers:
                    state.extracted += self._invented_names(raw)
            state.batches.append(len(state.hashes))
            state.seqs.append(seq)
            found += self._finish_choice(state, choice)
        self.finished = True
        self._count_output()
        self.engine._in_flight.pop(self.slot, None)
        return found

    def _invented_names(self, raw: str) -> list[tuple[str, str, int, int]]:
        """``extracted`` entries (``MODEL_NAME``) of the names this output made up, and
        of their words: not its own prompt's (the model restating its customer's name
        made up nothing) and held by no request of the window (a name another request
        holds is that request's, leaked or not: a leak must not make it the model's).
        Nor are the words of a held name ("Carroll Inc" of the firm's own answers, and
        "The Carroll" beside it): else every word of the firm's name would be one models
        write, and the next prompt that names it a quoted invention."""
        engine = self.engine
        table = engine.entities.table
        names = [(engine.entity_id(key), key, s, e, parts) for key, s, e, parts in iter_model_names(raw)]  # fmt: skip
        held = [(s, e) for entity_id, _, s, e, _ in names if entity_id in table]
        out = []
        for entity_id, key, start, end, parts in names:
            if entity_id in table:
                continue
            if all(h in self.own_units for h in engine.hasher.units(unit_texts(key))):
                continue
            out.append((MODEL_NAME, entity_id, start, end))
            # A pair's words: the first at its start, the second at its end.
            spans = ((start, start + len(parts[0])), (end - len(parts[-1]), end)) if parts else ()
            for word, (ws, we) in zip(parts, spans, strict=True):
                word_id = engine.entity_id(word)
                if word_id not in table and not any(hs <= ws and we <= he for hs, he in held):
                    out.append((MODEL_NAME, word_id, start, end))
        return out

    def _count_output(self) -> None:
        """The output's use of text, counted at its end: what no other request held,
        and what others held but for the text of the leaks found in it. A victim does
        not use what leaked to it: counted, a tenant's sentence leaked to two others
        would turn common and its third leak pass (bench/human_leaks.py seed 7)."""
        engine = self.engine
        engine._count_use(self.tenant, self._to_count, self._now)
        self._to_count = _tables.Column()
        held, self._held_uses = self._held_uses, {}
        if not held:
            return
        # By tenant, not by request: which of the source's requests a finding names
        # depends on the order its runs were judged in.
        leaked = {f.source_tenant for f in self.findings if f.kind == FRAGMENT}
        used = list(held)
        if leaked:
            by_tenant = _records.holders_by_tenant(engine._requests, self.tenant, used, held)
            theirs = {fp for tenant in leaked for fp in by_tenant.get(tenant, ())}
            used = [fp for fp in used if fp not in theirs]
        engine._count_use(self.tenant, used, self._now)

    def _finish_choice(self, state: _ChoiceState, choice: int) -> list[Finding]:
        """What the end of a choice teaches the engine: its words, and its entities (an
        entity another request owns is a finding; the others become this output's)."""
        engine = self.engine
        engine.vocabulary.learn(self.tenant, state.hashes)
        found = self._entity_findings(
            choice, [(s, e, i) for kind, i, s, e in state.extracted if kind != MODEL_NAME]
        )
        output_value = self.output_value
        around_leaks = self._around_leaks(state, choice)
        for kind, entity_id, _, _ in state.extracted:
            if entity_id in around_leaks:
                continue
            if kind == MODEL_NAME:
                # Kept in time order (a renewed name moves to the end): the sweep drops
                # the expired ones from the front.
                engine.model_names.pop(entity_id, None)
                engine.model_names[entity_id] = self._now
                continue
            if entity_id in self._foreign_entities and entity_id not in self._echoed_entities:
                owner = engine.entities.table.get(entity_id)
                if owner is not None and owner.model_born():
                    if owner.echoes is None:
                        owner.echoes = set()
                    if len(owner.echoes) < 8:
                        owner.echoes.add(self.tenant)  # the model wrote it here too
                continue
            if entity_id in engine._baseline_entities:
                continue
            engine.entities.add(
                entity_id,
                kind,
                self.tenant,
                output_value,
                self._now,
                text=state.texts.get(entity_id),
            )
            self._drop_later_outputs(engine.entities.table[entity_id])
        return found

    def _around_leaks(self, state: _ChoiceState, choice: int) -> set[str]:
        """Ids of the entities of a choice that hold a leak found in it, but for the
        leaked entities themselves: the source's text, not this output's own.
        "support@hayes-wyatt.com", made up around another tenant's firm in a faulted
        answer, made this tenant its owner, and the firm's own next answer with it a
        leak (real-model bench, seed 11)."""
        spans = [(f.start, f.end) for f in self.findings if f.choice == choice]
        return {
            entity_id
            for _, entity_id, start, end in state.extracted
            if entity_id not in self._foreign_entities
            and any(start < f_end and f_start < end for f_start, f_end in spans)
        }

    def _drop_later_outputs(self, owner: EntityOwner) -> None:
        """A string no prompt held, in this output and in outputs of requests that came
        after this one and asked something else (``_ended_first``): this request's model
        wrote it first, so they hold it as this one's leak. Forget their uses, as if
        this output had ended first (then they would never have held it)."""
        if not owner.model_born():
            return
        for tenant, (value, _) in list(owner.tenants.items()):
            later = tenant != self.tenant and self._ended_first(value)
            if later and not self.engine.delta_scanner().same_question(self, value >> 1):
                del owner.tenants[tenant]

    def _ended_first(self, value: int) -> bool:
        """``value`` (an index value) is the output of a request that came after this
        one: it ended first, which says nothing of who wrote what they share. A stream's
        end can reach the proxy after a later request's whole response (a KV-cache leak
        of this stream's text into a short answer), and an output's entities are its
        own only from its end. Its model-born strings in this output are no evidence
        against this one (a trade-off: a later request's entity-only leak into an
        earlier, longer stream goes unreported; its pages are still matched as text)."""
        return bool(value & 1) and value >> 1 > self.slot

    def record(self) -> OutputRecord:
        """The finished output in keyed form: what ``replay`` needs to make the same
        findings and leave the engine in the same state. Call after ``finish``."""
        # A leak of text found in it: what its findings set (the answers it carries, the
        # entities around the leak, the victim's uses not counted) is not in the record;
        # without the judgment, a receiver scans it again.
        judged = not any(f.kind == FRAGMENT for f in self.findings)
        choices = tuple(
            ChoiceRecord(
                choice,
                np.array(state.hashes, dtype=np.uint64),
                np.array(state.weights, dtype=np.uint8),
                np.array(state.numbers, dtype=bool),
                np.array(state.starts, dtype=np.uint32),
                np.array(state.ends, dtype=np.uint32),
                np.array(state.batches, dtype=np.uint32),
                np.array(state.seqs, dtype=np.uint64),
                tuple(state.matches),
                tuple(state.extracted),
                state.chars,
                np.sort(np.array(state.foreign, dtype=np.uint32)) if judged else None,
            )
            for choice, state in sorted(self._choices.items())
        )
        return OutputRecord(
            self.tenant,
            self.request_id,
            self._now,
            choices,
            self.engine.low_water(),
            self.prompt.seq,
            tuple(sorted(self._answers_held)),
        )

    def replay_step(self, record: OutputRecord, choice: ChoiceRecord, i: int) -> list[Finding]:
        """Run feed ``i`` of a recorded choice as the live scan ran it (the last one is
        the finish). Steps of one choice must run in order; ``RecordReplayer`` runs all
        records' steps in the live order."""
        self._now = record.time
        state = self._state(choice.choice)
        begin = int(choice.batches[i - 1]) if i else 0
        stop = int(choice.batches[i])
        last = i == len(choice.batches) - 1
        before = len(state.hashes)
        _extend_from(state, choice, begin, stop)
        scanner = self.engine.delta_scanner()
        found = scanner.scan_added(self, state, choice.choice, before, last)
        matches = [(s, e, entity_id) for s, e, entity_id, feed in choice.matches if feed == i]
        found += self._entity_findings(choice.choice, matches)
        if last:
            found += self._finish_recorded(state, choice)
        return found

    def ingest_output(self, record: OutputRecord) -> list[Finding]:
        """What another engine's finished output teaches this one (a replica ingesting
        another's record): the state ``replay_step`` of its feeds would leave. An output
        in which that engine's scan found no leak of text (the most of them) is indexed
        without judging owners against this engine's index
        (``DeltaScanner.learn_output``), as its ``foreign`` k-grams say that scan
        judged them. One with a leak (``foreign`` None, ``record``) is scanned again as
        one feed: what its findings set only they set (the answers it carries, the
        entities around the leak). So is a record of a version before them. The answers
        the record says it carries are carried here too, found again or not (a source
        that left the window before the output ended is not). Returns the findings
        (the scanning engine reported them: counted, not logged)."""
        for tenant in record.carries:
            self._carries(tenant)
        for choice in record.choices:  # every choice's state first: the output ends
            self._state(choice.choice)  # once all of them have (its uses counted)
        found: list[Finding] = []
        if any(c.foreign is None for c in record.choices):
            for choice in record.choices:
                found += self.replay_step(record, collapsed_choice(choice), 0)
            return found
        self._now = record.time
        scanner = self.engine.delta_scanner()
        for choice in record.choices:
            state = self._state(choice.choice)
            _extend_from(state, choice, 0, len(choice.units))
            scanner.learn_output(self, state, np.ascontiguousarray(choice.foreign, np.uint32))
            matches = [(s, e, entity_id) for s, e, entity_id, _ in choice.matches]
            found += self._entity_findings(choice.choice, matches)
            found += self._finish_recorded(state, choice)
        return found

    def _finish_recorded(self, state: _ChoiceState, choice: ChoiceRecord) -> list[Finding]:
        """The end of a recorded choice: its entities and length as the record holds
        them, then ``_finish_choice``; the output's uses are counted once every choice
        has ended."""
        state.extracted = list(choice.extracted)
        state.chars = choice.chars
        found = self._finish_choice(state, choice.choice)
        state.finished = True
        self.finished = all(s.finished for s in self._choices.values())
        if self.finished:
            self._count_output()
        return found

    def _state(self, choice: int) -> _ChoiceState:
        state = self._choices.get(choice)
        if state is None:
            state = self._choices[choice] = _ChoiceState(self.engine, self.own_units)
        return state

    @property
    def output_words(self) -> float:
        """Words of output received so far, all choices (a CJK character counts half).
        A word the stream may still continue is counted, though not scanned until it
        ends: a holdback counting these words keeps such a word back, since it is always
        among the newest."""
        return (
            sum(s.cumulative[-1] + s.tokenizer.pending_weight for s in self._choices.values()) / 2
        )

    # -- fragments -----------------------------------------------------------------

    def _use_held(self, fps: list[int], holders: dict[int, tuple[int, ...]]) -> None:
        """This output met ``fps``, which other requests hold. The other tenants that
        hold them used them: counted now (a holder still streaming counts its new text
        only at its end, and text several outputs are writing at once must not wait for
        that to turn common; the pair filter counts each tenant once). This output's own
        use waits for its end (``_count_output``), when its leaks are known."""
        by_tenant = _records.holders_by_tenant(self.engine._requests, self.tenant, fps, holders)
        for tenant, used in by_tenant.items():
            self.engine._count_use(tenant, used, self._now)
        self._held_uses.update((fp, holders[fp]) for fp in fps)

    def _source_record(self, slot: int) -> RequestRecord | None:
        """The request at ``slot`` while it is in the window at this scan's clock, else
        None. The sweep runs at most once a second, and an output's index values and
        entities are dated by its end, after its request: presence alone would let a
        source with no request left be reported, or not, by when the sweep last ran
        (so a live detector and a replay of its capture would disagree)."""
        record = self.engine._requests.get(slot)
        if record is None or record.time < self._now - self.engine.config.window_seconds:
            return None
        return record

    def _carries(self, tenant: str) -> None:
        """This output holds an answer of ``tenant``'s (a mis-routed or leaked copy).
        The engine may have seen only part of that answer (its stream was cut, or it
        went to this request alone): the rest, seen only here, is ``tenant``'s as much
        as this output's, and ``tenant`` writing it again is not a leak of this one."""
        self._answers_held.add(tenant)  # for the record, whether the request is still held
        own = self.engine._requests.get(self.slot)
        if own is not None:
            if own.carries is None:
                own.carries = set()
            own.carries.add(tenant)

    def _carried(self, record: RequestRecord) -> bool:
        """``record``'s output was found to hold an answer of this response's tenant:
        its text is no evidence of a leak to this tenant (other holders of the same
        text still are: the copy's own prompt, a third tenant's request). The cost: a
        later leak of the words that output alone held, to the same tenant, is missed."""
        return record.carries is not None and self.tenant in record.carries

    def _fragment_finding(
        self,
        state: _ChoiceState,
        choice: int,
        run: _scan.Run,
        record: RequestRecord,
        of_output: bool,
    ) -> Finding | None:
        """The finding of a run that is evidence, unless its source tenant was reported
        already (once per tenant and response). A run of another request's output
        makes this output one that carries that tenant's answer (``_carried``)."""
        if of_output:
            self._carries(record.tenant)
        if (FRAGMENT, record.tenant) in self._reported:
            return None
        self._reported.add((FRAGMENT, record.tenant))
        total = state.cumulative[-1]
        evidence = self.engine.hasher.digest(
            b"".join(fp.to_bytes(8, "little") for fp in run.fingerprints)
        )
        return Finding(
            FRAGMENT,
            record.tenant,
            record.request_id,
            round(run.covered / total, 4) if total else 0.0,
            run.covered / 2,
            state.starts[run.best_start],
            state.ends[run.best_end],
            choice,
            evidence,
            state.ends[-1],
        )

    def _entity_findings(self, choice: int, matches: list[tuple[int, int, str]]) -> list[Finding]:
        """Findings for entities met in this output, ``(start, end, entity id)``."""
        found = []
        for start, end, entity_id in matches:
            owner = self.engine.entities.table.get(entity_id)
            if owner is None or self.tenant in owner.tenants:
                continue
            self._foreign_entities.add(entity_id)
            is_canary = owner.kind == CANARY
            if not is_canary and owner.users() >= self.engine.config.common_tenants:
                continue
            if owner.kind in NAME_KINDS and (
                entity_id in self.engine.model_names or entity_id in self.own_model_names
            ):
                continue  # a name models write: nobody's, even when a prompt holds it
            sources = self._entity_sources(owner, is_canary)
            if not sources:
                self._echoed_entities.add(entity_id)
                continue  # only in answers to the same question, or in none left
            tenant, record = sources[0]
            kind = CANARY if is_canary else ENTITY
            if (kind, tenant) in self._reported:
                continue
            self._reported.add((kind, tenant))
            found.append(
                Finding(
                    kind,
                    tenant,
                    record.request_id,
                    1.0,
                    1.0,
                    start,
                    end,
                    choice,
                    entity_id,
                    end,
                )
            )
        self.findings += found
        return found

    def _as_written(self, raw: str, start: int, end: int, entity_id: str) -> bool:
        """Whether a case key met at ``raw[start:end]`` is written as its kind needs: a
        ``PROPER_NAME`` as a name (``written_as_name``), an amount in its own currency or
        none (``same_currency``), a reference's digits alone as a number of their own
        (``standalone_digits``); any other key as it is."""
        owner = self.engine.entities.table.get(entity_id)
        if owner is None:
            return True
        if owner.kind == PROPER_NAME:
            return written_as_name(raw, start, end)
        if owner.kind == "reference" and raw[start:end].isdigit():
            return standalone_digits(raw, start, end)
        return same_currency(owner.kind, raw, start, end)

    def _names_own_company(self, folded: str, start: int, end: int, entity_id: str) -> bool:
        """Whether a matched company key ("apple inc", the folded output at the match)
        has its name in this request's own prompt ("my Apple laptop"): the model naming
        the firm its customer asked about, not another tenant's dealings with it."""
        owner = self.engine.entities.table.get(entity_id)
        if owner is None or owner.kind not in NAME_KINDS:
            return False
        head = company_head(folded[start:end])
        return head is not None and all(
            h in self.own_units and h not in self.own_name_units
            for h in self.engine.hasher.units(unit_texts(head))
        )

    def _names_own_person(self, folded: str, start: int, end: int, entity_id: str) -> bool:
        """Whether a matched name key ("kimberly smith") has each of its words in the
        names of this request's own prompt ("my friend Kimberly Smith"): the model
        naming whom its customer wrote about. A prompt keys a rare pair itself, but not
        a name of plain words that another prompt keyed by its mailbox (human-text
        bench, seed 4, flagged such an answer)."""
        owner = self.engine.entities.table.get(entity_id)
        if owner is None or owner.kind != "name":
            return False
        return all(
            h in self.own_name_units
            for h in self.engine.hasher.units(unit_texts(folded[start:end]))
        )

    def _entity_sources(
        self, owner: EntityOwner, is_canary: bool
    ) -> list[tuple[str, RequestRecord]]:
        """(tenant, request) of each other use of an entity that makes it a finding,
        latest first: a canary's (its request never leaves the window); another one's
        while its request is in the window. None when an answer to the same question
        holds it, whoever else does (as for text, ``_foreign_values``): the model's
        answer to this question, which an unnoticed leak of it into another tenant's
        answer does not make that tenant's (seen in the fresh enforce e2e test: a
        misrouted copy in a third tenant's answer got a clean answer blocked)."""
        sources = []
        model_born = not is_canary and owner.model_born()
        for tenant, (value, _) in sorted(owner.tenants.items(), key=lambda item: -item[1][1]):
            slot = value >> 1
            if model_born and self._ended_first(value):
                continue
            record = self.engine._requests.get(slot) if is_canary else self._source_record(slot)
            if record is None:
                continue
            if value & 1:
                if self.engine.delta_scanner().same_question(self, slot):
                    if is_canary:
                        continue
                    return []
                if self._carried(record):
                    continue  # a copy of this tenant's answer: no evidence (others may be)
            sources.append((tenant, record))
        return sources


class _ChoiceState(_scan.ChoiceColumns):
    """Per-choice streaming state: tokenizer, shingler, unit offsets, coverage runs. The
    columns every delta appends to, the coverage by foreign requests (``runs``) and
    what judging it reads are ``_scan.ChoiceColumns``'s fields, which the compiled steps
    read and write in place; so are ``cover``, ``distinct``, ``specific``, ``tied`` and
    ``distinctive`` (``reference`` holds their Python)."""

    __slots__ = ("matches", "extracted", "texts", "chars", "finished")

    def __init__(self, engine: Engine, own_units: _tables.HotTable | None = None) -> None:
        super().__init__(
            StreamTokenizer(),
            EntityScanner(engine.entities, engine.entity_keys, engine.entity_id)
            if engine.config.entities
            else None,
        )
        self.plain = engine.vocabulary.plain
        self.public_numbers = engine.public_numbers
        self.exchange_555 = engine.exchange_555
        self.own_units = _tables.HotTable() if own_units is None else own_units
        # For the keyed record: entity matches with the feed they came in, entities
        # extracted at the end (and their folded texts).
        self.matches: list[tuple[int, int, str, int]] = []
        self.extracted: list[tuple[str, str, int, int]] = []
        self.texts: dict[str, str] = {}
        self.chars = 0
        self.finished = False  # replay: its last step ran


def _extend_from(state: _ChoiceState, choice: ChoiceRecord, begin: int, stop: int) -> None:
    """Append units ``begin:stop`` of a recorded choice to its state's columns."""
    state.extend_units(
        choice.units[begin:stop],
        choice.numbers[begin:stop].view(np.uint8),
        choice.starts[begin:stop],
        choice.ends[begin:stop],
        choice.weights[begin:stop],
    )


def beyond(units: list[int], of: list[int]) -> list[int]:
    """The units that ``units`` holds more often than ``of`` does (``Counter(units) -
    Counter(of)``'s keys, some repeated), in order: each of ``of``'s uses takes away the
    first one left of ``units``'. Compiled (``_tables.units_beyond``): a Counter of ``of``
    and a dict probe a unit took ~50 us for a conversation of the replay capture."""
    return _tables.units_beyond(units, of)


def uint64_array(values: list[int]) -> np.ndarray:
    """``numpy.array(values, dtype=numpy.uint64)``, filled in compiled code."""
    out = np.empty(len(values), dtype=np.uint64)
    _tables.ints_into(values, out)
    return out


def sorted_unique(values: list[int]) -> np.ndarray:
    """``numpy.unique`` of 64-bit ints (ascending, no repeats), sorted in compiled code:
    numpy 2's ``unique`` hashes first, which took ~55 us for a prompt's few hundred
    k-grams, and a sort and a mask in numpy still cost more in calls than in sorting."""
    out = np.empty(len(values), dtype=np.uint64)
    return out[: _tables.sorted_unique_into(values, out)]


def is_specific_number(unit: str) -> bool:
    """Amounts, ids and codes are specifics; years and small numbers are not."""
    if not unit.isdigit() or len(unit) < 3:
        return False
    return not (len(unit) == 4 and unit[:2] in ("19", "20"))


BITSET_TENANTS = 8192  # a word's users as bits while all are among the first this many


class Vocabulary:
    """Which words most tenants use: learned from traffic, bounded.

    A word (unit) is *plain* once at least ``common_tenants`` tenants, and at least
    ``plain_share`` of all tenants seen, used it. Boilerplate is made of plain words;
    private text nearly always carries a distinctive one (a name, a number, a product,
    a rare term). Names that recur in a few tenants' data stay distinctive.
    Holds keyed unit hashes, never words.
    """

    __slots__ = (
        "_common_tenants", "_share", "_numbered", "_named", "_plain", "_tenants", "_names",
        "max_entries",
    )  # fmt: skip

    def __init__(
        self,
        common_tenants: int,
        plain_share: float = 0.25,
        max_entries: int = 1_000_000,
        *,
        bitset_tenants: int = BITSET_TENANTS,
    ) -> None:
        self._common_tenants = common_tenants
        self._share = plain_share
        # A word's users while all are among the first ``bitset_tenants`` tenants: their
        # numbers, in compiled code (1,000 tenants in ~150 bytes, where a set of their
        # names took 1.6 KB); after that, the set of their names.
        self._numbered = _vocabulary.WordUsers(bitset_tenants)
        self._named: dict[int, set[str]] = {}
        # The plain words, in C (a key each; the value is unused): the vocabulary's loop
        # and every output's step ask it without an int object a word, and 20,000 words
        # take 0.4 MB, where a set of Python ints took 2 MB.
        self._plain = _tables.HotTable()
        self._tenants: dict[str, int] = {}  # name -> number, in order of first use
        self._names: list[str] = []  # number -> name
        self.max_entries = max_entries

    def __len__(self) -> int:
        """Words tracked that are not plain yet (at most ``max_entries``)."""
        return len(self._numbered) + len(self._named)

    def learn(self, tenant: str, units: Iterable[int]) -> None:
        tenants = self._tenants
        if tenant not in tenants and len(tenants) < 1_000_000:
            tenants[tenant] = len(self._names)
            self._names.append(tenant)
        needed = max(self._common_tenants, self._share * len(tenants))
        number = tenants.get(tenant)
        if not isinstance(units, list | _tables.Column):
            units = list(units)
        if number is not None and number < self._numbered.bitset_tenants:
            units = self._numbered.learn(
                units, number, needed, self._plain, self._named, self.max_entries
            )
        self._learn_by_name(tenant, units, needed)

    def _learn_by_name(self, tenant: str, units: Iterable[int], needed: float) -> None:
        """Count ``tenant`` among the users of ``units`` by name: every word of a tenant
        past the bitset's, and the words already kept by name."""
        plain, named = self._plain, self._named
        for unit in units:
            if unit in plain:
                continue
            users = named.get(unit)
            if users is None:
                numbers = self._numbered.pop(unit)
                if numbers is None:
                    if len(self) >= self.max_entries:
                        self._numbered.clear()  # rare words of the past; plain ones stay
                        named.clear()
                    named[unit] = {tenant}
                    continue
                users = named[unit] = {self._names[n] for n in numbers}
            if tenant in users:
                continue
            users.add(tenant)
            if len(users) >= needed:
                plain[unit] = 1
                del named[unit]

    @property
    def plain(self) -> _tables.HotTable:
        """The plain words: ``unit in plain``, ``len``, iteration over their hashes."""
        return self._plain

    def add_plain(self, units: Iterable[int]) -> None:
        self._plain.add_new(list(units), 1)

    def is_plain(self, unit: int) -> bool:
        return unit in self._plain
