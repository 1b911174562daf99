"""Detection quality benchmark: the simulator's workload and fault injection, through
the engine, with the clean-but-shared cases mixed in at realistic rates.

Traffic: ``proxy.sim.workload.Workload`` (shared system prompts in most requests,
public documents pasted by several tenants, popular questions asked verbatim by several
tenants, code, CJK tenants, entities, multi-turn, same-tenant repeats). Responses:
``proxy.sim.answers.answer_for``, corrupted by ``proxy.sim.faults.FaultInjector``.
Requests run in concurrent batches: every prompt of a batch is observed first, then the
responses stream round-robin in small deltas cut at random (mid-word included).

What counts as private, independent of the detector: a leaked unit is *private* when it
sits in a 4-unit shingle that no tenant other than the source ever used anywhere in the
whole benchmark, the earlier traffic a warm engine learned from included (an oracle
with full hindsight). A fault's size is its longest run of
private units, in words (a CJK character counts half). Targets (``TARGETS``; the bench
exits 1 when one is missed): recall >= 99% on leaks with >= 8 private words, on foreign
entities and on mis-routed responses with private content, and right source >= 98%,
for a fresh engine and a warm one alike; false positives <= 0.2% of a fresh engine's
first 300 clean responses and <= 0.05% after them, and <= 0.05% for a warm engine.

    python bench/quality.py [--requests 5000] [--tenants 24] [--engine FIELD=VALUE] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from proxy.defaults import (  # noqa: E402
    load_baseline,
    load_first_names,
    load_surnames,
    load_vocabulary,
)
from proxy.engine import Engine, EngineConfig  # noqa: E402
from proxy.engine.entities import extract_entities  # noqa: E402
from proxy.sim.answers import answer_for  # noqa: E402
from proxy.sim.faults import ALL_FAULT_KINDS, FaultInjector  # noqa: E402
from proxy.sim.oracle import Observed, PrivacyOracle  # noqa: E402
from proxy.sim.workload import Workload  # noqa: E402

SIZE_BUCKETS = ((0, 4), (4, 8), (8, 16), (16, 32), (32, 10_000))

#: Targets (issue 18): a fresh engine as good as a warm one. The bench exits 1 when one
#: is missed. (label, what, limit, "min" or "max"); rates are fractions.
TARGETS = (
    ("cold start", "recall", 0.99, "min"),
    ("cold start", "right_source", 0.98, "min"),
    ("cold start", "fp_first", 0.002, "max"),  # the first --warmup clean responses
    ("cold start", "fp_after", 0.0005, "max"),
    ("warm", "recall", 0.99, "min"),
    ("warm", "right_source", 0.98, "min"),
    ("warm", "fp_all", 0.0005, "max"),
    ("public text, baseline", "recitations_flagged", 0.0005, "max"),
)


@dataclass
class Exchange:
    tenant: str
    request_id: str
    prompt: str
    answer: str
    fault: object | None
    findings: list = field(default_factory=list)
    index: int = 0
    scan: object = None


@functools.cache
def word_lists(baseline: str | None, vocabulary: str | None) -> tuple[list[str], list[str]]:
    """The baseline texts and plain words (``--baseline``, ``--vocabulary``, else the
    shipped ones), read once per run."""
    return load_baseline(baseline), load_vocabulary(vocabulary)


def new_engine(args: argparse.Namespace, config: EngineConfig) -> Engine:
    """A fresh engine with the bench's baseline and vocabulary."""
    baseline, vocabulary = word_lists(args.baseline, args.vocabulary)
    return Engine(
        config,
        baseline=baseline,
        plain_words=vocabulary,
        surnames=load_surnames(),
        first_names=load_first_names(),
    )


def model_text_of(req) -> str:
    """The earlier assistant turns of a chat request's conversation, as the proxy passes
    them (``model_text``: a model's words, judged as an output's). A completions prompt
    is one string: the proxy cannot tell the turns in it apart, and neither does this."""
    if req.endpoint != "chat":
        return ""
    return "\n".join(
        m["content"]
        for m in req.messages
        if m["role"] == "assistant" and isinstance(m.get("content"), str)
    )


def deltas(text: str, rng: random.Random) -> list[str]:
    """Cut ``text`` like an engine's stream: mostly a token or two, sometimes mid-word."""
    out, i = [], 0
    while i < len(text):
        n = rng.choice((1, 2, 3, 4, 5, 6, 8, 12))
        out.append(text[i : i + n])
        i += n
    return out


def run_traffic(
    args: argparse.Namespace, config: EngineConfig, *, seed: int, requests: int, state: Path | None
) -> tuple[list[Exchange], Engine]:
    rng = random.Random(seed)
    workload = Workload(tenants=args.tenants, seed=seed)
    injector = FaultInjector(args.leak_rate, seed=seed + 1, kinds=args.fault_kinds.split(","))
    engine = new_engine(args, config)
    if state is not None and state.exists():
        engine.load_commonness(state)
    exchanges: list[Exchange] = []
    requests = list(workload.requests(requests))
    clock = 1_000_000.0
    for b in range(0, len(requests), args.concurrency):
        batch = []
        for req in requests[b : b + args.concurrency]:
            clock += 1.0 / args.rate
            prompt = req.prompt_text()
            answer = answer_for(prompt)
            answer, fault = injector.apply(req.tenant, req.request_id, prompt, answer)
            scan = engine.observe_prompt(
                req.tenant,
                req.request_id,
                prompt,
                now=clock,
                model_text=model_text_of(req),
                turns_known=req.endpoint == "chat",  # as the proxy reads a chat's roles
            )
            ex = Exchange(req.tenant, req.request_id, prompt, answer, fault, index=len(exchanges))
            ex.scan = scan
            exchanges.append(ex)
            batch.append((ex, scan, deltas(answer, rng)))
        step = 0
        while any(step < len(d) for _, _, d in batch):
            for ex, scan, ds in batch:
                if step < len(ds):
                    ex.findings += scan.feed(ds[step], now=clock)
            step += 1
        for ex, scan, _ in batch:
            ex.findings += scan.finish(now=clock)
            injector.remember(ex.tenant, ex.request_id, ex.prompt, ex.answer)
    return exchanges, engine


def entity_private(ex: Exchange, exchanges: list[Exchange]) -> bool:
    """Whether no other tenant used the leaked entities. They are the simulator's truth,
    not what the engine extracts: an entity the engine cannot recognise must count as a
    missed leak, not drop out of the targets."""
    ents = [e.lower() for e in ex.fault.entities] or [
        e.text.lower() for e in extract_entities(ex.fault.leaked_text)
    ]
    if not ents:
        return False
    for other in exchanges:
        if other.tenant == ex.fault.source_tenant:
            continue
        low = (other.prompt + "\n" + (other.answer if other.fault is None else "")).lower()
        if any(e in low for e in ents):
            return False
    return True


def bucket(words: float) -> str:
    for lo, hi in SIZE_BUCKETS:
        if lo <= words < hi:
            return f"{lo}-{hi}" if hi < 10_000 else f">={lo}"
    return "?"


def evaluate(exchanges: list[Exchange], warmup: int, history: list[Exchange] = ()) -> dict:
    """Scores the engine on ``exchanges``. ``history``: earlier traffic the engine learned
    from (the warm state); text other tenants used there is not private either."""
    seen = [*history, *exchanges]
    oracle = PrivacyOracle(
        Observed(ex.tenant, ex.prompt, ex.answer, ex.fault.leaked_text if ex.fault else "")
        for ex in seen
    )
    rows: dict[tuple[str, str], Counter] = defaultdict(Counter)
    clean = Counter()
    fp_examples = []
    target = Counter()
    missed: list[Exchange] = []
    lags: list[float] = []
    for ex in exchanges:
        phase = "warmup" if ex.index < warmup else "steady"
        if ex.fault is None:
            clean[phase, "n"] += 1
            if ex.findings:
                clean[phase, "flagged"] += 1
                fp_examples.append(ex)
            continue
        f = ex.fault
        hit = bool(ex.findings)
        right = hit and ex.findings[0].source_tenant == f.source_tenant
        if f.kind == "degenerate":
            key = ("degenerate", "-")
        elif f.kind == "entities":
            key = ("entities", "private" if entity_private(ex, seen) else "shared")
        else:
            key = (f.kind, bucket(oracle.private_run(f.source_tenant, f.leaked_text)))
        row = rows[key]
        row["n"] += 1
        row["hit"] += hit
        row["right"] += right
        in_target = (
            key[0] in ("prompt_page", "noisy_page", "output_page", "misroute")
            and key[1] in ("8-16", "16-32", ">=32")
        ) or key == ("entities", "private")
        if in_target:
            target["n"] += 1
            target["hit"] += hit
            target["right"] += right
            if not hit:
                missed.append(ex)
            elif f.leaked_text in ex.answer and f.source_tenant:
                lags.append(
                    oracle.words_to_detection(
                        f.source_tenant, f.leaked_text, ex.answer, ex.findings[0].detected_at
                    )
                )
    return {
        "rows": rows,
        "clean": clean,
        "target": target,
        "fp_examples": fp_examples,
        "missed": missed,
        "lags": sorted(lags),
    }


def degenerate_signal(args: argparse.Namespace) -> dict:
    """The degenerate-output signal (proxy/engine/degenerate.py) on the same workload: detection
    rate on the simulator's degenerate faults, false positives on clean answers by
    content type (the simulator's prose, code and CJK answers; generated markdown
    tables; hand-written text in other scripts, bench/degenerate_corpus.py). Streamed in
    the same random deltas as the leak benchmark."""
    from degenerate_corpus import MULTILINGUAL, markdown_table

    from proxy.engine.degenerate import DegenerateDetector
    from proxy.sim.answers import is_mostly_cjk
    from proxy.sim.faults import FaultInjector as Injector

    rng = random.Random(args.seed + 7)
    injector = Injector(1.0, seed=args.seed + 8, kinds=("degenerate",))
    clean: Counter = Counter()
    flagged: Counter = Counter()
    reasons: Counter = Counter()
    examples: list[tuple[str, str, str]] = []
    calls, seconds = 0, 0.0

    def judge(text: str) -> str | None:
        nonlocal calls, seconds
        detector = DegenerateDetector()
        pieces = deltas(text, rng)
        t0 = time.perf_counter()
        for piece in pieces:
            if detector.feed(piece):
                break
        detector.finish()
        seconds += time.perf_counter() - t0
        calls += len(pieces)
        return detector.reason

    def clean_case(kind: str, text: str) -> None:
        clean[kind] += 1
        if (reason := judge(text)) is not None:
            flagged[kind] += 1
            examples.append((kind, reason, text))

    for req in Workload(tenants=args.tenants, seed=args.seed).requests(args.requests):
        prompt = req.prompt_text()
        answer = answer_for(prompt)
        kind = "cjk" if is_mostly_cjk(answer) else "code" if "```" in answer else "prose"
        clean_case(kind, answer)
        garbage, _ = injector.apply(req.tenant, req.request_id, prompt, answer)
        reasons[judge(garbage) or "missed"] += 1
    for _ in range(args.requests // 10):
        clean_case("table", markdown_table(rng))
    for _ in range(20):
        for language, text in MULTILINGUAL.items():
            clean_case(f"hand-written ({language})", text)
    faults = sum(reasons.values())
    lines = [
        "| content | clean answers | flagged | false positive rate |",
        "|---|---:|---:|---:|",
        *(
            f"| {kind} | {n} | {flagged[kind]} | {pct(flagged[kind], n)} |"
            for kind, n in clean.items()
            if not kind.startswith("hand-written")
        ),
    ]
    hand = [k for k in clean if k.startswith("hand-written")]
    n_hand, f_hand = sum(clean[k] for k in hand), sum(flagged[k] for k in hand)
    lines.append(
        f"| hand-written: {len(hand)} texts (scripts, emoji, math, trees), 20 cuts each "
        f"| {n_hand} | {f_hand} | {pct(f_hand, n_hand)} |"
    )
    lines += [
        "",
        f"- degenerate faults detected: {pct(faults - reasons['missed'], faults)} "
        f"({faults - reasons['missed']}/{faults}); by reason: "
        + ", ".join(f"{r} {n}" for r, n in reasons.most_common()),
        f"- cost: {seconds / max(calls, 1) * 1e6:.2f} us per delta ({calls} deltas)",
    ]
    print("\n### degenerate output signal (proxy/engine/degenerate.py)\n")
    print("\n".join(lines))
    for kind, reason, text in examples[: args.show_fp]:
        print(f"\nDEGENERATE FALSE POSITIVE ({kind}, {reason}): {text[:300]!r}")
    return {
        "detected": faults - reasons["missed"],
        "faults": faults,
        "reasons": dict(reasons),
        "clean": dict(clean),
        "flagged": dict(flagged),
    }


def canary_signal(args: argparse.Namespace, config: EngineConfig) -> dict:
    """Canaries (proxy/prevention.py) on the same workload and faults: every chat
    request carries its tenant's canary in the system prompt, as ``inject_canary``
    sends it upstream (the engine observes the prompt as the client sent it). Which
    injected leaks carried the source's canary, how many of those the engine reports as
    kind ``canary`` with the right source, and canary findings anywhere else."""
    import json

    from proxy.prevention import canary_for, rewrite_request
    from proxy.sim.server import chat_prompt

    secret = b"quality-bench-canary-secret-0123"
    rng = random.Random(args.seed + 11)
    injector = FaultInjector(args.leak_rate, seed=args.seed + 1, kinds=args.fault_kinds.split(","))
    engine = new_engine(args, config)
    canaries: dict[str, str] = {}
    rows: dict[str, Counter] = defaultdict(Counter)
    clean, clean_flagged, elsewhere = 0, 0, 0
    for req in Workload(tenants=args.tenants, seed=args.seed).requests(args.requests):
        prompt = req.prompt_text()
        upstream_prompt = prompt
        if req.endpoint == "chat":
            if req.tenant not in canaries:
                canaries[req.tenant] = canary_for(secret, req.tenant)
                engine.register_canary(req.tenant, canaries[req.tenant])
            body = rewrite_request(
                orjson.dumps({"messages": req.messages}), salt=None, canary=canaries[req.tenant]
            ).body
            upstream_prompt = chat_prompt(json.loads(body)["messages"])[0]
        answer = answer_for(upstream_prompt)
        answer, fault = injector.apply(req.tenant, req.request_id, upstream_prompt, answer)
        scan = engine.observe_prompt(req.tenant, req.request_id, prompt)
        findings = [f for d in deltas(answer, rng) for f in scan.feed(d)] + scan.finish()
        injector.remember(req.tenant, req.request_id, upstream_prompt, answer)
        found = [f for f in findings if f.kind == "canary"]
        if fault is None:
            clean += 1
            clean_flagged += bool(found)
            continue
        source_canary = canaries.get(fault.source_tenant or "", "\0")
        row = rows[fault.kind]
        row["n"] += 1
        if source_canary.lower() in fault.leaked_text.lower():
            row["carried"] += 1
            row["found"] += any(f.source_tenant == fault.source_tenant for f in found)
        else:
            elsewhere += bool(found)
    lines = [
        "| leak kind | leaks | carried the source's canary | found as canary, right source |",
        "|---|---:|---:|---:|",
        *(
            f"| {kind} | {r['n']} | {r['carried']} | {r['found']} ({pct(r['found'], r['carried'])}) |"
            for kind, r in sorted(rows.items())
        ),
        "",
        f"- canary findings on clean answers: {clean_flagged}/{clean}; on leaks that did not "
        f"carry the source's canary: {elsewhere}",
    ]
    print("\n### canaries (inject_canary: every chat request carries its tenant's canary)\n")
    print("\n".join(lines))
    return {
        "rows": {k: dict(v) for k, v in rows.items()},
        "clean": clean,
        "clean_flagged": clean_flagged,
    }


def stdlib_passages(per_module: int = 3, modules: int = 120, min_words: int = 25) -> dict:
    """Human-written public text already on every machine: paragraphs of the docstrings
    of the running Python's standard library (module, class and function docstrings of
    the first ``modules`` modules by name). ``{module: [paragraph, ...]}``."""
    import ast
    import sysconfig

    found: dict[str, list[str]] = {}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:modules]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef))]
        paragraphs = [
            " ".join(paragraph.split())
            for node in nodes
            for paragraph in (ast.get_docstring(node) or "").split("\n\n")
            if len(paragraph.split()) >= min_words
        ]
        if paragraphs:
            found[path.stem] = paragraphs[:per_module]
    return found


def public_text_signal(args: argparse.Namespace, config: EngineConfig) -> dict:
    """Public text that several tenants handle: one tenant pastes a passage of Python's
    standard-library documentation (``stdlib_passages``), and later the simulated model
    recites 30 words of it to another tenant who asked about that module. Neither is a
    leak; the recitations are counted apart, on a fresh engine, without and with a
    baseline built from the corpus (``crosstalk baseline build``'s code), between the
    simulator's ordinary traffic."""
    from proxy.engine.baseline import build
    from proxy.engine.fingerprint import Hasher

    corpus = stdlib_passages()
    passages = [(module, text) for module, texts in corpus.items() for text in texts]
    with tempfile.TemporaryDirectory() as tmp:
        for module, texts in corpus.items():
            (Path(tmp) / f"{module}.txt").write_text("\n\n".join(texts), encoding="utf-8")
        public, _ = build([tmp], Hasher(config.key, config.k))
    rows = {}
    for label, with_baseline in (("no baseline", False), ("baseline of the corpus", True)):
        engine = new_engine(args, config)
        if with_baseline:
            engine.add_baseline_file(public)
        rng = random.Random(args.seed + 21)
        requests = Workload(tenants=args.tenants, seed=args.seed + 21).requests(len(passages) * 3)
        flagged = Counter()
        pasted: list[tuple[str, str, str]] = []  # (tenant, module, passage)
        now = 1_000_000.0
        for i, req in enumerate(requests):
            now += 0.1
            prompt, answer, kind = req.prompt_text(), None, "ordinary"
            model_text = model_text_of(req)
            if i % 3 == 0 and i // 3 < len(passages):
                module, text = passages[i // 3]
                prompt, kind = f"Please explain this part of the {module} docs:\n\n{text}", "paste"
                model_text = ""
                pasted.append((req.tenant, module, text))
            elif i % 3 == 1 and pasted:
                source, module, text = pasted[rng.randrange(len(pasted))]
                if source != req.tenant:
                    words = text.split()
                    start = rng.randrange(max(1, len(words) - 30))
                    prompt, model_text = f"What does the {module} module do?", ""
                    answer = (
                        answer_for(prompt)
                        + "\n\nFrom its docs: "
                        + " ".join(words[start : start + 30])
                    )
                    kind = "recitation"
            scan = engine.observe_prompt(
                req.tenant, req.request_id, prompt, now=now, model_text=model_text
            )
            found = []
            for piece in deltas(answer if answer is not None else answer_for(prompt), rng):
                found += scan.feed(piece, now=now)
            found += scan.finish(now=now)
            flagged[kind, "n"] += 1
            flagged[kind, "flagged"] += bool(found)
            if found and kind == "ordinary" and args.show_fp > 0:
                f = found[0]
                text = answer if answer is not None else answer_for(prompt)
                print(f"PUBLIC-TEXT RUN FALSE POSITIVE ({label}) {req.request_id} <- "
                      f"{f.source_tenant}/{f.source_request_id}: {text[f.start : f.end]!r}")  # fmt: skip
        rows[label] = flagged
    lines = [
        "| engine | recitations flagged | pastes' answers flagged | ordinary answers flagged |",
        "|---|---:|---:|---:|",
        *(
            f"| fresh, {label} | "
            + " | ".join(
                f"{c[k, 'flagged']}/{c[k, 'n']} ({pct(c[k, 'flagged'], c[k, 'n'])})"
                for k in ("recitation", "paste", "ordinary")
            )
            + " |"
            for label, c in rows.items()
        ),
        "",
        f"- corpus: {len(passages)} docstring paragraphs of {len(corpus)} standard-library "
        f"modules; baseline: {public.kgrams.size} fingerprints",
    ]
    print("\n### public text: the standard library's documentation, pasted and recited\n")
    print("\n".join(lines))
    return {label: {f"{a}_{b}": v for (a, b), v in c.items()} for label, c in rows.items()}


LAG_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))


def quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.2f}%" if b else "-"


def report(result: dict, engine: Engine, seconds: float, args) -> str:
    lines = [
        "| leak kind | private words | leaks | detected | recall | right source |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (kind, size), row in sorted(result["rows"].items()):
        lines.append(
            f"| {kind} | {size} | {row['n']} | {row['hit']} | {pct(row['hit'], row['n'])} "
            f"| {pct(row['right'], row['hit'])} |"
        )
    t = result["target"]
    c = result["clean"]
    n_clean = c["warmup", "n"] + c["steady", "n"]
    f_clean = c["warmup", "flagged"] + c["steady", "flagged"]
    lines += [
        "",
        f"- target leaks (>= 8 private words, private entities, mis-routes with >= 8 private words): "
        f"recall {pct(t['hit'], t['n'])} ({t['hit']}/{t['n']}), right source {pct(t['right'], t['hit'])}",
        f"- false positives on clean responses: {pct(f_clean, n_clean)} ({f_clean}/{n_clean}); "
        f"first {args.warmup} responses (cold start) {pct(c['warmup', 'flagged'], c['warmup', 'n'])}, "
        f"after {pct(c['steady', 'flagged'], c['steady', 'n'])}",
        "- words from a leak's first private word to its detection (target leaks found): "
        + ", ".join(f"{name} {quantile(result['lags'], q):g}" for name, q in LAG_QUANTILES),
        f"- {args.requests} responses, {args.tenants} tenants, leak rate {args.leak_rate}, "
        f"{engine.fingerprints} fingerprints held, {seconds:.1f} s",
    ]
    return "\n".join(lines)


def rates(result: dict) -> dict[str, float]:
    """The figures the targets are set on, as fractions."""
    t, c = result["target"], result["clean"]

    def ratio(a: int, b: int) -> float:
        return a / b if b else 0.0

    return {
        "recall": ratio(t["hit"], t["n"]),
        "right_source": ratio(t["right"], t["hit"]),
        "fp_first": ratio(c["warmup", "flagged"], c["warmup", "n"]),
        "fp_after": ratio(c["steady", "flagged"], c["steady", "n"]),
        "fp_all": ratio(
            c["warmup", "flagged"] + c["steady", "flagged"], c["warmup", "n"] + c["steady", "n"]
        ),
    }


def check_targets(results: dict[str, dict], public: dict[str, dict]) -> list[str]:
    """One line per target, PASS or FAIL; the failures are returned. Public text recited
    to a tenant is held to the false-positive target once its corpus is a baseline."""
    failed = []
    print("\n### targets\n")
    with_baseline = public["baseline of the corpus"]
    figures = {label: rates(result) for label, result in results.items()}
    figures["public text, baseline"] = {
        "recitations_flagged": with_baseline["recitation_flagged"]
        / max(1, with_baseline["recitation_n"])
    }
    for label, name, limit, kind in TARGETS:
        if label not in figures:
            continue
        value = figures[label][name]
        ok = value >= limit if kind == "min" else value <= limit
        line = f"{label}: {name} {100 * value:.2f}% ({kind} {100 * limit:g}%)"
        print(f"- {'PASS' if ok else 'FAIL'} {line}")
        if not ok:
            failed.append(line)
    return failed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--leak-rate", type=float, default=0.1)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rate", type=float, default=8.0, help="requests per simulated second")
    p.add_argument(
        "--warmup", type=int, default=300, help="responses counted apart as the cold-start period"
    )
    p.add_argument(
        "--warm",
        type=int,
        default=2500,
        help="requests of earlier traffic to learn commonness from (0: cold only)",
    )
    p.add_argument(
        "--baseline", default=None, help="baseline texts (default: the shipped baseline)"
    )
    p.add_argument(
        "--vocabulary", default=None, help="plain-word lists (default: the shipped vocabularies)"
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override an EngineConfig field, e.g. --engine k=5 (repeatable)",
    )
    p.add_argument(
        "--fault-kinds",
        default=",".join(ALL_FAULT_KINDS),
        help="comma-separated (default: all, noisy pages included)",
    )
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI: the leak and public-text rows only (no degenerate or canary sections), "
        "same seeds and targets",
    )
    p.add_argument("--show-fp", type=int, default=3, help="print N false positives and misses")
    return p.parse_args(argv)


def explain_miss(ex: Exchange) -> str:
    """The engine's coverage of the victim's output by the true source request."""
    scan = ex.scan
    state = scan._choices.get(0)
    if state is None:
        return "no output scanned"
    parts = []
    for value, run in state.runs.items():
        record = scan.engine._requests.get(value >> 1)
        if record is not None and record.request_id == ex.fault.source_request_id:
            best = " ".join(
                ex.answer[state.starts[i] : state.ends[i]]
                for i in range(run.best_start, run.best_end + 1)
            )
            parts.append(
                f"{'output' if value & 1 else 'prompt'}: best={run.best / 2} covered="
                f"{run.covered / 2} distinct={len(run.distinct_units)} span="
                f"{(state.cumulative[run.end + 1] - state.cumulative[run.first]) / 2} "
                f"best_run={best[:120]!r}"
            )
    return "; ".join(parts) or "source never matched"


def engine_config(overrides: list[str]) -> EngineConfig:
    """The engine's defaults, with ``FIELD=VALUE`` overrides (typed like the default)."""
    config = EngineConfig(key=b"quality-bench-key-0123456789abcdef")
    changes = {}
    for item in overrides:
        name, _, value = item.partition("=")
        default = getattr(config, name)  # AttributeError: unknown field
        changes[name] = type(default)(value)
    return dataclasses.replace(config, **changes)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = engine_config(args.engine)
    results = {}
    history: list[Exchange] = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "commonness.npz"
        if args.warm:
            # A previous day of the same deployment's traffic (another seed: other
            # prompts, other private data) teaches the engine what is boilerplate.
            history, warm_engine = run_traffic(
                args, config, seed=args.seed + 1000, requests=args.warm, state=None
            )
            warm_engine.save_commonness(state)
        for label, use_state in (("cold start", None), ("warm", state if args.warm else None)):
            if label == "warm" and not args.warm:
                continue
            t0 = time.perf_counter()
            exchanges, engine = run_traffic(
                args, config, seed=args.seed, requests=args.requests, state=use_state
            )
            seconds = time.perf_counter() - t0
            result = evaluate(exchanges, args.warmup, history if use_state else [])
            print(
                f"\n### {label}: {'fresh engine' if use_state is None else f'commonness learned from {args.warm} earlier requests'}\n"
            )
            print(report(result, engine, seconds, args))
            results[label] = result
    for label, result in results.items():
        for ex in result["fp_examples"][: args.show_fp]:
            f = ex.findings[0]
            print(
                f"\nFALSE POSITIVE ({label}) {ex.request_id} <- {f.source_tenant}/"
                f"{f.source_request_id} {f.kind} units={f.foreign_units}: "
                f"{ex.answer[f.start : f.end]!r}"
            )
        for ex in result["missed"][: args.show_fp]:
            f = ex.fault
            print(
                f"\nMISSED ({label}) {ex.request_id} <- {f.source_tenant}/{f.source_request_id} "
                f"{f.kind} {f.leaked_words} words: {f.leaked_text[:300]!r}"
            )
            print("   why:", explain_miss(ex))
    public = public_text_signal(args, config)
    failed = check_targets(results, public)
    degenerate = {} if args.quick else degenerate_signal(args)
    canary = {} if args.quick else canary_signal(args, config)
    if args.json:
        Path(args.json).write_bytes(
            orjson.dumps(
                {
                    label: {
                        "rows": [
                            {"kind": k, "size": s, **row} for (k, s), row in r["rows"].items()
                        ],
                        "target": dict(r["target"]),
                        "clean": {f"{a}_{b}": v for (a, b), v in r["clean"].items()},
                    }
                    for label, r in results.items()
                }
                | {"degenerate": degenerate, "canary": canary, "public_text": public},
                option=orjson.OPT_INDENT_2,
            )
        )
    if failed:
        print(f"\nquality: {len(failed)} target(s) missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
