"""Human-written private text leaked by a faulty engine: does crosstalk find it?

Tenants send what people send: support-desk tickets (``human_text.TICKETS``), messages
about their own lives in plain words (``human_text.PERSONAL``, each tenant its own
sentences), a shared code snippet with their own line after it, the same general
questions as everyone, and public licence text (paragraphs of the licences crosstalk
ships in its baseline, from Debian's common-licenses). They go through ``crosstalk run``
with the real ``openai`` SDK (chat and completions) to the simulator, which now and then
splices a page of another tenant's prompt or answer into an answer, another tenant's
identifiers, or a whole misrouted answer, and writes what it did to its truth file.

The judge owes nothing to the engine. A fault is a *target* when its inserted text holds
one of the source request's identifiers (``Request.values``) that the victim's own prompt
does not, or 8 consecutive words (its own tokenizer, casefolded) of the source's prompt,
none of them inside a run of 8 that another tenant's prompt holds too. A page of a prompt that pasted public text is a
*recitation*: never a leak (besides the workload's own, the simulator's test hooks make
one more answer recite 32 words of each paste, ``recitations``). Other faults (a page of an answer to a shared question, a
few words) are reported as their own row. Answers the simulator did not touch are
*clean*.

    python bench/human_leaks.py                      # 800 requests, fresh and warm, shadow
    python bench/human_leaks.py --quick              # 240 requests, fresh, shadow (CI)
    python bench/human_leaks.py --modes shadow,enforce --seed 3

Parameters are chosen on seed 1; the reported seeds are 2 and up. Exits 1 when a target
is missed (``TARGETS``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import human_text  # noqa: E402
import real_model  # noqa: E402
from common import (  # noqa: E402
    HOST,
    ROOT,
    die_with_parent,
    free_port,
    stop_processes,
    stream_all,
    wait_listening,
)
from faker import Faker  # noqa: E402
from real_model import grams, holds_value, read_jsonl, start_crosstalk, words  # noqa: E402

TARGETS = {
    "recall": 0.97,  # target leaks with a finding on the victim's answer
    "right_source": 0.97,
    "clean_flagged": 0.001,
    "recitations_flagged": 0,
    "delivered": 0,  # enforce: found target leaks whose private words reached the client
}
PRIVATE_RUN = 8  # consecutive words of the source's own text that make a leak a target
LEAK_RATE = 0.1
FAULT_KINDS = "prompt_page,output_page,entities,misroute"
#: Licences of the shipped baseline whose paragraphs tenants paste (public text).
LICENCES = ("licence-Apache-2.0.txt", "licence-GPL-3.txt", "licence-BSD.txt")
PERSONAL_KINDS = ("full_name", "amount", "account", "street", "employer")


# --- the workload -----------------------------------------------------------------------


@dataclass
class Message(human_text.Request):
    system: str = ""  # chat requests: the tenant's system prompt (shared by its requests)
    chat: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # to the simulator


#: Pasted licence paragraphs recited at the end of a run, each into one more answer.
RECITATIONS = 24
RECITED_WORDS = 32


def recitations(
    judged: list[Message], tenants: list[human_text.Tenant], seed: int
) -> list[Message]:
    """One more request per pasted licence paragraph (up to ``RECITATIONS``), from
    another tenant, whose answer the simulator makes recite ``RECITED_WORDS`` words of
    that paste (its test hooks): public text every model has read, never a leak."""
    rng = random.Random(seed + 7)
    # Pastes the simulator still holds: it remembers its last 256 exchanges.
    pastes = [r for r in judged[-200:] if r.kind == "public"][:RECITATIONS]
    out = []
    for i, paste in enumerate(pastes):
        tenant = rng.choice([t for t in tenants if t.name != paste.tenant])
        q = rng.choice(human_text.QUESTIONS)
        headers = {"x-sim-fault": "prompt_page", "x-sim-fault-source": paste.request_id,
                   "x-sim-fault-words": str(RECITED_WORDS)}  # fmt: skip
        out.append(
            Message(
                f"recite-{seed}-{i:03d}", tenant.name, "question", f"Q: {q}\nA:", headers=headers
            )
        )
    return out


def licence_paragraphs() -> list[str]:
    root = ROOT / "proxy" / "defaults" / "baseline"
    out = []
    for name in LICENCES:
        text = (root / name).read_text(encoding="utf-8")
        out += [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 30]
    return out


def make_workload(
    n: int, tenants: list[human_text.Tenant], seed: int, prefix: str
) -> list[Message]:
    """``n`` requests: 35% tickets, 35% personal messages, 7% a shared snippet and a
    private line, 15% shared questions, 8% pasted licence paragraphs."""
    rng = random.Random(seed)
    fake = Faker(["en_US", "en_GB"])
    fake.seed_instance(seed)
    pool = human_text.personal_pool(tenants)
    licences = licence_paragraphs()
    by_name = {t.name: t for t in tenants}
    out: list[Message] = []
    for i in range(n):
        tenant = by_name[rng.choice(tenants).name]
        rid = f"{prefix}-{seed}-{i:05d}"
        roll = rng.random()
        if roll < 0.35:
            t = human_text.ticket(fake, rng, tenant, rid)
            out.append(Message(rid, tenant.name, "ticket", t.prompt, t.values))
        elif roll < 0.77:
            v = human_text.ticket_values(fake, rng, tenant)
            v["name"] = v["relative"]
            own = rng.sample(pool[tenant.name], k=3)
            text = " ".join(s.format(**v) for s in own)
            if roll >= 0.70:  # a shared snippet, then the person's own line
                text = f"{rng.choice(human_text.CODE_SNIPPETS)}\n{text.split('. ')[0]}."
            values = {k: v[k if k != "full_name" else "name"] for k in PERSONAL_KINDS}
            values = {k: s for k, s in values.items() if s in text}
            system = f"You are the assistant of {tenant.company}. Answer kindly and briefly."
            out.append(Message(rid, tenant.name, "personal", text, values, system, True))
        elif roll < 0.92:
            q = rng.choice(human_text.QUESTIONS)
            out.append(Message(rid, tenant.name, "question", f"Q: {q}\nA:"))
        else:
            text = rng.choice(licences)
            prompt = f"Explain in plain words what this licence text says:\n\n{text}\n\nAnswer:"
            out.append(Message(rid, tenant.name, "public", prompt))
    return out


# --- the run ----------------------------------------------------------------------------


def start_sim(tmp: Path, seed: int) -> tuple[subprocess.Popen, str, Path]:
    port, truth = free_port(), tmp / "truth.jsonl"
    cmd = [sys.executable, "-m", "proxy.sim.server", "--host", HOST, "--port", str(port),
           "--leak-rate", str(LEAK_RATE), "--truth", str(truth), "--seed", str(seed),
           "--fault-kinds", FAULT_KINDS, "--split-words"]  # fmt: skip
    log = (tmp / "sim.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, preexec_fn=die_with_parent)
    wait_listening(port, proc, "simulator", 60)
    return proc, f"http://{HOST}:{port}", truth


def send_all(base: str, requests: list[Message], keys: dict[str, str], concurrency: int = 8):
    """Every request through the proxy, streamed, chat or completions
    (``common.stream_all``)."""

    def open_stream(client, _: int, r: Message):
        headers = {"X-Request-ID": r.request_id, **r.headers}
        if r.chat:
            messages = [{"role": "system", "content": r.system}, {"role": "user", "content": r.prompt}]  # fmt: skip
            chat = client.chat.completions.create(
                model="sim", messages=messages, stream=True, extra_headers=headers
            )
            return (c.choices[0].delta.content or "" for c in chat if c.choices)
        stream = client.completions.create(
            model="sim", prompt=r.prompt, stream=True, extra_headers=headers
        )
        return (c.choices[0].text or "" for c in stream if c.choices)

    return stream_all(base, keys, requests, open_stream, concurrency=concurrency, timeout=120)


@dataclass
class Run:
    mode: str
    warm: int
    requests: list[Message]  # the judged ones
    everything: dict[str, Message]  # warm-up and judged, by id (sources may be either)
    outputs: dict[str, str]
    faults: list[dict]
    findings: list[dict]
    errors: list[str]
    live: bool = True  # False: findings of a replay (``--rescore``), which never blocks


def run_once(tmp: Path, mode: str, tenants, seed: int, n: int, warm: int) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    sim, url, _ = start_sim(tmp, seed)
    procs = [sim]
    judged = make_workload(n, tenants, seed, "hl")
    warmup = make_workload(warm, tenants, seed + 1000, "warm") if warm else []
    keys = {t.name: t.key for t in tenants}
    try:
        proxy, base, log, _ = start_crosstalk(tmp, url, mode, tenants)
        procs.append(proxy)
        if warmup:
            send_all(base, warmup, keys)
        outputs, _, errors = send_all(base, judged, keys)
        recited, _, more_errors = send_all(base, recitations(judged, tenants, seed), keys)
        outputs.update(recited)
        errors += more_errors
    finally:
        stop_processes(procs, timeout=30)
    (tmp / "client.json").write_text(json.dumps({"outputs": outputs, "errors": errors}))
    return load_run(tmp, mode, tenants, seed, n, warm)


def load_run(tmp: Path, mode: str, tenants, seed: int, n: int, warm: int,
             replay: bool = False, detection: str = "") -> Run:  # fmt: skip
    """A run's record from its directory; with ``replay``, its findings are today's
    engine's over the run's capture (``crosstalk replay``; ``detection``: lines added to
    its ``[detection]`` section), for trying a change."""
    judged = make_workload(n, tenants, seed, "hl")
    judged += recitations(judged, tenants, seed)
    warmup = make_workload(warm, tenants, seed + 1000, "warm") if warm else []
    client = json.loads((tmp / "client.json").read_text())
    if replay:
        findings = real_model.rescore(tmp, mode, [], detection).findings
    else:
        events = read_jsonl(tmp / f"events-{mode}.jsonl")
        findings = [e for e in events if e.get("event") == "leak.detected"]
    every = {r.request_id: r for r in [*warmup, *judged]}
    faults = read_jsonl(tmp / "truth.jsonl")
    return Run(mode, warm, judged, every, client["outputs"], faults, findings, client["errors"],
               live=not replay)  # fmt: skip


# --- the judge --------------------------------------------------------------------------


@dataclass
class Score:
    targets: list[str] = field(default_factory=list)
    found: list[str] = field(default_factory=list)
    right_source: list[str] = field(default_factory=list)
    missed: list[tuple[str, str, str]] = field(default_factory=list)  # id, kind, why
    recitations: int = 0
    recitations_flagged: list[str] = field(default_factory=list)
    other_faults: int = 0
    other_flagged: int = 0
    clean: int = 0
    clean_flagged: list[str] = field(default_factory=list)
    delivered: list[str] = field(default_factory=list)


def evidence(leaked: str, known: str, source: Message, private: set) -> list[str]:
    """What of ``source``'s own text ``leaked`` holds: its identifiers that the victim's
    tenant has not written itself (``known``: its prompts so far; "Roberts and Sons" in
    an answer tells a tenant nothing when it wrote "my boss at Roberts and Sons"), and
    its private runs of ``PRIVATE_RUN`` words."""
    values = [v for v in source.values.values() if holds_value(leaked, v)]
    values = [v for v in values if not holds_value(known, v)]
    runs = [" ".join(g) for g in grams(leaked, PRIVATE_RUN) & private]
    return values + runs


def private_runs(sent: list[tuple[str, str]]) -> dict[str, set[tuple[str, ...]]]:
    """Each tenant's runs of ``PRIVATE_RUN`` words that are its own: no word of the run
    lies in a run that another tenant sent too. A shared code block followed by "I have"
    is a run no other tenant sent, but it tells nobody anything: only the words after
    the shared text are the tenant's."""
    holders: dict[tuple[str, ...], set[str]] = {}
    for tenant, text in sent:
        for g in grams(text, PRIVATE_RUN):
            holders.setdefault(g, set()).add(tenant)
    own: dict[str, set[tuple[str, ...]]] = {}
    for tenant, text in sent:
        ws = words(text)
        shared = [False] * len(ws)
        for i in range(len(ws) - PRIVATE_RUN + 1):
            if len(holders[tuple(ws[i : i + PRIVATE_RUN])]) > 1:
                shared[i : i + PRIVATE_RUN] = [True] * PRIVATE_RUN
        for i in range(len(ws) - PRIVATE_RUN + 1):
            if not any(shared[i : i + PRIVATE_RUN]):
                own.setdefault(tenant, set()).add(tuple(ws[i : i + PRIVATE_RUN]))
    return own


def score(run: Run) -> Score:
    s = Score()
    judged = {r.request_id for r in run.requests}
    own = private_runs([(r.tenant, f"{r.system}\n{r.prompt}") for r in run.everything.values()])
    # What each tenant wrote up to each of its requests (the record's order: warm-up,
    # then judged as sent).
    written: dict[str, list[str]] = {}
    upto: dict[str, int] = {}
    for r in run.everything.values():
        written.setdefault(r.tenant, []).append(r.prompt)
        upto[r.request_id] = len(written[r.tenant])

    def known(rid: str) -> str:
        return "\n".join(written[run.everything[rid].tenant][: upto[rid]])

    flagged: dict[str, list[dict]] = {}
    for e in run.findings:
        flagged.setdefault(e["request_id"], []).append(e)
    faulted = set()
    for f in run.faults:
        rid = f["request_id"]
        if rid not in judged or rid in faulted:
            continue
        faulted.add(rid)
        victim, source = run.everything[rid], run.everything.get(f["source_request_id"] or "")
        if source is None or source.tenant == victim.tenant:
            continue
        if source.kind == "public" and f["kind"] == "prompt_page":
            s.recitations += 1
            if rid in flagged:
                s.recitations_flagged.append(rid)
            continue
        private = own.get(source.tenant, set()) - grams(victim.prompt, PRIVATE_RUN)
        victim_knows = known(rid)
        found = evidence(f["leaked_text"], victim_knows, source, private)
        if not found:
            s.other_faults += 1
            s.other_flagged += rid in flagged
            continue
        s.targets.append(rid)
        if rid in flagged:
            s.found.append(rid)
            if any(e.get("source_tenant") == source.tenant for e in flagged[rid]):
                s.right_source.append(rid)
            if run.mode == "enforce" and evidence(
                run.outputs.get(rid, ""), victim_knows, source, private
            ):
                s.delivered.append(rid)
        else:
            s.missed.append((rid, f["kind"], found[0][:60]))
    for rid in judged - faulted:
        s.clean += 1
        if rid in flagged:
            s.clean_flagged.append(rid)
    return s


def ratio(a: int, b: int) -> str:
    return f"{a}/{b} = {a / b:.4f}" if b else f"{a}/0"


def report(label: str, run: Run, s: Score) -> list[str]:
    print(f"\n## {label}: {len(run.requests)} judged requests, {run.warm} warm-up first")
    print("| row | value | target |\n|---|---:|---:|")
    rows = [
        ("recall", len(s.found), len(s.targets), ">="),
        ("right_source", len(s.right_source), len(s.found), ">="),
        ("clean_flagged", len(s.clean_flagged), s.clean, "<="),
        ("recitations_flagged", len(s.recitations_flagged), s.recitations, "<="),
    ]
    if run.mode == "enforce" and run.live:
        rows.append(("delivered", len(s.delivered), len(s.found), "<="))
    elif run.mode == "enforce":
        print("| delivered | not judged: a replay never blocks | |")
    misses = []
    for name, a, b, op in rows:
        target = TARGETS[name]
        value = a / b if b and name in ("recall", "right_source", "clean_flagged") else a
        ok = value >= target if op == ">=" else value <= target
        print(f"| {name} | {ratio(a, b)} | {op} {target} |")
        if not ok:
            misses.append(f"{label}:{name}")
    print(f"| other faults (nothing private) flagged | {s.other_flagged}/{s.other_faults} | |")
    for rid, kind, why in s.missed[:20]:
        print(f"  missed {rid} ({kind}): {len(why)} chars of evidence")
    for rid in s.clean_flagged[:12]:
        print(f"  clean flagged {rid}")
    if run.errors:
        print(f"  client errors: {len(run.errors)}, first: {run.errors[0]}")
        misses.append(f"{label}:client_errors")
    return misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--quick", action="store_true", help="240 requests, fresh only")
    ap.add_argument("--seed", type=int, default=2, help="1 tunes; 2+ report")
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--warm", type=int, default=1500, help="clean-run requests before the judged")
    ap.add_argument("--modes", default="shadow")
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rescore", action="store_true",
                    help="judge a kept --dir again, its capture replayed by today's engine")  # fmt: skip
    ap.add_argument("--detection", default="", help="with --rescore: [detection] lines to add")
    args = ap.parse_args(argv)
    n = 240 if args.quick else args.requests
    base = args.dir or Path(tempfile.mkdtemp(prefix="crosstalk-human-leaks-"))
    fake = Faker()
    fake.seed_instance(args.seed)
    tenants = human_text.make_tenants(args.tenants, fake)
    print(f"# human-written leaks: {n} requests, {args.tenants} tenants, seed {args.seed}, "
          f"leak rate {LEAK_RATE}; logs in {base}")  # fmt: skip
    misses, scores = [], {}
    for mode in args.modes.split(","):
        for warm in (0,) if args.quick else (0, args.warm):
            label = f"{mode}, {'warm' if warm else 'fresh'}"
            tmp = base / f"{mode}-{warm}"
            if args.rescore:
                run = load_run(tmp, mode, tenants, args.seed, n, warm, True, args.detection)
            else:
                run = run_once(tmp, mode, tenants, args.seed, n, warm)
            s = score(run)
            scores[label] = {k: v if isinstance(v, int) else len(v) for k, v in vars(s).items()}
            misses += report(label, run, s)
    if args.json:
        args.json.write_text(json.dumps(scores, indent=1))
    if misses:
        print(f"\nMISSED: {', '.join(misses)}")
        return 1
    print("\nall targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
