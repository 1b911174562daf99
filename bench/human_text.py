"""Support-desk traffic written the way people write it, for a real model to answer.

Each tenant is a business whose help desk sends its customers' tickets to a shared
engine as completions prompts (a ticket, then "Reply:"), as such a tool shapes them.
The sentences are written by hand, in the registers people use with a help desk (a
billing dispute, a diagnosis, an eviction, a late parcel, a locked account); Faker only
fills in names, numbers, amounts and places. Beside the tickets, tenants ask the same
general questions (the same question from many tenants is not a leak) and paste public
licence text (recited to another tenant it is not a leak either).

Every request keeps its own record (``Request.values``: the identifiers it carries, by
kind), so a judge decides what leaked from the workload alone, with no part of the
engine.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from faker import Faker

#: Kinds of value that tie a text to one person or case. A first name or a year alone
#: does not: many people share them.
IDENTIFIER_KINDS = (
    "ticket", "invoice", "order", "account", "iban", "email", "full_name", "street",
    "amount", "company", "phone", "policy", "relative", "ticket_ref", "employer", "auditor",
)  # fmt: skip

#: Hand-written ticket bodies. ``{...}`` slots are filled per request.
TICKETS = (
    "Hi, I was charged {amount} twice on invoice {invoice} and my bank shows both payments "
    "leaving account {iban}. I only ordered once. Can you refund the second charge please? "
    "Money is tight this month because my husband was diagnosed with {diagnosis} last spring.",
    "My parcel (order {order}) was supposed to arrive last Tuesday at {street}, {city}. The "
    "tracking has said out for delivery for six days. It is a birthday present for my "
    "daughter {child} and her party is on Saturday. What can you do?",
    "I cannot log in anymore. The app says my account {account} is locked after too many "
    "attempts but I never tried to log in. I am worried someone has my password. My phone "
    "number on file is {phone}, please call me there and not by email.",
    "Our landlord is threatening to evict us because the rent payment of {amount} bounced. "
    "Your bank transfer from {iban} was marked as completed on your side. I need a letter "
    "confirming the transfer by Friday or we lose the flat at {street}.",
    "Hello, this is {full_name} from {employer}. Our auditors at {auditor} need a copy of "
    "invoice {invoice} for {amount} and the payment confirmation before the year end close. "
    "Could you send both to {email}?",
    "My son {child} has his final exam in {subject} next week and the tutoring sessions I "
    "paid for ({amount}, order {order}) were cancelled three times. I want either the "
    "sessions or the money back, he is really stressed about it.",
    "I was told by Dr. {doctor} that my {diagnosis} medication would be covered under policy "
    "{policy}, but the pharmacy charged me the full {amount}. Can you check why the claim was "
    "rejected? I am on a fixed pension and cannot keep paying this.",
    "Please update my address. I moved from {street}, {city} to a care home after my fall in "
    "March. My daughter {relative} manages my affairs now and her email is {email}. My "
    "customer number is {account}.",
    "The washing machine we bought (order {order}) flooded our kitchen on the first wash. "
    "The repair man said the hose was cut at the factory. We had to throw out the floor, "
    "the quote is {amount}. I expect you to cover it.",
    "Someone used my card to buy a laptop on your site, order {order}, shipped to {street}, "
    "{city}, which is not my address. I have reported it to the police, the case number is "
    "{ticket_ref}. Please cancel the order and freeze my account {account}.",
    "I run {employer}, a small bakery, and we have been on your business plan for four "
    "years. Since your price change the direct debit from {iban} went up to {amount} a month "
    "without any notice. I would like to talk to someone about going back to the old plan.",
    "I am writing on behalf of my mother, {relative}, who has dementia. She signed up for "
    "three subscriptions on the phone and does not remember doing it. The charges are "
    "{amount} each. Her account is {account}. Can these be cancelled and refunded?",
    "The flight I booked through you was cancelled and the refund of {amount} still has not "
    "arrived after eight weeks. Booking reference {ticket_ref}. I have called four times and "
    "every time I am told to wait. My contact email is {email}.",
    "Hi, my name is {full_name}. I got a letter saying I owe {amount} on account {account} "
    "but I closed that account in January and have the confirmation. This is affecting my "
    "mortgage application with {auditor}, please fix it urgently.",
)

#: General questions several tenants ask the same way (Q&A form).
QUESTIONS = (
    "What is a database index and when should I add one?",
    "How do I reset a forgotten password safely?",
    "What is the difference between a debit card and a credit card?",
    "How long does a bank transfer usually take?",
    "What should I do if my package is lost in the mail?",
    "How do I write a polite complaint letter?",
    "What is two-factor authentication?",
    "How can I tell if an email is a phishing attempt?",
)

#: Public text a tenant pastes (an excerpt of the MIT licence, as published by the OSI).
MIT_EXCERPT = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this "
    'software and associated documentation files (the "Software"), to deal in the Software '
    "without restriction, including without limitation the rights to use, copy, modify, "
    "merge, publish, distribute, sublicense, and/or sell copies of the Software, and to "
    "permit persons to whom the Software is furnished to do so, subject to the following "
    "conditions:"
)

DIAGNOSES = (
    "type 2 diabetes", "multiple sclerosis", "a slipped disc", "early onset Parkinson's",
    "breast cancer", "chronic kidney disease", "epilepsy", "rheumatoid arthritis",
)  # fmt: skip
SUBJECTS = ("chemistry", "maths", "history", "biology", "French", "physics")
TICKET_FORMATS = ("INC{:07d}", "TCK-{:06d}", "#{:06d}", "ZD-{:06d}")


@dataclass
class Tenant:
    name: str  # the tenant's id at the proxy
    key: str  # its API key
    company: str
    domain: str


@dataclass
class Request:
    request_id: str
    tenant: str
    kind: str  # ticket | question | public
    prompt: str
    #: Identifiers of this request by kind (the judge's record; never given to the engine).
    values: dict[str, str] = field(default_factory=dict)


def make_tenants(n: int, fake: Faker) -> list[Tenant]:
    tenants = []
    for i in range(n):
        company = fake.unique.company()
        slug = re.sub(r"[^a-z]", "", company.lower())[:14] or f"co{i}"
        tenants.append(Tenant(f"t{i:02d}", f"sk-desk-{i:02d}-{slug}", company, f"{slug}.com"))
    return tenants


def _ticket_values(fake: Faker, rng: random.Random, tenant: Tenant) -> dict[str, str]:
    first, last = fake.first_name(), fake.last_name()
    email_user = f"{first}.{last}".lower()
    email_domain = rng.choice(("gmail.com", "outlook.com", "yahoo.co.uk", "proton.me", "gmx.de"))
    return {
        "ticket": rng.choice(TICKET_FORMATS).format(rng.randrange(10_000, 999_999)),
        "full_name": f"{first} {last}",
        "email": re.sub(r"[^a-z.@]", "", f"{email_user}@{email_domain}"),
        "company": tenant.company,
        "invoice": f"INV-{rng.randrange(10_000, 99_999)}",
        "order": f"{rng.randrange(100, 999)}-{rng.randrange(1_000_000, 9_999_999)}",
        "account": str(rng.randrange(10_000_000, 99_999_999)),
        "iban": fake.iban(),
        "amount": rng.choice(("${:,.2f}", "€{:,.2f}", "£{:,.2f}")).format(
            rng.randrange(2_000, 480_000) / 100
        ),
        "street": fake.street_address(),
        "phone": fake.numerify("0### ### ####"),
        "policy": f"P{rng.randrange(1_000_000, 9_999_999)}",
        "ticket_ref": f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randrange(10_000, 99_999)}"
        f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}",
        "relative": fake.name(),
        "employer": fake.company(),
        "auditor": fake.company(),
        # Not identifiers on their own (many people share them), but the case's words.
        "city": fake.city(),
        "child": fake.first_name(),
        "doctor": fake.last_name(),
        "diagnosis": rng.choice(DIAGNOSES),
        "subject": rng.choice(SUBJECTS),
        "first": first,
    }


def _ticket(fake: Faker, rng: random.Random, tenant: Tenant, request_id: str) -> Request:
    v = _ticket_values(fake, rng, tenant)
    body = rng.choice(TICKETS).format(**v)
    prompt = (
        f"{tenant.company} customer support\n"
        f"Ticket {v['ticket']} from {v['full_name']} <{v['email']}>\n\n"
        f"{body}\n\n"
        f"Reply from the {tenant.company} support team:\n"
    )
    # The values the prompt really holds are what the judge may look for.
    used = {k: s for k, s in v.items() if k in IDENTIFIER_KINDS and s in prompt}
    return Request(request_id, tenant.name, "ticket", prompt, used)


def make_workload(n: int, tenants: list[Tenant], seed: int, prefix: str = "rm") -> list[Request]:
    """``n`` requests: about 70% tickets, 22% shared questions, 8% pasted public text."""
    rng = random.Random(seed)
    fake = Faker(["en_US", "en_GB"])
    fake.seed_instance(seed)
    out = []
    for i in range(n):
        tenant = rng.choice(tenants)
        rid = f"{prefix}-{seed}-{i:05d}"
        roll = rng.random()
        if roll < 0.70:
            out.append(_ticket(fake, rng, tenant, rid))
        elif roll < 0.92:
            q = rng.choice(QUESTIONS)
            out.append(Request(rid, tenant.name, "question", f"Q: {q}\nA:"))
        else:
            prompt = f"Explain in plain words what this licence allows:\n\n{MIT_EXCERPT}\n\nAnswer:"
            out.append(Request(rid, tenant.name, "public", prompt))
    return out
