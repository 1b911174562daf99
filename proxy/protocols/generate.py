"""Native text-generation endpoints: SGLang ``/generate``, TGI ``/generate`` and
``/generate_stream``, vLLM's demo ``/generate``.

One path, three engines; the body tells them apart, request and response alike:

=========  ==============================  =============================================
engine     request                         response
=========  ==============================  =============================================
SGLang     ``text`` (string or list) or    ``{"text", "output_ids", "meta_info"}`` (a list
           ``input_ids``; ``stream``       of them for a batch or ``n`` > 1); streamed:
                                           ``data: {...}`` events whose ``text`` is
                                           **cumulative** by default (incremental with
                                           ``--incremental-streaming-output``), ``index``
                                           per sequence, ``data: [DONE]``; errors
                                           ``{"error": {"message"}}``
TGI        ``inputs``, ``parameters``      ``{"generated_text", "details"}``; streamed
                                           (``/generate_stream``): one event per token,
                                           ``{"token": {"text", "special"}, ...}``, the
                                           last one also with the whole
                                           ``generated_text``; errors ``{"error":
                                           "...", "error_type": "..."}``
vLLM       ``prompt``, ``stream``          ``{"text": [prompt + output, ...]}``; streamed:
                                           the same, cumulative, one JSON object a line
                                           (not SSE: the proxy buffers it, like any
                                           response that is not ``text/event-stream``)
=========  ==============================  =============================================

vLLM's ``api_server.py`` says of itself that it is for demos and benchmarks only, not for
production; vLLM's production text endpoint is ``/v1/completions`` (the OpenAI module).
Its output (and TGI's with ``return_full_text``) repeats the prompt: that is the tenant's
own text, which the detector never reports.

A cut stream ends in the engine's own error event: TGI's on ``/generate_stream``, SGLang's
(``data: {"error": {...}}`` then ``data: [DONE]``) on ``/generate``. A blocked whole
response is an HTTP error with ``{"error": {"message", "type", "code", ...}}``, SGLang's
envelope: the engine behind ``/generate`` is not known once the request is gone (TGI's
clients raise on the status, with that object as the message).

Streams are fed to the detector as increments. SGLang's cumulative ``text`` is turned into
the new characters of each event; whether a stream is cumulative is read from
``output_ids`` against ``meta_info.completion_tokens`` when the engine sends them, else
from the text itself (see :class:`StreamParser`). TGI's special tokens (``</s>``) and its
final ``generated_text`` (a repeat of the tokens) are not output text.

Ollama's ``/api/generate`` has another format and is not handled (passed through).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.protocols import openai
from proxy.protocols.chat_templates import conversation_texts
from proxy.protocols.openai import (
    OutputDelta,
    ParsedRequest,
)
from proxy.protocols.shapes import (
    DONE_MARKER,
    MALFORMED,
    ProtocolError,
    Shape,
    event_object,
    load_object,
    opt_str,
    opt_text,
)
from proxy.protocols.sse import SSEEvent

__all__ = [
    "StreamParser",
    "error_body",
    "error_event",
    "parse_request",
    "parse_response",
    "route_for",
    "tgi_error_event",
]

GENERATE, GENERATE_STREAM = "generate", "generate_stream"


def route_for(method: str, path: str) -> str | None:
    """``"generate"`` or ``"generate_stream"`` for ``POST .../generate[_stream]`` (any
    prefix but Ollama's ``/api``; query and one trailing slash ignored), else ``None``.
    SGLang also accepts ``PUT /generate``."""
    if method.upper() not in ("POST", "PUT"):
        return None
    path = path.partition("?")[0].partition("#")[0]
    if path.endswith("/"):
        path = path[:-1]
    head, _, last = path.rpartition("/")
    if last not in (GENERATE, GENERATE_STREAM) or head.rpartition("/")[2] == "api":
        return None
    if method.upper() == "PUT" and last != GENERATE:
        return None
    return last


def parse_request(kind: str, body: bytes) -> ParsedRequest:
    """The prompt of a generate request: SGLang's ``text`` (a string or a list, joined),
    TGI's ``inputs`` or vLLM's ``prompt``. Token ids (SGLang's ``input_ids``) are not
    text: such a request has an empty prompt (its output is still scanned and learned).
    A conversation rendered by a chat template counts as its turns' texts, its assistant
    turns as ``model_text`` (:mod:`proxy.protocols.chat_templates`).
    ``stream`` is always true on ``/generate_stream``. ``n`` is the number of sequences
    (SGLang: prompts in the batch times ``sampling_params.n``).

    Raises :class:`ProtocolError` if the body is not a JSON object, has none of
    ``text``/``input_ids``/``inputs``/``prompt``, or one of them has the wrong type.
    """
    obj = load_object(body)
    try:
        if not any(k in obj for k in ("text", "input_ids", "inputs", "prompt")):
            raise Shape("no 'text', 'input_ids', 'inputs' or 'prompt'")
        pieces: list[str] = []
        prompts = 1
        text = obj.get("text")
        if isinstance(text, list):
            for item in text:
                if not isinstance(item, str):
                    raise Shape("'text' list items must be strings")
                if item:
                    pieces.append(item)
            prompts = max(1, len(text))
        else:
            opt_text(text, pieces)
        opt_text(obj.get("inputs"), pieces)
        opt_text(obj.get("prompt"), pieces)
        stream = obj.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise Shape("'stream' must be a boolean")
        params = obj.get("sampling_params")
        n = params.get("n") if isinstance(params, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            n = 1
        prompt, model_text, turns_known = conversation_texts("\n".join(pieces))
        return ParsedRequest(
            prompt=prompt,
            model_text=model_text,
            stream=kind == GENERATE_STREAM or bool(stream),
            model=opt_str(obj, "model"),
            n=prompts * n,
            user=None,
            turns_known=turns_known,
        )
    except Shape as exc:
        raise ProtocolError(f"{kind} request: {exc}") from None


def parse_response(kind: str, body: bytes) -> list[OutputDelta]:
    """One :class:`OutputDelta` per sequence of a whole generate response: TGI's
    ``generated_text``, SGLang's ``text``, vLLM's ``text`` list; a list of such objects
    (SGLang batches, TGI's ``/`` route) gives one per item (``index`` if present, else its
    position). vLLM's streamed lines, when buffered whole, are read from the last line.

    Raises :class:`ProtocolError` for an error body or a shape none of the engines sends.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        lines = [line for line in body.splitlines() if line.strip()]
        if len(lines) < 2:
            load_object(body)  # raises the usual "not valid JSON" error
        obj = load_object(lines[-1])
    try:
        items = obj if isinstance(obj, list) else [obj]
        out: list[OutputDelta] = []
        for position, item in enumerate(items):
            if not isinstance(item, dict):
                raise Shape("each result must be an object")
            if "error" in item:
                raise Shape("an error body")
            text = item.get("generated_text", item.get("text"))
            if isinstance(text, list):  # vLLM: one string per sequence
                for i, piece in enumerate(text):
                    if not isinstance(piece, str):
                        raise Shape("'text' list items must be strings")
                    out.append(OutputDelta(i, piece))
            elif isinstance(text, str):
                out.append(OutputDelta(_index(item.get("index"), position), text))
            else:
                raise Shape("no 'generated_text' or 'text' string")
        return out
    except Shape as exc:
        raise ProtocolError(f"{kind} response: {exc}") from None


@dataclass(slots=True)
class _Sequence:
    """What one streamed sequence has said so far."""

    text: str = ""
    events: int = 0
    cumulative: bool | None = None  # None: not known yet


@dataclass(slots=True)
class StreamParser:
    """Turn a streamed generate response (SGLang or TGI events) into output deltas.

    SGLang events carry ``text``: cumulative (every event repeats the text so far) unless
    the server runs with ``--incremental-streaming-output``. Per sequence the parser
    decides which, then feeds only the new characters:

    * ``output_ids`` shorter than ``meta_info.completion_tokens``: incremental; equal
      after the first event: cumulative (SGLang sends both in either mode);
    * else from the text: an event that extends the text so far is cumulative, one that
      does not is incremental. Decided once, on the second event with text.
    * A cumulative event that rewrites earlier text (a detokeniser fixing a partial
      character) feeds the rewritten tail again.

    ``done``: ``data: [DONE]`` or TGI's last event (the one with ``generated_text``).
    ``error``: the ``error`` of an error event (TGI's string becomes ``{"message",
    "type"}``). ``malformed_events``: events that were not JSON objects of either shape.
    """

    route: str = GENERATE
    done: bool = False
    error: dict[str, Any] | None = None
    model: str | None = None
    malformed_events: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    _sequences: dict[int, _Sequence] = field(default_factory=dict)

    def feed(self, event: SSEEvent) -> list[OutputDelta]:
        """Consume one SSE event and return the output text it carries. Never raises."""
        obj = event_object(event)
        if not isinstance(obj, dict):
            self.done |= obj == DONE_MARKER
            self.malformed_events += obj == MALFORMED
            return []
        err = obj.get("error")
        if err is not None:
            if isinstance(err, dict):
                self.error = err
            else:
                self.error = {"message": str(err), "type": obj.get("error_type")}
            return []
        token = obj.get("token")
        if isinstance(token, dict):  # TGI
            if isinstance(obj.get("generated_text"), str):
                self.done = True
            text = token.get("text")
            if token.get("special") or not isinstance(text, str) or not text:
                return []
            return [OutputDelta(0, text)]
        text = obj.get("text")
        if not isinstance(text, str):
            self.malformed_events += 1
            return []
        meta = obj.get("meta_info")
        index = _index(obj.get("index"), 0)
        if isinstance(meta, dict):
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and isinstance(reason.get("type"), str):
                self.finish_reasons[index] = reason["type"]
        seq = self._sequences.get(index)
        if seq is None:
            seq = self._sequences[index] = _Sequence()
        new = _increment(seq, text, obj.get("output_ids"), meta)
        return [OutputDelta(index, new)] if new else []

    def error_event(self, message: str, *, type: str, code: str) -> bytes:
        """The event that ends a cut stream: TGI's own on ``/generate_stream`` (only TGI
        streams there), else SGLang's (:func:`error_event`)."""
        if self.route == GENERATE_STREAM:
            return tgi_error_event(message, code=code)
        return error_event(message, type=type, code=code)


def _increment(seq: _Sequence, text: str, ids: Any, meta: Any) -> str:
    """The characters ``text`` adds to sequence ``seq`` (and update it)."""
    seq.events += 1
    if seq.cumulative is None:
        seq.cumulative = _mode_hint(seq, ids, meta)
    if seq.cumulative is None:
        if not seq.text:  # the first text is new whichever the mode
            seq.text = text
            return text
        if text:  # the second one decides
            seq.cumulative = text.startswith(seq.text)
    if not seq.cumulative:
        seq.text += text
        return text
    if text.startswith(seq.text):
        new = text[len(seq.text) :]
    else:
        # Rewritten: feed everything after the common prefix. (Also what an incremental
        # stream taken for cumulative degrades to: each piece, less any prefix it shares
        # with the previous one.)
        common = 0
        for a, b in zip(seq.text, text, strict=False):
            if a != b:
                break
            common += 1
        new = text[common:]
    seq.text = text
    return new


def _mode_hint(seq: _Sequence, ids: Any, meta: Any) -> bool | None:
    """SGLang's own signal: in cumulative mode ``output_ids`` holds every token so far,
    as many as ``meta_info.completion_tokens``; in incremental mode only the new ones."""
    done = meta.get("completion_tokens") if isinstance(meta, dict) else None
    if not isinstance(ids, list) or not isinstance(done, int) or isinstance(done, bool):
        return None
    if len(ids) < done:
        return False
    if len(ids) == done and seq.events > 1:
        return True
    return None


def error_body(message: str, *, type: str, code: str) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}``: SGLang's error envelope (an
    ``error`` object with a ``message``), and TGI clients raise on any ``error`` key."""
    return openai.error_body(message, type=type, code=code)


def error_event(message: str, *, type: str, code: str) -> bytes:
    """:func:`error_body` as a ``data:`` event: SGLang's stream error (it sends
    ``data: {"error": {...}}``), which TGI's clients also raise on (they look for an
    ``error`` key). Followed by ``data: [DONE]``, as SGLang ends a failed stream."""
    return b"data: " + error_body(message, type=type, code=code) + b"\n\ndata: [DONE]\n\n"


def tgi_error_event(message: str, *, code: str) -> bytes:
    """TGI's stream error, ``data:{"error": "<message>", "error_type": "<code>"}``: its
    clients raise it with the message as is (``text_generation`` reads ``error`` as a
    string)."""
    return b"data:" + orjson.dumps({"error": message, "error_type": code}) + b"\n\n"


def _index(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
