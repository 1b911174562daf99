"""OpenAI-compatible HTTP API: ``/v1/chat/completions`` and ``/v1/completions``.

Extracts the prompt text of a request and the output text of a response, whole or streamed.
The same wire format is spoken by vLLM, SGLang, TGI, llama.cpp, Ollama and most gateways, so
the parser accepts their common extensions (``reasoning_content`` / ``reasoning`` deltas, an
error object in place of a chunk) and tolerates missing optional keys.

Two failure policies, by design:

* Whole bodies (:func:`parse_request`, :func:`parse_response`) raise :class:`ProtocolError` if
  they are not JSON or a field this module reads has the wrong type. The caller logs it and
  passes the traffic through untouched; an engine would reject such a request anyway.
* Streams (:class:`StreamParser`) never raise: one bad event must not cost the rest of the
  stream, so it is counted in ``malformed_events`` and whatever is well-formed in it is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import orjson

from proxy.protocols._wire import openai_event_deltas
from proxy.protocols.chat_templates import conversation_texts
from proxy.protocols.shapes import (
    DONE_MARKER,
    MALFORMED,
    ProtocolError,
    Shape,
    event_object,
    load_object,
    opt_str,
    opt_text,
    type_of,
)
from proxy.protocols.sse import SSEEvent

__all__ = [
    "OutputDelta",
    "ParsedRequest",
    "ProtocolError",
    "Route",
    "StreamParser",
    "error_body",
    "error_event",
    "parse_request",
    "parse_response",
    "route_for",
]

Route = Literal["chat", "completions"]

# Content-part types whose "text" key is prompt or output text. "input_text"/"output_text" are
# the Responses-API spellings that some clients and gateways also send to chat completions.
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the proxy needs from a request body.

    ``prompt`` is every piece of prompt text, non-empty pieces joined with ``"\\n"``:

    * chat: each message in order; per message its ``reasoning_content``/``reasoning``, its
      ``content`` (a string, or the text of ``text``/``input_text``/``output_text`` parts and
      the ``refusal`` of ``refusal`` parts; image, audio and file parts contribute nothing),
      ``refusal``, then ``tool_calls[].function.arguments`` (and ``custom.input``) and the
      legacy ``function_call.arguments``. Tool definitions are not included.
    * completions: ``prompt`` (a string, or a list whose strings are joined; token-id lists
      contribute nothing), then ``suffix`` if present. A conversation rendered by a chat
      template counts as its turns' texts, without the template's markers
      (:mod:`proxy.protocols.chat_templates`).

    ``model_text`` is the part of ``prompt`` that a model wrote: earlier ``assistant``
    turns of a chat or of a rendered conversation (the detector treats it like an
    output, not like a user's words). ``turns_known``: the request says who wrote what
    (a chat, a rendered conversation whose template was read), so the rest of
    ``prompt`` is its users' words; a plain completions string may quote a model.

    ``n`` defaults to 1; ``model`` and ``user`` are ``None`` when absent.
    """

    prompt: str
    model_text: str
    stream: bool
    model: str | None
    n: int
    user: str | None
    turns_known: bool = False


class OutputDelta(NamedTuple):
    """A piece of output text for one choice (``choice`` is the API's choice ``index``).
    Immutable; a named tuple, not a frozen dataclass, for its cost: one is made for every
    delta of every stream."""

    choice: int
    text: str


def route_for(method: str, path: str) -> Route | None:
    """Return which API a request targets, or ``None`` if this module does not handle it.

    Only ``POST`` is handled. The path's last segment must be ``completions``: preceded by
    ``chat`` it is ``"chat"``, otherwise ``"completions"``. Any prefix is accepted, so
    ``/v1/chat/completions``, ``/chat/completions``, ``/openai/v1/completions`` and Azure's
    ``/openai/deployments/<name>/chat/completions`` all match. The query string and fragment
    are ignored, as is one trailing slash.
    """
    if method.upper() != "POST":
        return None
    path = path.partition("?")[0].partition("#")[0]
    if path.endswith("/"):
        path = path[:-1]
    head, _, last = path.rpartition("/")
    if last != "completions":
        return None
    return "chat" if head.rpartition("/")[2] == "chat" else "completions"


def parse_request(route: Route, body: bytes) -> ParsedRequest:
    """Parse a request body for ``route``; see :class:`ParsedRequest` for what is extracted.

    Raises :class:`ProtocolError` if the body is not a JSON object, if chat ``messages`` is
    missing or not a list of objects, or if any field read here has the wrong type (e.g. a
    non-boolean ``stream``, ``n`` that is not a positive integer, a numeric ``content``).
    Unknown fields and unknown content-part types are ignored.
    """
    obj = load_object(body)
    try:
        pieces: list[str] = []
        model_pieces: list[str] = []
        turns_known = route == "chat"
        if route == "chat":
            messages = obj.get("messages")
            if not isinstance(messages, list):
                raise Shape("'messages' must be a list")
            for message in messages:
                if not isinstance(message, dict):
                    raise Shape("each message must be an object")
                _message_texts(message, pieces)
                if message.get("role") == "assistant":
                    _message_texts(message, model_pieces)
        else:
            _prompt_texts(obj.get("prompt"), pieces)
            text, model_text, turns_known = conversation_texts("\n".join(pieces))
            pieces, model_pieces = [text] if text else [], [model_text]
            opt_text(obj.get("suffix"), pieces)
        stream = obj.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise Shape("'stream' must be a boolean")
        n = obj.get("n")
        if n is None:
            n = 1
        elif not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise Shape("'n' must be a positive integer")
        return ParsedRequest(
            prompt="\n".join(pieces),
            model_text="\n".join(model_pieces),
            stream=bool(stream),
            model=opt_str(obj, "model"),
            n=n,
            user=opt_str(obj, "user"),
            turns_known=turns_known,
        )
    except Shape as exc:
        raise ProtocolError(f"{route} request: {exc}") from None


def parse_response(route: Route, body: bytes) -> list[OutputDelta]:
    """Parse a whole (non-streamed) response body into one :class:`OutputDelta` per choice.

    A chat choice's text is its message's ``reasoning_content``/``reasoning``, ``content``,
    ``refusal``, audio transcript and tool-call arguments, non-empty pieces joined with
    ``"\\n"`` in that (generation) order; a completions choice's text is its ``text``. Choices
    with no text still get a delta with ``text == ""``, in body order; ``choice`` is the
    choice's ``index`` (its position if absent).

    Raises :class:`ProtocolError` if the body is not a JSON object with a ``choices`` list of
    well-formed choices. An error body (``{"error": ...}``) is a ProtocolError too.
    """
    obj = load_object(body)
    try:
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise Shape("'choices' must be a list")
        out: list[OutputDelta] = []
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise Shape("each choice must be an object")
            index = _choice_index(choice, position)
            pieces: list[str] = []
            if route == "chat":
                message = choice.get("message")
                if not isinstance(message, dict):
                    raise Shape("choice 'message' must be an object")
                _message_texts(message, pieces)
                text = "\n".join(pieces)
            else:
                if "text" not in choice and isinstance(choice.get("message"), dict):
                    # A chat answer where a completion was asked for: its text is not
                    # where this route reads, and must not pass as an empty answer.
                    raise Shape("a completions choice holds a chat 'message', not 'text'")
                opt_text(choice.get("text"), pieces)
                text = pieces[0] if pieces else ""
            out.append(OutputDelta(index, text))
        return out
    except Shape as exc:
        raise ProtocolError(f"{route} response: {exc}") from None


@dataclass(slots=True)
class StreamParser:
    """Turn the decoded SSE events of one streamed response into output deltas.

    Feed every event in order. :meth:`feed` returns the text each event adds, per choice,
    in stream order: a chat chunk can yield several deltas for one choice (reasoning, content,
    refusal, tool-call arguments, in that order); empty pieces are dropped. State:

    * ``done``: a ``data: [DONE]`` event was seen (events after it are still parsed).
    * ``error``: the inner object of an ``{"error": {...}}`` event (a bare string error
      becomes ``{"message": ...}``), or a whole ``{"object": "error", ...}`` event as older
      vLLM versions send it. The last one wins.
    * ``model``: from the first chunk that carries a string ``model``.
    * ``finish_reasons``: choice index to the last non-null ``finish_reason``.
    * ``malformed_events``: events that were not JSON, not an object, had no ``choices``
      list, or had a wrong-typed field somewhere. Each counts once; any well-formed choices
      in it are still returned. Empty ``data`` (a keep-alive some servers send) is ignored.
    """

    route: Route
    done: bool = False
    error: dict[str, Any] | None = None
    model: str | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    malformed_events: int = 0
    # The compiled step's last event of the usual shape, as the text around its one
    # output string (``_wire.openai_event_deltas``): not part of the parser's state.
    template: tuple[str, str, int, str | None] | None = field(
        default=None, repr=False, compare=False
    )

    def feed(self, event: SSEEvent) -> list[OutputDelta]:
        """Consume one SSE event and return the output text it carries. Never raises.
        The compiled step (``_wire.openai_event_deltas``) reads an event of the usual
        shape; :meth:`read_event`, the reference it is held to, reads any other, from the
        object the compiled step parsed when it got that far (one parse an event)."""
        read = openai_event_deltas(self, event.data, self.route, OutputDelta)
        if type(read) is list:
            return read
        return self.read_object(event_object(event) if read is None else read)

    def read_event(self, event: SSEEvent) -> list[OutputDelta]:
        """``feed``, in Python: any event, whatever its shape."""
        return self.read_object(event_object(event))

    def read_object(self, obj: dict[str, Any] | str) -> list[OutputDelta]:
        """``read_event`` of an event's ``event_object``."""
        if not isinstance(obj, dict):
            self.done |= obj == DONE_MARKER
            self.malformed_events += obj == MALFORMED
            return []
        err = obj.get("error")
        if err is not None or obj.get("object") == "error":
            self._record_error(obj if err is None else err)
            return []
        if self.model is None:
            model = obj.get("model")
            if isinstance(model, str):
                self.model = model
        choices = obj.get("choices")
        if not isinstance(choices, list):
            self.malformed_events += 1
            return []

        out: list[OutputDelta] = []
        malformed = False
        chat = self.route == "chat"
        for position, choice in enumerate(choices):
            try:
                if not isinstance(choice, dict):
                    raise Shape("choice")
                index = _choice_index(choice, position)
                pieces: list[str] = []
                if chat:
                    delta = choice.get("delta")
                    if delta is not None:
                        if not isinstance(delta, dict):
                            raise Shape("delta")
                        _message_texts(delta, pieces)
                else:
                    opt_text(choice.get("text"), pieces)
                finish = choice.get("finish_reason")
                if isinstance(finish, str):
                    self.finish_reasons[index] = finish
            except Shape:
                malformed = True
                continue
            for piece in pieces:
                out.append(OutputDelta(index, piece))
        if malformed:
            self.malformed_events += 1
        return out

    def _record_error(self, err: Any) -> None:
        if isinstance(err, dict):
            self.error = err
        else:
            self.error = {"message": err if isinstance(err, str) else str(err)}


def error_body(message: str, *, type: str, code: str) -> bytes:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param": null, "code"}}``."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})


def error_event(message: str, *, type: str, code: str) -> bytes:
    """:func:`error_body` as one SSE event (``data: <json>\\n\\n``), for an open stream.

    The JSON has no raw newlines (orjson escapes them), so it is always a single data line.
    """
    return b"data: " + error_body(message, type=type, code=code) + b"\n\n"


# --- helpers -------------------------------------------------------------------------------
# They append to a caller-owned list rather than building and concatenating lists: fewer
# allocations on the per-chunk path.


def _choice_index(choice: dict[str, Any], position: int) -> int:
    index = choice.get("index", position)
    if not isinstance(index, int) or isinstance(index, bool):
        raise Shape("choice 'index' must be an integer")
    return index


def _prompt_texts(prompt: Any, out: list[str]) -> None:
    if isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                if item:
                    out.append(item)
            # Token ids (ints, or lists of ints for a batch) are not text; they are not
            # inspected element by element, which could cost a lot for long prompts.
            elif not isinstance(item, int | list):
                raise Shape("'prompt' list items must be strings or token ids")
    else:
        opt_text(prompt, out)


def _content_texts(content: Any, out: list[str]) -> None:
    if isinstance(content, str):
        if content:
            out.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                if part:
                    out.append(part)
            elif isinstance(part, dict):
                kind = type_of(part)
                if kind in _TEXT_PART_TYPES:
                    opt_text(part.get("text"), out)
                elif kind == "refusal":
                    opt_text(part.get("refusal"), out)
                # Other part types (image_url, input_audio, file, ...) carry no text.
            else:
                raise Shape("content parts must be objects")
    elif content is not None:
        raise Shape("'content' must be a string, a list of parts or null")


def _message_texts(message: dict[str, Any], out: list[str]) -> None:
    """Append the text of a chat message, a streamed delta or a response message."""
    if len(message) <= 2:  # most streamed deltas: {"content": ...}, maybe with the role
        content = message.get("content")
        if type(content) is str and (len(message) == 1 or "role" in message):
            if content:
                out.append(content)
            return
    reasoning = message.get("reasoning_content")
    opt_text(reasoning, out)
    alt = message.get("reasoning")
    # Some vLLM versions send the same text under both names during the rename.
    if alt != reasoning:
        opt_text(alt, out)
    _content_texts(message.get("content"), out)
    opt_text(message.get("refusal"), out)
    audio = message.get("audio")
    if isinstance(audio, dict):
        opt_text(audio.get("transcript"), out)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise Shape("'tool_calls' must be a list")
        for call in tool_calls:
            if not isinstance(call, dict):
                raise Shape("each tool call must be an object")
            function = call.get("function")
            if isinstance(function, dict):
                opt_text(function.get("arguments"), out)
            elif function is not None:
                raise Shape("tool call 'function' must be an object")
            custom = call.get("custom")
            if isinstance(custom, dict):
                opt_text(custom.get("input"), out)
    function_call = message.get("function_call")
    if isinstance(function_call, dict):
        opt_text(function_call.get("arguments"), out)
    elif function_call is not None:
        raise Shape("'function_call' must be an object")
