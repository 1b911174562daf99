"""Unit tests of the detection engine (proxy.engine): its public behaviour only.

Every scenario passes explicit ``now`` times. Each "not a leak" case has a control
that changes only the excusing factor and must produce a finding, so that the
negative assertion cannot pass by accident.
"""

from __future__ import annotations

import itertools
import pickle
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.engine import (
    CANARY,
    ENTITY,
    FRAGMENT,
    Engine,
    EngineConfig,
    Finding,
    _entities,
    _tables,
    entities,
)
from proxy.engine.detector import beyond, sorted_unique, uint64_array
from proxy.engine.entities import extract_entities, iban_ok, luhn_ok
from proxy.engine.fingerprint import Hasher
from proxy.engine.index import CommonnessSketch, FingerprintIndex
from proxy.engine.ordered_replay import replay
from proxy.engine.tokens import CHAR_WEIGHT, WORD_WEIGHT, StreamTokenizer, unit_texts, units_of

KEY = b"k" * 32
T0 = 1_000_000.0  # well past 0 so that the first sweep behaves like in production

# -- texts -------------------------------------------------------------------------

PROMPT_A = (
    "Please summarise the Q3 roadmap for Project Falcon: Maria Jensen in Oslo wants the "
    "Kestrel migration budget of 4471 thousand kroner approved before the Halvorsen audit "
    "closes on Friday."
)
LEAK_A = "Maria Jensen in Oslo wants the Kestrel migration budget of 4471 thousand kroner approved"
PROMPT_B = "What is a good recipe for a vegetarian lasagna with spinach and ricotta?"
OUTPUT_B = (
    "Here is a simple recipe. Layer the pasta sheets with tomato sauce. "
    + LEAK_A
    + " Then bake for forty minutes until golden."
)
UNRELATED_OUTPUT = (
    "Layer the pasta sheets with tomato sauce, then bake for forty minutes until golden."
)

ZH_PROMPT_A = (
    "请帮我起草一封邮件给王晓明，告诉他深圳南山分行的贷款审批已经通过，额度为380000元，"
    "下周三之前需要签署补充协议并提交收入证明。"
)
ZH_LEAK = "深圳南山分行的贷款审批已经通过，额度为380000元"
ZH_OUTPUT_B = "好的，今天北京天气晴朗，适合出门散步。" + ZH_LEAK + "。祝你周末愉快！"

JA_PROMPT_A = (
    "田中様の注文番号はABC-4471です。配送先は大阪市北区梅田三丁目の青葉ビル十二階、"
    "受取人は佐藤花子さんでお願いします。"
)
JA_LEAK = "配送先は大阪市北区梅田三丁目の青葉ビル十二階、受取人は佐藤花子さん"
JA_OUTPUT_B = "ご質問ありがとう。" + JA_LEAK + "。以上、よろしくね。"


def make_engine(baseline: Iterable[str] = (), **config) -> Engine:
    return Engine(EngineConfig(key=KEY, **config), baseline=list(baseline))


def fragment_engine(**config) -> Engine:
    """An engine without case identifiers: LEAK_A holds a full name ("Maria Jensen"),
    which is an entity finding of its own; these tests are about the fragment path."""
    return make_engine(case_identifiers=False, **config)


def stream(scan, text: str, *, now: float, pieces: Sequence[str] | None = None, choice: int = 0):
    """Feed ``text`` (as ``pieces`` if given) and finish; returns every finding."""
    if pieces is not None:
        assert "".join(pieces) == text
    found: list[Finding] = []
    for piece in pieces if pieces is not None else [text]:
        found += scan.feed(piece, choice=choice, now=now)
    found += scan.finish(now=now)
    return found


def exchange(engine: Engine, tenant: str, rid: str, prompt: str, output: str, now: float, **kw):
    """One request: observe its prompt, stream its output; returns the findings."""
    scan = engine.observe_prompt(tenant, rid, prompt, now=now)
    return stream(scan, output, now=now, **kw)


def split_by(text: str, sizes: Sequence[int]) -> list[str]:
    """Cut ``text`` into pieces whose lengths cycle through ``sizes``."""
    pieces, i, j = [], 0, 0
    while i < len(text):
        n = sizes[j % len(sizes)]
        pieces.append(text[i : i + n])
        i += n
        j += 1
    return pieces


def words(text: str) -> list[str]:
    return [u.text for u in units_of(text)]


def kinds(findings: Iterable[Finding]) -> list[str]:
    return [f.kind for f in findings]


def assert_fragment_in(finding: Finding, output: str, leak: str, min_units: float = 8) -> None:
    """The finding points at (a part of) the leaked span, and it is big enough."""
    lo = output.index(leak)
    hi = lo + len(leak)
    assert lo <= finding.start < finding.end <= hi, (finding, lo, hi)
    span = output[finding.start : finding.end]
    assert span in leak
    leaked_units = words(span)
    weight = sum(u.weight for u in units_of(span)) / 2
    assert weight >= min_units, (span, leaked_units)
    assert finding.foreign_units >= min_units


def leak_from_a(engine: Engine, *, prompt_a: str = PROMPT_A, now: float = T0) -> None:
    exchange(engine, "A", "a-1", prompt_a, "Sure, here is the summary you asked for.", now)


# -- fragment signal ---------------------------------------------------------------


@given(st.lists(st.integers(0, 2**64 - 1) | st.sampled_from([0, 7, 2**64 - 1]), max_size=200))
def test_sorted_unique_is_numpys_unique(values):
    """The prompt signature's compiled sort stands in for ``numpy.unique``: lists long
    enough for its quicksort, and repeats of the few sampled values."""
    expected = np.unique(np.array(values, dtype=np.uint64))
    got = sorted_unique(values)
    assert got.dtype == np.uint64
    assert got.tolist() == expected.tolist()


UNITS = st.lists(st.integers(0, 5) | st.sampled_from([2**63, 2**64 - 1]), max_size=80)


@given(UNITS, UNITS)
def test_units_beyond_a_model_s_are_the_counters_difference(units, of):
    """A prompt's own words: each unit as many more times than the model's turns hold it
    (a few values, so that repeats on both sides meet)."""
    kept = beyond(units, of)
    assert Counter(kept) == Counter(units) - Counter(of)
    rest = iter(units)
    assert all(unit in rest for unit in kept)  # in the prompt's order
    expected, taken = [], Counter(of)
    for unit in units:  # each of the model's uses takes the first one left
        if taken[unit]:
            taken[unit] -= 1
        else:
            expected.append(unit)
    assert kept == expected


@given(st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_uint64_array_is_numpys(values):
    got = uint64_array(values)
    assert got.dtype == np.uint64
    assert got.tolist() == np.array(values, dtype=np.uint64).tolist()


def test_sorted_unique_of_an_order_that_defeats_the_middle_key():
    """An organ pipe makes every middle key a bad pivot: the sort hands the rest to
    ``qsort`` past its depth, and the answer is still ``numpy.unique``'s."""
    pipe = [*range(20_000), *range(20_000, 0, -1)]
    assert sorted_unique(pipe).tolist() == list(range(20_001))


def test_sorted_unique_into_refuses_a_short_array_and_ints_out_of_range():
    """Bad input is an error before anything is written past the array it was given."""
    out = np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="shorter"):
        _tables.sorted_unique_into([3, 1, 2], out)
    with pytest.raises(OverflowError):
        _tables.sorted_unique_into([-1], out)
    with pytest.raises(OverflowError):
        _tables.sorted_unique_into([2**64], out)
    with pytest.raises(ValueError, match="shorter"):
        _tables.ints_into([1, 2, 3], out)
    with pytest.raises(OverflowError):
        _tables.ints_into([-1], out)
    assert _tables.sorted_unique_into([5, 5], out) == 1 and out[0] == 5


def test_fragment_of_a_prompt_in_b_output_is_reported():
    engine = fragment_engine()
    leak_from_a(engine)
    found = exchange(engine, "B", "b-1", PROMPT_B, OUTPUT_B, T0 + 1)
    assert len(found) == 1
    (f,) = found
    assert f.kind == FRAGMENT
    assert (f.source_tenant, f.source_request_id, f.choice) == ("A", "a-1", 0)
    assert_fragment_in(f, OUTPUT_B, LEAK_A)
    # Delivered in one delta, the whole leak is visible at once: the span is all of it.
    assert OUTPUT_B[f.start : f.end] == LEAK_A
    assert f.foreign_units == len(words(LEAK_A))
    assert 0 < f.score < 1
    assert re.fullmatch(r"[0-9a-f]{16}", f.evidence)


def test_unrelated_output_has_no_finding():
    engine = make_engine()
    leak_from_a(engine)
    assert exchange(engine, "B", "b-1", PROMPT_B, UNRELATED_OUTPUT, T0 + 1) == []


def test_finding_is_returned_by_the_delta_that_completes_it_and_kept_on_the_scan():
    engine = fragment_engine()
    leak_from_a(engine)
    scan = engine.observe_prompt("B", "b-1", PROMPT_B, now=T0 + 1)
    assert scan.feed("Here is a simple recipe. ", now=T0 + 1) == []
    found = scan.feed(LEAK_A + " Then bake.", now=T0 + 1)
    assert kinds(found) == [FRAGMENT]
    assert scan.feed(" " + LEAK_A + " again.", now=T0 + 1) == []  # reported once per source
    assert scan.finish(now=T0 + 1) == []
    assert scan.findings == found


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=40))
def test_fragment_split_into_tiny_deltas_gives_the_same_finding(sizes):
    engine = fragment_engine()
    leak_from_a(engine)
    pieces = split_by(OUTPUT_B, sizes)
    found = exchange(engine, "B", "b-1", PROMPT_B, OUTPUT_B, T0 + 1, pieces=pieces)
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.source_tenant, f.source_request_id) == (FRAGMENT, "A", "a-1")
    # Reported as soon as the run is long enough: it starts where the leak starts.
    assert f.start == OUTPUT_B.index(LEAK_A)
    assert_fragment_in(f, OUTPUT_B, LEAK_A)


def test_fragment_in_second_choice_has_choice_relative_offsets():
    engine = fragment_engine()
    leak_from_a(engine)
    scan = engine.observe_prompt("B", "b-1", PROMPT_B, now=T0 + 1)
    found = scan.feed(UNRELATED_OUTPUT, choice=0, now=T0 + 1)
    found += scan.feed(OUTPUT_B, choice=1, now=T0 + 1)
    found += scan.finish(now=T0 + 1)
    assert len(found) == 1
    assert found[0].choice == 1
    assert OUTPUT_B[found[0].start : found[0].end] == LEAK_A


@pytest.mark.parametrize(
    "prompt_a, output_b, leak, min_units",
    [
        (ZH_PROMPT_A, ZH_OUTPUT_B, ZH_LEAK, 8),
        (JA_PROMPT_A, JA_OUTPUT_B, JA_LEAK, 8),
    ],
    ids=["chinese", "japanese"],
)
@pytest.mark.parametrize("delta_sizes", [None, (1,), (2, 1, 3)], ids=["whole", "1", "213"])
def test_cjk_fragment_is_reported(prompt_a, output_b, leak, min_units, delta_sizes):
    engine = make_engine()
    leak_from_a(engine, prompt_a=prompt_a)
    pieces = split_by(output_b, delta_sizes) if delta_sizes else None
    found = exchange(engine, "B", "b-1", "今天天气怎么样？", output_b, T0 + 1, pieces=pieces)
    fragments = [f for f in found if f.kind == FRAGMENT]
    assert len(fragments) == 1
    (f,) = fragments
    assert (f.source_tenant, f.source_request_id) == ("A", "a-1")
    assert f.start == output_b.index(leak)
    assert_fragment_in(f, output_b, leak, min_units)


def test_short_cjk_overlap_is_not_reported():
    engine = make_engine()
    leak_from_a(engine, prompt_a=ZH_PROMPT_A)
    output = "好的，今天北京天气晴朗。深圳南山分行的贷款审批，祝你周末愉快！"  # 11 characters
    assert exchange(engine, "B", "b-1", "今天天气怎么样？", output, T0 + 1) == []


OUTPUT_A = (
    "Your booking reference is QX7731 for the Lindqvist family suite at Hotel Brattoe, "
    "check-in on the fourth of May with breakfast for three guests included."
)
LEAK_OUTPUT_A = "Your booking reference is QX7731 for the Lindqvist family suite at Hotel Brattoe"


@pytest.mark.parametrize("a_finished", [True, False], ids=["a-finished", "a-still-streaming"])
def test_leak_of_another_tenants_output_is_reported(a_finished):
    engine = make_engine()
    scan_a = engine.observe_prompt("A", "a-7", "What did the booking system reply?", now=T0)
    scan_a.feed(OUTPUT_A, now=T0)
    if a_finished:
        scan_a.finish(now=T0)
    output_b = "The weather is fine. " + LEAK_OUTPUT_A + ", so enjoy the trip."
    found = exchange(engine, "B", "b-1", "How is the weather in Bergen?", output_b, T0 + 1)
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.source_tenant, f.source_request_id) == (FRAGMENT, "A", "a-7")
    assert_fragment_in(f, output_b, LEAK_OUTPUT_A)


@pytest.mark.parametrize("n_words", [5, 6, 7, 8, 9])
def test_min_run_words_threshold(n_words):
    engine = fragment_engine()
    leak_from_a(engine)
    leak = " ".join(LEAK_A.split()[:n_words])
    output = "Zebras graze quietly. " + leak + ". Penguins waddle home."
    found = exchange(engine, "B", "b-1", PROMPT_B, output, T0 + 1)
    if n_words < 8:
        assert found == []
    else:
        assert kinds(found) == [FRAGMENT]
        assert output[found[0].start : found[0].end] == leak


# -- entity signal -----------------------------------------------------------------

ENTITIES = {
    "email": "maria.jensen@falcon-corp.no",
    "iban": "GB12 WEST 1234 5698 7654 31",
    "card": "4539 1488 0343 6467",
    "api_key": "sk-proj-Xa9bQ7rT2mN4pL8kV3cW6yZ1",
    "phone": "+47 22 33 44 55",
    "digit_id": "48213377",
}


@pytest.mark.parametrize("kind", sorted(ENTITIES))
def test_entity_of_a_prompt_in_b_output_is_reported(kind):
    entity = ENTITIES[kind]
    assert [(e.kind, e.text) for e in extract_entities(f"use {entity} now")] == [(kind, entity)]
    engine = make_engine()
    leak_from_a(engine, prompt_a=f"Please settle the Halvorsen invoice with {entity} today.")
    output = f"Sure. The value you need is {entity} as requested."
    found = exchange(engine, "B", "b-1", PROMPT_B, output, T0 + 1)
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.source_tenant, f.source_request_id) == (ENTITY, "A", "a-1")
    # An IBAN's head is keyed too, and completes first: the finding may point at it.
    matched = output[f.start : f.end]
    assert matched == entity or (
        kind == "iban" and entity.startswith(matched) and len(matched) >= 19
    )
    assert entity.lower() not in f.evidence


@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 1, 2), (5, 7)])
def test_entity_split_across_deltas_is_reported(sizes):
    entity = ENTITIES["email"]
    engine = make_engine()
    leak_from_a(engine, prompt_a=f"Please email {entity} about the Halvorsen invoice.")
    output = f"Write to {entity}"  # ends with the entity: confirmed by finish
    found = exchange(engine, "B", "b-1", PROMPT_B, output, T0 + 1, pieces=split_by(output, sizes))
    assert kinds(found) == [ENTITY]
    assert output[found[0].start : found[0].end] == entity


@pytest.mark.parametrize(
    "rebuild_interval", [0.0, 1e12], ids=["automaton-swapped-mid-stream", "pending-keys"]
)
def test_entity_added_while_victim_streams_is_found(rebuild_interval):
    """A source observed while the victim streams is matched, whether its entity is
    already in a freshly rebuilt automaton or still in the pending list."""
    entity = ENTITIES["api_key"]
    engine = make_engine()
    engine.entities.rebuild_interval = rebuild_interval
    scan_b = engine.observe_prompt("B", "b-1", PROMPT_B, now=T0)
    assert scan_b.feed("Working on it. ", now=T0) == []
    leak_from_a(engine, prompt_a=f"My key is {entity} keep it safe", now=T0 + 1)
    output = f"Key: {entity}, done."
    found = stream(scan_b, output, now=T0 + 1, pieces=split_by(output, (3, 1, 2)))
    assert kinds(found) == [ENTITY]
    offset = len("Working on it. ")
    assert (found[0].start - offset, found[0].end - offset) == (5, 5 + len(entity))


@pytest.mark.parametrize(
    "output, pieces",
    [
        ("Call 99482133771 today.", None),  # inside a longer number
        ("Call 4821337799 today.", None),  # prefix of a longer number
        ("Call 948213377 today.", None),  # suffix of a longer number
        ("Call 48213377" + "5 today.", ["Call 48213377", "5 today."]),  # continued by a delta
        ("Call X48213377 today.", None),  # glued to a letter
    ],
)
def test_digit_id_inside_longer_token_is_not_matched(output, pieces):
    engine = make_engine()
    leak_from_a(engine, prompt_a="Ticket 48213377 is blocked on the Halvorsen side.")
    assert exchange(engine, "B", "b-1", PROMPT_B, output, T0 + 1, pieces=pieces) == []


@pytest.mark.parametrize(
    "cut",
    [len("on file: REF-76859772"), len("on file: REF-76859772.")],
    ids=["id-ends-a-delta", "period-ends-a-delta"],
)
def test_identifier_before_a_glued_cjk_sentence_is_found_while_streaming(cut):
    """A period then digits after an identifier begin the next sentence (Japanese is
    written without a space). Found as the stream goes, not at its end: with the ID
    ending one delta and ".25日" opening the next, it was found only by ``finish``, after
    enforce had released it (CI run of stop 55 let ``REF-76859772`` through so)."""
    engine = make_engine()
    leak_from_a(engine, prompt_a="My booking is REF-76859772 and it still shows as unpaid.")
    output = "on file: REF-76859772.25日までにご連絡します。"
    scan = engine.observe_prompt("B", "b-1", PROMPT_B, now=T0 + 1)
    streamed = scan.feed(output[:cut], now=T0 + 1) + scan.feed(output[cut:], now=T0 + 1)
    assert kinds(streamed) == [ENTITY] and scan.finish(now=T0 + 1) == []
    assert output[streamed[0].start : streamed[0].end] == "REF-76859772"


@pytest.mark.parametrize(
    "pieces",
    [None, ["Paid €12,449", ".", "51 today."], ["Paid €12,449.", "51 today."]],
    ids=["one-delta", "period-alone", "period-last"],
)
def test_amount_continued_by_decimals_is_not_matched_however_cut(pieces):
    """An amount inside a longer one is another amount, whichever delta brings the
    digits after its separator."""
    engine = make_engine()
    leak_from_a(engine, prompt_a="The Halvorsen deposit of €12,449 is still missing.")
    output = "Paid €12,449.51 today."
    assert exchange(engine, "B", "b-1", PROMPT_B, output, T0 + 1, pieces=pieces) == []


@pytest.mark.parametrize(
    ("written", "after"),
    [("CUS-8591332", ""), ("ana.lima@halvorsen-bank.no", ""), ("TCK-629869", ""),
     ("€3,813.95", ""), ("Suzanne Woodward", ""), ("Pearson-Kramer", ""),
     ("TCK-629869", "。25日までに担当者からご連絡いたしますので、少々お待ちください。")],
    ids=["id", "email", "ticket", "amount", "name", "firm", "ticket-in-japanese"],
)  # fmt: skip
def test_another_replicas_entity_is_found_while_streaming(written, after):
    """An entity known by id only (ingested from another replica's record: no text for
    an automaton) is found as the stream goes, at the offsets where the engine that saw
    the text finds it, at most 8 units (words, CJK characters) after its end: half an
    enforce holdback. Before, ids were matched at the end, format entities only, so
    enforce let another replica's tenant's ticket, amount or name through whole."""
    prompt = (
        "Please refund Ana Lima (ana.lima@halvorsen-bank.no, customer CUS-8591332): ticket "
        "TCK-629869, €3,813.95 owed to Suzanne Woodward at Pearson-Kramer."
    )
    tail = after or " is on file. Then bake the lasagna for forty minutes until golden."
    output = f"Noted: {written}{tail}"
    pieces = [output[i : i + 3] for i in range(0, len(output), 3)]
    found_at = {}
    for remote in (False, True):
        a = make_engine()
        b = make_engine() if remote else a
        source = a.observe_prompt("A", "a-1", prompt, now=T0)
        if remote:
            b.ingest_prompt(source.prompt)
            assert b.entities.id_only and not b.entities._texts
        scan = b.observe_prompt("B", "b-1", PROMPT_B, now=T0 + 1)
        streamed = 0
        for piece in pieces:
            streamed += len(piece)
            for f in scan.feed(piece, now=T0 + 1):
                found_at[remote] = (f.kind, f.source_tenant, f.start, f.end, streamed)
        assert scan.finish(now=T0 + 1) == []  # all found while streaming
    start = output.index(written.lstrip("€"))
    kind, tenant, s, e, at = found_at[True]
    assert (kind, tenant, s, e) == found_at[False][:4] == (ENTITY, "A", start, e)
    units_between = len(unit_texts(output[e:at]))
    assert units_between <= 8 + 1, (output[e:at], units_between)


def test_the_by_id_scan_reads_a_long_run_without_spaces_once():
    """A run with no boundary (a JSON array written without spaces) is cut every
    ``_ID_CARRY`` characters: the text kept between runs stays bounded (it held the whole
    run, walked again at every run), and a key inside the run is still found, by id."""
    a, b = make_engine(), make_engine()
    b.ingest_prompt(
        a.observe_prompt("A", "a-1", "Refund customer CUS-8591332 today.", now=T0).prompt
    )
    scan = b.observe_prompt("B", "b-1", PROMPT_B, now=T0 + 1)
    items = [str(n) for n in range(20_000)]
    items[15_000] = "CUS-8591332"
    output = "[" + ",".join(items) + "]"
    found, carried = [], 0
    for i in range(0, len(output), 7):
        found += scan.feed(output[i : i + 7], now=T0 + 1)
        carried = max(carried, len(scan._choices[0].entities._ids_carry))
    found += scan.finish(now=T0 + 1)
    assert carried <= 4 * entities._ID_CARRY, carried
    assert [(f.kind, f.source_tenant, output[f.start : f.end]) for f in found] == [
        (ENTITY, "A", "CUS-8591332")
    ]


def test_an_entity_known_by_id_is_not_its_own_tenants_leak():
    a, b = make_engine(), make_engine()
    b.ingest_prompt(
        a.observe_prompt("A", "a-1", "Ticket TCK-629869 for Suzanne Woodward.", now=T0).prompt
    )
    output = "Your ticket TCK-629869 for Suzanne Woodward is open and will be handled this week."
    assert exchange(b, "A", "a-2", "Where is my ticket?", output, T0 + 1) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("refund to Ana Lima, ref CUS-8591332.", ["CUS-8591332"]),  # a customer's id
        ("account acc1234567 is overdue", ["acc1234567"]),
        ("Ticket 48213377 is blocked", ["48213377"]),
        ("we shipped 1234567 units", []),  # seven digits alone: a count
        ("see A-1234567 and ISO-27001", []),  # one letter; five digits
    ],
)
def test_digit_ids_are_long_numbers_or_prefixed_seven_digit_ones(text, expected):
    assert [e.text for e in extract_entities(text) if e.kind == "digit_id"] == expected


def test_a_foreign_customer_id_is_a_finding():
    engine = make_engine()
    leak_from_a(engine, prompt_a="Please refund Ana Lima, customer id CUS-8591332, this week.")
    found = exchange(
        engine, "B", "b-1", PROMPT_B, "Noted: the record for CUS-8591332 is done.", T0 + 1
    )
    assert kinds(found) == [ENTITY] and found[0].source_tenant == "A"


def test_digit_id_standalone_split_across_deltas_is_matched():
    engine = make_engine()
    leak_from_a(engine, prompt_a="Ticket 48213377 is blocked on the Halvorsen side.")
    output = "Call 48213377 today."
    found = exchange(
        engine, "B", "b-1", PROMPT_B, output, T0 + 1, pieces=["Call 4821", "3377", " to", "day."]
    )
    assert kinds(found) == [ENTITY]
    assert output[found[0].start : found[0].end] == "48213377"


def test_entity_of_a_output_is_reported_after_a_finishes():
    entity = ENTITIES["email"]
    engine = make_engine()
    exchange(engine, "A", "a-1", "Who handles refunds?", f"Refunds go to {entity} directly.", T0)
    found = exchange(engine, "B", "b-1", PROMPT_B, f"Ask {entity} please.", T0 + 1)
    assert kinds(found) == [ENTITY]
    assert found[0].source_request_id == "a-1"


def test_iban_of_a_output_is_reported():
    iban = ENTITIES["iban"]
    engine = make_engine()
    exchange(engine, "A", "a-1", "Where do I send the money?", f"Transfer it to {iban} soon.", T0)
    found = exchange(engine, "B", "b-1", PROMPT_B, f"Your account: {iban} is ready.", T0 + 1)
    assert kinds(found) == [ENTITY]


def test_entity_offsets_survive_length_changing_lowercase():
    entity = ENTITIES["email"]
    engine = make_engine()
    leak_from_a(engine, prompt_a=f"Please email {entity} about the Halvorsen invoice.")
    output = f"İstanbul office: write to {entity} today"
    found = exchange(engine, "B", "b-1", PROMPT_B, output, T0 + 1)
    assert kinds(found) == [ENTITY]
    assert output[found[0].start : found[0].end] == entity


def test_entities_in_chinese_text_are_extracted():
    found = extract_entities(
        "请把款转到账号6222020200112233，联系邮箱是wang.xiaoming@polarmail.cn，谢谢"
    )
    assert [(e.kind, e.text) for e in found] == [
        ("digit_id", "6222020200112233"),
        ("email", "wang.xiaoming@polarmail.cn"),
    ]


# -- canaries ------------------------------------------------------------------------

CANARY_TEXT = "ZX81-quartz-canary-7731"


def test_canary_in_other_tenants_output_is_reported():
    engine = make_engine()
    engine.register_canary("A", CANARY_TEXT)
    output = f"Sure! The code is {CANARY_TEXT.lower()}, enjoy."
    found = exchange(engine, "B", "b-1", PROMPT_B, output, T0, pieces=split_by(output, (2, 3)))
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.source_tenant) == (CANARY, "A")
    assert output[f.start : f.end].lower() == CANARY_TEXT.lower()


def test_canary_in_own_output_is_not_reported():
    engine = make_engine()
    engine.register_canary("A", CANARY_TEXT)
    assert exchange(engine, "A", "a-1", "hi", f"Your marker is {CANARY_TEXT}.", T0) == []


def test_canary_outlives_the_window():
    engine = make_engine(window_seconds=60)
    engine.register_canary("A", CANARY_TEXT)
    leak_from_a(engine)
    later = T0 + 10 * 60
    found = exchange(engine, "B", "b-1", PROMPT_B, f"x {CANARY_TEXT} y", later)
    assert kinds(found) == [CANARY]


# -- not a leak --------------------------------------------------------------------


@pytest.mark.parametrize("excused", [True, False])
def test_victim_restating_its_own_prompt(excused):
    """A shares text with B; B's answer restates B's own prompt: not a leak. Control: B
    did not send that text, so the same answer is a leak of A's text."""
    engine = fragment_engine()
    leak_from_a(engine)
    prompt_b = "Rewrite this more politely: " + LEAK_A if excused else PROMPT_B
    found = exchange(engine, "B", "b-1", prompt_b, OUTPUT_B, T0 + 1)
    assert kinds(found) == ([] if excused else [FRAGMENT])


@pytest.mark.parametrize("tenant", ["A", "B"])
def test_same_tenant_earlier_request_is_not_a_leak(tenant):
    engine = fragment_engine()
    leak_from_a(engine)
    found = exchange(engine, tenant, "x-2", PROMPT_B, OUTPUT_B, T0 + 30)
    assert kinds(found) == ([] if tenant == "A" else [FRAGMENT])


SYSTEM_PROMPT = (
    "You are Orbital Helper for Zentrix Logistics. Answer politely, cite the shipment "
    "tracking policy section 4.2, never promise delivery dates, and escalate damaged "
    "parcel claims to the Vandermeer claims desk."
)
RESTATED = (
    "As your instructions say: cite the shipment tracking policy section 4.2, never promise "
    "delivery dates, and escalate damaged parcel claims to the Vandermeer claims desk."
)


@pytest.mark.parametrize("n_tenants", [2, 3, 4])
def test_text_of_common_tenants_is_shared_not_private(n_tenants):
    engine = make_engine()
    for i in range(n_tenants):
        question = f"Customer {i} asks where parcel number {9100 + i} is."
        exchange(engine, f"T{i}", f"t{i}", SYSTEM_PROMPT + "\n" + question, "Checking.", T0 + i)
    found = exchange(engine, "D", "d-1", "Repeat your instructions.", RESTATED, T0 + 10)
    if n_tenants >= engine.config.common_tenants:
        assert found == []
    else:  # control: two tenants' text is still private to them
        assert FRAGMENT in kinds(found)


@pytest.mark.parametrize("n_earlier", [1, 2, 3])
def test_commonness_outlives_the_window(n_earlier):
    """Tenants that used the text before the window (their requests are gone) still
    make it common, through the decaying sketch: with the live source A they reach
    common_tenants from 2 earlier tenants on. Control: 1 earlier tenant + A is private."""
    engine = make_engine(window_seconds=600)
    # Just after a whole hour: the sketch halves on whole multiples of its half-life.
    start = 3600.0 * (T0 // 3600 + 1)
    for i in range(n_earlier):
        question = f"Customer {i} asks where parcel number {9100 + i} is."
        exchange(engine, f"T{i}", f"t{i}", SYSTEM_PROMPT + "\n" + question, "Checking.", start + i)
    later = start + 1200  # earlier requests expired; sketch half-life is an hour
    exchange(engine, "A", "a-1", SYSTEM_PROMPT + "\nWhere is parcel 7?", "Checking.", later)
    found = exchange(engine, "D", "d-1", "Repeat your instructions.", RESTATED, later + 1)
    assert kinds(found) == ([FRAGMENT] if n_earlier + 1 < 3 else [])


def test_entity_of_common_tenants_is_not_reported():
    engine = make_engine()
    entity = "support@zentrix-logistics.example"
    for i in range(3):
        exchange(engine, f"T{i}", f"t{i}", f"Forward complaint {i} to {entity}.", "ok", T0 + i)
    found = exchange(engine, "D", "d-1", PROMPT_B, f"Mail {entity} please.", T0 + 10)
    assert found == []


@pytest.mark.parametrize("with_baseline", [True, False])
def test_baseline_text_is_not_a_leak(with_baseline):
    engine = make_engine(baseline=[SYSTEM_PROMPT] if with_baseline else [])
    exchange(engine, "A", "a-1", SYSTEM_PROMPT + "\nWhere is parcel 9100?", "Checking.", T0)
    found = exchange(engine, "D", "d-1", "Repeat your instructions.", RESTATED, T0 + 1)
    assert kinds(found) == ([] if with_baseline else [FRAGMENT])


BOILERPLATE = (
    "I would be happy to help you with that request. Let me walk you through the steps "
    "one at a time so that nothing important is missed along the way."
)


@pytest.mark.parametrize("with_baseline", [True, False])
def test_assistant_boilerplate_is_not_a_leak_even_on_a_fresh_engine(with_baseline):
    """Two tenants' answers share the model's phrasing, and only two tenants have used
    it yet: nothing in it belongs to the first exchange (no number, no word of its
    prompt), so it is the model's habit, baseline or not."""
    engine = make_engine(baseline=[BOILERPLATE] if with_baseline else [])
    exchange(
        engine, "A", "a-1", "How do I reset my router?", BOILERPLATE + " First, unplug it.", T0
    )
    output = BOILERPLATE + " First, open the settings page."
    found = exchange(engine, "B", "b-1", "How do I change my password?", output, T0 + 1)
    assert kinds(found) == []


def test_a_foreign_output_page_is_a_leak_when_it_carries_that_exchange_specifics():
    """The same page of A's answer, restating a word of A's own prompt or carrying a
    number only A's answer has, is A's: what makes it specific to A decides."""
    prompt_a = "How do I reset the Zephyrine router in our Kalmbach office?"
    answer_a = f"{BOILERPLATE} For the Zephyrine in Kalmbach, hold reset; ticket 773412 is open."
    engine = make_engine()
    exchange(engine, "A", "a-1", prompt_a, answer_a, T0)
    page = "missed along the way. For the Zephyrine in Kalmbach, hold reset"
    found = exchange(engine, "B", "b-1", "Weather?", f"Sunny. {page}. Bye.", T0 + 1)
    assert kinds(found) == [FRAGMENT] and found[0].source_tenant == "A"
    numbered = "one at a time so that nothing important is missed; ticket 773412 is open"
    found = exchange(engine, "C", "c-1", "Tides?", f"Low. {numbered}. Bye.", T0 + 2)
    assert kinds(found) == [FRAGMENT] and found[0].source_tenant == "A"


@pytest.mark.parametrize("with_baseline", [True, False])
def test_entity_in_baseline_is_not_a_leak(with_baseline):
    entity = "help@zentrix-logistics.eu"
    engine = make_engine(baseline=[f"Contact {entity}."] if with_baseline else [])
    leak_from_a(engine, prompt_a=f"Escalate to {entity} if the Halvorsen parcel is late.")
    found = exchange(engine, "B", "b-1", PROMPT_B, f"Write to {entity}.", T0 + 1)
    assert kinds(found) == ([] if with_baseline else [ENTITY])


SAME_PROMPT = "Explain the refund policy of Zentrix Logistics for parcel 88213 in detail."
SAME_ANSWER = (
    "Zentrix Logistics refunds parcel 88213 within fourteen days once the Vandermeer desk "
    "confirms the damage report; write to refunds@zentrix-logistics.eu with photos."
)


@pytest.mark.parametrize(
    "prompt_b, leak",
    [(SAME_PROMPT, False), ("Tell me a fun fact about octopuses.", True)],
    ids=["identical-prompt", "different-prompt"],
)
def test_identical_prompt_identical_answer_is_not_a_leak(prompt_b, leak):
    """Temperature 0: two tenants asking the same thing get the same answer word for
    word (including the entity it contains). Control: a different question that gets
    A's answer is a leak of A's output."""
    engine = make_engine()
    assert exchange(engine, "A", "a-1", SAME_PROMPT, SAME_ANSWER, T0) == []
    found = exchange(engine, "B", "b-1", prompt_b, SAME_ANSWER, T0 + 2)
    if leak:
        assert sorted(kinds(found)) == [ENTITY, FRAGMENT]
        assert {f.source_request_id for f in found} == {"a-1"}
    else:
        assert found == []


PLAIN_VOCAB = (
    "the of and to in is it for on with as at by from that this be are was were has "
    "have had not but or an will can all one"
)
PLAIN_PRIVATE_ORDER = " ".join(reversed(PLAIN_VOCAB.split()))


@pytest.mark.parametrize(
    ("factor", "n_words", "leak"),
    [(1.0, 7, False), (1.0, 8, True), (2.0, 15, False), (2.0, 16, True)],
)
def test_run_of_plain_words_from_a_prompt(factor, n_words, leak):
    """Words that several tenants use (here: the baseline's vocabulary, in another
    order) are plain. A user's plain words are still private: by default a run of them
    from a prompt is a leak at min_run_words; plain_run_factor asks for longer runs."""
    engine = make_engine(baseline=[PLAIN_VOCAB], plain_run_factor=factor)
    leak_from_a(engine, prompt_a=PLAIN_PRIVATE_ORDER)
    text = " ".join(PLAIN_PRIVATE_ORDER.split()[:n_words])
    found = exchange(engine, "B", "b-1", PROMPT_B, f"Zebras. {text}. Penguins.", T0 + 1)
    assert kinds(found) == ([FRAGMENT] if leak else [])


@pytest.mark.parametrize("senders", [1, 2], ids=["one-tenant", "two-tenants"])
def test_a_sentence_one_tenant_sent_in_every_request_stays_its_own(senders):
    """A k-gram that 64 requests or more hold was taken for shared text. Sent by one tenant only (its signature, its system
    prompt, its own story told again: bench/human_leaks.py seed 7, warm), it is still that
    tenant's: another tenant's answer holding 8 words of it is a leak. Control: the same
    requests split between two tenants is text several requests of several tenants
    share, which the index no longer tells apart from boilerplate."""
    engine = make_engine()
    # Small generations, so that 80 requests give a k-gram 64 values or more, as thousands
    # of requests do with the default size.
    engine.index.freeze_size = 16
    sentence = "I have two job interviews on the same day and I cannot decide which one to miss."
    for i in range(80):
        tenant = "A" if senders == 1 or i % 2 else "C"
        scan = engine.observe_prompt(tenant, f"a-{i}", sentence, now=T0 + i, turns_known=True)
        stream(scan, f"Noted, item {i}.", now=T0 + i)
    leak = "job interviews on the same day and I cannot decide"
    assert (
        len(engine.index.lookup([engine.hasher.kgram(engine.hasher.units(words(leak)[:4]))])[0])
        >= 64
    )
    scan = engine.observe_prompt("B", "b-1", PROMPT_B, now=T0 + 100, turns_known=True)
    found = stream(scan, f"Sure. {leak}. Bye.", now=T0 + 100)
    if senders == 1:
        assert kinds(found) == [FRAGMENT] and found[0].source_tenant == "A"
    else:
        assert found == []


@pytest.mark.parametrize("echoed", [True, False], ids=["own-prompt-echoed", "model-phrasing"])
def test_a_phrase_another_tenant_s_answer_echoes_from_its_prompt_stays_a_user_s(echoed):
    """People share phrases ("day and I cannot"). When a second tenant's prompt holds
    one and that tenant's answer repeats it, the answer only repeats its tenant's words:
    the phrase is still the first tenant's, and eight words of its sentence leaking are
    found at the eighth word (bench/human_leaks.py seed 4 missed its first word). Control:
    where a third tenant's answer wrote it unprompted, it is the model's phrasing, which
    must be specific to an exchange (and the run is a word short)."""
    engine = make_engine()

    def chat(tenant: str, rid: str, prompt: str, output: str, now: float) -> list[Finding]:
        scan = engine.observe_prompt(tenant, rid, prompt, now=now, turns_known=True)
        return stream(scan, output, now=now)

    sentence = "I have two job interviews on the same day and I cannot decide which one to miss."
    chat("A", "a-1", sentence, "Sorry to hear that.", T0)
    said = "I work a double shift every day and I cannot sleep."
    chat("B", "b-1", said, f"You said: {said}" if echoed else "Okay.", T0 + 1)
    if not echoed:
        exchange(engine, "C", "c-1", "Weather?", "Rain every day and I cannot say more.", T0 + 2)
    leak = "day and I cannot decide which one to"
    found = chat("D", "d-1", PROMPT_B, f"Let me address {leak} first.", T0 + 3)
    if echoed:
        assert kinds(found) == [FRAGMENT] and found[0].source_request_id == "a-1"
        assert found[0].detected_at <= len(f"Let me address {leak} first")
    else:
        assert found == []


def test_run_of_plain_words_from_an_output_is_boilerplate():
    """A model's own plain words are its boilerplate: however long, a run of another
    tenant's output without a distinctive word, inside an answer of its own, is not a
    leak, and nor is an answer that is all that other output but holds nothing of its
    exchange. Controls: one specific number in the run makes it one, and so does a
    mis-routed answer that carries it."""
    engine = make_engine(baseline=[PLAIN_VOCAB])
    exchange(engine, "A", "a-1", "Say something.", PLAIN_PRIVATE_ORDER + " 88213 ok.", T0)
    plain = PLAIN_PRIVATE_ORDER
    own = (
        "Layer lasagna sheets with spinach ricotta and tomato sauce, bake at 190 degrees "
        "for forty minutes, rest ten minutes, then slice into vegetarian squares."
    )
    answer = f"{own} {plain}. {own.replace('Layer', 'Next layer')}"
    assert exchange(engine, "B", "b-1", PROMPT_B, answer, T0 + 1) == []
    fresh = make_engine(baseline=[PLAIN_VOCAB])
    exchange(fresh, "A", "a-1", "Say something.", PLAIN_PRIVATE_ORDER + " 88213 ok.", T0)
    assert exchange(fresh, "E", "e-1", "Weather?", f"Zebras. {plain}. Penguins.", T0 + 1) == []
    misrouted = f"Zebras. {plain} 88213 ok. Penguins."
    misrouted = exchange(engine, "D", "d-1", "Weather?", misrouted, T0 + 2)
    assert kinds(misrouted) == [FRAGMENT] and misrouted[0].source_tenant == "A"
    specific = " ".join(PLAIN_PRIVATE_ORDER.split()[-7:]) + " 88213"
    found = exchange(engine, "C", "c-1", "Any tips?", f"{own} {specific}. {own}", T0 + 3)
    # A's words with its number; and B's answer, whose text (its "190" too) C's repeats.
    assert sorted((f.kind, f.source_tenant) for f in found) == [(FRAGMENT, "A"), (FRAGMENT, "B")]


@pytest.mark.parametrize(
    "phrase",
    [
        "all prices include sales tax",  # 5 words: k-grams overlap across it
        "all prices include sales tax today",  # 6 words = k + 2: adjacent k-grams
    ],
    ids=["5-word-baseline", "6-word-baseline"],
)
def test_private_text_around_a_short_baseline_phrase_is_one_run(phrase):
    """Every unit of the leak is covered by a private foreign k-gram: the leak is one
    contiguous run of 10-11 words, whatever the length of the baseline phrase inside."""
    engine = fragment_engine(baseline=[phrase])
    prompt_a = (
        f"Draft for Halvorsen Shipping about the Tarnby depot: Kestrel Vantablue, {phrase}, "
        "Quorvex Lindqvist Brattoe, sign off by Osmund."
    )
    leak_from_a(engine, prompt_a=prompt_a)
    leak = f"Kestrel Vantablue, {phrase}, Quorvex Lindqvist Brattoe"
    output = "Sure thing, here it goes: " + leak + " and that is all folks."
    found = exchange(engine, "B", "b-1", "Tell me a joke about cats.", output, T0 + 1)
    assert kinds(found) == [FRAGMENT]
    assert output[found[0].start : found[0].end] == leak


# -- time window -------------------------------------------------------------------


@pytest.mark.parametrize("delay, reported", [(300.0, True), (700.0, False), (5000.0, False)])
def test_source_older_than_the_window_is_not_reported(delay, reported):
    engine = make_engine(window_seconds=600)
    email = ENTITIES["email"]
    leak_from_a(engine, prompt_a=PROMPT_A + f" Mail {email}.")
    output = OUTPUT_B + f" Write to {email}."
    found = exchange(engine, "B", "b-1", PROMPT_B, output, T0 + delay)
    assert sorted(kinds(found)) == ([ENTITY, FRAGMENT] if reported else [])


def test_expired_source_is_forgotten_even_when_newer_traffic_keeps_the_index_hot():
    engine = make_engine(window_seconds=600)
    leak_from_a(engine)  # T0
    exchange(engine, "C", "c-1", "Unrelated chatter about tulips.", "Tulips are nice.", T0 + 500)
    found = exchange(engine, "B", "b-1", PROMPT_B, OUTPUT_B, T0 + 700)
    assert found == []


@pytest.mark.parametrize("held", [False, True], ids=["dropped", "still-held"])
@pytest.mark.parametrize("delay, reported", [(59.5, True), (60.5, False)])
def test_source_leaves_the_window_at_its_horizon(delay, reported, held):
    """A prompt's text is a source for exactly the window, whether or not the sweep has
    dropped the request yet when the window closes (``held``: a sweep half a second
    earlier left it in place)."""
    engine = fragment_engine(window_seconds=60)
    leak_from_a(engine)  # T0
    if held:
        exchange(engine, "C", "c-1", "Tell me about tulips.", "Tulips are nice.", T0 + delay - 0.5)
    found = exchange(engine, "B", "b-1", PROMPT_B, OUTPUT_B, T0 + delay)
    assert kinds(found) == ([FRAGMENT] if reported else [])


MODEL_REFERENCE = "Your booking is confirmed under reference REF-76242946, keep it safe."


@pytest.mark.parametrize("held", [False, True], ids=["dropped", "still-held"])
@pytest.mark.parametrize(
    "delay, same_question, reported",
    [(50.0, False, True), (50.0, True, False), (60.5, False, False), (60.5, True, False)],
)
def test_output_entity_leaves_the_window_with_its_request(delay, same_question, reported, held):
    """A's answer, finished 20 s after its prompt, holds a reference the model wrote.
    Once A's request has left the window the reference is nobody's, for any question,
    whether the once-a-second sweep has dropped that request yet or not (a replay and
    the live detector sweep at different moments; measured in a soak: 2 findings on
    clean exchanges that the replay did not make). Controls: inside the window it is
    A's, unless B asked A's question."""
    engine = make_engine(window_seconds=60)
    question = "Book me a table for two at the harbour restaurant on Friday."
    scan = engine.observe_prompt("A", "a-1", question, now=T0)
    stream(scan, MODEL_REFERENCE, now=T0 + 20)
    if held:  # a sweep half a second before B, while A was in the window: none due at B
        exchange(engine, "C", "c-1", "Tell me about tulips.", "Tulips are nice.", T0 + delay - 0.5)
    prompt_b = question if same_question else "Which museums in Oslo open on Mondays?"
    found = exchange(engine, "B", "b-1", prompt_b, "Noted: REF-76242946.", T0 + delay)
    if reported:
        assert [(f.kind, f.source_tenant, f.source_request_id) for f in found] == [
            (ENTITY, "A", "a-1")
        ]
    else:
        assert found == []


def test_a_later_request_that_ends_first_does_not_own_what_an_earlier_stream_wrote():
    """A's model writes a reference; a KV-cache leak copies it into B's short answer,
    which B's request (after A's) ends before A's stream ends at the proxy. B ended
    first, but A wrote it: A's own reference is no finding on A, nor on C asking A's
    question later (seen once in the fresh enforce e2e run: a clean response blocked).
    Control: once they have ended, the reference in a later answer is their leak."""
    engine = make_engine()
    question = "Book me a table for two at the harbour restaurant on Friday."
    a = engine.observe_prompt("A", "a-1", question, now=T0)
    a.feed(MODEL_REFERENCE[:20], now=T0)
    copy = "Happy to help! Check the details with your team. Noted: REF-76242946."
    b_found = exchange(engine, "B", "b-1", "Which museums in Oslo open on Mondays?", copy, T0 + 1)
    a_found = a.feed(MODEL_REFERENCE[20:], now=T0 + 2) + a.finish(now=T0 + 2)
    c_found = exchange(engine, "C", "c-1", question, MODEL_REFERENCE, T0 + 3)
    assert b_found == [] and a_found == [] and c_found == []
    found = exchange(engine, "D", "d-1", "Capital of Peru?", "It is REF-76242946.", T0 + 4)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "C")]  # the latest


def test_prompts_that_differ_in_a_word_ask_the_same_question():
    """Two requests asked the same when their prompts are the same text, or when their
    signatures share nearly all their private k-grams; a prompt too short to have
    a signature matches only itself, and a request out of the window matches nothing."""
    engine = Engine(EngineConfig(key=b"k" * 32))
    question = (
        "please summarise the quarterly revenue figures for the northern region sales team"
        " and list the three largest accounts by growth"
    )
    slots = {
        name: engine.observe_prompt(name, name, text, now=T0).slot
        for name, text in [
            ("asked", question),
            ("again", question + " today"),
            ("other", "write a haiku about autumn leaves on a quiet mountain lake at dawn"),
            ("hi", "hi there"),
            ("hi-too", "hi there"),
            ("hi-more", "hi there friend"),
        ]
    }
    same = engine.similar_prompts
    assert len(engine._requests[slots["asked"]].signature) >= 4
    assert same(slots["asked"], slots["again"]) and same(slots["again"], slots["asked"])
    assert not same(slots["asked"], slots["other"])
    assert same(slots["hi"], slots["hi-too"]) and not same(slots["hi"], slots["hi-more"])
    assert not same(slots["asked"], max(slots.values()) + 1)


def test_an_answer_to_the_same_question_explains_an_entity_whoever_else_holds_it():
    """A's answer holds a reference the model wrote; an unnoticed copy of it sits in B's
    answer to another question (a misroute the detector missed, or another replica's
    record: added here as B's use). C asks A's question and gets the same answer: the
    model's answer to that question, not B's leak (the fresh enforce e2e test once
    blocked such a clean answer, naming the tenant of the unnoticed copy)."""
    question = "Book me a table for two at the harbour restaurant on Friday."

    def with_unnoticed_copy() -> Engine:
        engine = make_engine()
        assert exchange(engine, "A", "a-1", question, MODEL_REFERENCE, T0) == []
        b = engine.observe_prompt("B", "b-1", "Which museums in Oslo open on Mondays?", now=T0 + 1)
        b.feed("Most of them do.", now=T0 + 1)
        b.finish(now=T0 + 1)
        (entity_id,) = engine.entities.table
        engine.entities.add(entity_id, "digit_id", "B", (b.slot << 1) | 1, T0 + 1)
        return engine

    assert exchange(with_unnoticed_copy(), "C", "c-1", question, MODEL_REFERENCE, T0 + 2) == []
    # Control: in an answer to another question, it is a leak.
    found = exchange(with_unnoticed_copy(), "D", "d-1", "Capital?", "It is REF-76242946.", T0 + 2)
    assert [f.kind for f in found] == [ENTITY]


# -- privacy -------------------------------------------------------------------------


def _leaves(obj, seen=None):
    """Every leaf object reachable through attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(k, seen)
            yield from _leaves(v, seen)
    elif isinstance(obj, list | tuple | set | frozenset):
        for v in obj:
            yield from _leaves(v, seen)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            names += list(getattr(cls, "__slots__", ()))
        for name in names:
            if hasattr(obj, name):
                yield from _leaves(getattr(obj, name), seen)
    else:
        yield obj


def test_index_and_sketch_store_no_text():
    engine = make_engine()
    engine.index.freeze_size = 32  # also exercise frozen numpy generations
    secret_words = ["Kestrel", "Halvorsen", "Jensen", "Lindqvist", "Brattoe", "QX7731"]
    leak_from_a(engine)
    exchange(engine, "A", "a-2", "What did the booking system reply?", OUTPUT_A, T0 + 1)
    exchange(engine, "B", "b-1", PROMPT_B, OUTPUT_B, T0 + 2)
    assert len(engine.index) > 0 and engine.index._generations

    for part in (engine.index, engine.sketch, engine.baseline, engine.vocabulary):
        blob = pickle.dumps(part)
        for word in secret_words:
            for variant in (word, word.lower()):
                for encoding in ("utf-8", "utf-16-le", "utf-32-le"):
                    assert variant.encode(encoding) not in blob, (type(part), variant)
    engine.index.lookup([1, 2, 3])  # builds the compiled view of the generations
    for leaf in _leaves(engine.index):
        # bytes, bytearray: bitmaps of hash buckets; FrozenGenerations: pointers into the
        # generations' own arrays (and never pickled); HotTable: 64-bit keys, 32-bit
        # values (pickled as ints, which the blob check above reads)
        kinds = int | float | np.ndarray | bytes | bytearray | _tables.FrozenGenerations
        kinds |= _tables.HotTable
        assert isinstance(leaf, kinds), type(leaf)
        if isinstance(leaf, np.ndarray):
            assert leaf.dtype.kind in "ui", leaf.dtype
    for leaf in _leaves(engine.sketch):
        assert not isinstance(leaf, str | bytes), leaf


def test_fingerprints_depend_on_the_key():
    a, b = Hasher(b"a" * 32, 4), Hasher(b"b" * 32, 4)
    units = words(PROMPT_A)
    assert a.kgrams(units) == Hasher(b"a" * 32, 4).kgrams(units)  # stable
    assert not set(a.kgrams(units)) & set(b.kgrams(units))
    with pytest.raises(ValueError):
        Hasher(b"short", 4)


def test_engines_with_different_keys_do_not_share_sources():
    """Sanity: a finding needs the same key on both sides (fingerprints are keyed)."""
    engine = fragment_engine()
    other = Engine(EngineConfig(key=b"z" * 32))
    leak_from_a(engine)
    leak_from_a(other)
    assert kinds(exchange(engine, "B", "b-1", PROMPT_B, OUTPUT_B, T0 + 1)) == [FRAGMENT]
    assert engine.hasher.kgrams(words(LEAK_A)) != other.hasher.kgrams(words(LEAK_A))


# -- fingerprint ---------------------------------------------------------------------

vocab_units = st.sampled_from(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "中", "文"])


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 5), extra=st.integers(0, 6), data=st.data())
def test_a_shared_run_of_k_units_shares_a_fingerprint(k, extra, data):
    hasher = Hasher(KEY, k)
    shared = data.draw(st.lists(vocab_units, min_size=k + extra, max_size=k + extra))
    doc_a = (
        data.draw(st.lists(vocab_units, max_size=12))
        + shared
        + data.draw(st.lists(vocab_units, max_size=12))
    )
    doc_b = (
        data.draw(st.lists(vocab_units, max_size=12))
        + shared
        + data.draw(st.lists(vocab_units, max_size=12))
    )
    assert set(hasher.kgrams(doc_a)) & set(hasher.kgrams(doc_b))


# -- tokens --------------------------------------------------------------------------

TOKEN_ALPHABET = (
    "abcXYZ019 _-.,;:!?\n\t'\""
    "中文字漢あいウエー"  # CJK and kana: one unit per character
    "ＡＢｚ１２"  # fullwidth Latin and digits (NFKC -> ASCII), words
    "ｱｲﾞ"  # half-width katakana and voiced mark
    "ßİﬁé\u0301"  # casefold/NFKC changing letters, combining accent
    "กั"  # Thai with a combining vowel
    "\U00020000"  # CJK extension B (astral)
)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=TOKEN_ALPHABET, max_size=50), data=st.data())
def test_stream_tokenizer_matches_units_of_for_any_split(text, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    tokenizer = StreamTokenizer()
    units = []
    for piece in pieces:
        units += tokenizer.feed(piece).units()
    units += tokenizer.flush().units()
    assert units == units_of(text)
    for u in units:
        assert u.text and u.weight in (WORD_WEIGHT, CHAR_WEIGHT)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=TOKEN_ALPHABET + "’‘“”—–…«»·\u00a0\u200b", max_size=50))
def test_whole_text_fast_path_gives_the_streamed_units(text):
    """Prompts take ``unit_texts`` (one C pass when the text is ASCII but for common
    punctuation), outputs the streaming tokenizer: both must see the same units."""
    assert unit_texts(text) == [u.text for u in units_of(text)]


def test_units_normalise_case_width_and_punctuation():
    assert words("Q3-Roadmap, ＱＵＡＲＴＥＲ Straße") == ["q3", "roadmap", "quarter", "strasse"]
    cjk = units_of("猎鹰项目Q3计划")
    assert [u.text for u in cjk] == ["猎", "鹰", "项", "目", "q3", "计", "划"]
    assert [u.weight for u in cjk] == [1, 1, 1, 1, 2, 1, 1]
    assert [(u.start, u.end) for u in cjk][4] == (4, 6)


# -- index ---------------------------------------------------------------------------


def test_fingerprint_index_lookup_spans_hot_and_frozen_generations():
    index = FingerprintIndex(freeze_size=4, max_generations=2)
    for i in range(20):
        index.add(1000 + i, i, now=T0 + i)
    index.add(1000, 99, now=T0 + 30)  # second value for a frozen key
    assert len(index._generations) <= 2
    got = index.lookup([1000, 1005, 1019, 5])
    assert sorted(got[0]) == [0, 99]
    assert got[1] == (5,) and got[2] == (19,) and got[3] == ()


def test_a_fingerprint_index_that_could_never_hold_a_key_is_refused():
    """``freeze_size`` below 1 would freeze before the hot table held anything (and
    ``add_many`` could make no progress): refused when the index is made."""
    with pytest.raises(ValueError, match="freeze_size"):
        FingerprintIndex(freeze_size=0)
    index = FingerprintIndex(freeze_size=1, max_generations=8)  # a freeze after each key
    index.add_many([1, 2, 2, 3], 7, now=T0)
    index.add_many([1, 4], 8, now=T0)
    assert index.lookup([1, 2, 3, 4, 5]) == [(7, 8), (7,), (7,), (8,), ()]


def test_fingerprint_index_bulk_adds_and_freezes_keep_every_value():
    """``add_many`` of many fingerprints (set operations first) and of few (the loop)
    give the same values per key, hot or frozen, through freezes of keys with several
    values; in one hot generation a key keeps its newest ``max_values_per_key`` values,
    in the order they came."""
    rng = random.Random(5)
    bulk = FingerprintIndex(freeze_size=300, max_generations=50)
    single = FingerprintIndex(freeze_size=300, max_generations=50)
    capped = FingerprintIndex(freeze_size=10_000, max_values_per_key=3)
    expected: dict[int, list[int]] = {}
    for value in range(40):
        fps = [rng.randrange(400) for _ in range(rng.choice([3, 40]))]
        bulk.add_many(fps, value, now=T0)
        capped.add_many(fps, value, now=T0)
        for fp in dict.fromkeys(fps):
            single.add(fp, value, now=T0)
            expected.setdefault(fp, []).append(value)
    assert len(bulk._generations) >= 2 and max(map(len, expected.values())) > 3
    keys = sorted(expected)
    assert [sorted(v) for v in bulk.lookup(keys)] == [expected[fp] for fp in keys]
    assert [sorted(v) for v in single.lookup(keys)] == [expected[fp] for fp in keys]
    assert capped.lookup(keys) == [tuple(expected[fp][-3:]) for fp in keys]


def test_fingerprint_index_freezes_keys_of_several_values_under_a_cap_of_one():
    """With ``max_values_per_key`` 1, a key added again with another value still
    freezes (the freeze makes room for all the values the hot generation holds), and
    the newest value is found."""
    index = FingerprintIndex(freeze_size=4, max_values_per_key=1)
    index.add_many([1, 2], 1, now=T0)
    index.add_many([1, 2], 2, now=T0)
    index.add_many([3, 4, 5], 3, now=T0)  # past the freeze size
    assert index._generations and len(index) >= 5
    found = index.lookup([1, 2, 5])
    assert 2 in found[0] and 2 in found[1] and found[2] == (3,)


def test_fingerprint_index_evicts_by_time():
    index = FingerprintIndex(freeze_size=4)
    for i in range(8):
        index.add(10 + i, i, now=T0)
    index.add(50, 1, now=T0 + 100)
    index.evict(older_than=T0 + 50)
    assert index.lookup([10, 17, 50]) == [(), (), (1,)]
    index.evict(older_than=T0 + 200)
    assert len(index) == 0


def test_commonness_sketch_counts_and_decays():
    sketch = CommonnessSketch(width_bits=10, half_life=100.0)
    fps = [1, 2, 3]
    many = list(range(100, 120))  # the batched (numpy) path must agree
    for t in range(4):
        sketch.increment(fps[:2], now=T0 + t)
        sketch.increment(many, now=T0 + t)
    assert sketch.counts(fps)[:2] == [4, 4]
    assert sketch.counts(fps)[2] <= 4  # count-min over-estimates only
    assert sketch.counts(many) == [sketch.counts([fp])[0] for fp in many]
    assert min(sketch.counts(many)) >= 4
    sketch.increment([], now=T0 + 250)  # two half-lives
    assert sketch.counts(fps[:2]) == [1, 1]


# -- entities.extract_entities -------------------------------------------------------


def entity_pairs(text: str) -> list[tuple[str, str]]:
    return [(e.kind, e.text) for e in extract_entities(text)]


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "mail maria.jensen+q3@falcon-corp.co.uk.",
            [("email", "maria.jensen+q3@falcon-corp.co.uk")],
        ),
        ("IBAN GB12 WEST 1234 5698 7654 31 ok", [("iban", "GB12 WEST 1234 5698 7654 31")]),
        ("IBAN DE62370400440532013001 ok", [("iban", "DE62370400440532013001")]),
        ("card 4539 1488 0343 6467 ok", [("card", "4539 1488 0343 6467")]),
        ("card 4539-1488-0343-6467 ok", [("card", "4539-1488-0343-6467")]),
        ("call +47 22 33 44 55 now", [("phone", "+47 22 33 44 55")]),
        ("call (415) 782-0132 now", [("phone", "(415) 782-0132")]),
        ("call +1 415 782 0132 now", [("phone", "+1 415 782 0132")]),
        (
            "key sk-proj-Xa9bQ7rT2mN4pL8kV3cW6yZ1 ok",
            [("api_key", "sk-proj-Xa9bQ7rT2mN4pL8kV3cW6yZ1")],
        ),
    ],
)
def test_extract_entities_finds(text, expected):
    assert entity_pairs(text) == expected


@pytest.mark.parametrize(
    "text, rejected_kind",
    [
        ("IBAN GB12 WEST 1234 5698 7654 32 ok", "iban"),  # bad checksum
        ("IBAN DE62370400440532013002 ok", "iban"),
        ("card 4539 1488 0343 6468 ok", "card"),  # fails Luhn
        ("card 1234 5678 9012 3456 ok", "card"),
        ("call +12 34 now", "phone"),  # too few digits
        ("it costs 1 234 dollars in 2024", "phone"),
    ],
)
def test_extract_entities_rejects(text, rejected_kind):
    assert rejected_kind not in [kind for kind, _ in entity_pairs(text)]


# Texts made of what a digit_id's edges are made of: runs of letters (both cases) and of
# digits, hyphens, underscores, spaces, punctuation, a digit and a letter not ASCII.
_DIGIT_ID_PIECES = st.one_of(
    st.text(alphabet="aZkQ", min_size=1, max_size=5),
    st.text(alphabet="0123456789", min_size=1, max_size=12),
    st.sampled_from(["-", "--", "_", " ", ".", "\n", "\u0663", "\u00e9"]),
)


@given(st.lists(_DIGIT_ID_PIECES, max_size=12).map("".join))
@example("ZZZZ-1234567 and ab12345678, 1234567-12345678 x_1234567")  # the longest leads
@example("123456789012 AB-1234567AB-1234567 Q-12345678")  # runs next to runs
@settings(max_examples=3000, deadline=None)
def test_digit_id_matches_are_the_patterns_own(text):
    """The digit_id pattern tried only before runs of seven digits finds what
    ``finditer`` over the whole text finds, at the same spans."""
    anchored = next(p for kind, p, _ in entities._PATTERNS if kind == "digit_id")
    assert isinstance(anchored, entities.AnchoredPattern)
    assert [m.span() for m in anchored.finditer(text)] == [
        m.span() for m in anchored.pattern.finditer(text)
    ]


# Texts made of what emails and phone numbers are made of, and of what stops them: word
# runs, digits, "@", dots, "+", "-", parentheses, spaces, a non-ASCII letter and digit.
_CONTACT_PIECES = st.one_of(
    st.text(alphabet="abZ_", min_size=1, max_size=4),
    st.text(alphabet="0123456789", min_size=1, max_size=5),
    st.sampled_from(
        ["@", "@@", ".", "..", "+", "-", "(", ")", " ", ".com", ".io", "\u00e9", "\u0663"]
    ),
)


@given(st.lists(_CONTACT_PIECES, max_size=16).map("".join))
@example("a@b.co x.y+z@mail.example.org @ab.cd a@@b.cd a@b.c@d.ef")  # runs and "@"s
@example("+1 (555) 123-4567 x+44 20 7946 0958 (212) 555-0100 ++1 234 567 89")
@settings(max_examples=3000, deadline=None)
def test_email_and_phone_matches_are_the_patterns_own(text):
    """The email pattern tried only at the run before each "@", and the phone pattern
    only at each "+" and "(", find what ``finditer`` over the whole text finds."""
    for kind in ("email", "phone"):
        anchored = next(p for k, p, _ in entities._PATTERNS if k == kind)
        assert isinstance(anchored, entities.RunBeforePattern | entities.AnchoredPattern)
        assert [m.span() for m in anchored.finditer(text)] == [
            m.span() for m in anchored.pattern.finditer(text)
        ], kind


@given(
    st.text(alphabet="abcxyz0189-_ ", max_size=14)
    | st.builds(
        lambda first, n, step: "".join(chr(max(0, ord(first) + step * i)) for i in range(n)),
        st.sampled_from("0a5tz9"),
        st.integers(0, 14),
        st.sampled_from([1, -1]),
    )
)
def test_token_soup_is_what_its_definition_says(text):
    """``_monotonous``, written for speed, against its definition: after non-[a-z0-9]
    characters go, at least ``MIN_ENTITY_CHARS`` left and few distinct ones, a pattern of
    up to 4 repeated, or every step between neighbours +1 (or every one -1)."""
    body = re.sub(r"[^a-z0-9]", "", text.lower())
    steps = {ord(b) - ord(a) for a, b in itertools.pairwise(body)}
    expected = len(body) >= entities.MIN_ENTITY_CHARS and (
        len(set(body)) <= max(2, len(body) // 8)
        or any(body == (body[:p] * len(body))[: len(body)] for p in range(1, 5))
        or steps <= {1}
        or steps <= {-1}
    )
    assert entities._monotonous(text) == expected


def test_checksums():
    assert luhn_ok("4539148803436467") and not luhn_ok("4539148803436468")
    assert iban_ok("GB12 WEST 1234 5698 7654 31") and not iban_ok("GB12 WEST 1234 5698 7654 32")
    assert not iban_ok("GB82")


def test_extract_entities_in_order_and_non_overlapping():
    text = "a@bcd.no then 4539 1488 0343 6467 then +47 22 33 44 55"
    found = extract_entities(text)
    assert [e.kind for e in found] == ["email", "card", "phone"]
    for e in found:
        assert text[e.start : e.end] == e.text
    assert all(a.end <= b.start for a, b in zip(found, found[1:], strict=False))


def test_index_lookup_paths_agree():
    """One delta's few fingerprints take the bitmap path, a prompt's many the numpy
    path: both must return the same values, across hot and frozen generations."""
    import random

    from proxy.engine.index import FingerprintIndex

    rng = random.Random(5)
    index = FingerprintIndex(freeze_size=500, max_generations=3)
    stored = [rng.getrandbits(64) for _ in range(3000)]
    for i, fp in enumerate(stored):
        index.add(fp, i % 997, float(i))
        if i % 7 == 0:
            index.add(fp, (i + 1) % 997, float(i))  # several values for some keys
    assert len(index._generations) >= 2 and index._hot
    queries = stored[::13] + [rng.getrandbits(64) for _ in range(200)]
    batched = index.lookup(queries)
    singles = [index.lookup([fp])[0] for fp in queries]
    assert [sorted(v) for v in batched] == [sorted(v) for v in singles]
    assert all(batched[i] for i in range(len(stored[::13])))


def test_a_streams_columns_are_out_of_the_collector_s_sight():
    """A stream's columns (unit hashes, offsets, weights, feeds; the entity scan's
    deltas) hold only ints or strings, and a collection would read every one of them:
    they stay untracked while the stream grows them, through the compiled ASCII step and
    the Python step alike."""
    import gc

    engine = make_engine()
    scan = engine.observe_prompt("A", "a-1", "Plan the Kestrel audit", now=T0)
    for delta in ("Sure, the Kestrel ", "audit plan: ", "步骤一 ", "done."):
        scan.feed(delta)
    state = scan._choices[0]
    scan.finish()
    columns = (state.hashes, state.numbers, state.weights, state.cumulative, state.starts,
               state.ends, state.batches, state.seqs, state.entities._text,
               state.entities._raw)  # fmt: skip
    assert all(columns) and not any(gc.is_tracked(c) for c in columns)


def test_the_hot_generation_is_out_of_the_collector_s_sight():
    """A full collection walks every tracked container's entries: the hot generation
    (up to 65,536 keys) holds only ints in its main dict, so it is never tracked; keys
    with several values keep them in a small dict of tuples, made untracked (no young
    collection walks them first), so that dict is never tracked either."""
    import gc

    from proxy.engine.index import FingerprintIndex

    index = FingerprintIndex(freeze_size=100_000, max_values_per_key=3)
    index.add_many(list(range(1, 5000)), 7, 1.0)  # the bulk path
    for fp in range(1, 5000, 10):  # the loop, and keys with several values
        index.add_many([fp, fp + 1], 8, 2.0)
        index.add_many([fp], 9, 3.0)
        index.add_many([fp], 10, 4.0)
    assert not gc.is_tracked(index._hot)
    assert len(index._hot_more) == 1000 and not gc.is_tracked(index._hot_more)
    assert not any(gc.is_tracked(v) for v in index._hot_more.values())
    # 11's fourth value pushed out its oldest (7); 12 took 8 as a neighbour; 13 only 7.
    assert index.lookup([11, 12, 13, 5000]) == [(8, 9, 10), (7, 8), (7,), ()]
    assert len(index) == 4999 + 500 * 3


def test_the_entity_tables_tuples_are_out_of_the_collector_s_sight():
    """An entity's uses, its place in the expiry queue, its pending key and its
    automaton payload are tuples of strings and numbers that live as long as the
    entity: made untracked, so that young collections do not walk them one by one."""
    import gc

    from proxy.engine._tables import untracked
    from proxy.engine.entities import EntityIndex

    index = EntityIndex(rebuild_interval=0.0)
    for n in range(50):
        index.add(f"id-{n}", "email", f"tenant-{n % 3}", n << 1, T0 + n, text=f"p{n}@example.com")
    queued, pending = list(index._by_time), list(index.pending)
    index.maybe_rebuild(T0 + 60)
    payloads = [payload for automaton in index.automata() for _, payload in automaton.items()]
    uses = [use for owner in index.table.values() for use in owner.tenants.values()]
    assert len(queued) == len(pending) == len(payloads) == len(uses) == 50
    assert not any(gc.is_tracked(t) for t in queued + pending + payloads + uses)
    assert not any(gc.is_tracked(owner.tenants) for owner in index.table.values())
    # A tuple that holds a tracked container stays tracked: it may be in a cycle.
    assert gc.is_tracked(untracked((1, [2])))


def test_pair_filter_and_sketch_give_the_same_answers_by_numpy_and_by_python():
    """Deltas take the unrolled Python paths, whole texts the numpy ones: both must
    record and count alike (same bits set, same counts)."""
    import random

    from proxy.engine.index import PairFilter

    rng = random.Random(2)
    # Large enough that a batch's own pairs do not collide in the filter: the numpy path
    # tests a batch before setting its bits, the Python path one pair after another.
    scalar, vector = PairFilter(bits=24), PairFilter(bits=24)
    for step in range(200):
        fps = [
            rng.getrandbits(64) if rng.random() < 0.5 else rng.randrange(3000)
            for _ in range(100)  # above _PAIR_SCALAR_BATCH: the numpy path
        ]
        tenant = rng.choice([1, 2**63 + 5, 77])
        one_by_one = [fp for fp in dict.fromkeys(fps) if scalar.add_new(tenant, fp, step)]
        assert vector.first_seen(tenant, fps, step) == one_by_one
        assert [bytes(g) for g in scalar.generations] == [bytes(g) for g in vector.generations]
    sketch = CommonnessSketch(width_bits=12)
    fps = [rng.getrandbits(64) for _ in range(200)]
    sketch.increment(fps[:100], 0)  # numpy path
    for fp in fps[50:150]:
        sketch.increment([fp], 0)  # Python path
    together = sketch.counts(fps)
    assert together == [c for i in range(0, 200, 5) for c in sketch.counts(fps[i : i + 5])]
    assert sum(together) >= 200 and together[60] >= 2


PREFILTER_SAMPLES = [
    "mail ana.lopez+x@corp-mail.eu.org now",
    "see https://host/path?token=abcdef123456 and ftp://u:p@h/",
    "order ID-123456789 and 00012345678",
    "secret AbCdEfGh1234567890IjKlMnOp_-x9 here",
    "nothing to see, 1234567 and short Ab1",
    "key sk-proj-a1B2c3D4e5F6g7H8i9 and ghp_abcdefghijklmnopqrstu1 and AKIAZ7Y6X5W4V3U2T1S0",
    "card 4539 1488 0343 6467 or 5490-1234-5678-9011 or 4012888888881882",
    "call +44 20 7946 0123 or (415) 555-0142",
    "the shortest card, 13 digits: 4539-1488-0343-3",  # each alone: the least a pattern takes
    "a phone in Arabic-Indic digits +٤٤ ٢٠ ٧٩٤٦ ٠١٢٣",
    "iban DE62 3704 0044 0532 0130 01, ssn 512-44-1873, passport AB123456C",
    "bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "ticket TCK-629869, #12345, order 879-8541208, paid USD1,234.56 and €3,813.95",
    "Suzanne Woodward of Pearson-Kramer, Perkins and Sons, Okafor Holdings, Green Inc",
    "Davis, Coleman and Branch; D’angelo Reyes",
]


def _prefilters_hold(text: str) -> None:
    for kind, pattern, _ in entities._PATTERNS:
        if pattern.search(text):
            assert entities.needs(kind, text), (kind, text)
    # The case keys' groups (iter_case_keys runs a group only when its bit is set).
    e = entities
    names = (e._CAPITALISED, e._FIRM, e._ORGANISATION, e._COMPANY, e._FIRM_OF_THREE)
    for bit, patterns in ((e._REFERENCE_NEEDS, (e._REFERENCE,)), (e._AMOUNT_NEEDS, (e._AMOUNT,)),
                          (e._NAME_NEEDS, names)):  # fmt: skip
        if any(p.search(text) for p in patterns):
            assert _entities.entity_needs(text) & bit, (bit, text)


def test_entity_prefilters_never_skip_a_match():
    """The cheap tests that skip a kind's pattern are implied by the pattern itself."""
    for text in PREFILTER_SAMPLES:
        _prefilters_hold(text)
    kinds = {e.kind for text in PREFILTER_SAMPLES for e in entities.extract_entities(text)}
    assert set(entities._NEEDS) == {kind for kind, _, _ in entities._PATTERNS} == kinds
    prose = "The quarterly report (due Friday) lists 12 items + 3 notes: see page 4."
    assert not any(entities.needs(kind, prose) for kind in entities._NEEDS)


PREFILTER_TEXTS = st.lists(
    st.one_of(
        st.sampled_from(PREFILTER_SAMPLES).map(lambda t: t[: len(t) // 2 + 7]),
        st.sampled_from(
            [
                " ",
                "-",
                "+",
                "(",
                ")",
                "@",
                "://",
                "sk-",
                "gh",
                "_",
                "٣",
                ", ",
                " and ",
                " & ",
                "’",
                "'",
                "€",
                "£",
                "$",
                "USD",
                "CHF",
                ".",
                "#",
            ]
        ),
        st.from_regex(r"[0-9A-Za-z]{1,8}", fullmatch=True),
        st.from_regex(r"[A-Z][a-z]{1,6}", fullmatch=True),
    ),
    max_size=25,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(PREFILTER_TEXTS)
def test_entity_prefilters_never_skip_a_match_in_any_text(text):
    _prefilters_hold(text)


@settings(max_examples=200, deadline=None)
@given(PREFILTER_TEXTS)
def test_entity_needs_reads_text_of_every_width_alike(text):
    """``entity_needs`` reads a text's characters as stored, one, two or four bytes
    each: a wide character after a space changes none of its bits."""
    expected = _entities.entity_needs(text + " ")
    for wide in ("\u00e9", "\u0101", "\U0001f600"):
        assert _entities.entity_needs(text + " " + wide) == expected


def test_kgrams_rolling_and_one_by_one_agree():
    import random

    from proxy.engine import fingerprint

    rng = random.Random(5)
    for k in (1, 2, 4, 7):
        hasher = fingerprint.Hasher(b"k" * 32, k)
        for n in (1, 2, 7, 24, 25, 60):
            hashes = [rng.getrandbits(64) for _ in range(n + k - 1)]
            hashes[0] = (1 << 64) - 1  # the top bit set: unsigned all the way
            one_by_one = [hasher.kgram(hashes[i : i + k]) for i in range(n)]
            assert hasher.kgrams_of_hashes(hashes) == one_by_one  # compiled, rolled
        assert hasher.kgrams_of_hashes(hashes[: k - 1]) == []


def test_observe_in_steps_is_observe_at_once():
    """A long prompt observed step by step (as the idle queue runs it) leaves the same
    engine and finds the same leak as one observe_prompt call."""
    from proxy.engine.detector import OBSERVE_STEP

    words = " ".join(f"w{i} zq{i * 7} kx{i % 13}" for i in range(200))  # > OBSERVE_STEP k-grams
    leak = " ".join(words.split()[300:330])
    results = []
    for stepped in (False, True):
        engine = Engine(EngineConfig(key=b"s" * 32))
        if stepped:
            yields = list(engine.observe_prompt_steps("A", "a-1", words, now=100.0))
            assert len(yields) > 2  # it did yield between pieces
        else:
            engine.observe_prompt("A", "a-1", words, now=100.0)
        scan = engine.observe_prompt("B", "b-1", "tell me", now=101.0)
        found = scan.feed(leak, 0, 102.0) + scan.finish(102.0)
        results.append(
            (
                engine.fingerprints,
                [(f.source_tenant, f.start, f.end, f.foreign_units) for f in found],
            )
        )
    assert results[0] == results[1] and results[0][1]
    assert len(words.split()) > OBSERVE_STEP


def test_an_output_counts_shared_text_at_once_and_its_own_new_text_at_its_end():
    """The commonness sketch learns the holders' use of text an output meets as the
    output streams (it may be turning common), and the output's own use when it ends
    (counting on every delta was a third of the time per delta; and a leak found in it
    is not its use); replaying the output's record counts the same."""
    engine = Engine(EngineConfig(key=b"k" * 32))
    shared = "quarterly ledger reconciliation for the northern depot closes every friday"
    fresh = "wobbling pelicans audit seventeen crates of violet marmalade near harbour"
    first = engine.observe_prompt("A", "a-1", "what closes when", now=T0)
    first.feed(shared, 0, T0)
    first.finish()

    def counts(text: str, engine: Engine = engine) -> list[int]:
        return engine.sketch.counts(engine.hasher.kgrams(unit_texts(text)))

    assert set(counts(shared)) == {1} and set(counts(fresh)) == {0}
    scan = engine.observe_prompt("B", "b-1", "what closes on friday", now=T0 + 1)
    for word in f"{shared} and {fresh} .".split():
        scan.feed(word + " ", 0, T0 + 1)
    assert set(counts(shared)) == {1} and set(counts(fresh)) == {0}
    scan.finish(T0 + 1)
    assert set(counts(shared)) == {2} and set(counts(fresh)) == {1}
    again = Engine(EngineConfig(key=b"k" * 32))
    records = [first.prompt, first.record(), scan.prompt, scan.record()]
    assert [f.finding for f in replay(again, records)] == scan.findings
    assert counts(shared, again) == counts(shared) and counts(fresh, again) == counts(fresh)


def test_text_two_outputs_write_at_once_counts_both_tenants_when_it_is_shared():
    """An output counts its new text at its end; when another tenant's output meets that
    text while the first is still streaming, the first's use is counted then, and the
    second's at its own end (not where it was a leak found in it): text many outputs
    write together turns common as they end, each tenant counted once."""
    engine = Engine(EngineConfig(key=b"k" * 32))
    phrase = "the simplest approach is to validate each change and review the results"
    fps = engine.hasher.kgrams(unit_texts(phrase))
    first = engine.observe_prompt("A", "a-1", "how do I roll this out", now=T0)
    second = engine.observe_prompt("B", "b-1", "any rollout advice", now=T0)
    first.feed(phrase + " .", 0, T0)
    assert set(engine.sketch.counts(fps)) == {0}
    second.feed(phrase + " .", 0, T0)
    assert set(engine.sketch.counts(fps)) == {1}
    third = engine.observe_prompt("C", "c-1", "how to ship it", now=T0)
    third.feed(phrase + " .", 0, T0)
    assert set(engine.sketch.counts(fps)) == {1}
    for scan in (first, second, third):
        scan.finish(T0)
    assert set(engine.sketch.counts(fps)) == {3}  # each tenant counted once


def test_a_leak_does_not_make_its_victim_a_user_of_the_leaked_text():
    """A tenant's sentence that a faulty engine leaks to one tenant after another is
    found every time: a victim's output does not count as its use of what leaked to it,
    or two leaks would make the sentence common (three tenants) and the third pass
    (bench/human_leaks.py seed 7). Text a victim's answer shares with others without a
    finding is still its use."""
    engine = make_engine()
    sentence = "I have two job interviews on the same day and I cannot decide which one to miss."
    scan = engine.observe_prompt("A", "a-1", sentence, now=T0, turns_known=True)
    stream(scan, "Sorry to hear that.", now=T0)
    for i, victim in enumerate("BCDE", start=1):
        scan = engine.observe_prompt(victim, f"v-{i}", PROMPT_B, now=T0 + i)
        found = stream(scan, f"Sure. {sentence} Bye.", now=T0 + i)
        assert [(f.kind, f.source_tenant) for f in found] == [(FRAGMENT, "A")], victim
    fps = engine.hasher.kgrams(unit_texts(sentence))
    assert max(engine.sketch.counts(fps)) == 1


# -- what a model writes for everyone (issue 18) ---------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "AKIAIOSFODNN7EXAMPLE",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "john.doe@example.com",
        "ops@billing.test",
        "support@gmx.de",
        "info@yahoo.co.uk",
        "4111 1111 1111 1111",
        "sk-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
        "12345678",
        "(212) 555-0147",
        "GB82 WEST 1234 5698 7654 32",
        "123-45-6789",
    ],
)
def test_placeholders_are_nobodys_entities(value):
    assert extract_entities(f"Use {value} in the example.") == []


@pytest.mark.parametrize(
    "value",
    [
        "anna.kowalczyk@polarpath.eu",
        "support@polarpath.eu",
        "anna.kowalczyk@gmx.de",
        "AKIA4Q2ZR7XW3K9PLM2T",
        "4532 0151 1283 0366",
        "(415) 782-0132",
        "GB12 WEST 1234 5698 7654 31",
        "512-44-1873",
    ],
)
def test_real_looking_values_stay_entities(value):
    assert [e.text for e in extract_entities(f"Use {value} in the example.")] == [value]


def test_a_placeholder_number_does_not_tie_a_model_habit_to_one_exchange():
    """Two tenants' code carries the model's test card: its digits are public by
    convention, so they do not make the shared lines specific to the first exchange.
    Control: a number only the first exchange's answer has does."""
    engine = make_engine()
    code = 'logger = logging.getLogger(__name__)\nTEST_CARD = "4111 1111 1111 1111"\n'
    exchange(engine, "A", "a-1", "Write a parser.", f"Here:\n{code}def parse(rows): ...", T0)
    found = exchange(engine, "B", "b-1", "Write a loader.", f"Here:\n{code}def load(p): ...", T0)
    assert found == []
    answer = "Logged as ticket 773412 for the router in the north office today."
    exchange(engine, "C", "c-1", "Ticket?", answer, T0)
    page = "Logged as ticket 773412 for the router in the north office"
    assert kinds(exchange(engine, "D", "d-1", "Hi", f"{page}.", T0)) == [FRAGMENT]


def test_a_string_the_model_writes_for_three_tenants_is_its_habit():
    """An entity no prompt holds, written by the model into three tenants' answers, is
    the model's: the second and third tenants' answers are still findings (each may be a
    leak of the first's output), the fourth's no longer."""
    engine = make_engine()
    habit = "Reach the desk at helpdesk@northwind-traders.com today."
    exchange(engine, "A", "a-1", "Who do I write to?", habit, T0)
    assert kinds(exchange(engine, "B", "b-1", "Support contact?", habit, T0 + 1)) == [ENTITY]
    assert kinds(exchange(engine, "C", "c-1", "Where to email?", habit, T0 + 2)) == [ENTITY]
    assert exchange(engine, "D", "d-1", "Which address?", habit, T0 + 3) == []


def test_the_models_answer_to_the_same_question_keeps_its_entity_known():
    """A and B asked the same question and got the model's entity (no prompt held it):
    B's answer is an echo, not a leak, and it renews the entity's life. Once A's use has
    left the window, B's answer mis-routed to C is still a leak of B's, and B's own next
    answer with it is not a leak of C's."""
    engine = make_engine(window_seconds=60)
    question = "Which order number did the booking system give my request?"
    answer = "Your order: 48213377."
    exchange(engine, "A", "a-1", question, answer, T0)
    assert exchange(engine, "B", "b-1", question, answer, T0 + 50) == []
    found = exchange(engine, "C", "c-1", "Weather?", "Sunny. Also 48213377.", T0 + 70)
    assert kinds(found) == [ENTITY] and found[0].source_request_id == "b-1"
    assert exchange(engine, "B", "b-2", question, answer, T0 + 80) == []


# A's question and the head of A's answer that the engine saw before its stream was cut.
CUT_QUESTION = "Summarise the Vividfield Foods deadline and the reference of my invoice."
CUT_HEAD = (
    "Vividfield Foods moves the Halvorsen deadline to 13 May. The amount due is "
    "8,168.78, scheduled for August. Order ORD-2026-641211 was placed by Noor Thibodeau."
)


def test_an_answer_found_to_carry_a_tenants_answer_holds_that_tenants_text():
    """A's stream was cut part way (the engine saw its head only); B's answer is A's
    whole answer, mis-routed: a leak of A's, the tail with it. A's next answer to the
    same question restates that tail, which only B's copy held: A's own answer again,
    not a leak of B's (seen in the warm enforce e2e test: a clean answer blocked).
    Control: a third tenant's answer with the tail is still a leak (of A's next answer,
    and of B's copy)."""
    engine = make_engine()
    question, head = CUT_QUESTION, CUT_HEAD
    tail = "The projected Kestrel total is 5,373.97 under reference REF-16299053 for Lisbet."
    scan = engine.observe_prompt("A", "a-1", question, now=T0)
    scan.feed(head, now=T0)
    scan.finish(now=T0)
    copy = exchange(engine, "B", "b-1", "Weather in Oslo?", f"{head} {tail}", T0 + 1)
    assert FRAGMENT in kinds(copy) and {f.source_tenant for f in copy} == {"A"}
    assert exchange(engine, "A", "a-2", question, f"Again: {tail}", T0 + 2) == []
    control = exchange(engine, "C", "c-1", "Tips?", f"Note: {tail}", T0 + 3)
    assert ENTITY in kinds(control) and {f.source_tenant for f in control} == {"A", "B"}


@pytest.mark.parametrize("holder", ["copy's prompt", "third tenant's prompt"])
def test_a_copy_of_a_tenants_answer_does_not_hide_what_prompts_hold(holder):
    """B's answer carries A's answer (a finding) and also a record of B's user's, which
    B's prompt or a third tenant's holds. That record in A's next answer is still a leak
    of its prompt's (found in review: the copy explained the k-grams away whoever else
    held them). Control: without the copy, the same."""
    question, head = CUT_QUESTION, CUT_HEAD
    secret = (
        "Patient Orla Brennigan, record MRN-55-2038-771, was prescribed 40 mg of Zorvexil "
        "on 3 March at the Quillmoor clinic, account 7731-0094."
    )
    for copied in (True, False):
        engine = make_engine()
        exchange(engine, "A", "a-1", question, head, T0)
        if holder == "copy's prompt":
            prompt_b, source = f"Draft a referral letter. Details: {secret}", "B"
        else:
            prompt_b, source = "Draft a referral letter.", "C"
            exchange(engine, "C", "c-1", f"Check this record: {secret}", "Checked.", T0 + 0.5)
        answer_b = f"{head} Referral: {secret} Kind regards." if copied else f"Referral: {secret}"
        copy = exchange(engine, "B", "b-1", prompt_b, answer_b, T0 + 1)
        assert ("A" in {f.source_tenant for f in copy}) == copied
        found = exchange(
            engine, "A", "a-2", "A poem about autumn leaves?", f"Here: {secret}", T0 + 2
        )
        assert source in {f.source_tenant for f in found}, (copied, found)


def test_an_iban_cut_short_by_the_page_is_still_that_account():
    iban = "GB12 WEST 1234 5698 7654 31"
    engine = make_engine()
    leak_from_a(engine, prompt_a=f"Pay the Halvorsen invoice to {iban} by Friday.")
    found = exchange(engine, "B", "b-1", PROMPT_B, "We used GB12 WEST 1234 5698.", T0 + 1)
    assert kinds(found) == [ENTITY] and found[0].source_tenant == "A"


def test_a_users_entity_that_its_own_answer_restates_is_never_the_models_habit():
    """The source's own answer repeats the account it was asked about: the entity is
    still the user's, and its leak to a third and fourth tenant is still a finding."""
    engine = make_engine()
    prompt = "Move the billing contact of account ZX-48213377 to the Halden office."
    exchange(engine, "A", "a-1", prompt, "Done: account ZX-48213377 now bills Halden.", T0)
    for i, victim in enumerate("BCD"):
        found = exchange(engine, victim, f"{victim}-1", "Hi", "See ZX-48213377 here.", T0 + i)
        assert kinds(found) == [ENTITY] and found[0].source_tenant == "A", victim


def test_a_prompt_holding_what_the_model_wrote_for_others_is_judged_as_the_models():
    """A completions prompt is one string: the earlier assistant turn in it is a model's
    phrasing, which the model also wrote into another tenant's answer. A third tenant's
    answer with that phrasing is not a leak of the prompt. Control: a page of the
    prompt's own words, which no output holds, still is."""
    engine = make_engine()
    turn = "If you would like more detail, I can expand on any of the points you raised."
    exchange(engine, "A", "a-1", "Say hi.", f"Hi. {turn}", T0)
    prompt = f"User: plan the Varnhagen audit\nAssistant: {turn}\nUser: Kestrel deadline?"
    exchange(engine, "P", "p-1", prompt, "Noted.", T0 + 1)
    assert exchange(engine, "V", "v-1", "Tips?", f"Sure. {turn}", T0 + 2) == []
    page = "User: plan the Varnhagen audit Assistant: If you would like more detail"
    found = exchange(engine, "W", "w-1", "News?", f"{page}.", T0 + 3)
    assert kinds(found) == [FRAGMENT] and found[0].source_tenant == "P"


def test_max_rare_words_bounds_what_commonness_tracks_and_keeps_plain_words():
    engine = Engine(EngineConfig(key=b"k" * 32, max_rare_words=50, common_tenants=2))
    vocabulary = engine.vocabulary
    shared = [engine.hasher.unit(f"shared{i}") for i in range(5)]
    vocabulary.learn("a", shared)
    vocabulary.learn("b", shared)  # two tenants: plain now
    for n in range(40):
        vocabulary.learn(f"t{n}", [engine.hasher.unit(f"rare{n}-{i}") for i in range(7)])
        assert len(vocabulary) <= 50
    assert all(vocabulary.is_plain(u) for u in shared)


def test_max_rare_words_below_one_is_a_config_error():
    from proxy.config import ConfigError, load_text

    with pytest.raises(ConfigError, match="max_rare_words"):
        load_text("[detection]\nmax_rare_words = 0\n")


def test_a_removed_key_says_why_it_went():
    """``winnow_window`` went with the Python scan: an older configuration that still
    holds it is told what to do, not only that the key is unknown."""
    from proxy.config import ConfigError, load_text

    with pytest.raises(ConfigError, match=r"detection\.winnow_window is gone: .*delete the line"):
        load_text("[detection]\nwinnow_window = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_text("[detection]\nwinnow_windows = 1\n")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 11), st.lists(st.integers(0, 30), max_size=8)), max_size=60),
    st.sampled_from([2, 3, 4]),
)
def test_vocabulary_counts_tenants_exactly_in_every_representation(steps, common):
    """Names, bitsets and the fallback to names past the bitset's tenants (4 here) all
    count distinct tenants as a set of names would: the same words turn plain."""
    import proxy.engine.detector as detector

    vocabulary = detector.Vocabulary(common, plain_share=0.5, bitset_tenants=4)
    users: dict[int, set[str]] = {}
    plain: set[int] = set()
    tenants: set[str] = set()
    for who, units in steps:
        tenant = f"t{who}"
        vocabulary.learn(tenant, units)
        tenants.add(tenant)
        needed = max(common, 0.5 * len(tenants))
        for unit in set(units) - plain:
            users.setdefault(unit, set()).add(tenant)
            if len(users[unit]) >= needed:
                plain.add(unit)
                del users[unit]
        assert set(vocabulary.plain) == plain
        assert len(vocabulary) == len(users)


def test_a_small_number_in_the_source_prompt_does_not_tie_the_models_code_to_it():
    """Seen once in the enforce e2e (1 of 1,354 clean answers blocked): two tenants'
    first answers share the model's code scaffold; the source's system prompt numbers
    its rules ("1."), and the scaffold's ``+ 1`` counted as restating that prompt."""
    from proxy.config import Config
    from proxy.factory import build_engine
    from proxy.sim.answers import answer_for
    from proxy.sim.workload import Workload

    reqs = {r.request_id: r for r in Workload(tenants=24, seed=21).requests(100)}
    source, victim = reqs["req-tenant-21-000001"], reqs["req-tenant-00-000001"]
    engine = build_engine(Config())  # fresh, with the shipped vocabulary and baseline
    exchange(engine, source.tenant, "s", source.prompt_text(), answer_for(source.prompt_text()), T0)
    answer = answer_for(victim.prompt_text())
    assert "results.get(key, 0) + 1" in answer  # the shared scaffold is there
    words = answer.split(" ")
    pieces = [" ".join(words[i : i + 2]) + " " for i in range(0, len(words), 2)]
    pieces[-1] = pieces[-1][:-1]
    assert exchange(engine, victim.tenant, "v", victim.prompt_text(), answer, T0 + 1,
                    pieces=pieces) == []  # fmt: skip


# -- ordering of concurrent scans ------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=300))
def test_the_low_water_is_the_oldest_open_scan_s_prompt(steps: list[tuple[bool, int]]) -> None:
    """Whatever order scans open and finish in (the heap behind ``low_water`` is rebuilt
    when finished entries pile up), the low water is the sequence number of the oldest
    prompt whose scan is still open, or one past the newest number when none is."""
    engine = Engine(EngineConfig(key=KEY))
    open_scans: list = []
    for i, (opens, pick) in enumerate(steps):
        if opens or not open_scans:
            open_scans.append(engine.observe_prompt("t", f"r{i}", "a prompt", now=T0))
        else:
            open_scans.pop(pick % len(open_scans)).finish(now=T0)
        expected = min((s.prompt.seq for s in open_scans), default=engine.sequence + 1)
        assert engine.low_water() == expected


def test_a_huge_response_s_scratch_is_not_kept():
    """The scan's k-gram scratch grows to the longest delta or output it scanned; past
    ``GRAMS_KEPT`` (65,536 k-grams, 1 MB) it is freed once that output is scanned, so
    one book-length answer does not hold its scratch for the life of the engine."""
    engine = fragment_engine()
    exchange(engine, "A", "a-1", "a short question", "a short answer of a few words", now=T0)
    scanner = engine.delta_scanner()
    assert 0 < scanner.grams_capacity <= 1 << 16  # a short answer's scratch stays
    rng = random.Random(5)
    book = " ".join(f"w{rng.getrandbits(40):x}" for _ in range(70_000))
    scan = engine.observe_prompt("B", "b-1", "write a book", now=T0 + 1)
    scan.feed(book, now=T0 + 1)
    assert scanner.grams_capacity >= 70_000 - 8  # one delta of 70,000 words
    scan.finish(now=T0 + 1)
    assert scanner.grams_capacity == 0
    exchange(engine, "C", "c-1", "another question", "another short answer here", now=T0 + 2)
    assert 0 < scanner.grams_capacity <= 1 << 16
