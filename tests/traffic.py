"""Drive the simulator's multi-tenant workload through a proxy with the openai SDK, and
judge the outcome against the simulator's truth file.

Used by the end-to-end leak tests (shadow and enforce). Every request carries its tenant
and request id; the raw bytes each client received are kept, so that clean responses can
be compared byte for byte with what the simulator sent.

Judged by the simulator's truth, never by crosstalk's own code: targets come from the
truth file's entities and the privacy oracle; the text a client received is read from the
wire by this module's own small parser (JSON bodies and SSE ``data:`` lines), not by
crosstalk's protocol parsers; and a leak counts as found only when a finding's span in the
victim's output overlaps the text that was leaked there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai

from proxy.sim.faults import PAGE_KINDS
from proxy.sim.oracle import Observed, PrivacyOracle, shingles
from proxy.sim.workload import SimRequest, Workload

TARGET_PAGE_KINDS = PAGE_KINDS


@dataclass
class Result:
    request: SimRequest
    body: bytes = b""
    error: str | None = None  # what the client saw go wrong (None: a normal response)
    status: int = 200

    @property
    def text(self) -> str:
        """Output text of choice 0 as the client received it."""
        return output_text(self.request.endpoint, self.body, self.request.stream)


def _choice_text(obj: object, endpoint: str) -> str:
    """Choice 0's text in one OpenAI response object or stream chunk."""
    if not isinstance(obj, dict):
        return ""
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            if endpoint != "chat":
                return choice.get("text") or ""
            part = choice.get("delta") or choice.get("message") or {}
            return (part.get("content") or "") if isinstance(part, dict) else ""
    return ""


def output_text(endpoint: str, body: bytes, stream: bool) -> str:
    """Output text of choice 0 in the bytes a client received (OpenAI chat or
    completions, whole or streamed), read independently of crosstalk's parsers."""
    if not stream:
        try:
            return _choice_text(json.loads(body), endpoint)
        except ValueError:
            return ""
    text = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                text.append(_choice_text(json.loads(line[5:]), endpoint))
            except ValueError:
                continue  # a cut stream's last line, or the proxy's error event
    return "".join(text)


def send(url: str, req: SimRequest) -> Result:
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=60,
        default_headers={"X-Tenant-ID": req.tenant, "X-Request-ID": req.request_id},
    )  # fmt: skip
    body = req.body()
    body.pop("stream")
    api = client.chat.completions if req.endpoint == "chat" else client.completions
    result = Result(req)
    try:
        if req.stream:
            with api.with_streaming_response.create(stream=True, **body) as resp:
                chunks = []
                try:
                    for chunk in resp.iter_bytes():
                        chunks.append(chunk)
                except Exception as e:  # noqa: BLE001 -- a cut stream ends abruptly
                    result.error = f"{type(e).__name__}: {e}"
                result.body = b"".join(chunks)
        else:
            raw = api.with_raw_response.create(**body)
            result.body = raw.http_response.content
    except openai.APIStatusError as e:
        result.status, result.error = e.status_code, f"status {e.status_code}"
        result.body = e.response.content
    return result


def run_workload(url: str, *, tenants: int, requests: int, seed: int, concurrency: int = 16):
    reqs = list(Workload(tenants=tenants, seed=seed).requests(requests))
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda r: send(url, r), reqs))


@dataclass
class Judgement:
    """Injected faults, classified against what the proxy logged."""

    targets: list[dict] = field(default_factory=list)  # leaks that must be found
    found: list[dict] = field(default_factory=list)
    right_source: list[dict] = field(default_factory=list)
    missed: list[dict] = field(default_factory=list)
    clean_flagged: list[str] = field(default_factory=list)
    clean: int = 0
    oracle: PrivacyOracle | None = None


def judge(results, truth: list[dict], events: list[dict], answer_of) -> Judgement:
    """``answer_of(request_id)`` is choice 0's text as the simulator generated it
    (``Sim.answer``): the judge reads no wire format, so no parser under test decides
    what the client was meant to get."""
    by_id = {r.request.request_id: r for r in results}
    faults = {t["request_id"]: t for t in truth if t["request_id"] in by_id}
    answers = {rid: answer_of(rid) for rid in by_id}
    oracle = PrivacyOracle(
        Observed(r.request.tenant, r.request.prompt_text(), answers[rid],
                 faults.get(rid, {}).get("leaked_text", ""))
        for rid, r in by_id.items()
    )  # fmt: skip
    leaks: dict[str, list[dict]] = {}
    for e in events:
        if e["event"] == "leak.detected":
            leaks.setdefault(e["request_id"], []).append(e)
    j = Judgement(oracle=oracle)
    for rid in by_id:
        fault = faults.get(rid)
        if fault is None:
            j.clean += 1
            if rid in leaks:
                j.clean_flagged.append(rid)
            continue
        if not is_target(fault, oracle, by_id):
            continue
        j.targets.append(fault)
        on_leak = [e for e in leaks.get(rid, []) if overlaps(e, fault, answers[rid])]
        if on_leak:
            j.found.append(fault)
            if on_leak[0]["source_tenant"] in holders(fault, faults.values()):
                j.right_source.append(fault)
        else:
            j.missed.append(fault)
    return j


def holders(fault: dict, faults: Iterable[dict]) -> set[str]:
    """The tenants whose exchanges held the fault's leaked words by the simulator's
    truth: its source, and the two ends of a chain of leaks. A source answer that itself
    held another tenant's leaked words carries them on (a mis-routed answer with a leak
    in it); and a victim of an earlier fault from the same source request holds the
    same words in its own output. A finding naming any of them names an owner of the
    words; seen in a three-replica run, where each chain's first finding named such a
    tenant."""
    named = {fault["source_tenant"]}
    if fault["source_request_id"] is None:
        return named
    for other in faults:
        if other["request_id"] == fault["source_request_id"]:
            named.add(other["source_tenant"])
        elif other is not fault and other["source_request_id"] == fault["source_request_id"]:
            named.add(other["victim_tenant"])
    return named


def overlaps(event: dict, fault: dict, answer: str) -> bool:
    """Whether a leak.detected event points into the text the fault leaked into
    ``answer`` (choice 0's text as the simulator generated it), placed by the truth's
    offset. A whole mis-routed answer is the leaked text everywhere."""
    if event.get("choice", 0) != 0:
        return False
    if fault["kind"] == "misroute":
        return True
    at, leaked = fault["offset"], fault["leaked_text"]
    assert answer[at : at + len(leaked)] == leaked, (fault["request_id"], "offset")
    start, end = event["output_offset"]
    return start < at + len(leaked) and at < end


def is_target(fault: dict, oracle: PrivacyOracle, by_id: dict[str, Result]) -> bool:
    """The issue's targets: >= 8 private words of a page or a mis-route, or an entity
    that only the source tenant used."""
    if fault["kind"] in TARGET_PAGE_KINDS:
        return oracle.private_run(fault["source_tenant"], fault["leaked_text"]) >= 8
    if fault["kind"] == "entities":
        entities = [e.lower() for e in fault.get("entities", ())]
        others = [
            (r.request.prompt_text()).lower()
            for r in by_id.values()
            if r.request.tenant != fault["source_tenant"]
        ]
        return bool(entities) and not any(e in o for e in entities for o in others)
    return False


def private_words_reached_client(fault: dict, result: Result, oracle: PrivacyOracle):
    """Private shingles of the leaked text that the client received."""
    leaked = oracle.private_shingles(fault["source_tenant"], fault["leaked_text"])
    return leaked & set(shingles(result.text))


def load_truth(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
