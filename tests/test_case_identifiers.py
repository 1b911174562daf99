"""Case identifiers: what a model answering on another request's cached context copies
into its own prose (a ticket or invoice number, a full name, a company, a street, an
amount), found one by one, with the right source; and what stays quiet (common word
pairs, round amounts, the victim's own values, names a model made up)."""

from __future__ import annotations

import pytest

from proxy.defaults import load_baseline, load_first_names, load_surnames, load_vocabulary
from proxy.engine import ENTITY, Engine, EngineConfig
from proxy.engine.entities import iter_case_keys

KEY = b"c" * 32
T0 = 1_000_000.0

SOURCE = (
    "Halloran & Webb customer support\n"
    "Ticket QRS-408172 from Ingrid Vasquez-Tolland <ingrid.vt@fastmail.com>\n\n"
    "Our accountants at Brightwater Accounting (Kestrel and Sons before) need invoice INV-55210 for €7,318.40 "
    "before the close. I still live at 88 Saltmarsh Row in Penhallow. My case number "
    "with the police is K40517M.\n\nReply:"
)
VICTIM_PROMPT = "Q: What is a database index and when should I add one?\nA:"


PLAIN = load_vocabulary()
SURNAMES = load_surnames()
FIRST_NAMES = load_first_names()
BASELINE = load_baseline()


def engine(**config) -> Engine:
    """An engine as the proxy builds it: the shipped vocabularies and baseline."""
    return Engine(
        EngineConfig(key=KEY, **config),
        baseline=BASELINE,
        plain_words=PLAIN,
        surnames=SURNAMES,
        first_names=FIRST_NAMES,
    )


def answer(e: Engine, tenant: str, rid: str, prompt: str, output: str, now: float):
    scan = e.observe_prompt(tenant, rid, prompt, now=now)
    found = []
    for i in range(0, len(output), 7):  # a stream: deltas cut anywhere
        found += scan.feed(output[i : i + 7], now=now)
    return found + scan.finish(now=now)


def with_source(**config) -> Engine:
    e = engine(**config)
    answer(e, "acme", "src-1", SOURCE, "We will look into it.", T0)
    return e


@pytest.mark.parametrize(
    "leaked",
    [
        "the ticket QRS-408172",
        "ticket number 408172",
        "Ingrid Vasquez-Tolland",
        "Halloran & Webb",  # not a pair of capitalised words: no key
        "Brightwater Accounting",  # a pair with a plain word: no key (documented limit)
        "88 Saltmarsh Row",  # likewise
        "Kestrel and Sons",
        "an amount of 7,318.40",
        "invoice INV-55210",
        "case K40517M",
    ],
)
def test_one_identifier_in_fresh_prose_is_a_finding_with_its_source(leaked):
    output = (
        "An index is a data structure that speeds up lookups. As for "
        f"{leaked}, we have forwarded it to the team and will reply within two days."
    )
    found = answer(with_source(), "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)
    if leaked in ("Halloran & Webb", "Brightwater Accounting", "88 Saltmarsh Row"):
        assert found == []  # documented limits (docs/detection.md)
        return
    assert [(f.kind, f.source_tenant, f.source_request_id) for f in found] == [
        (ENTITY, "acme", "src-1")
    ]
    # The span is the identifier's, in the victim's output.
    start, end = found[0].start, found[0].end
    assert output[start:end].lower() in leaked.lower()


@pytest.mark.parametrize(
    "output",
    [
        "Ingrid wrote to us last week.",  # a first name alone
        "Penhallow is a lovely town in the summer.",  # one capitalised word
        "The total was €7,300.00 this year.",  # round amount, not the source's
        "Please pay 318.40 by Friday.",  # a part of the amount, not the amount
        "Use ticket 4081720 for reference.",  # a longer number holding the digits
        "Customer Support in the United States can help.",  # common words only
    ],
)
def test_what_is_not_the_sources_identifier_stays_quiet(output):
    e = with_source()
    # Make "Customer Support" and "United States" visible in another tenant's prompt.
    answer(e, "initech", "i-1", "Customer Support of the United States office", "Ok.", T0)
    assert answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1) == []


def test_the_victims_own_values_are_its_own():
    e = with_source()
    own = "Ticket QRS-408172 was raised by Ingrid Vasquez-Tolland. Reply:"
    output = "We looked at ticket QRS-408172 for Ingrid Vasquez-Tolland."
    assert answer(e, "acme", "a-2", own, output, T0 + 1) == []


def test_names_a_model_made_up_belong_to_nobody():
    """Case identifiers come from prompts only: a model writes the same invented names
    and references for many tenants (docs/detection.md)."""
    e = engine()
    invented = "Regards, Harriet Quillfeather, ticket ZZT-774012."
    answer(e, "acme", "a-1", "Write a sign-off.", invented, T0)
    assert answer(e, "globex", "g-1", "Write a sign-off.\n", invented, T0 + 1) == []


def test_identifiers_several_tenants_sent_are_common():
    e = engine()
    for i, tenant in enumerate(("a", "b", "c")):
        answer(e, tenant, f"{tenant}-1", "Ship it with Northwind Traders please.", "Ok.", T0 + i)
    found = answer(e, "d", "d-1", VICTIM_PROMPT, "Northwind Traders ships it.", T0 + 5)
    assert found == []


def test_turned_off_by_configuration():
    e = with_source(case_identifiers=False)
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, "Ingrid Vasquez-Tolland asked.", T0 + 1)
    assert found == []


def test_case_keys():
    keys = set(iter_case_keys(SOURCE, []))
    assert ("reference", "qrs-408172") in keys and ("reference", "408172") in keys
    assert ("reference", "inv-55210") in keys and ("reference", "k40517m") in keys
    assert ("amount:EUR", "7,318.40") in keys
    assert ("name", "ingrid vasquez-tolland") in keys and ("name", "kestrel and sons") in keys
    # A date, a year and a short count are nobody's reference.
    assert not list(iter_case_keys("On 2024-01-15, in 2023, 3 of 12 items, pay $500.00.", []))


def test_a_reference_whose_digits_repeat_is_still_a_reference():
    """A ticket "ZD-216216" is a reference, though its digits alone repeat a pattern as a filler's
    do: the whole token is judged (human-text bench, seed 4, missed it). A number alone
    that repeats ("#121212", "ticket 216216") stays filler."""
    keys = set(iter_case_keys("Ticket ZD-216216 and #121212 and ticket 216216", []))
    assert keys == {("reference", "zd-216216")}


def test_a_compound_cut_at_a_token_boundary_is_still_found():
    output = "Reply from the Vasquez-Tol team: we are on it."
    found = answer(with_source(), "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


def test_a_leak_does_not_make_the_name_a_models():
    """A model that wrote another tenant's name (a leak) did not make it up: the next
    leak of that name is found too."""
    e = with_source()
    leak = "Ingrid Vasquez-Tolland asked about this too."
    assert answer(e, "globex", "v-1", VICTIM_PROMPT, leak, T0 + 1) != []
    answer(e, "acme", "src-2", SOURCE, "We will look into it.", T0 + 2)
    assert answer(e, "initech", "v-2", VICTIM_PROMPT, leak, T0 + 3) != []


def test_a_quoted_invention_is_nobodys():
    """A conversation sent as one completions string quotes the names the model made up
    in an earlier answer; the model writing them again for another tenant leaks nothing."""
    e = engine()
    invented = "Harriet Quillfeather from our team will follow up."
    answer(e, "acme", "a-1", "Who will follow up?", invented, T0)
    quoted = f"Who will follow up?\n{invented}\nThanks, and when?"
    answer(e, "acme", "a-2", quoted, "Soon.", T0 + 1)
    assert answer(e, "globex", "g-1", "Who will follow up?\n", invented, T0 + 2) == []


def test_names_in_the_victims_own_earlier_turns_are_its_own():
    e = with_source()
    history = "Ingrid Vasquez-Tolland will call you back."
    scan = e.observe_prompt("globex", "v-1", "And when?", now=T0 + 1, model_text=history)
    found = scan.feed("Ingrid Vasquez-Tolland calls tomorrow.", now=T0 + 1)
    assert found + scan.finish(now=T0 + 1) == []


def test_public_names_in_a_baseline_are_nobodys():
    """A product name one tenant asks about and a model writes for another is flagged
    on a fresh engine (a documented limit, docs/detection.md) unless a baseline names
    it, or until three tenants used it."""
    question = "Why does Docker Compose fail on my laptop?"
    output = "Install Docker Compose first."
    fresh = engine()
    answer(fresh, "initech", "i-1", question, "Ok.", T0)
    assert answer(fresh, "globex", "g-1", VICTIM_PROMPT, output, T0 + 1) != []
    public = Engine(
        EngineConfig(key=KEY), baseline=[*BASELINE, "Docker Compose"], plain_words=PLAIN
    )
    answer(public, "initech", "i-1", question, "Ok.", T0)
    assert answer(public, "globex", "g-1", VICTIM_PROMPT, output, T0 + 1) == []


COMPANY_SOURCE = "Ticket from a customer: Green Inc cancelled my contract and kept the deposit."


@pytest.mark.parametrize("leaked", ["Green Inc", "Green Inc.", "green inc"])
def test_a_company_of_a_plain_word_and_its_legal_form_is_found(leaked):
    """The words "Green" and "Morales" are plain words (no rare pair), yet "Green Inc" names one
    firm: a real model's leaks (docs/real-model.md) wrote the source's company whole."""
    e = engine()
    answer(e, "acme", "src-1", COMPANY_SOURCE, "We will look into it.", T0)
    output = f"Reply from the support team: {leaked} has cancelled your booking."
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


def test_a_company_the_victim_asked_about_is_its_own():
    e = engine()
    answer(e, "acme", "src-1", COMPANY_SOURCE, "We will look into it.", T0)
    own = "Q: Does Green sell refurbished phones?\nA:"
    output = "Yes, Green Inc sells refurbished phones on its website."
    assert answer(e, "globex", "v-1", own, output, T0 + 1) == []


def test_a_compound_written_with_the_tokenizers_spacing_is_found():
    """A model's tokenizer may write "Vasquez- Tolland" for "Vasquez-Tolland"."""
    for written in ("Vasquez- Tolland", "Vasquez - Tolland"):
        output = f"Kind regards, Ingrid {written}, account manager."
        found = answer(with_source(), "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)
        assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")], written


@pytest.mark.parametrize(
    ("prompt", "leaked"),
    [
        ("Our contract with Blair Group ends in May.", "the Blair group support team"),
        ("Our solicitors Davis, Coleman and Branch wrote twice.", "Davis, Coleman and Branch"),
        ("Our solicitors Davis, Coleman and Branch wrote twice.", "from the Davis, Coleman team"),
    ],
)
def test_organisations_and_firms_of_three_are_found(prompt, leaked):
    e = engine()
    answer(e, "acme", "src-1", prompt, "We will look into it.", T0)
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, f"Reply from {leaked}: thanks.", T0 + 1)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


@pytest.mark.parametrize(
    "prompt",
    [
        "Our Support Group meets on Monday.",  # a plain name with it: everyone's
        "We fly to Paris, London and Berlin next week.",  # plain words only
    ],
)
def test_plain_organisations_and_lists_are_not_keys(prompt):
    e = engine()
    answer(e, "acme", "src-1", prompt, "We will look into it.", T0)
    output = "The support group visits Paris, London and Berlin."
    assert answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1) == []


@pytest.mark.parametrize(
    "prompt",
    [
        "How do I file the annual report for my Delaware LLC?",
        "Your LLC must file its report by June.",
        "Ask Smith, Jones and Okonkwo about the lease.",  # plain names: no head key
    ],
)
def test_kinds_of_company_and_plain_heads_are_not_keys(prompt):
    e = engine()
    answer(e, "acme", "src-1", prompt, "We will look into it.", T0)
    output = "A Delaware LLC files once a year; your LLC can ask Smith, Jones or a lawyer."
    assert answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1) == []


def test_a_person_in_the_victims_prompt_does_not_excuse_a_firm_of_that_name():
    """The victim's own prompt names a "Jessica Miller": the firm "Miller Inc" of
    another tenant's prompt is still that tenant's (held-out seed 6 missed it)."""
    e = engine()
    answer(e, "acme", "src-1", "Our auditors at Miller Inc need the ledger.", "Noted.", T0)
    own = "Q: I write for my mother, Jessica Miller. How do I reset her password?\nA:"
    output = "Reply from the Miller Inc. customer service team: we reset it."
    found = answer(e, "globex", "v-1", own, output, T0 + 1)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


PLAIN_FIRM = (
    "Hill-Thompson customer support\nMy contract with Wood Group and the solicitors "
    "Short, Washington and Green ended; King-Lewis still bills me.\n\nReply:"
)


@pytest.mark.parametrize(
    "leaked",
    [
        "Reply from the Hill-Thompson team",
        "Account manager, Hill- Thompson",  # the tokenizer's spacing
        "Reply from the Wood Group customer service",
        "Short, Washington and Green support team",
        "Reply from the Short, Washington and billing desk",  # cut after its "and"
        "write to customer.support@king-lewis.co.uk today",  # a host is lower case
    ],
)
def test_names_of_plain_surnames_written_as_names_are_found(leaked):
    """Names made only of plain words that are all frequent surnames: every word is in
    the vocabulary, so no rare pair keys them, yet written as a name they are the
    source's firm (the real model's misses on seeds 2, 4, 6 and 8, docs/real-model.md)."""
    e = engine()
    for word in ("Hill", "Thompson", "Wood", "Short", "Washington", "Green", "King", "Lewis"):
        assert e._common_word(word), word  # else this is not the case under test
    answer(e, "acme", "src-1", PLAIN_FIRM, "We will look into it.", T0)
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, f"{leaked}. Thanks.", T0 + 1)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


@pytest.mark.parametrize(
    "output",
    [
        "Walk up the hill-thompson style path; the wood group meets at noon.",
        "It was short, washington and green were mentioned.",  # prose, not a name
        "Ask Short, Washington or a lawyer.",  # two surnames alone: many answers' example
        "Follow-Up: the Long-Term plan of the Support Group.",  # plain words, not surnames
    ],
)
def test_plain_surnames_not_written_as_names_stay_quiet(output):
    e = engine()
    prompt = f"{PLAIN_FIRM}\nFollow-Up on the Long-Term plan of our Support Group."
    answer(e, "acme", "src-1", prompt, "We will look into it.", T0)
    assert answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1) == []


def test_a_firms_own_answers_do_not_make_its_name_a_models():
    """The model answering the firm's own tickets writes "The King-Lewis team": the pair
    is the model's, its word "King-Lewis" stays the firm's (seed 2 missed the leak)."""
    e = engine()
    answer(e, "acme", "src-1", PLAIN_FIRM, "The King-Lewis Team will call you.", T0)
    answer(e, "acme", "src-2", PLAIN_FIRM, "Regards, The King-Lewis Team", T0 + 1)
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, "Mail support@king-lewis.co.uk.", T0 + 2)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


@pytest.mark.parametrize(
    ("written", "found"),
    [("GBP 919.69", True), ("GBP 2,919.69", False), ("GBP 1.919.69", False), ("919.69.5", False)],
)
def test_an_amount_inside_a_longer_number_is_not_that_amount(written, found):
    """ "919.69" is not in "2,919.69": a digit group's separator between digits joins
    them (the human-text bench flagged two clean answers so, seed 1, warm)."""
    e = engine()
    answer(e, "acme", "src-1", "The council says we owe £919.69 in unpaid tax.", "Noted.", T0)
    output = f"The estimated cost is {written}, payable by June."
    assert bool(answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)) is found


def test_the_victims_own_firm_named_in_its_own_prompt_excuses_it():
    """The help desk of Carroll Inc sends its tickets; another tenant's customer wrote
    that Carroll Inc audits them. Carroll Inc's answers naming Carroll Inc leak nothing,
    although "Carroll Inc" is also a run of capitalised words."""
    e = engine()
    answer(e, "acme", "src-1", "Our auditors at Carroll Inc need the ledger.", "Noted.", T0)
    own = "Carroll Inc customer support\nMy order is late.\n\nReply from the Carroll Inc team:\n"
    output = "Reply from the Carroll Inc support team: we are on it."
    assert answer(e, "globex", "v-1", own, output, T0 + 1) == []


def test_the_words_of_a_firms_name_its_own_answers_write_stay_the_firms():
    """Carroll Inc's answers write "The Carroll Inc support team": "The Carroll" is the
    model's pair, but its word "Carroll" (and "Inc") must not become words models write,
    or Carroll Inc's next ticket would be a quoted invention and its leak nobody's
    (bench/human_leaks.py, seed 1, missed it)."""
    e = engine()
    ticket = "Carroll Inc customer support\nMy order is late.\n\nReply from the Carroll Inc team:"
    for n in range(3):
        answer(e, "acme", f"src-{n}", ticket, "The Carroll Inc Support Team thanks you.", T0 + n)
    output = "Reply from the Carroll Inc support team: we are on it."
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 5)
    assert [(f.kind, f.source_tenant) for f in found] == [(ENTITY, "acme")]


@pytest.mark.parametrize(
    ("written", "found"),
    [("€1,815.87", True), ("EUR 1,815.87", True), ("1,815.87", True), ("1,815.87 EUR", True),
     ("CHF 1,815.87", False), ("$1,815.87", True), ("1,815.87 GBP", False),
     ("USD 1,815.87", False)],
)  # fmt: skip
def test_an_amount_in_another_currency_is_another_amount(written, found):
    """ "CHF 1,815.87" a model made up is not the "€1,815.87" of another tenant's ticket
    (bench/human_leaks.py flagged a clean answer so, seed 3, warm). A bare "$" is a
    model's habit when it copies an amount (Gemma 3 wrote "$777.55" for "€777.55",
    bench/real_model.py seed 10): the same amount."""
    e = engine()
    answer(e, "acme", "src-1", "The rent payment of €1,815.87 bounced.", "Noted.", T0)
    output = f"The adjusted figure is {written} (ref. 12)."
    assert bool(answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)) is found


@pytest.mark.parametrize(
    ("text", "key"),
    [("owe 5,678.91 € today", ("amount:EUR", "5,678.91")), ("¥12,345 due", ("amount:JPY", "12,345")),
     ("GBP 4,567.89 due", ("amount:GBP", "4,567.89"))],
)  # fmt: skip
def test_amount_keys_carry_the_currency_written_before_or_after(text, key):
    """One currency table: a symbol after the number ("5,678.91 €") is read as well."""
    assert key in list(iter_case_keys(text, []))


MAILBOX_SOURCE = (
    "Glenn-Vincent customer support\n"
    "Ticket ZD-871065 from Grace Hunter <grace.hunter@proton.me>\n\n"
    "The tutoring sessions I paid for were cancelled three times.\n\nReply:"
)


@pytest.mark.parametrize(
    ("output", "found"),
    [
        ("Reply from the Grace Hunter support team: sorry.", True),
        ("Reply from the Grace support team: sorry.", False),  # a first name alone
        ("Hunter is a common surname; Grace is a common name.", False),
    ],
)
def test_a_plain_name_that_spells_its_mailbox_is_found(output, found):
    """ "Grace" and "Hunter" are plain words, so no rare pair keys the name, yet the
    name that spells the address beside it is that address's owner: a real model wrote
    such a name ("George Ramirez", both words plain by then) as another tenant's
    "support team" (bench/real_model.py, seed 11)."""
    e = engine()
    assert e._common_word("Grace") and e._common_word("Hunter")  # the case under test
    answer(e, "acme", "src-1", MAILBOX_SOURCE, "We will look into it.", T0)
    got = answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)
    assert [(f.kind, f.source_tenant) for f in got] == ([(ENTITY, "acme")] if found else [])


def test_a_mailbox_name_the_victim_wrote_about_is_its_own():
    """The victim's customer writes about "my friend Grace Hunter"; another tenant's
    ticket comes from a Grace Hunter by mail. The model naming the friend leaks nothing
    (human-text bench, seed 4, flagged such an answer)."""
    e = engine()
    answer(e, "acme", "src-1", MAILBOX_SOURCE, "We will look into it.", T0)
    own = "My old school friend Grace Hunter asked me to be a guarantor. What do I say?"
    output = "You could tell Grace Hunter kindly that you cannot take the risk."
    assert answer(e, "globex", "v-1", own, output, T0 + 1) == []


@pytest.mark.parametrize(
    ("prompt", "output", "found"),
    [
        ("Our landlord Okonkwo and Sons kept the deposit.", "Reply from the Okonkwo and to", True),
        ("Our landlord Brown and Sons kept the deposit.", "Ask Brown and Smith first.", False),
    ],
)
def test_a_rare_firms_head_with_its_and_is_found(prompt, output, found):
    """A model cuts a firm's name at its "and" ("Reply from the Griffin and to talk to
    someone"; bench/real_model.py, seed 11): a rare name's head is the firm's, a plain
    surname's ("Brown and") is anyone's."""
    e = engine()
    assert e._common_word("Brown") and not e._common_word("Okonkwo")
    answer(e, "acme", "src-1", prompt, "We will look into it.", T0)
    got = answer(e, "globex", "v-1", VICTIM_PROMPT, f"{output} someone.", T0 + 1)
    assert [(f.kind, f.source_tenant) for f in got] == ([(ENTITY, "acme")] if found else [])


def test_an_address_made_up_around_a_leak_stays_with_the_firm():
    """A faulted answer to another tenant made up "support@hayes-wyatt.com" around the
    firm's name (a leak, found); the firm's own next answer writing that address is not
    a leak back (bench/real_model.py, seed 11, flagged one so)."""
    e = engine()
    firm = "Hayes-Wyatt customer support\nI owe money on a closed account.\n\nReply:"
    answer(e, "hw", "src-1", firm, "We will look into it.", T0)
    leaked = "Please email Support@hayes-wyatt.com and we will help."
    found = answer(e, "globex", "v-1", VICTIM_PROMPT, leaked, T0 + 1)
    assert [f.source_tenant for f in found] == ["hw"]
    own = "You can contact Hayes-Wyatt support at support@hayes-wyatt.com today."
    assert answer(e, "hw", "src-2", firm, own, T0 + 2) == []


@pytest.mark.parametrize(
    ("output", "found"),
    [
        ("About Richard Williams asked me to: here is my view.", True),
        ("Richard Williams will call you back.", True),
        ("Ask Richard, or Mrs Williams, for help.", False),  # not a full name
        ("the richard williams of this world", False),  # not written as a name
    ],
)
def test_a_full_name_of_a_first_name_and_a_surname_is_found(output, found):
    """ "Richard" and "Williams" are plain words, and no address spells them, yet a
    frequent first name before a frequent surname is somebody: the simulator's answer
    restating another tenant's "my friend Richard Williams" was cut only after it had
    reached the client (bench/human_leaks.py, seed 8, enforce)."""
    e = engine()
    assert e._common_word("Richard") and e._common_word("Williams")  # the case under test
    source = "My old school friend Richard Williams asked me to be a guarantor on his loan."
    answer(e, "acme", "src-1", source, "That is hard.", T0)
    got = answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)
    assert [(f.kind, f.source_tenant) for f in got] == ([(ENTITY, "acme")] if found else [])


def test_a_company_whose_words_models_write_in_other_names_is_still_a_key():
    """Models write "Inc" in every firm's name and "Lee" in many a person's: that does
    not make the firm "Lee Inc" a name the model made up (bench/human_leaks.py, seed 8:
    its answers reached other tenants unfound)."""
    e = engine()
    answer(e, "initech", "i-1", "Who can help?", "Ask Bruce Lee at Frey Inc about it.", T0)
    answer(
        e, "acme", "src-1", "Lee Inc customer support\nMy order is late.\n\nReply:", "Ok.", T0 + 1
    )
    output = "Regarding the Lee Inc support team, here is what I found."
    got = answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 2)
    assert [(f.kind, f.source_tenant) for f in got] == [(ENTITY, "acme")]


@pytest.mark.parametrize(
    ("written", "found"),
    [("ticket 959486", True), ("#959486", True), ("ORD-2026-959486", False),
     ("REF/959486", False), ("TCK-959486", False)],
)  # fmt: skip
def test_a_tickets_digits_in_another_code_are_not_that_ticket(written, found):
    """ "959486" of ticket "#959486" stands for it alone ("ticket 959486"), not as the
    last group of a code a model made up ("ORD-2026-959486"): six random digits meet
    another tenant's ticket by chance (bench/human_leaks.py, seed 9, warm). The cost: a
    model that gives the ticket another prefix ("TCK-959486") is not found by it."""
    e = engine()
    answer(
        e, "acme", "src-1", "Ticket #959486 from a customer: my card was charged twice.", "Ok.", T0
    )
    output = f"Your request is tracked as {written} in our system."
    assert bool(answer(e, "globex", "v-1", VICTIM_PROMPT, output, T0 + 1)) is found


def test_the_pattern_groups_gates_change_no_key(monkeypatch):
    """``iter_case_keys`` skips a group of patterns when a text lacks what all of them
    need (3 digits, a currency, a capitalised pair): the same keys as running every
    pattern, on the quality workload's prompts and answers (faults in them) whole and
    cut into the by-id scan's windows, and on texts made to sit at each gate's edge."""
    from test_core_parity import workload_texts

    from proxy.engine import entities

    texts = workload_texts(600)
    texts += [t[i : i + 112] for t in texts[:300] for i in range(0, len(t), 48)]
    texts += ["USD1,234.56 paid", "a €3,813.95 refund", "Perkins and Sons", "D'angelo Reyes",
              "Davis, Coleman and Branch", "Green-Smith Inc", "Okafor Holdings", "INV-23399",
              "#12345 and 879-8541208", "Hill-Thompson wrote", "Short, Washington & Green", "D’angelo-Reyes", "pay ¥12,000",
              "£1,450.00 due", "McDonald Smith", "CHF 2,500.00", "Reyes, Ana"]  # fmt: skip
    gated = [list(iter_case_keys(t, [])) for t in texts]
    monkeypatch.setattr(entities, "entity_needs", lambda _: -1)  # every group runs
    assert [list(iter_case_keys(t, [])) for t in texts] == gated
    assert sum(map(len, gated)) > 500  # keys of every group were found
