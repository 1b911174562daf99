"""Isolation probe: concurrent traffic as synthetic tenants, every response checked for
any other tenant's data.

Each synthetic tenant has its own ``X-Tenant-ID`` and API key. Every prompt carries
values that exist nowhere else: a canary, an email, an IBAN-like number (valid mod-97),
a card number (valid Luhn), an API-key-like token and a made-up project name. A response
that contains another tenant's value, or a run of another tenant's prompt or answer, is
contamination: the engine (or something between it and the client) mixed requests.

Two checks, both over every response:

* the detection engine (``proxy.engine``), exactly as the proxy drives it: the prompt is
  observed before the request is sent, the answer is fed when it arrives; canaries are
  registered per tenant;
* a direct check for the other tenants' canaries and entities (order-independent).

Every finding is then confirmed against the probe's own ground truth, with hindsight
once all traffic is done: canaries and entities are exact random values; a fragment
must share runs of at least 8 words with the source request's prompt or answer (not
with the victim's own prompt) that hold one of the source tenant's made-up values or an
id-like number only the source used. A fresh engine flags some shared model boilerplate
between tenants (docs/benchmarks.md, "Quality"); boilerplate holds no such word, so it
stays unconfirmed: reported, never counted as contamination.

How sensitive a run was is measured, not assumed: the probe can only see a leak that the
model writes out, so it counts the answers that repeat a value of their own prompt (the
system prompt asks for the reference code). A model that repeats its own values in
fewer than ``MIN_SENSITIVITY`` of its answers (one that does not follow instructions,
a random-weight test model) could not have shown another tenant's either: its run is
"inconclusive", never "no contamination found".

With ``determinism`` a sample of prompts is sent again one at a time at temperature 0
and compared with the answers given under load: a difference is not proof of a leak
(engines are not bit-exact under batching), but a leak shows up as one.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import aiohttp

from proxy.engine import CANARY, ENTITY, FRAGMENT, Engine, Finding
from proxy.engine.checksums import luhn_complete

SYSTEM_PROMPT = (
    "You are a careful assistant for a customer-support team. Answer briefly and repeat "
    "the reference code you were given."
)
CHAT_PATH = "/v1/chat/completions"
SOLO = "-solo"  # request id suffix of a determinism repeat
MIN_CONFIRM_WORDS = 8  # a fragment is confirmed by runs of this many words of its source
MIN_SENSITIVITY = 0.5  # share of answers that must repeat one of their own values
MAX_RECORDED_FINDINGS = 200


class ProbeError(RuntimeError):
    """The probe cannot run (target unreachable, no model)."""


@dataclass(frozen=True, slots=True)
class ProbeParams:
    """What to send. ``requests`` is the total over all tenants."""

    target: str
    tenants: int = 4
    concurrency: int = 8
    requests: int = 200
    model: str | None = None
    max_tokens: int = 160
    stream: bool = False
    determinism: bool = False
    sample: int = 10
    timeout: float = 60.0
    api_key: str | None = None  # one real key for every tenant (else synthetic keys)
    seed: int | None = None

    def to_json(self) -> dict:
        data = asdict(self)
        data["api_key"] = "(given)" if self.api_key else None
        return data


# --- synthetic tenants and prompts ------------------------------------------------------

_SYLLABLES = (
    "vel", "kar", "ost", "pin", "tesh", "mor", "dal", "quin", "bro", "zef", "lum", "rav", "sig",
    "tor", "nem", "fal", "dru", "kes", "wim", "yar",
)  # fmt: skip
_TOPICS = (
    "the delayed refund", "the contract renewal", "a duplicate invoice", "the address change",
    "the blocked card", "the loan schedule", "the data export request", "the overdue payment",
)  # fmt: skip
_TEMPLATES = (
    "Summarise the account note for {name} ({email}), reference {canary}: IBAN {iban}, card "
    "{card}, API key {key}; project {project} needs a reply about {topic} by {date}.",
    "Draft a short reply to {name} about {topic} (reference {canary}). Their details: email "
    "{email}, IBAN {iban}, card {card}, integration key {key}, project {project}, due {date}.",
    "Check this customer record and say what is missing: reference {canary}, holder {name}, "
    "mail {email}, account {iban}, card {card}, token {key}, project {project}, {topic}, {date}.",
)


def iban_like(rng: random.Random, country: str = "DE") -> str:
    """A German-format IBAN with valid mod-97 check digits (random, owned by nobody)."""
    bban = "".join(rng.choice("0123456789") for _ in range(18))
    digits = "".join(str(int(c, 36)) for c in bban + country + "00")
    check = 98 - int(digits) % 97
    iban = f"{country}{check:02d}{bban}"
    return " ".join(iban[i : i + 4] for i in range(0, len(iban), 4))


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    api_key: str


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """One synthetic request and the private values it carries."""

    index: int
    tenant: str
    request_id: str
    canary: str
    entities: tuple[str, ...]
    user: str
    project: str = ""

    def private_values(self) -> tuple[str, ...]:
        """Every value made up for this request alone."""
        return (self.canary, *self.entities, self.project)

    def messages(self) -> list[dict]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.user},
        ]

    def prompt_text(self) -> str:
        """The prompt as the proxy sees it: every message, joined by newlines."""
        return SYSTEM_PROMPT + "\n" + self.user


def make_tenants(count: int, rng: random.Random) -> list[Tenant]:
    token = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(6))
    return [
        Tenant(
            f"probe-{token}-t{i + 1:02d}",
            "sk-probe-"
            + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(24)),
        )
        for i in range(count)
    ]


def make_workload(
    tenants: int, requests: int, rng: random.Random
) -> tuple[list[Tenant], list[ProbeRequest]]:
    """The probe's tenants and its requests in sending order (a seeded ``rng`` makes
    the same ones again: a judge can rebuild what each tenant sent)."""
    made = make_tenants(tenants, rng)
    out = [make_request(i, made[i % len(made)], rng) for i in range(requests)]
    rng.shuffle(out)
    return made, out


def make_request(index: int, tenant: Tenant, rng: random.Random) -> ProbeRequest:
    """A request whose every private value is fresh random data."""
    hexdigits = "0123456789ABCDEF"
    canary = "XTC" + "".join(rng.choice(hexdigits) for _ in range(14))
    # Names made of random syllables, like the project's: a name from a small pool would
    # be two tenants' by chance, and a full name is an identifier (case identifiers).
    first, last = ("".join(rng.choice(_SYLLABLES) for _ in range(n)).capitalize() for n in (2, 3))
    email = f"{first.lower()}.{last.lower()}{rng.randint(1000, 99999)}@probe{rng.randint(10, 999)}.xtc-mail.net"
    card = luhn_complete("4" + "".join(rng.choice("0123456789") for _ in range(14)))
    card = " ".join(card[i : i + 4] for i in range(0, 16, 4))
    key = "sk-live-" + "".join(
        rng.choice("abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(28)
    )
    iban = iban_like(rng)
    project = " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize() for _ in range(2)
    )
    date = (
        f"{rng.randint(1, 28)} {rng.choice(('March', 'June', 'October'))} {rng.randint(2026, 2028)}"
    )
    user = rng.choice(_TEMPLATES).format(
        name=f"{first} {last}",
        email=email,
        canary=canary,
        iban=iban,
        card=card,
        key=key,
        project=project,
        topic=rng.choice(_TOPICS),
        date=date,
    )
    request_id = f"probe-{index:06d}-{''.join(rng.choice(hexdigits.lower()) for _ in range(8))}"
    entities = (email, iban, card, key)
    return ProbeRequest(index, tenant.name, request_id, canary, entities, user, project)


# --- HTTP -------------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    """What came back for one request."""

    status: str  # ok | error | blocked
    http_status: int = 0
    text: str = ""
    error: str = ""
    latency: float = 0.0


def _blocked(body: Any) -> bool:
    """A crosstalk proxy in enforce mode stopped this response as a leak."""
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and err.get("code") == "cross_tenant_leak"


async def send(
    session: aiohttp.ClientSession,
    base: str,
    req: ProbeRequest,
    tenant: Tenant,
    params: ProbeParams,
    model: str,
) -> Answer:
    """POST one chat completion as ``tenant``; never raises."""
    headers = {
        "X-Tenant-ID": tenant.name,
        "Authorization": f"Bearer {params.api_key or tenant.api_key}",
        "X-Request-ID": req.request_id,
    }
    body = {
        "model": model,
        "messages": req.messages(),
        "temperature": 0,
        "max_tokens": params.max_tokens,
        "stream": params.stream,
    }
    start = time.perf_counter()
    try:
        async with session.post(base + CHAT_PATH, json=body, headers=headers) as resp:
            if params.stream and resp.status == 200:
                answer = await _read_stream(resp)
            else:
                data = await resp.read()
                answer = _read_body(resp.status, data)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        answer = Answer("error", error=f"{type(e).__name__}: {e}")
    answer.latency = time.perf_counter() - start
    return answer


def _read_body(status: int, data: bytes) -> Answer:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return Answer("error", status, error=f"HTTP {status}: not JSON")
    if _blocked(obj):
        return Answer("blocked", status, error="blocked by crosstalk (cross_tenant_leak)")
    if status != 200:
        return Answer("error", status, error=f"HTTP {status}: {str(obj)[:200]}")
    try:
        text = obj["choices"][0]["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return Answer("error", status, error="no choices[0].message in the answer")
    return Answer("ok", status, text)


async def _read_stream(resp: aiohttp.ClientResponse) -> Answer:
    parts: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if _blocked(obj):
            return Answer("blocked", resp.status, "".join(parts), "stream cut by crosstalk")
        if isinstance(obj, dict) and "error" in obj:
            return Answer("error", resp.status, "".join(parts), f"error event: {obj['error']}")
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) == 0:
                parts.append((choice.get("delta") or {}).get("content") or "")
    if not done:
        return Answer("error", resp.status, "".join(parts), "stream ended without [DONE]")
    return Answer("ok", resp.status, "".join(parts))


async def discover_model(session: aiohttp.ClientSession, base: str, api_key: str | None) -> str:
    """The first model of ``/v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(base + "/v1/models", headers=headers) as resp:
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        raise ProbeError(f"cannot list models at {base}/v1/models: {e}") from e
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as e:
        raise ProbeError(f"{base}/v1/models lists no model; pass --model") from e


# --- checking ---------------------------------------------------------------------------

_WORD_RE = re.compile(r"\w+", re.UNICODE)
_ID_RE = re.compile(r"\w*\d{4,}\w*")  # reference numbers, order ids, account numbers


def _words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD_RE.findall(text)]


def shared_runs(a: list[str], b: list[str], min_len: int) -> list[list[str]]:
    """The stretches of ``a`` covered by runs of at least ``min_len`` words that also
    occur in ``b`` (overlapping runs merged)."""
    covered = [False] * len(a)
    prev = [0] * (len(b) + 1)
    for i, wa in enumerate(a, 1):
        cur = [0] * (len(b) + 1)
        for j, wb in enumerate(b, 1):
            if wa == wb:
                cur[j] = length = prev[j - 1] + 1
                if length == min_len:  # a run reaches the minimum: mark all of it
                    covered[i - length : i] = [True] * length
                elif length > min_len:  # it goes on: its start is already marked
                    covered[i - 1] = True
        prev = cur
    runs, start = [], None
    for i, c in enumerate([*covered, False]):
        if c and start is None:
            start = i
        elif not c and start is not None:
            runs.append(a[start:i])
            start = None
    return runs


@dataclass(slots=True)
class Contamination:
    """One piece of another tenant's data in a response."""

    victim_tenant: str
    victim_request: str
    kind: str  # canary | entity | fragment
    source_tenant: str
    source_request: str
    foreign_words: float
    confirmed: bool
    via: str  # engine | direct
    phase: str  # load | determinism
    excerpt: str
    run: tuple[str, ...] = ()  # fragment: the words shared with the source

    def to_json(self) -> dict:
        data = asdict(self)
        del data["run"]
        return data


@dataclass(slots=True)
class Tally:
    """Counts of one probe run."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    blocked: int = 0
    echoed: int = 0  # answers that repeat a value of their own prompt
    findings: list[Contamination] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    @property
    def sensitivity(self) -> float:
        """Share of the answers that repeat one of their own prompt's values: how likely
        the run was to show another tenant's, had it been there."""
        return self.echoed / self.ok if self.ok else 0.0

    @property
    def contaminated(self) -> set[str]:
        """Requests whose answer holds confirmed contamination."""
        return {c.victim_request for c in self.findings if c.confirmed}


class Checker:
    """Drives the detection engine and the direct checks over the probe's traffic."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.requests: dict[str, ProbeRequest] = {}
        self.answers: dict[str, str] = {}
        self._canaries: dict[str, str] = {}  # canary -> tenant
        self._entities: dict[str, tuple[str, str]] = {}  # entity -> (tenant, request id)

    def observe(self, req: ProbeRequest):
        """Before sending: register the canary and the prompt (a page of this prompt can
        leak into a response that is already being generated)."""
        self.requests[req.request_id] = req
        self._canaries[req.canary] = req.tenant
        for value in req.entities:
            self._entities[value] = (req.tenant, req.request_id)
        self.engine.register_canary(req.tenant, req.canary)
        return self.engine.observe_prompt(req.tenant, req.request_id, req.prompt_text())

    def check(self, req: ProbeRequest, scan, answer: Answer, phase: str) -> list[Contamination]:
        """After the answer: feed it to the engine, then confirm each finding; add the
        direct canary/entity hits the engine did not report."""
        text = answer.text if answer.status == "ok" else ""
        findings: list[Finding] = scan.feed(text) if text else []
        findings += scan.finish()
        if text:
            self.answers[req.request_id] = text
        found = [self._confirm(req, text, f, phase) for f in findings]
        seen = {(c.kind, c.source_tenant) for c in found}
        for canary, tenant in self._canaries.items():
            if tenant != req.tenant and canary in text and (CANARY, tenant) not in seen:
                found.append(self._direct(req, text, CANARY, canary, tenant, "", phase))
                seen.add((CANARY, tenant))
        for value, (tenant, rid) in self._entities.items():
            if tenant != req.tenant and value in text and (ENTITY, tenant) not in seen:
                found.append(self._direct(req, text, ENTITY, value, tenant, rid, phase))
                seen.add((ENTITY, tenant))
        return found

    def _direct(self, req, text, kind, value, tenant, rid, phase) -> Contamination:
        at = text.find(value)
        excerpt = text[max(0, at - 40) : at + len(value) + 40]
        return Contamination(
            req.tenant, req.request_id, kind, tenant, rid, len(value.split()), True, "direct",
            phase, excerpt,
        )  # fmt: skip

    def _confirm(self, req: ProbeRequest, text: str, f: Finding, phase: str) -> Contamination:
        span = text[f.start : f.end] if f.end > f.start else ""
        source = self.requests.get(f.source_request_id)
        if f.kind == CANARY:
            confirmed = any(c in text for c, t in self._canaries.items() if t == f.source_tenant)
        elif f.kind == ENTITY:
            sources = self._texts_of(f.source_request_id, source)
            confirmed = bool(span.strip()) and any(span.casefold() in s.casefold() for s in sources)
        else:
            run = self._fragment_run(req, span, f.source_request_id, source)
            return Contamination(
                req.tenant, req.request_id, f.kind, f.source_tenant, f.source_request_id,
                f.foreign_units, False, "engine", phase, span[:300], run,
            )  # fmt: skip
        return Contamination(
            req.tenant, req.request_id, f.kind, f.source_tenant, f.source_request_id,
            f.foreign_units, confirmed, "engine", phase, span[:300],
        )  # fmt: skip

    def _texts_of(self, request_id: str, source: ProbeRequest | None) -> list[str]:
        texts = [source.prompt_text()] if source else []
        if request_id in self.answers:
            texts.append(self.answers[request_id])
        return texts

    def _fragment_run(
        self, victim: ProbeRequest, span: str, source_id: str, source: ProbeRequest | None
    ) -> tuple[str, ...]:
        """The words of the span that lie in runs of >= ``MIN_CONFIRM_WORDS`` words shared
        with the source request's prompt or answer, runs of the victim's own prompt left
        out; () if there are none."""
        span_words = _words(span)
        own = " ".join(_words(victim.prompt_text()))
        kept: list[str] = []
        for text in self._texts_of(source_id, source):
            for run in shared_runs(span_words, _words(text), MIN_CONFIRM_WORDS):
                if " ".join(run) not in own:
                    kept += run
        return tuple(dict.fromkeys(kept))

    def finalize(self, findings: list[Contamination]) -> None:
        """With hindsight over the whole run, confirm fragments. A fragment of tenant S's
        text is confirmed when its shared runs hold a word that belongs to S: a word of
        a value the probe made up for S (canary, entities, project name) that no other
        tenant's prompt has, or an id-like word (a number of 4+ digits, or a code holding
        one: what a model writes as reference numbers) found in no request outside S's,
        this victim and the requests already proven to hold S's canaries or entities.
        Model boilerplate never confirms a fragment, however rare its words in the run."""
        prompt_words: dict[str, set[str]] = {}
        made_up: dict[str, set[str]] = {}
        where: dict[str, set[tuple[str, str]]] = {}  # word -> {(request, tenant)}
        for rid, req in self.requests.items():
            prompt = set(_words(req.prompt_text()))
            prompt_words.setdefault(req.tenant, set()).update(prompt)
            made_up.setdefault(req.tenant, set()).update(_words(" ".join(req.private_values())))
            doc = (rid.removesuffix(SOLO), req.tenant)
            for w in prompt | set(_words(self.answers.get(rid, ""))):
                where.setdefault(w, set()).add(doc)
        for tenant, words in made_up.items():
            for other, prompt in prompt_words.items():
                if other != tenant:
                    words -= prompt
        proven: dict[str, set[str]] = {}  # request -> tenants whose values it holds
        for c in findings:
            if c.kind != FRAGMENT and c.confirmed:
                proven.setdefault(c.victim_request.removesuffix(SOLO), set()).add(c.source_tenant)

        def owned(word: str, tenant: str, victim: str) -> bool:
            if word in made_up.get(tenant, ()):
                return True
            return _ID_RE.fullmatch(word) is not None and all(
                t == tenant or rid == victim or tenant in proven.get(rid, ())
                for rid, t in where.get(word, ())
            )

        for c in findings:
            if c.kind == FRAGMENT:
                victim = c.victim_request.removesuffix(SOLO)
                c.confirmed = any(owned(w, c.source_tenant, victim) for w in c.run)


# --- progress ---------------------------------------------------------------------------


class ProbeProgress:
    """A one-line progress bar on a terminal; a few plain lines otherwise."""

    def __init__(self, total: int, out: TextIO | None = None, label: str = "requests") -> None:
        self.total, self.done, self.bad = max(1, total), 0, 0
        self.out = out if out is not None else sys.stderr
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.label = label
        self._next_plain = 0.25

    def step(self, suspect: bool) -> None:
        """One request done; ``suspect``: it has findings (confirmed at the end)."""
        self.done += 1
        self.bad += suspect
        share = self.done / self.total
        if self.tty:
            filled = int(share * 30)
            self.out.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                f"{self.label}, {self.bad} with findings"
            )
            if self.done == self.total:
                self.out.write("\n")
            self.out.flush()
        elif share >= self._next_plain or self.done == self.total:
            self.out.write(f"{self.done}/{self.total} {self.label}, {self.bad} with findings\n")
            self.out.flush()
            while self._next_plain <= share:
                self._next_plain += 0.25


# --- the run ----------------------------------------------------------------------------


@dataclass(slots=True)
class ProbeResult:
    params: ProbeParams
    model: str
    tenants: list[str]
    load: Tally
    determinism: dict | None
    duration: float

    @property
    def findings(self) -> list[Contamination]:
        return self.load.findings + list((self.determinism or {}).get("findings", []))

    @property
    def confirmed(self) -> list[Contamination]:
        return [c for c in self.findings if c.confirmed]

    @property
    def unconfirmed(self) -> list[Contamination]:
        return [c for c in self.findings if not c.confirmed]

    @property
    def contaminated(self) -> bool:
        return bool(self.confirmed) or self.load.blocked > 0

    @property
    def inconclusive(self) -> bool:
        """Too few answers to say anything, or answers that could not have shown a leak:
        a model that does not repeat its own prompt's values would not repeat another's."""
        return self.load.ok < max(1, self.load.sent // 2) or self.load.sensitivity < MIN_SENSITIVITY

    def why_inconclusive(self) -> str:
        if self.load.ok < max(1, self.load.sent // 2):
            return f"only {self.load.ok} of {self.load.sent} requests answered"
        return (
            f"{self.load.echoed} of {self.load.ok} answers repeated a value of their own "
            f"prompt (at least {MIN_SENSITIVITY:.0%} needed): the model does not echo its "
            "prompt, so it could not have shown another tenant's"
        )

    def counts(self) -> dict[str, Any]:
        by_kind = Counter(c.kind for c in self.confirmed)
        pairs = sorted({f"{c.source_tenant} -> {c.victim_tenant}" for c in self.confirmed})
        det = self.determinism or {}
        lat = sorted(self.load.latencies)
        return {
            "requests_sent": self.load.sent,
            "answered": self.load.ok,
            "answers_repeating_own_values": self.load.echoed,
            "sensitivity": round(self.load.sensitivity, 4),
            "errors": self.load.errors,
            "blocked_by_proxy": self.load.blocked,
            "contaminated_responses": len({c.victim_request for c in self.confirmed}),
            "canary_findings": by_kind.get(CANARY, 0),
            "entity_findings": by_kind.get(ENTITY, 0),
            "fragment_findings": by_kind.get(FRAGMENT, 0),
            "unconfirmed_findings": len(self.unconfirmed),
            "tenant_pairs": pairs,
            "determinism_compared": det.get("compared", 0),
            "determinism_identical": det.get("identical", 0),
            "determinism_divergent": det.get("divergent", 0),
            "latency_p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
            "duration_s": round(self.duration, 2),
            "error_samples": self.load.error_samples[:5],
        }

    def verdict(self) -> str:
        if self.contaminated:
            return "contamination found"
        if self.inconclusive:
            return "inconclusive"
        return "no contamination found"


def probe_engine(config=None) -> tuple[Engine, dict]:
    """A detection engine like the proxy's: the operator's config if given (baseline,
    vocabulary, parameters), else the packaged defaults, with a fresh random key (nothing
    of the probe outlives the run). Returns the engine and the detection settings it
    used, for the evidence record's config hash."""
    import dataclasses
    import hashlib
    import os

    from proxy.config import load
    from proxy.factory import build_engine as configured_engine
    from proxy.factory import word_lists

    cfg = config or load(None)
    engine_config = dataclasses.replace(cfg.engine_config(), key=os.urandom(32))
    settings = {k: v for k, v in dataclasses.asdict(engine_config).items() if k != "key"}
    lists = word_lists(cfg)
    for name, texts in zip(("baseline", "vocabulary"), lists, strict=True):
        settings[f"{name}_sha256"] = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    engine = configured_engine(cfg, engine_config, lists=lists)
    return engine, settings


async def run_probe(
    params: ProbeParams,
    engine: Engine,
    *,
    progress: Callable[[int], ProbeProgress] | None = None,
) -> ProbeResult:
    """Send the traffic, check every answer, and optionally the determinism sample."""
    if params.tenants < 2:
        raise ProbeError("--tenants must be at least 2 (a leak is between tenants)")
    if params.requests < params.tenants or params.concurrency < 1:
        raise ProbeError("--requests must be >= --tenants and --concurrency >= 1")
    rng = random.Random(params.seed) if params.seed is not None else random.SystemRandom()
    base = params.target.rstrip("/")
    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=params.timeout)
    connector = aiohttp.TCPConnector(limit=params.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = params.model or await discover_model(session, base, params.api_key)
        tenants, requests = make_workload(params.tenants, params.requests, rng)
        by_name = {t.name: t for t in tenants}
        checker = Checker(engine)
        load = Tally()
        bar = progress(len(requests)) if progress else None
        queue: asyncio.Queue[ProbeRequest] = asyncio.Queue()
        for req in requests:
            queue.put_nowait(req)

        async def worker() -> None:
            while not queue.empty():
                req = queue.get_nowait()
                scan = checker.observe(req)
                answer = await send(session, base, req, by_name[req.tenant], params, model)
                found = checker.check(req, scan, answer, "load")
                _record(load, req, answer, found)
                if bar:
                    bar.step(bool(found))

        await asyncio.gather(*(worker() for _ in range(min(params.concurrency, len(requests)))))
        determinism = None
        if params.determinism:
            determinism = await _determinism(
                session, base, params, model, rng, requests, checker, by_name
            )
    result = ProbeResult(
        params, model, [t.name for t in tenants], load, determinism, time.perf_counter() - started
    )
    checker.finalize(result.findings)
    return result


def _record(tally: Tally, req: ProbeRequest, answer: Answer, found: list[Contamination]) -> None:
    tally.sent += 1
    if answer.status == "ok":
        tally.ok += 1
        tally.latencies.append(answer.latency)
        tally.echoed += any(value in answer.text for value in req.private_values() if value)
    elif answer.status == "blocked":
        tally.blocked += 1
    else:
        tally.errors += 1
        if len(tally.error_samples) < 20:
            tally.error_samples.append(f"{req.request_id}: {answer.error}")
    tally.findings += found


async def _determinism(
    session, base, params, model, rng, requests, checker: Checker, by_name
) -> dict:
    """Send a sample again, one at a time, and compare with the answers under load."""
    answered = [r for r in requests if r.request_id in checker.answers]
    sample = rng.sample(answered, min(params.sample, len(answered)))
    result: dict[str, Any] = {
        "compared": 0, "identical": 0, "divergent": 0, "divergent_requests": [],
        "findings": [],
    }  # fmt: skip
    for original in sample:
        again = ProbeRequest(
            original.index, original.tenant, original.request_id + SOLO, original.canary,
            original.entities, original.user, original.project,
        )  # fmt: skip
        scan = checker.observe(again)
        answer = await send(session, base, again, by_name[again.tenant], params, model)
        found = checker.check(again, scan, answer, "determinism")
        result["findings"] += found
        if answer.status != "ok":
            continue
        result["compared"] += 1
        if answer.text.strip() == checker.answers[original.request_id].strip():
            result["identical"] += 1
        else:
            result["divergent"] += 1
            result["divergent_requests"].append(original.request_id)
    return result


# --- report -----------------------------------------------------------------------------


def render(result: ProbeResult, engine_line: str = "") -> str:
    """The summary table of a probe run."""
    p = result.params
    c = result.counts()
    mode = "streamed" if p.stream else "non-streamed"
    lines = [
        f"target:   {p.target}" + (f"  ({engine_line})" if engine_line else ""),
        f"traffic:  {p.tenants} tenants, {c['requests_sent']} requests, concurrency "
        f"{p.concurrency}, model {result.model}, {mode}, temperature 0",
        "",
    ]
    rows: list[tuple[str, Any]] = [
        ("requests sent", c["requests_sent"]),
        ("answered", c["answered"]),
        (
            "sensitivity: answers repeating their own values",
            f"{c['answers_repeating_own_values']} ({c['sensitivity']:.0%})",
        ),
        ("errors", c["errors"]),
        ("blocked by a crosstalk proxy", c["blocked_by_proxy"]),
        ("responses with another tenant's data", c["contaminated_responses"]),
        ("  canary findings", c["canary_findings"]),
        ("  entity findings", c["entity_findings"]),
        ("  fragment findings", c["fragment_findings"]),
        ("unconfirmed engine findings (not counted)", c["unconfirmed_findings"]),
        ("tenant pairs (source -> victim)", len(c["tenant_pairs"])),
    ]
    if result.determinism is not None:
        rows.append(
            (
                "determinism: identical / divergent",
                f"{c['determinism_identical']} / {c['determinism_divergent']}",
            )
        )
    rows += [("p50 latency (ms)", c["latency_p50_ms"]), ("duration (s)", c["duration_s"])]
    rows.append(("verdict", result.verdict().upper()))
    width = max(len(r[0]) for r in rows)
    lines += [f"{name.ljust(width)}  {value}" for name, value in rows]
    if result.verdict() == "inconclusive":
        lines.append(f"  why: {result.why_inconclusive()}")
    for sample in c["error_samples"]:
        lines.append(f"  error: {sample}")
    confirmed = result.confirmed
    if confirmed:
        lines += ["", "first findings:"]
        for f in confirmed[:10]:
            excerpt = " ".join(f.excerpt.split())[:100]
            lines.append(
                f"  {f.kind:8} {f.source_tenant} -> {f.victim_tenant} ({f.victim_request}, "
                f"{f.phase}, {f.via}): {excerpt!r}"
            )
    return "\n".join(lines) + "\n"


def probe_record(result: ProbeResult) -> dict:
    """The probe part of an evidence record."""
    counts = result.counts()
    det = result.determinism
    return {
        "parameters": {**result.params.to_json(), "model": result.model},
        "tenants": result.tenants,
        "results": {k: v for k, v in counts.items() if k != "error_samples"},
        "error_samples": counts["error_samples"],
        "determinism_divergent_requests": (det or {}).get("divergent_requests", []),
        "findings": [f.to_json() for f in result.confirmed[:MAX_RECORDED_FINDINGS]],
        "unconfirmed_findings": [f.to_json() for f in result.unconfirmed[:MAX_RECORDED_FINDINGS]],
    }
