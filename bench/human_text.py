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


def ticket_values(fake: Faker, rng: random.Random, tenant: Tenant) -> dict[str, str]:
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


def ticket(fake: Faker, rng: random.Random, tenant: Tenant, request_id: str) -> Request:
    v = ticket_values(fake, rng, tenant)
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
            out.append(ticket(fake, rng, tenant, rid))
        elif roll < 0.92:
            q = rng.choice(QUESTIONS)
            out.append(Request(rid, tenant.name, "question", f"Q: {q}\nA:"))
        else:
            prompt = f"Explain in plain words what this licence allows:\n\n{MIT_EXCERPT}\n\nAnswer:"
            out.append(Request(rid, tenant.name, "public", prompt))
    return out


# --- personal messages ------------------------------------------------------------------

#: Hand-written sentences of a person's own case, as people write to an assistant: mostly
#: plain words (what a leak of private text mostly is), a few slots Faker fills. Each
#: tenant gets its own share (``personal_pool``): one person's words are not another's.
PERSONAL = (
    "My husband was diagnosed with {diagnosis} last spring and we are still learning what that means for us.",
    "The landlord is threatening to evict us because the rent was late twice this winter.",
    "I have been working at {employer} for six years and my manager wants me to take a pay cut.",
    "My daughter {child} has been refusing to go to school since the fight with her best friend.",
    "We borrowed {amount} from my brother-in-law to cover the funeral and now he wants it back by June.",
    "I think my sister is hiding a drinking problem from the rest of the family.",
    "Our old flat at {street} had mould in every room and the children kept getting sick.",
    "Dr. {doctor} told me the scan showed a small shadow on my left lung and I am scared to ask what it is.",
    "I was let go from my job on Friday without any warning and I do not know how to tell my wife.",
    "My father keeps forgetting where he parked the car and last week he got lost on the way home.",
    "We are trying to have a baby and after two years of trying the doctor suggested we see a specialist.",
    "I owe {amount} on three credit cards and the minimum payments are eating my whole salary.",
    "The neighbours on the other side of the wall play loud music until three in the morning every weekend.",
    "My son {child} was caught taking money from my purse and I am not sure how to talk to him about it.",
    "I moved to {city} in March to be closer to my mother, but I have not made a single friend yet.",
    "My partner and I keep arguing about money and last night he slept on the sofa.",
    "I have had a pain in my lower back for months and the painkillers do nothing anymore.",
    "The insurance company refused to pay for the damage after the pipe burst in our kitchen.",
    "I am thinking about leaving my job at {employer} to start a small cleaning business of my own.",
    "My grandmother left me her house in {city} but my uncle says the will is not valid.",
    "I failed my driving test for the third time and my instructor says I panic at roundabouts.",
    "My wife found out about the messages I sent to an old friend and now she wants a separation.",
    "We adopted a rescue dog last month and he bites anyone who comes near the food bowl.",
    "I have been feeling low for weeks and I cannot get out of bed before noon.",
    "Our son has autism and the school keeps sending him home early without telling us why.",
    "I lent my car to a friend and he crashed it, and now his insurance will not cover the repairs.",
    "My mother needs a carer three times a day and I cannot afford to pay for one.",
    "I got a letter from the council saying we owe {amount} in unpaid council tax from two years ago.",
    "The hospital lost my test results and now I have to wait another six weeks for a new appointment.",
    "I found out my boss at {employer} has been paying the new guy more than me for the same work.",
    "We are selling the house on {street} because we cannot keep up with the mortgage anymore.",
    "My teenage daughter told me she is pregnant and she wants to keep the baby.",
    "I have been sober for nine months but the stress at home makes me want to drink again.",
    "My brother owes me money and every time I bring it up he changes the subject.",
    "The car broke down on the motorway and the garage wants {amount} to fix the gearbox.",
    "I am a single dad with two kids and I work nights, so I hardly see them during the week.",
    "My best friend stopped talking to me after I missed her wedding because I was in hospital.",
    "We were burgled while we were away and they took my late father's watch.",
    "I am being bullied at work by a colleague who makes jokes about my accent in every meeting.",
    "My ex-husband has not paid child support for five months and the kids need new school uniforms.",
    "I have to choose between a job offer in {city} and staying near my ageing parents.",
    "The vet says our cat has kidney failure and the treatment would cost {amount}.",
    "My husband snores so loudly that I have been sleeping in the spare room for a year.",
    "I got into a university course but my parents say it is a waste of money.",
    "Our baby has not been sleeping more than two hours at a time and we are exhausted.",
    "I accidentally deleted all the photos of my daughter's first year and I have no backup.",
    "My stepson refuses to speak to me and my husband always takes his side.",
    "I was diagnosed with {diagnosis} in January and I have not told anyone at work yet.",
    "The builder took a deposit of {amount} for our extension and then stopped answering his phone.",
    "My flatmate never pays her share of the bills on time and I end up covering for her.",
    "I am worried my son spends all night playing games and his grades are falling fast.",
    "My wife wants to move back to her home country and I do not speak the language.",
    "I was in a car accident in November and I still get nervous every time I drive.",
    "We found damp behind the wardrobe in our rented flat and the agency says it is our fault.",
    "My old school friend {name} asked me to be a guarantor on his loan and I do not know how to say no.",
    "I have two job interviews on the same day and I cannot decide which one to miss.",
    "My father had a stroke last week and the doctors say he may not walk again.",
    "I keep getting calls from a debt collector about a loan I never took out.",
    "Our daughter {child} wants to drop out of college to become a musician.",
    "I am having panic attacks on the train to work and I have started taking taxis I cannot afford.",
    "My partner wants children and I am not sure I ever will.",
    "The bank froze my account ending {account} after a payment from my cousin abroad.",
    "My twin brother and I have not spoken since our mother's funeral three years ago.",
    "I have put on a lot of weight since I stopped smoking and I feel awful about myself.",
    "We had to put my grandfather in a care home and I feel guilty every single day.",
    "I am being asked to relocate to {city} or lose my position at {employer}.",
    "My son was stopped by the police on his way home and he is too upset to go out now.",
    "My sister borrowed my wedding dress and returned it with a tear down the back.",
    "I think my teenage son is being bullied online but he will not show me his phone.",
    "Our upstairs neighbour's bath leaked through our ceiling and now the plaster is falling down.",
    "I lost my wallet with my residence card in it and I have to travel in two weeks.",
    "My mother-in-law moved in with us for a month and it has been six months now.",
    "I have tinnitus since the concert in August and the ringing never stops at night.",
    "My manager keeps giving me work on Friday afternoons that has to be done by Monday morning.",
    "We paid {amount} for a holiday and the travel company went bust a week before we left.",
    "I have not been able to see my grandchildren since my son's divorce.",
    "My daughter {child} has an eating disorder and the waiting list for treatment is eight months.",
    "I was overcharged at the dentist and they say the extra was for a filling I never had.",
    "I have been offered a promotion but it means working every other weekend.",
    "My husband lost his job at {employer} and he has not told his parents yet.",
    "The school says my son {child} needs glasses but he refuses to wear them.",
    "I am trying to leave a controlling relationship and I do not know where I can go.",
    "My landlord entered the flat while I was at work and moved my things around.",
    "I have a court date in {city} next month about the accident and I cannot afford a lawyer.",
    "My elderly neighbour {name} has nobody and I have started doing her shopping every week.",
    "I have been dating someone for a year and I just found out he is still married.",
    "The pension office says I have paid in for eleven years less than I actually worked.",
    "We want to foster a child but we are worried we are too old.",
    "My brother was arrested last night and my parents do not know yet.",
    "I keep waking up at four in the morning worrying about the debts.",
    "I have been asked to give a speech at my father's retirement and I am terrified of public speaking.",
    "My daughter was offered a place at a school across the city and the bus takes an hour.",
    "I broke my wrist playing football and I cannot work on the building site for eight weeks.",
    "My girlfriend wants us to move in together but I still owe {amount} on my student loan.",
    "We have been fighting with the council for two years about the tree that is cracking our wall.",
)  # fmt: skip

#: Code people paste (the same snippet for many: public), then their own line about it.
CODE_SNIPPETS = (
    "```python\nimport csv\n\nwith open('data.csv', newline='') as f:\n    for row in csv.reader(f):\n        print(row)\n```",
    "```python\nfrom datetime import datetime\n\nnow = datetime.now()\nprint(now.strftime('%Y-%m-%d'))\n```",
    "```sql\nSELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY 2 DESC;\n```",
)  # fmt: skip


def personal_pool(tenants: list[Tenant]) -> dict[str, list[str]]:
    """Each tenant's own share of ``PERSONAL``: no two tenants write the same sentence."""
    return {t.name: list(PERSONAL[i :: len(tenants)]) for i, t in enumerate(tenants)}
