"""A real model behind a real KV-cache fault, with crosstalk in front: does it find what
the model leaks in its own words?

llama.cpp's llama-server (built by scripts/ensure-llama-server.sh with the test-only
fault of scripts/llama_fault.py) serves Gemma 3 270M (scripts/ensure-gemma.sh). Now and
then a slot treats the previous request's cached tokens as the new prompt's prefix, so
the model writes its answer on another tenant's case; the server writes which request
got whose context. Tenants send support-desk tickets, shared questions and pasted
licence text (bench/human_text.py) through ``crosstalk run`` with the real ``openai``
SDK's completions API.

The judge owes nothing to the engine: from the workload's own record it decides which
faulted answers carry the source's identifiers (its ticket, invoice or account number,
full name, email, IBAN, street address, amount, company) or >= 5 consecutive words of
its private text that no other tenant sent, with its own tokenizer; then it reads
crosstalk's findings and the client's text.

    python bench/real_model.py                  # 480 requests, shadow, then enforce
    python bench/real_model.py --quick          # 120 requests (CI)
    python bench/real_model.py --seed 2 --requests 240 --modes shadow

Exits 1 when a target is missed (``TARGETS``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import human_text  # noqa: E402
from common import (  # noqa: E402
    HOST,
    ROOT,
    die_with_parent,
    free_port,
    stop_processes,
    stream_all,
    wait_healthy,
    wait_listening,
)  # noqa: E402
from faker import Faker  # noqa: E402

TARGETS = {
    "recall": 0.95,  # faulted answers carrying the source's identifiers or private run
    "right_source": 0.95,
    "clean_flagged": 0.001,
    "delivered": 0,  # enforce: faulted answers that reached the client with an identifier
}
MIN_RUN = 5  # consecutive private words of the source that make a verbatim leak
MAX_TOKENS = 96


# --- the judge's own reading of text ----------------------------------------------------

_WORD = re.compile(r"[\w'’]+")


def words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


def grams(text: str, n: int = MIN_RUN) -> set[tuple[str, ...]]:
    ws = words(text)
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


def holds_value(text: str, value: str) -> bool:
    """``value`` appears in ``text`` as a whole (casefolded, spaces collapsed, not inside
    a longer word or number)."""
    norm = " ".join(text.casefold().split())
    needle = " ".join(value.casefold().split())
    return re.search(rf"(?<![\w]){re.escape(needle)}(?![\w])", norm) is not None


@dataclass
class Verdict:
    values: list[str] = field(default_factory=list)  # kinds of the source's values found
    run: bool = False  # >= MIN_RUN private words of the source

    @property
    def carries(self) -> bool:
        return bool(self.values) or self.run


def judge_leak(
    output: str,
    victim: human_text.Request,
    source: human_text.Request,
    others_grams: set[tuple[str, ...]],
) -> Verdict:
    """What of ``source``'s private text ``output`` holds, excluding what the victim's
    own prompt holds and what other tenants' prompts hold (``others_grams``)."""
    verdict = Verdict()
    for kind, value in source.values.items():
        if holds_value(output, value) and not holds_value(victim.prompt, value):
            verdict.values.append(kind)
    private = grams(source.prompt) - others_grams - grams(victim.prompt)
    verdict.run = bool(grams(output) & private)
    return verdict


# --- processes --------------------------------------------------------------------------


def ensure(script: str) -> Path:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} failed:\n{done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass
class Run:
    """One pass of a workload through llama-server (faulty) and crosstalk."""

    mode: str
    requests: list[human_text.Request]
    outputs: dict[str, str]  # what the client received, by request id
    blocked: set[str]  # request ids whose stream crosstalk cut
    engine: dict[str, str]  # what the engine generated (crosstalk's capture)
    faults: list[dict]  # the server's ground truth
    findings: list[dict]  # leak.detected events
    errors: list[str]
    live: bool = True  # False: findings of a replay (``rescore``), which never blocks


def start_llama(
    tmp: Path, seed: int, rate: float, slots: int
) -> tuple[subprocess.Popen, str, Path]:
    server, model = ensure("ensure-llama-server.sh"), ensure("ensure-gemma.sh")
    port = free_port()
    fault_log = tmp / "faults.jsonl"
    env = {**os.environ, "CROSSTALK_FAULT_RATE": str(rate), "CROSSTALK_FAULT_SEED": str(seed),
           "CROSSTALK_FAULT_LOG": str(fault_log)}  # fmt: skip
    cmd = [str(server), "-m", str(model), "-c", str(2048 * slots), "-np", str(slots),
           "--cache-ram", "0", "-t", "2", "--alias", "gemma", "--host", HOST, "--port", str(port)]  # fmt: skip
    log = (tmp / "llama-server.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, preexec_fn=die_with_parent)
    url = f"http://{HOST}:{port}"
    wait_healthy(url, proc, "llama-server")
    return proc, url, fault_log


def start_crosstalk(tmp: Path, upstream: str, mode: str, tenants: list[human_text.Tenant],
                    extra_config: str = "") -> tuple[subprocess.Popen, str, Path, Path]:  # fmt: skip
    cfg = tmp / f"crosstalk-{mode}.toml"
    keys = "\n".join(f'"{t.key}" = "{t.name}"' for t in tenants)
    cfg.write_text(
        f'[proxy]\nmode = "{mode}"\n{extra_config}\n'
        f'[tenants]\nsources = ["api_key"]\n[tenants.api_keys]\n{keys}\n'
    )
    port = free_port()
    log, flows = tmp / f"events-{mode}.jsonl", tmp / f"flows-{mode}.mitm"
    cmd = [sys.executable, "-m", "proxy", "run", "--listen-port", str(port), "--upstream",
           upstream, "--config", str(cfg), "--log-file", str(log), "--capture", str(flows)]  # fmt: skip
    err = (tmp / f"crosstalk-{mode}.stderr").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=err, stderr=err, preexec_fn=die_with_parent)
    wait_listening(port, proc, "crosstalk", 120)
    return proc, f"http://{HOST}:{port}", log, flows


def send_all(base: str, requests: list[human_text.Request], keys: dict[str, str], seed: int,
             concurrency: int, tagged: bool = True) -> tuple[dict[str, str], set[str], list[str]]:  # fmt: skip
    """``requests`` as completions streams to Gemma through the proxy
    (``common.stream_all``)."""

    def open_stream(client, i: int, r: human_text.Request):
        shared = r.kind != "ticket"  # the same question at temperature 0: the same answer
        stream = client.completions.create(
            model="gemma", prompt=r.prompt, max_tokens=MAX_TOKENS, stream=True,
            temperature=0.0 if shared else 0.8, top_p=0.95, seed=seed * 100_000 + i,
            # Untagged requests (the warm-up) are never faulted nor sources.
            extra_body={"crosstalk_tag": r.request_id} if tagged else {},
            extra_headers={"X-Request-ID": r.request_id},
        )  # fmt: skip
        return (chunk.choices[0].text or "" for chunk in stream if chunk.choices)

    return stream_all(base, keys, requests, open_stream, concurrency=concurrency, timeout=300)


def engine_texts(flows: Path) -> dict[str, str]:
    """Choice 0's text as the engine streamed it, from crosstalk's capture."""
    from mitmproxy import http
    from mitmproxy.io import FlowReader

    out = {}
    with flows.open("rb") as f:
        for fl in FlowReader(f).stream():
            if not isinstance(fl, http.HTTPFlow) or fl.response is None:
                continue
            rid = fl.request.headers.get("x-request-id", "")
            parts = []
            for line in (fl.response.raw_content or b"").decode("utf-8", "replace").splitlines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    try:
                        obj = json.loads(line[5:])
                    except ValueError:
                        continue
                    for choice in obj.get("choices") or ():
                        if choice.get("index", 0) == 0:
                            parts.append(choice.get("text") or "")
            out[rid] = "".join(parts)
    return out


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_once(tmp: Path, mode: str, requests, tenants, seed: int, rate: float, slots: int,
             concurrency: int, extra_config: str = "", warm: int = 0) -> Run:  # fmt: skip
    """``requests`` through a fresh llama-server and crosstalk; with ``warm``, that many
    clean requests of another seed go first (crosstalk learns what is common)."""
    tmp.mkdir(parents=True, exist_ok=True)
    llama, url, fault_log = start_llama(tmp, seed, rate, slots)
    procs = [llama]
    try:
        proxy, base, log, flows = start_crosstalk(tmp, url, mode, tenants, extra_config)
        procs.append(proxy)
        keys = {t.name: t.key for t in tenants}
        if warm:
            warmup = human_text.make_workload(warm, tenants, seed + 1000, prefix="warm")
            send_all(base, warmup, keys, seed + 1000, concurrency, tagged=False)
        outputs, blocked, errors = send_all(base, requests, keys, seed, concurrency)
    finally:
        stop_processes(procs, timeout=30)
    # What the clients received, kept beside the capture for a later look.
    (tmp / f"client-{mode}.json").write_text(
        json.dumps({"outputs": outputs, "blocked": sorted(blocked)})
    )
    events = read_jsonl(log)
    findings = [e for e in events if e.get("event") == "leak.detected"]
    blocked |= {e["request_id"] for e in findings if e.get("action") == "blocked"}
    return Run(mode, requests, outputs, blocked, engine_texts(flows), read_jsonl(fault_log),
               findings, errors)  # fmt: skip


def rescore(tmp: Path, mode: str, requests, detection: str = "") -> Run:
    """A kept run (``--dir``) judged again with today's engine: its capture replayed by
    ``crosstalk replay`` (the same tenants, the same time order), for trying a detection
    change without the model; ``detection`` adds lines to the ``[detection]`` section
    (``case_identifiers = false`` replays as the engine did before them). Only shadow
    findings: a replay never blocks."""
    events = tmp / f"replay-{mode}.jsonl"
    events.unlink(missing_ok=True)
    flows = tmp / f"flows-{mode}.mitm"
    config = tmp / f"replay-{mode}.toml"
    config.write_text(f"{(tmp / f'crosstalk-{mode}.toml').read_text()}\n[detection]\n{detection}\n")
    cmd = [sys.executable, "-m", "proxy", "replay", str(flows), "--config",
           str(config), "--log-file", str(events), "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: findings
        raise SystemExit(f"replay failed ({done.returncode}): {done.stderr[-1500:]}")
    engine = engine_texts(flows)
    findings = [e for e in read_jsonl(events) if e.get("event") == "leak.detected"]
    return Run(mode, requests, dict(engine), set(), engine, read_jsonl(tmp / "faults.jsonl"),
               findings, [], live=False)  # fmt: skip


def masked_example(run: Run, victim_id: str, width: int = 90) -> str:
    """What a faulted answer carried of its source, the source's values masked by kind:
    the victim's question, then the answer's words around the first value."""
    by_id = {r.request_id: r for r in run.requests}
    fault = next(f for f in run.faults if f["victim"] == victim_id)
    victim, source = by_id[victim_id], by_id[fault["source"]]
    text = " ".join(run.engine.get(victim_id, "").split())
    for kind, value in sorted(source.values.items(), key=lambda kv: -len(kv[1])):
        if holds_value(text, value):
            text = re.sub(re.escape(" ".join(value.split())), f"<{kind}>", text, flags=re.I)
    first = text.find("<")
    asked = victim.prompt.split("\n")[3 if victim.kind == "ticket" else 0]
    for kind, value in victim.values.items():
        asked = asked.replace(value, f"<own {kind}>")
    asked = asked[:60]
    start = max(0, first - width // 3) if first >= 0 else 0
    return f"asked {asked!r}; answer: ...{text[start : start + width]}..."


# --- scoring ----------------------------------------------------------------------------


@dataclass
class Score:
    mode: str
    live: bool = True
    answers: int = 0
    faulted: int = 0
    same_tenant: int = 0  # faults whose source was the victim's own tenant: no leak
    carrying: int = 0
    found: int = 0
    right_source: int = 0
    paraphrase: int = 0
    paraphrase_flagged: int = 0
    clean: int = 0
    clean_flagged: int = 0
    delivered: int = 0  # enforce: faulted answers whose client text held an identifier
    delivered_ids: list[str] = field(default_factory=list)
    missed: list[tuple[str, list[str], bool]] = field(default_factory=list)
    flagged_clean: list[str] = field(default_factory=list)


def score(run: Run) -> Score:
    by_id = {r.request_id: r for r in run.requests}
    s = Score(run.mode, run.live)
    faults = {}
    for f in run.faults:
        if f.get("n_stale", 0) > 0 and f["victim"] in by_id and f["source"] in by_id:
            faults.setdefault(f["victim"], f)  # the first fault of a request decides
    flagged: dict[str, list[dict]] = {}
    for e in run.findings:
        flagged.setdefault(e["request_id"], []).append(e)
    # 5-grams each tenant's prompts hold: text several tenants send is nobody's.
    tenant_grams: dict[str, set] = {}
    for r in run.requests:
        tenant_grams.setdefault(r.tenant, set()).update(grams(r.prompt))
    for r in run.requests:
        if r.request_id not in run.engine:
            continue  # never answered (an error): nothing to judge
        s.answers += 1
        output = run.engine[r.request_id]
        fault = faults.get(r.request_id)
        hits = flagged.get(r.request_id, [])
        if fault is None:
            s.clean += 1
            if hits:
                s.clean_flagged += 1
                s.flagged_clean.append(r.request_id)
            continue
        source = by_id[fault["source"]]
        s.faulted += 1
        if source.tenant == r.tenant:
            s.same_tenant += 1
            continue
        others = set().union(*(g for t, g in tenant_grams.items() if t != source.tenant))
        verdict = judge_leak(output, r, source, others)
        if verdict.carries:
            s.carrying += 1
            if hits:
                s.found += 1
                if any(e.get("source_tenant") == source.tenant for e in hits):
                    s.right_source += 1
            else:
                s.missed.append((r.request_id, verdict.values, verdict.run))
            client = run.outputs.get(r.request_id, "")
            if any(holds_value(client, source.values[k]) for k in verdict.values):
                s.delivered += 1
                s.delivered_ids.append(r.request_id)
        else:
            s.paraphrase += 1
            s.paraphrase_flagged += bool(hits)
    return s


# --- a candidate signal for paraphrased faults, measured here before it blocks anything ---

RELEVANCE_WINDOW = 40  # earlier requests an answer is compared with
_STOP = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "been", "but", "by", "can", "could", "do",
    "does", "for", "from", "has", "have", "he", "her", "his", "i", "if", "in", "into", "is",
    "it", "its", "me", "my", "no", "not", "of", "on", "or", "our", "she", "so", "that", "the",
    "their", "them", "there", "they", "this", "to", "was", "we", "were", "what", "when",
    "which", "who", "will", "with", "would", "you", "your",
))  # fmt: skip


def content_words(text: str) -> set[str]:
    return {w for w in words(text) if w not in _STOP and not w.isdigit() and len(w) > 2}


def relevance_probe(run: Run, ratios=(1.5, 2.0, 3.0)) -> list[str]:
    """Lexical relevance, no model: an answer whose content words match one other
    tenant's recent prompt far better than its own prompt (sum of the shared words'
    idf). Rows of what it would flag among paraphrased faults and clean answers."""
    import math

    prompts = [(r, content_words(r.prompt)) for r in run.requests]
    df = Counter(w for _, ws in prompts for w in ws)
    idf = {w: math.log(len(prompts) / n) for w, n in df.items()}
    by_id = {r.request_id: r for r in run.requests}
    faults = {f["victim"]: f for f in run.faults if f.get("n_stale", 0) > 0}
    best: dict[str, float] = {}
    for i, (r, own_words) in enumerate(prompts):
        answer = content_words(run.engine.get(r.request_id, ""))
        own = sum(idf[w] for w in answer & own_words)
        foreign = max(
            (sum(idf[w] for w in answer & ws) for q, ws in prompts[max(0, i - RELEVANCE_WINDOW) : i]
             if q.tenant != r.tenant),
            default=0.0,
        )  # fmt: skip
        best[r.request_id] = foreign / max(own, 1.0)
    rows = []
    for threshold in ratios:
        para = [rid for rid, f in faults.items() if by_id[f["source"]].tenant != by_id[rid].tenant]
        clean = [r.request_id for r in run.requests if r.request_id not in faults]
        hit_p = sum(best.get(rid, 0) >= threshold for rid in para)
        hit_c = sum(best.get(rid, 0) >= threshold for rid in clean)
        rows.append(f"| relevance ratio >= {threshold} | cross-tenant faults {hit_p}/{len(para)} | "
                    f"clean {hit_c}/{len(clean)} |")  # fmt: skip
    return rows


def ratio(a: int, b: int) -> float:
    return a / b if b else float("nan")


def report(s: Score) -> list[str]:
    """The table's rows, and a list of missed targets."""
    misses = []
    recall, right = ratio(s.found, s.carrying), ratio(s.right_source, s.found)
    clean = ratio(s.clean_flagged, s.clean)
    print(f"\n## {s.mode}: {s.answers} answers, {s.faulted} faulted "
          f"({s.same_tenant} from the same tenant, not leaks)")  # fmt: skip
    print("| row | value | target |\n|---|---:|---:|")
    print(f"| faulted answers carrying the source's identifiers or a {MIN_RUN}-word private run "
          f"| {s.carrying} | |")  # fmt: skip
    print(f"| recall of those | {s.found}/{s.carrying} = {recall:.2f} | >= {TARGETS['recall']} |")
    print(
        f"| right source | {s.right_source}/{s.found} = {right:.2f} | >= {TARGETS['right_source']} |"
    )
    print(
        f"| faulted, nothing verbatim: flagged | {s.paraphrase_flagged}/{s.paraphrase} | (no floor) |"
    )
    print(
        f"| clean answers flagged | {s.clean_flagged}/{s.clean} = {clean:.4f} | <= {TARGETS['clean_flagged']} |"
    )
    if s.mode == "enforce" and not s.live:
        print(
            "| faulted answers that delivered an identifier | not judged: a replay never blocks | |"
        )
    elif s.mode == "enforce":
        print(
            f"| faulted answers that delivered an identifier | {s.delivered} | {TARGETS['delivered']} |"
        )
        if s.delivered > TARGETS["delivered"]:
            misses.append("delivered")
    if s.carrying and recall < TARGETS["recall"]:
        misses.append("recall")
    if s.found and right < TARGETS["right_source"]:
        misses.append("right_source")
    if s.clean and clean > TARGETS["clean_flagged"]:
        misses.append("clean_flagged")
    for rid, kinds, run in s.missed[:12]:
        print(f"  missed {rid}: values {kinds or '-'}, private run {run}")
    for rid in s.flagged_clean[:12]:
        print(f"  clean flagged {rid}")
    return misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=480)
    ap.add_argument("--quick", action="store_true", help="120 requests")
    ap.add_argument(
        "--seed", type=int, default=2, help="workload and fault seed (1 tunes, 2+ report)"
    )
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--fault-rate", type=float, default=0.3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--modes", default="shadow,enforce")
    ap.add_argument("--warm", type=int, default=0, help="clean requests sent first (warm engine)")
    ap.add_argument("--dir", type=Path, default=None, help="keep logs here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the scores here")
    ap.add_argument(
        "--rescore", action="store_true", help="judge a kept --dir again by replaying its capture"
    )
    ap.add_argument(
        "--before",
        action="store_true",
        help="with --rescore: also replay without case identifiers, list what they add",
    )
    args = ap.parse_args(argv)
    n = 120 if args.quick else args.requests
    import tempfile

    base = args.dir or Path(tempfile.mkdtemp(prefix="crosstalk-real-model-"))
    fake = Faker()
    fake.seed_instance(args.seed)
    tenants = human_text.make_tenants(args.tenants, fake)
    requests = human_text.make_workload(n, tenants, args.seed)
    if args.rescore:
        print(f"# real model, kept run replayed: {n} requests, seed {args.seed}; logs in {base}")
    else:
        print(f"# real model: {n} requests, {args.tenants} tenants, seed {args.seed}, "
              f"fault rate {args.fault_rate}, {args.slots} slots; logs in {base}")  # fmt: skip
    misses, scores = [], {}
    for mode in args.modes.split(","):
        t0 = time.monotonic()
        if args.rescore:
            run = rescore(base / mode, mode, requests)
            if args.before:
                before = score(rescore(base / mode, mode, requests, "case_identifiers = false"))
                print(f"\n## before case identifiers ({mode}, replayed)")
                report(before)
                newly = {rid for rid, _, _ in before.missed} - {
                    rid for rid, _, _ in score(run).missed
                }
                print(f"  found now, missed before: {len(newly)}")
                for rid in sorted(newly):
                    print(f"  - {rid}: {masked_example(run, rid)}")
        else:
            run = run_once(base / mode, mode, requests, tenants, args.seed, args.fault_rate,
                           args.slots, args.concurrency, warm=args.warm)  # fmt: skip
        s = score(run)
        scores[mode] = {k: v for k, v in vars(s).items()}
        misses += [f"{mode}:{m}" for m in report(s)]
        print(
            "\ncandidate signal (not in the engine): lexical relevance to another tenant's prompt"
        )
        print("| rule | faulted answers it flags | clean answers it flags |\n|---|---:|---:|")
        print("\n".join(relevance_probe(run)))
        kinds = Counter(k for f in run.findings for k in [f.get("kind")])
        print(f"  findings by kind {dict(kinds)}; client errors {len(run.errors)}; "
              f"{time.monotonic() - t0:.0f} s")  # fmt: skip
        if run.errors:
            misses.append(f"{mode}:client_errors")
    if args.json:
        args.json.write_text(json.dumps(scores, indent=1))
    if misses:
        print(f"\nMISSED: {', '.join(misses)}")
        return 1
    print("\nall targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
