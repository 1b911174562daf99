"""The simulated workload written as the logs operators keep (for bench/replay.py's
per-format rows): LiteLLM payloads, SGLang request logs (text and JSON), vLLM request
logs, OpenTelemetry GenAI spans. Written from each format's definition (the sources
named in docs/forensics.md, "Logs as input"), independently of crosstalk's readers.

Every exchange becomes its format's lines with the times of the exchange; the second
line of a two-line format (SGLang's Finish, vLLM's Generated response) is written when
its time comes, so lines interleave as a busy engine writes them.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from proxy.sim.templates import render


@dataclass(frozen=True, slots=True)
class Logged:
    """One exchange of the workload, as a log would see it."""

    tenant: str
    request_id: str
    messages: list[dict]
    template: str  # the chat template the engine would render the messages with
    answer: str
    start: float
    end: float

    @property
    def rendered(self) -> str:
        return render(self.messages, self.template)


Lines = list[tuple[float, str]]  # (time the line is written, the line)


def _local(ts: float, with_year: bool = True) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S" if with_year else "%m-%d %H:%M:%S", time.localtime(ts))


def jsonl(x: Logged) -> Lines:
    """crosstalk's own JSON-lines exchange format: the reference row."""
    line = {"time": x.start, "end_time": x.end, "tenant": x.tenant, "request_id": x.request_id,
            "path": "/v1/chat/completions", "request": {"model": "sim-llm-1", "messages": x.messages},
            "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": x.answer}}]}}  # fmt: skip
    return [(x.end, json.dumps(line, ensure_ascii=False))]


def litellm(x: Logged) -> Lines:
    payload = {
        "id": f"chatcmpl-{x.request_id}", "litellm_call_id": x.request_id, "call_type": "acompletion",
        "stream": None, "status": "success", "startTime": x.start, "endTime": x.end,
        "model": "sim-llm-1",
        "metadata": {"user_api_key_hash": "h" * 64, "user_api_key_alias": f"{x.tenant}-key",
                     "user_api_key_team_id": f"team-{x.tenant}", "user_api_key_team_alias": x.tenant},
        "messages": x.messages,
        "response": {"id": f"chatcmpl-{x.request_id}", "object": "chat.completion",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": x.answer}}]},
    }  # fmt: skip
    return [(x.end, json.dumps(payload, ensure_ascii=False))]


def sglang_text(x: Logged) -> Lines:
    """``--log-requests-level 3`` (nothing cut), tenant header logged."""
    obj = (
        f"GenerateReqInput(rid={x.request_id!r}, session_id=None, text={x.rendered!r}, "
        "input_ids=None, sampling_params={'max_new_tokens': 512, 'temperature': 0.7}, "
        f"stream=False, lora_path=None, routing_key=None, received_time={x.start!r})"
    )
    headers = f"headers={{'x-tenant-id': {x.tenant!r}}}"
    out = {"text": x.answer, "meta_info": {"id": x.request_id, "finish_reason": {"type": "stop"},
           "completion_tokens": len(x.answer) // 4, "e2e_latency": round(x.end - x.start, 4)}}  # fmt: skip
    return [
        (x.start, f"[{_local(x.start)}] Receive: obj={obj}, {headers}"),
        (x.end, f"[{_local(x.end)}] Finish: obj={obj}, {headers}, out={out!r}"),
    ]


def sglang_json(x: Logged) -> Lines:
    obj = {"rid": x.request_id, "text": x.rendered, "input_ids": None, "stream": False,
           "received_time": x.start}  # fmt: skip
    headers = {"x-tenant-id": x.tenant}
    out = {"text": x.answer, "meta_info": {"id": x.request_id, "e2e_latency": x.end - x.start}}
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + "Z"  # noqa: E731
    received = {"timestamp": iso(x.start), "event": "request.received", "rid": x.request_id,
                "obj": obj, "headers": headers}  # fmt: skip
    finished = {**received, "timestamp": iso(x.end), "event": "request.finished", "out": out}
    return [(x.start, json.dumps(received, ensure_ascii=False)),
            (x.end, json.dumps(finished, ensure_ascii=False))]  # fmt: skip


def vllm(x: Logged) -> Lines:
    """v0.10 lines, ``--enable-log-outputs``, the tenant in the request id (a gateway's
    X-Request-Id), no ``--max-log-len``."""
    rid = f"chatcmpl-{x.request_id}"  # the sim's ids name the tenant: req-TENANT-N
    prefix = "(APIServer pid=2817) INFO {} [logger.py:{}] "
    params = ("SamplingParams(n=1, presence_penalty=0.0, temperature=0.7, top_p=0.8, seed=None, "
              "stop=[], max_tokens=512, guided_decoding=None, extra_args=None)")  # fmt: skip
    return [
        (x.start, prefix.format(_local(x.start, False), 40) + f"Received request {rid}: prompt: "
         f"{x.rendered!r}, params: {params}, prompt_token_ids: None, prompt_embeds shape: None, "
         "lora_request: None."),
        (x.end, prefix.format(_local(x.end, False), 71) + f"Generated response {rid}: output: "
         f"{x.answer!r}, output_token_ids: None, finish_reason: stop"),
    ]  # fmt: skip


def otel(x: Logged) -> Lines:
    """Semantic conventions 1.37, as the Collector's file exporter writes one span."""
    attr = lambda k, v: {"key": k, "value": {"stringValue": v}}  # noqa: E731
    system = [m for m in x.messages if m["role"] == "system"]
    rest = [m for m in x.messages if m["role"] != "system"]
    span = {
        "traceId": hashlib.md5(x.request_id.encode()).hexdigest(),
        "spanId": hashlib.md5(x.request_id.encode()).hexdigest()[:16],
        "name": "chat sim-llm-1", "kind": 3,
        "startTimeUnixNano": str(int(x.start * 1e9)), "endTimeUnixNano": str(int(x.end * 1e9)),
        "attributes": [
            attr("gen_ai.operation.name", "chat"), attr("gen_ai.provider.name", "openai"),
            attr("gen_ai.response.id", x.request_id), attr("tenant.id", x.tenant),
            attr("gen_ai.system_instructions", json.dumps(
                [{"type": "text", "content": m["content"]} for m in system], ensure_ascii=False)),
            attr("gen_ai.input.messages", json.dumps(
                [{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]} for m in rest],
                ensure_ascii=False)),
            attr("gen_ai.output.messages", json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": x.answer}],
                  "finish_reason": "stop"}], ensure_ascii=False)),
        ],
        "status": {},
    }  # fmt: skip
    doc = {"resourceSpans": [{"resource": {"attributes": [attr("service.name", "llm-gateway")]},
                              "scopeSpans": [{"scope": {"name": "bench"}, "spans": [span]}]}]}  # fmt: skip
    return [(x.end, json.dumps(doc, separators=(",", ":"), ensure_ascii=False))]


WRITERS: dict[str, tuple[Callable[[Logged], Lines], tuple[str, ...]]] = {
    # format: (writer, the replay arguments that tell it where the tenant is)
    "jsonl": (jsonl, ()),
    "litellm": (litellm, ()),
    "sglang": (sglang_text, ()),
    "sglang-json": (sglang_json, ()),
    "vllm": (vllm, ("--tenant-from", "request_id", "--tenant-pattern", r"^chatcmpl-req-(.+)-\d+$")),
    "otel": (otel, ()),
}


def write_log(path: Path, exchanges: Iterable[Logged], writer: Callable[[Logged], Lines]) -> int:
    """Write the exchanges' lines in time order (they arrive in start order; a later line
    waits in a heap until its time). Returns the file's size in bytes."""
    pending: list[tuple[float, int, str]] = []
    n = 0
    with path.open("w", encoding="utf-8") as out:
        for x in exchanges:
            while pending and pending[0][0] <= x.start:
                out.write(heapq.heappop(pending)[2] + "\n")
            for when, line in writer(x):
                n += 1
                heapq.heappush(pending, (when, n, line))
        while pending:
            out.write(heapq.heappop(pending)[2] + "\n")
    return path.stat().st_size
