"""Every parser that reads outside input, as a fuzz target: a hypothesis strategy of
inputs and a call that may fail only in the documented way (each target's ``allowed``
exceptions). Run briefly by tests/test_fuzz.py in every test run and at length by
bench/fuzz.py. A crash found becomes a regression example in tests/test_fuzz.py."""

from __future__ import annotations

import base64
import json
import os
import tempfile
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brotli
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import strategies as st

from proxy.config import ConfigError, load_text
from proxy.forensics import pyrepr
from proxy.forensics.gateway_logs import litellm_record
from proxy.forensics.inputs import InputError
from proxy.forensics.readers import jsonl_record, open_input, read_records
from proxy.protocols import ProtocolError, Route
from proxy.protocols.chat_templates import split_turns
from proxy.protocols.decoding import UnsupportedEncoding, stream_decoder, zstd
from proxy.protocols.sse import SSEDecoder
from proxy.store import journal
from proxy.store.redis_index import KEY, ORIGIN, RECORD, Ingester
from proxy.tenants import TenantRules, load_jwt_key

ROUTES = (
    Route("openai", "chat"),
    Route("openai", "completions"),
    Route("anthropic", "messages"),
    Route("responses", "responses"),
    Route("textgen", "generate"),
    Route("textgen", "generate_stream"),
)

# JSON values shaped like API bodies: the keys the parsers read, and any others.
KEYS = st.sampled_from(
    ["messages", "role", "content", "prompt", "text", "inputs", "choices", "delta", "index",
     "type", "stream", "n", "user", "model", "tool_calls", "function", "arguments",
     "output", "input", "system", "parts", "token", "generated_text", "error", "usage",
     "reasoning_content", "message", "content_block", "sampling_params", "metadata", "x"]
)  # fmt: skip
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text()
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(KEYS | st.text(), inner, max_size=6)
    ),
    max_leaves=30,
)


def _dump(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


BODIES = st.one_of(JSON.map(_dump), st.binary(max_size=300), JSON.map(_dump).map(lambda b: b[:-3]))
SSE_BYTES = st.lists(
    st.one_of(
        BODIES.map(lambda b: b"data: " + b + b"\n\n"),
        st.sampled_from([b"data: [DONE]\n\n", b"event: x\n", b": ping\n\n", b"\r\n", b"data:"]),
        st.binary(max_size=40),
    ),
    max_size=8,
).map(b"".join)


class _Log:
    """A logger that keeps nothing (the ingester logs the first corrupt entry)."""

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


_INGESTER: list[Ingester] = []


def _ingest(data: tuple[bytes, bool]) -> None:
    """One Redis stream entry from another replica, as the consumer hands it over: the
    record is zlib-compressed JSON of any shape (never a reason to raise)."""
    if not _INGESTER:
        from proxy.config import Config
        from proxy.factory import build_engine

        counters: dict[str, int] = defaultdict(int)  # SharedIndex names them all
        _INGESTER.append(Ingester(build_engine(Config()), "fuzz-replica", _Log(), counters))
    ingester = _INGESTER[0]
    raw, compressed = data
    fields = {ORIGIN: b"other-replica", KEY: ingester.key_id,
              RECORD: zlib.compress(raw) if compressed else raw}  # fmt: skip
    ingester.ingest(b"1-0", fields)


DATA = Path(__file__).parent / "data"
_SAMPLE_LINES = {
    fmt: (DATA / name).read_bytes().splitlines(keepends=True)
    for fmt, name in (
        ("sglang", "sglang-requests.log"),
        ("sglang-json", "sglang-requests-json.log"),
        ("vllm", "vllm-requests.log"),
        ("otel", "otel-genai-traces.jsonl"),
    )
}
_REPR_TOKENS = st.sampled_from(
    ["'", '"', "(", ")", "[", "]", "{", "}", ", ", "=", ": ", " ... ", "None", "True", "x",
     "1", "-2.5e3", "\\", "\\'", "GenerateReqInput(", "rid='r'", "text='t'", "<obj at 0x1>",
     "out={'text': 'a'}", "SamplingParams(n=1)", "\n", "\u00e9", "inf"]
)  # fmt: skip
REPR_TEXT = st.one_of(
    st.lists(_REPR_TOKENS, max_size=30).map("".join),
    JSON.map(repr),
    st.tuples(JSON.map(repr), st.integers(0, 200)).map(lambda t: t[0][: t[1]]),
)


def _capture_samples() -> tuple[bytes, bytes]:
    """A small mitmproxy flow file and a HAR of the same exchanges (mitmproxy's own
    writer and HAR exporter), for the flow and HAR readers' mutations."""
    import io

    from mitmproxy.addons.savehar import SaveHar
    from mitmproxy.io import FlowWriter
    from mitmproxy.test import tflow

    flows = []
    for n, streamed in enumerate((False, True, False)):
        flow = tflow.tflow(resp=True)
        flow.request.path = "/v1/chat/completions"
        flow.request.headers["x-tenant-id"] = f"t{n}"
        flow.request.content = json.dumps(
            {"messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        if streamed:
            flow.response.headers["content-type"] = "text/event-stream"
            flow.response.content = (
                b'data: {"choices":[{"delta":{"content":"yo"}}]}\n\ndata: [DONE]\n\n'
            )
        else:
            flow.response.content = b'{"choices":[{"message":{"content":"hello"}}]}'
        flows.append(flow)
    out = io.BytesIO()
    writer = FlowWriter(out)
    for flow in flows:
        writer.add(flow)
    return out.getvalue(), json.dumps(SaveHar().make_har(flows), indent=1).encode()


_FLOWS, _HAR = _capture_samples()


def _mutated_bytes(sample: bytes) -> st.SearchStrategy[bytes]:
    """A whole sample file cut short, with bytes overwritten or spliced in."""
    at = st.integers(0, len(sample))
    return st.one_of(
        at.map(lambda n: sample[:n]),
        st.tuples(at, st.binary(min_size=1, max_size=8)).map(
            lambda t: sample[: t[0]] + t[1] + sample[t[0] + len(t[1]) :]
        ),
        st.tuples(at, st.binary(max_size=30)).map(lambda t: sample[: t[0]] + t[1] + sample[t[0] :]),
    )


def _mutated_lines(fmt: str) -> st.SearchStrategy[bytes]:
    """Real lines of a sample, cut short, spliced with junk or repr soup, reordered."""
    line = st.sampled_from(_SAMPLE_LINES[fmt])
    mutation = st.one_of(
        line,
        st.tuples(line, st.integers(0, 3000)).map(lambda t: t[0][: t[1]]),
        st.tuples(line, st.integers(0, 3000), st.binary(max_size=20)).map(
            lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
        ),
        st.tuples(line, st.integers(0, 3000), REPR_TEXT).map(
            lambda t: t[0][: t[1]] + t[2].encode() + t[0][t[1] :]
        ),
    )
    return st.lists(mutation, max_size=5).map(b"".join)


def _read_file(fmt: str) -> Callable[[bytes], None]:
    """A whole file through a reader: it skips what it cannot read, never raises. Opening
    it may refuse the whole file the documented way (``InputError``: a file that starts
    with gzip's magic bytes but is no gzip stream, say)."""

    def run(data: bytes) -> None:
        fd, name = tempfile.mkstemp(prefix="crosstalk-fuzz-")
        try:
            os.write(fd, data)
            os.close(fd)
            try:
                source = open_input(name, fmt)
            except InputError:
                return
            try:
                for _ in read_records(source, lambda skipped: None):
                    pass
            finally:
                source.close()
        finally:
            os.unlink(name)

    return run


@dataclass(frozen=True)
class Target:
    name: str
    inputs: st.SearchStrategy
    call: Callable[[Any], object]
    allowed: tuple[type[BaseException], ...] = ()


def _stream(route: Route) -> Callable[[tuple[bytes, int]], object]:
    def run(data: tuple[bytes, int]) -> None:
        raw, cut = data
        decoder, parser = SSEDecoder(), route.stream_parser()
        for piece in (raw[:cut], raw[cut:]):
            for event in decoder.feed(piece):
                parser.feed(event)

    return run


def _decode(data: tuple[str, bytes]) -> None:
    encoding, raw = data
    decode = stream_decoder(encoding)
    decode(raw)
    decode(b"")


_COMPRESSED = st.tuples(st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "x"]),
                        st.binary(max_size=200)) | st.tuples(
    st.just("gzip"), st.binary(max_size=200).map(lambda b: zlib.compress(b)[: len(b) // 2 + 2])
)  # fmt: skip


def _jwt_target() -> tuple[TenantRules, st.SearchStrategy[str]]:
    """Rules that verify ES256 tokens, and bearer credentials made from a valid token
    whose header, payload or signature may be replaced by junk or by other JSON, the
    header also by one naming another algorithm (``none``, HMAC, RSA, another curve)."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    rules = TenantRules(
        sources=("jwt",), secret=b"k", jwt_key=load_jwt_key(public, ("ES256",)),
        jwt_algorithms=("ES256",),
    )  # fmt: skip
    valid = jwt.encode({"sub": "acme", "exp": 4102444800}, key, algorithm="ES256")

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    def part(original: str) -> st.SearchStrategy[str]:
        return st.one_of(
            st.just(original),
            JSON.map(lambda v: b64(_dump(v))),
            st.binary(max_size=80).map(b64),
            st.text(max_size=40),
        )

    header, payload, signature = valid.split(".")
    algorithms = ["none", "HS256", "RS256", "PS256", "ES256", "ES384", "EdDSA", "x", ""]
    headers = part(header) | st.sampled_from(algorithms).map(
        lambda a: b64(json.dumps({"alg": a, "typ": "JWT"}).encode())
    )
    tokens = st.tuples(headers, part(payload), part(signature)).map(".".join)
    return rules, st.one_of(tokens, st.text(max_size=120))


_JWT_RULES, _JWT_TOKENS = _jwt_target()


TARGETS: tuple[Target, ...] = (
    *(
        Target(f"{r.api}.{r.kind}.request", BODIES, r.parse_request, (ProtocolError,))
        for r in ROUTES
    ),
    *(
        Target(f"{r.api}.{r.kind}.response", BODIES, r.parse_response, (ProtocolError,))
        for r in ROUTES
    ),
    *(
        Target(f"{r.api}.{r.kind}.stream", st.tuples(SSE_BYTES, st.integers(0, 400)), _stream(r))
        for r in ROUTES
    ),
    Target("sse", st.tuples(SSE_BYTES, st.integers(0, 400)), _stream(ROUTES[0])),
    Target(
        "decoding",
        _COMPRESSED,
        _decode,
        (UnsupportedEncoding, zlib.error, brotli.error, zstd.ZstdError),
    ),  # fmt: skip
    Target("chat_templates", st.text(max_size=300), split_turns),
    Target("journal", BODIES, journal.decode, (ValueError, KeyError, TypeError)),
    Target(
        "jsonl_reader",
        JSON,
        lambda obj: jsonl_record(obj, "f:1", "f:1"),
        (ValueError, KeyError, TypeError),
    ),  # fmt: skip
    Target(
        "litellm_reader",
        st.fixed_dictionaries(
            {
                "call_type": st.sampled_from(["acompletion", "text_completion", "x"]),
                "messages": JSON,
                "metadata": JSON,
                "startTime": SCALARS,
                "response": JSON,
            }
        ),
        lambda obj: litellm_record(obj, "f:1", "f:1"),
        (ValueError, KeyError, TypeError),
    ),  # fmt: skip
    Target("flows_reader", _mutated_bytes(_FLOWS), _read_file("flows")),
    Target("har_reader", _mutated_bytes(_HAR), _read_file("har")),
    Target("pyrepr", REPR_TEXT, pyrepr.parse, (ValueError,)),
    Target("sglang_reader", _mutated_lines("sglang"), _read_file("sglang")),
    Target("sglang_json_reader", _mutated_lines("sglang-json"), _read_file("sglang")),
    Target("vllm_reader", _mutated_lines("vllm"), _read_file("vllm")),
    Target("otel_reader", _mutated_lines("otel"), _read_file("otel")),
    Target("config", st.text(max_size=300), load_text, (ConfigError,)),
    Target("redis_record", st.tuples(BODIES, st.booleans()), _ingest),
    Target("jwt_bearer", _JWT_TOKENS, _JWT_RULES.tenant_of_token),
)
