"""The simulated LLM engine (aiohttp), with leak injection and misbehaviour hooks.

It stands in for vLLM/SGLang in tests, benchmarks and demos: deterministic answers
(answers), cross-tenant leaks injected at a configurable rate with a JSON-lines truth file
(faults), streaming that goes out event by event like a real engine, and header-selected
misbehaviour (truncated streams, error events, gzip bodies, answers in no encoding
their header names, 500s) for the proxy's bad-input tests.

It speaks the OpenAI API (``/v1/chat/completions``, ``/v1/completions``) and, through
``proxy.sim.formats``, Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses``, SGLang's and
vLLM's ``/generate`` (told apart by the body: ``text`` or ``prompt``) and TGI's ``/generate``
(``inputs``) and ``/generate_stream``: the same answers, faults, truth file and misbehaviour
whatever the format.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import random
import signal
import ssl
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web

from proxy.sim import formats
from proxy.sim.answers import (
    answer_for,
    count_units,
    prompt_seed,
    question_part,
    split_units,
    truncate_units,
)
from proxy.sim.faults import FAULT_KINDS, FaultInjector
from proxy.sim.templates import unrender

MISBEHAVIOURS = (
    "nonjson",
    "truncate",
    "error-event",
    "gzip",
    "mislabelled",  # a non-streamed answer only (gzip wins when both are asked)
    "status500",
    "slow",
    "stall",
)
# Misbehaviours after which the answer does not reach the client in full.
UNDELIVERED = frozenset({"nonjson", "truncate", "error-event", "status500"})
SLOW_CHUNK_DELAY = 0.2  # seconds per chunk under `x-sim-misbehave: slow`
STALL_SECONDS = 30.0  # `x-sim-misbehave: stall`: silence half way through a stream
MAX_CHOICES = 16
SENT_RECORDS = 4096
SPLIT_WORD_PROBABILITY = 0.3  # share of stream pieces cut mid-word when split_words is on


@dataclass
class SimConfig:
    """Settings of one simulated engine."""

    token_delay: float = 0.0  # sleep between stream chunks (seconds)
    words_per_chunk: int = 1
    split_words: bool = False  # cut some deltas mid-word, like BPE tokens do
    leak_rate: float = 0.0
    truth_path: str | None = None
    seed: int = 0
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    model: str = "sim-llm-1"
    engine: str = "vllm"
    engine_version: str = "0.10.2"
    # SGLang's --incremental-streaming-output: /generate streams only the new text.
    incremental_output: bool = False


@dataclass
class _State:
    """Mutable per-app state: the fault injector and id counters."""

    cfg: SimConfig
    injector: FaultInjector
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))
    # Bytes sent per request id (newest SENT_RECORDS), for tests that check the proxy
    # delivered exactly what the engine sent: GET /_sim/sent/{request_id}.
    sent: OrderedDict[str, bytearray] = field(default_factory=OrderedDict)
    # How each stream ended: "complete" or "aborted after N of M events" (test hook:
    # GET /_sim/outcome/{request_id}), to show that a cut stream stopped generation.
    outcomes: dict[str, str] = field(default_factory=dict)
    # The JSON body received per request id (newest SENT_RECORDS), for tests of what a
    # gateway adds to requests (cache_salt, canaries): GET /_sim/received/{request_id}.
    received: OrderedDict[str, dict] = field(default_factory=OrderedDict)
    # The headers of each request (newest SENT_RECORDS), for tests of what a proxy
    # forwards or removes: GET /_sim/headers/{request_id}, names lower-cased.
    headers: OrderedDict[str, dict] = field(default_factory=OrderedDict)
    # The answer texts generated per request id, faults applied (newest SENT_RECORDS):
    # the ground truth a judge compares findings with, GET /_sim/answer/{request_id}.
    answers: OrderedDict[str, list[str]] = field(default_factory=OrderedDict)

    def record(self, request_id: str, data: bytes) -> None:
        buf = self.sent.get(request_id)
        if buf is None:
            buf = self.sent[request_id] = bytearray()
            while len(self.sent) > SENT_RECORDS:
                self.sent.popitem(last=False)
        buf += data


STATE_KEY = web.AppKey("sim_state", _State)


class BadRequest(formats.FormatError):
    """A request the engine rejects with HTTP 400."""


@dataclass
class _Exchange:
    """One parsed request and the answers generated for it."""

    kind: str  # "chat" | "completions" | a key of NATIVE_FORMATS
    tenant: str
    request_id: str
    prompt: str
    private: str
    stream: bool
    include_usage: bool
    answers: list[str]
    finish: list[str]
    misbehave: frozenset[str]
    # Choice 0's text as far as the engine generated it before the client went away:
    # the engine stops decoding then, so no page of the rest exists to leak.
    generated: str | None = None


# --- request parsing (pure) ---------------------------------------------------------------


def content_text(content: Any) -> str:
    """Text of a chat message content: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    raise BadRequest("message content must be a string or a list of content parts")


def chat_prompt(messages: Any) -> tuple[str, str]:
    """(prompt text, last user message) of a chat request; contents joined by "\\n"."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    texts: list[str] = []
    last_user = ""
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object")
        text = content_text(m.get("content"))
        texts.append(text)
        if m.get("role") == "user":
            last_user = text
    return "\n".join(texts), last_user


def completion_prompt(prompt: Any) -> str:
    """Prompt text of a legacy completions request (a string or a list of strings); a
    conversation rendered by a chat template reads as its turns, like a chat request."""
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = "\n".join(prompt)
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string or a list of strings")
    turns = unrender(prompt)
    return prompt if turns is None else turns


def sim_tenant(headers: Any, body: dict) -> str:
    """Tenant: X-Tenant-ID header, else the bearer token, else the x-api-key header
    (Anthropic), else body "user" (or Anthropic's "metadata.user_id"), else anonymous."""
    tenant = headers.get("X-Tenant-ID", "").strip()
    if tenant:
        return tenant
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    key = headers.get("x-api-key", "").strip()
    if key:
        return key
    user = body.get("user")
    metadata = body.get("metadata")
    if user is None and isinstance(metadata, dict):
        user = metadata.get("user_id")
    if isinstance(user, str) and user.strip():
        return user.strip()
    return "anonymous"


def _int_param(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be an integer in [{low}, {high}]")
    return value


def parse_misbehave(value: str) -> frozenset[str]:
    """Comma-separated misbehaviour names from the `x-sim-misbehave` header."""
    names = frozenset(v.strip().lower() for v in value.split(",") if v.strip())
    unknown = names - set(MISBEHAVIOURS)
    if unknown:
        raise BadRequest(f"unknown x-sim-misbehave {sorted(unknown)}; expected {MISBEHAVIOURS}")
    return names


# --- response bodies (pure) ---------------------------------------------------------------


def sse(obj: Any) -> bytes:
    """One SSE event carrying `obj` as compact JSON (vLLM style: raw UTF-8)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


def usage_of(prompt: str, answers: Sequence[str]) -> dict:
    """OpenAI usage block; units (words / CJK characters) stand in for tokens."""
    prompt_tokens = count_units(prompt)
    completion_tokens = sum(count_units(a) for a in answers)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_body(ex: _Exchange, resp_id: str, created: int, model: str) -> dict:
    """Non-streamed response body for chat or completions."""
    if ex.kind == "chat":
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": ex.finish[i],
            }
            for i, text in enumerate(ex.answers)
        ]
        obj = "chat.completion"
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": ex.finish[i]}
            for i, text in enumerate(ex.answers)
        ]
        obj = "text_completion"
    return {
        "id": resp_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_of(ex.prompt, ex.answers),
    }


def stream_pieces(
    text: str, words_per_chunk: int, split_words: bool, rng: random.Random
) -> list[str]:
    """Delta texts for one answer: `words_per_chunk` units each, some cut mid-word."""
    units = split_units(text)
    step = max(1, words_per_chunk)
    pieces = ["".join(units[i : i + step]) for i in range(0, len(units), step)]
    if not split_words:
        return pieces
    out: list[str] = []
    for piece in pieces:
        if len(piece) > 2 and rng.random() < SPLIT_WORD_PROBABILITY:
            cut = rng.randint(1, len(piece) - 1)
            out += [piece[:cut], piece[cut:]]
        else:
            out.append(piece)
    return out


def stream_events(
    ex: _Exchange, resp_id: str, created: int, model: str, pieces: list[list[str]]
) -> list[bytes]:
    """Every SSE event of a streamed response, in order, ending with [DONE]."""
    chat = ex.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if ex.include_usage else {}

    def chunk(index: int, text: str | None, finish: str | None, *, role: bool = False) -> bytes:
        if chat:
            delta: dict = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": resp_id, "object": obj, "created": created, "model": model}
        return sse({**body, "choices": [choice], **extra})

    events: list[bytes] = []
    if chat:
        events += [chunk(i, None, None, role=True) for i in range(len(pieces))]
    # n>1: choices interleave, as an engine decoding them in one batch emits them.
    for step in range(max((len(p) for p in pieces), default=0)):
        events += [chunk(i, p[step], None) for i, p in enumerate(pieces) if step < len(p)]
    events += [chunk(i, None if chat else "", ex.finish[i]) for i in range(len(pieces))]
    if ex.include_usage:
        body = {"id": resp_id, "object": obj, "created": created, "model": model}
        events.append(sse({**body, "choices": [], "usage": usage_of(ex.prompt, ex.answers)}))
    events.append(DONE_EVENT)
    return events


def error_body(message: str, type_: str = "invalid_request_error", code: int = 400) -> dict:
    """OpenAI-style error object."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


OPENAI_ERROR_EVENT = sse({"error": {"message": "engine overloaded", "type": "server_error"}})


@dataclass(frozen=True)
class NativeFormat:
    """An endpoint that is not OpenAI chat/completions: how it reads requests and writes
    answers (``proxy.sim.formats``)."""

    parse: Callable[[dict], formats.Request]
    id_prefix: str
    body: Callable[[Any, str, int, str], Any]
    # (exchange, response id, created, model, pieces, config) -> (events, events before text)
    events: Callable[[Any, str, int, str, list[list[str]], SimConfig], tuple[list[bytes], int]]
    error_event: bytes  # what x-sim-misbehave: error-event sends mid-stream
    error: Callable[[str, int], dict]  # error body for an HTTP status
    content_type: str = "text/event-stream; charset=utf-8"


def _events(
    build: Callable[..., tuple[list[bytes], int]],
) -> Callable[..., tuple[list[bytes], int]]:
    return lambda ex, rid, created, model, pieces, _cfg: build(ex, rid, created, model, pieces)


NATIVE_FORMATS: dict[str, NativeFormat] = {
    "messages": NativeFormat(
        formats.anthropic_request,
        "msg_",
        formats.anthropic_body,
        _events(formats.anthropic_events),
        formats.ANTHROPIC_ERROR_EVENT,
        formats.anthropic_error,
    ),
    "responses": NativeFormat(
        formats.responses_request,
        "resp_",
        formats.responses_body,
        _events(formats.responses_events),
        formats.RESPONSES_ERROR_EVENT,
        lambda message, status: error_body(message, "invalid_request_error", status),
    ),
    "sglang": NativeFormat(
        formats.sglang_request,
        "",
        formats.sglang_body,
        lambda ex, rid, created, model, pieces, cfg: formats.sglang_events(
            ex, rid, created, model, pieces, incremental=cfg.incremental_output
        ),
        formats.SGLANG_ERROR_EVENT,
        formats.sglang_error,
    ),
    "tgi": NativeFormat(
        lambda body: formats.tgi_request(body, stream=False),
        "",
        formats.tgi_body,
        _events(formats.tgi_events),
        formats.TGI_ERROR_EVENT,
        formats.tgi_error,
    ),
    "tgi_stream": NativeFormat(
        lambda body: formats.tgi_request(body, stream=True),
        "",
        formats.tgi_body,
        _events(formats.tgi_events),
        formats.TGI_ERROR_EVENT,
        formats.tgi_error,
    ),
    "vllm": NativeFormat(
        formats.vllm_request,
        "",
        formats.vllm_body,
        _events(formats.vllm_events),
        b"",
        formats.vllm_error,
        # vLLM's demo server streams JSON lines with no SSE content type.
        content_type="application/octet-stream",
    ),
}


# --- handlers -----------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    # Raw UTF-8 like vLLM (pydantic), not \u escapes: CJK text reaches the proxy as-is.
    return json.dumps(obj, ensure_ascii=False)


def _json_response(
    obj: Any, request_id: str, status: int = 200, state: _State | None = None
) -> web.Response:
    headers = {"x-sim-request-id": request_id}
    resp = web.json_response(obj, status=status, headers=headers, dumps=_dumps)
    if state is not None:
        state.record(request_id, cast(bytes, resp.body))  # json_response's: encoded bytes
    return resp


async def _read_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _build_exchange(state: _State, kind: str, request: web.Request, body: dict) -> _Exchange:
    """Parse a request, generate its answers and apply any fault (to choice 0)."""
    request_id = request.headers.get("X-Request-ID", "").strip() or f"sim-{next(state.counter):08d}"
    tenant = sim_tenant(request.headers, body)
    state.received[request_id] = body
    state.headers[request_id] = {k.lower(): v for k, v in request.headers.items()}
    while len(state.received) > SENT_RECORDS:
        state.received.popitem(last=False)
    while len(state.headers) > SENT_RECORDS:
        state.headers.popitem(last=False)
    if kind in NATIVE_FORMATS:
        req = NATIVE_FORMATS[kind].parse(body)
        prompt, private, max_words, stream = req.prompt, req.private, req.max_words, req.stream
        n, include_usage = min(req.n, MAX_CHOICES), False
    else:
        if kind == "chat":
            prompt, private = chat_prompt(body.get("messages"))
            max_words = _int_param(body, "max_completion_tokens", None, 0, 1_000_000)
        else:
            prompt = completion_prompt(body.get("prompt"))
            private = question_part(prompt)
            max_words = None
        if max_words is None:
            max_words = _int_param(body, "max_tokens", None, 0, 1_000_000)
        n = _int_param(body, "n", 1, 1, MAX_CHOICES) or 1
        stream = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    misbehave = parse_misbehave(request.headers.get("x-sim-misbehave", ""))
    force = request.headers.get("x-sim-fault", "").strip() or None
    if force is not None and force not in FAULT_KINDS:
        raise BadRequest(f"unknown x-sim-fault {force!r}; expected one of {FAULT_KINDS}")
    answers: list[str] = []
    finish: list[str] = []
    for i in range(n):
        full = answer_for(prompt, variant=i)
        text = full if max_words is None else truncate_units(full, max_words)
        finish.append("length" if len(text) < len(full.rstrip()) else "stop")
        answers.append(text)
    if kind == "chat" and request.headers.get("x-sim-echo", "") == "system":
        # A model that reveals its system prompt (test hook: prompt injection).
        system = [
            content_text(m.get("content")) for m in body["messages"] if m.get("role") == "system"
        ]
        answers[0] = "\n".join([*system, answers[0]])
    # A fault hits one sequence; choice 0 keeps the truth file one line per request. Random
    # faults skip responses that will never be delivered whole, or the truth file would list
    # leaks no detector could see; a forced fault is always applied.
    if force is not None or not misbehave & UNDELIVERED:
        answers[0], _ = state.injector.apply(
            tenant,
            request_id,
            prompt,
            answers[0],
            force=force,
            source=request.headers.get("x-sim-fault-source") or None,
            words=int(w) if (w := request.headers.get("x-sim-fault-words", "")).isdigit() else None,
        )
    state.answers[request_id] = answers
    while len(state.answers) > SENT_RECORDS:
        state.answers.popitem(last=False)
    return _Exchange(
        kind, tenant, request_id, prompt, private, stream, include_usage, answers, finish, misbehave
    )


async def _completion(
    request: web.Request, kind: str, body: dict | None = None
) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    native = NATIVE_FORMATS.get(kind)
    try:
        if body is None:
            body = await _read_body(request)
        ex = _build_exchange(state, kind, request, body)
    except formats.FormatError as exc:
        rid = request.headers.get("X-Request-ID", "") or "rejected"
        err = native.error(str(exc), 400) if native else error_body(str(exc))
        return _json_response(err, rid, status=400)
    if "status500" in ex.misbehave:
        if native is not None:
            err = native.error("simulated engine failure", 500)
        else:
            err = error_body("simulated engine failure", "server_error", 500)
        return _json_response(err, ex.request_id, status=500)
    if "nonjson" in ex.misbehave:
        return web.Response(
            text="oops not json",
            content_type="text/plain",
            headers={"x-sim-request-id": ex.request_id},
        )
    cfg = state.cfg
    prefix = native.id_prefix if native else ("chatcmpl-" if kind == "chat" else "cmpl-")
    resp_id = f"{prefix}{prompt_seed(ex.request_id, cfg.seed):016x}"
    created = int(time.time())
    if not ex.stream:
        state.injector.remember(
            ex.tenant, ex.request_id, ex.prompt, ex.answers[0], private=ex.private
        )
        if native is not None:
            obj = native.body(ex, resp_id, created, cfg.model)
        else:
            obj = full_body(ex, resp_id, created, cfg.model)
        # "mislabelled": labelled UTF-16 but sent as UTF-8, padded to an odd length; no
        # decoder reads it, and the codec's error quotes the whole body.
        misbehave = ex.misbehave
        encoding = (
            "gzip" if "gzip" in misbehave else "utf-16" if "mislabelled" in misbehave else None
        )
        if encoding is not None:
            data = _dumps(obj).encode()
            data = gzip.compress(data) if encoding == "gzip" else data + b" " * (len(data) % 2 == 0)
            headers = {
                "Content-Encoding": encoding,
                "Content-Type": "application/json",
                "x-sim-request-id": ex.request_id,
            }
            state.record(ex.request_id, data)
            return web.Response(body=data, headers=headers)
        return _json_response(obj, ex.request_id, state=state)
    try:
        return await _stream(request, state, ex, resp_id, created)
    finally:
        # Remember cancelled streams too: the pages they generated existed, and leak.
        output = ex.answers[0] if ex.generated is None else ex.generated
        state.injector.remember(ex.tenant, ex.request_id, ex.prompt, output, private=ex.private)


async def _stream(
    request: web.Request, state: _State, ex: _Exchange, resp_id: str, created: int
) -> web.StreamResponse:
    """Send the SSE stream one event per write, sleeping token_delay between events."""
    cfg = state.cfg
    rng = random.Random(prompt_seed(ex.request_id, cfg.seed + 1))
    pieces = [stream_pieces(a, cfg.words_per_chunk, cfg.split_words, rng) for a in ex.answers]
    native = NATIVE_FORMATS.get(ex.kind)
    content_type = "text/event-stream; charset=utf-8"
    if native is not None:
        events, lead = native.events(ex, resp_id, created, cfg.model, pieces, cfg)
        content_type = native.content_type
    else:
        events = stream_events(ex, resp_id, created, cfg.model, pieces)
        lead = len(pieces)  # one role chunk per choice (chat), or the first choices' deltas
    resp = web.StreamResponse(
        headers={
            "Content-Type": content_type,
            "Cache-Control": "no-cache",
            "x-sim-request-id": ex.request_id,
        }
    )
    compressor = None
    if "gzip" in ex.misbehave:
        # Streaming gzip: each event is compressed and sync-flushed so it still arrives live.
        resp.headers["Content-Encoding"] = "gzip"
        compressor = zlib.compressobj(wbits=31)
    await resp.prepare(request)
    delay = cfg.token_delay + (SLOW_CHUNK_DELAY if "slow" in ex.misbehave else 0.0)
    if "error-event" in ex.misbehave:
        cut = lead + min(2, len(pieces[0]))  # what comes before the text + a couple of deltas
        error_event = native.error_event if native is not None else OPENAI_ERROR_EVENT
        events = events[:cut] + [error_event]
    truncate_at = len(events) // 2 if "truncate" in ex.misbehave else None
    stall_at = len(events) // 2 if "stall" in ex.misbehave else None
    i = -1
    try:
        async for i, event in _paced(events, delay):
            if i == stall_at:
                await _stall(request)  # an engine that hangs mid-generation
            if truncate_at is not None and i == truncate_at:
                await _write(resp, event[: max(1, len(event) // 2)], compressor, state, ex)
                # Stop mid-event and drop the connection: no terminating chunk, no [DONE].
                if request.transport is not None:
                    request.transport.abort()
                return resp
            await _write(resp, event, compressor, state, ex)
        if compressor is not None:
            tail = compressor.flush()
            state.record(ex.request_id, tail)
            await resp.write(tail)
        await resp.write_eof()
        state.outcomes[ex.request_id] = "complete"
    except (ConnectionResetError, asyncio.CancelledError):
        # The client (or a proxy cutting the stream) went away: the engine stops here.
        state.outcomes[ex.request_id] = f"aborted after {i + 1} of {len(events)} events"
        ex.generated = generated_prefix(pieces, written=i, lead=lead)
    return resp


async def _stall(request: web.Request) -> None:
    """Silence for STALL_SECONDS, or until the peer goes away (then as a write fails)."""
    for _ in range(int(STALL_SECONDS / 0.1)):
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the peer went away during the stall")
        await asyncio.sleep(0.1)


def generated_prefix(pieces: list[list[str]], *, written: int, lead: int) -> str:
    """Choice 0's text in the first ``written`` events of a stream: after ``lead``
    events without text, the choices' pieces interleave one event each."""
    per_choice = -(-max(0, written - lead) // max(1, len(pieces)))
    return "".join(pieces[0][:per_choice])


async def _paced(events: list[bytes], delay: float) -> AsyncIterator[tuple[int, bytes]]:
    """Yield events, sleeping `delay` before every event after the first."""
    for i, event in enumerate(events):
        if i and delay > 0:
            await asyncio.sleep(delay)
        yield i, event


async def _write(
    resp: web.StreamResponse, data: bytes, compressor: Any, state: _State, ex: _Exchange
) -> None:
    if compressor is not None:
        data = compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)
    state.record(ex.request_id, data)
    await resp.write(data)


async def outcome(request: web.Request) -> web.Response:
    """GET /_sim/outcome/{request_id}: how that stream ended (test hook)."""
    result = request.app[STATE_KEY].outcomes.get(request.match_info["request_id"])
    return web.json_response({"outcome": result}, status=200 if result else 404)


async def answer(request: web.Request) -> web.Response:
    """GET /_sim/answer/{request_id}: ``{"answers": [...]}``, the text of each choice as
    generated, faults applied, however much of it the client was sent (test hook)."""
    texts = request.app[STATE_KEY].answers.get(request.match_info["request_id"])
    return web.json_response({"answers": texts}, status=200 if texts is not None else 404)


async def headers(request: web.Request) -> web.Response:
    """GET /_sim/headers/{request_id}: the headers received for that request (test hook)."""
    seen = request.app[STATE_KEY].headers.get(request.match_info["request_id"])
    return web.json_response(seen, status=200 if seen is not None else 404)


async def received(request: web.Request) -> web.Response:
    """GET /_sim/received/{request_id}: the JSON body received for that request (test hook)."""
    body = request.app[STATE_KEY].received.get(request.match_info["request_id"])
    return web.json_response(body, status=200 if body is not None else 404)


async def sent(request: web.Request) -> web.Response:
    """GET /_sim/sent/{request_id}: the exact body bytes sent for that request (test hook)."""
    data = request.app[STATE_KEY].sent.get(request.match_info["request_id"])
    if data is None:
        return web.Response(status=404)
    return web.Response(body=bytes(data), content_type="application/octet-stream")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _completion(request, "completions")


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (Anthropic Messages)."""
    return await _completion(request, "messages")


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses (OpenAI Responses)."""
    return await _completion(request, "responses")


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: SGLang (``text``), TGI (``inputs``) or vLLM's demo server
    (``prompt``), told apart by the body as the proxy does."""
    try:
        body = await _read_body(request)
    except BadRequest as exc:
        return _json_response(error_body(str(exc)), "rejected", status=400)
    for key, kind in (("text", "sglang"), ("inputs", "tgi"), ("prompt", "vllm")):
        if key in body:
            return await _completion(request, kind, body)
    err = error_body("expected 'text' (SGLang), 'inputs' (TGI) or 'prompt' (vLLM)")
    return _json_response(err, request.headers.get("X-Request-ID", "") or "rejected", status=400)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    """POST /generate_stream (TGI)."""
    return await _completion(request, "tgi_stream")


async def models(request: web.Request) -> web.Response:
    """GET /v1/models (OpenAI list format)."""
    cfg = request.app[STATE_KEY].cfg
    entry = {"id": cfg.model, "object": "model", "created": 0, "owned_by": cfg.engine}
    return web.json_response({"object": "list", "data": [entry]})


async def version(request: web.Request) -> web.Response:
    """GET /version, as vLLM serves it."""
    return web.json_response({"version": request.app[STATE_KEY].cfg.engine_version})


async def health(_request: web.Request) -> web.Response:
    """GET /health: 200 with an empty body, as vLLM."""
    return web.Response(status=200)


async def _server_header(_request: web.Request, resp: web.StreamResponse) -> None:
    # vLLM and SGLang serve through uvicorn; look like them to header-sniffing clients.
    resp.headers["Server"] = "uvicorn"


def make_app(cfg: SimConfig) -> web.Application:
    """The aiohttp application of one simulated engine."""
    injector = FaultInjector(
        cfg.leak_rate, seed=cfg.seed, kinds=cfg.fault_kinds, truth_path=cfg.truth_path
    )
    app = web.Application()
    app[STATE_KEY] = _State(cfg=cfg, injector=injector)
    app.on_response_prepare.append(_server_header)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/_sim/sent/{request_id}", sent)
    app.router.add_get("/_sim/answer/{request_id}", answer)
    app.router.add_get("/_sim/headers/{request_id}", headers)
    app.router.add_get("/_sim/outcome/{request_id}", outcome)
    app.router.add_get("/_sim/received/{request_id}", received)
    return app


async def start_sim(
    cfg: SimConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Start the engine (HTTPS with ``ssl_context``); returns the runner (call
    `await runner.cleanup()`) and bound port."""
    runner = web.AppRunner(make_app(cfg), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, int(bound)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="crosstalk sim", description="Simulated OpenAI-compatible LLM")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between chunks")
    p.add_argument("--words-per-chunk", type=int, default=1)
    p.add_argument("--split-words", action="store_true", help="cut some deltas mid-word")
    p.add_argument("--leak-rate", type=float, default=0.0, help="fault probability per request")
    p.add_argument("--truth", default=None, help="append injected faults here (JSON lines)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-kinds", default=",".join(FAULT_KINDS), help="comma-separated")
    p.add_argument("--model", default="sim-llm-1")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--engine-version", default="0.10.2")
    p.add_argument("--tls-cert", help="serve HTTPS: PEM certificate chain")
    p.add_argument("--tls-key", help="the certificate's PEM private key")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    p.add_argument(
        "--incremental-output",
        action="store_true",
        help="SGLang /generate streams only new text (SGLang's --incremental-streaming-output)",
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """SimConfig from parsed CLI arguments; raises ValueError on bad values."""
    kinds = tuple(k.strip() for k in args.fault_kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"--fault-kinds: unknown {unknown}; choose from {','.join(FAULT_KINDS)}")
    if not 0.0 <= args.leak_rate <= 1.0:
        raise ValueError("--leak-rate must be within [0, 1]")
    if args.words_per_chunk < 1 or args.token_delay < 0:
        raise ValueError("--words-per-chunk must be >= 1 and --token-delay >= 0")
    return SimConfig(
        token_delay=args.token_delay,
        words_per_chunk=args.words_per_chunk,
        split_words=args.split_words,
        leak_rate=args.leak_rate,
        truth_path=args.truth,
        seed=args.seed,
        fault_kinds=kinds,
        model=args.model,
        engine=args.engine,
        engine_version=args.engine_version,
        incremental_output=args.incremental_output,
    )


def tls_context(cert: str, key: str | None, client_ca: str | None) -> ssl.SSLContext:
    """A server context for ``--tls-cert``; with ``client_ca`` a client certificate
    signed by it is required (mutual TLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def _serve(cfg: SimConfig, host: str, port: int, context: ssl.SSLContext | None) -> None:
    runner, bound = await start_sim(cfg, host, port, context)
    print(f"sim listening on {'https' if context else 'http'}://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """`crosstalk sim`: run the simulated engine until SIGINT/SIGTERM."""
    args = _parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"crosstalk sim: {exc}", file=sys.stderr)
        return 2
    try:
        context = (
            tls_context(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        )
    except (OSError, ssl.SSLError) as exc:
        print(f"crosstalk sim: --tls-cert: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(cfg, args.host, args.port, context))
    except OSError as exc:
        print(f"crosstalk sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
