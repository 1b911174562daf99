"""Wire-protocol parsers for LLM serving APIs, and the registry that picks one per request.

Each submodule turns request bodies into prompt text and response bodies (whole or streamed as
:class:`proxy.protocols.sse.SSEEvent` objects) into output text. They are pure: no I/O, no mitmproxy, no
detection logic, so they can be tested and benchmarked on their own.

=================  ===========================================  ==========================
module             endpoints (POST)                             route kinds
=================  ===========================================  ==========================
``openai``         ``.../chat/completions``, ``.../completions``  ``chat``, ``completions``
``anthropic``      ``.../v1/messages``                          ``messages``
``responses``      ``.../responses`` (OpenAI Responses API)     ``responses``
``textgen``        ``.../generate``, ``.../generate_stream``    ``generate``,
                   (SGLang, TGI, vLLM's demo server)            ``generate_stream``
=================  ===========================================  ==========================

Every module has the same small interface: ``route_for(method, path)`` (its route kind or
``None``), ``parse_request(kind, body)``, ``parse_response(kind, body)``,
``StreamParser(kind)`` (``feed(event)``, ``done``, ``error``, ``model``,
``malformed_events``), ``error_event(...)`` and ``error_body(...)``. A stream parser may also
have an ``error_event`` method, when the event that ends a stream depends on what the stream
said (the Responses API numbers its events). :func:`route_for` asks the modules in turn and
returns a :class:`Route` that knows its module, so callers never branch on the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from proxy.protocols import anthropic, openai, responses
from proxy.protocols import generate as textgen
from proxy.protocols.openai import OutputDelta, ParsedRequest
from proxy.protocols.shapes import ProtocolError
from proxy.protocols.sse import SSEEvent

__all__ = [
    "APIS",
    "OutputDelta",
    "ParsedRequest",
    "ProtocolError",
    "Route",
    "StreamParserLike",
    "as_route",
    "route_for",
]

#: The API modules by name, in the order :func:`route_for` asks them. Their paths do not
#: overlap (each matches on the path's last segment), so the order only matters for speed.
APIS: dict[str, ModuleType] = {
    "openai": openai,
    "anthropic": anthropic,
    "responses": responses,
    "textgen": textgen,
}


class StreamParserLike(Protocol):
    """What the exchange monitor uses of a stream parser."""

    done: bool
    error: dict[str, Any] | None
    model: str | None
    malformed_events: int

    def feed(self, event: SSEEvent) -> list[OutputDelta]: ...


@dataclass(frozen=True, slots=True)
class Route:
    """Which API a request speaks (``api``, a key of :data:`APIS`) and which of its
    endpoints (``kind``, the module's own route name). Dispatches to the module."""

    api: str
    kind: str

    @property
    def module(self) -> ModuleType:
        return APIS[self.api]

    def parse_request(self, body: bytes) -> ParsedRequest:
        """The prompt of a request body; raises :class:`ProtocolError`."""
        return self.module.parse_request(self.kind, body)

    def parse_response(self, body: bytes) -> list[OutputDelta]:
        """The output of a whole response body; raises :class:`ProtocolError`."""
        return self.module.parse_response(self.kind, body)

    def stream_parser(self) -> StreamParserLike:
        return self.module.StreamParser(self.kind)

    def error_event(
        self, message: str, *, type: str, code: str, parser: StreamParserLike | None = None
    ) -> bytes:
        """The event that ends a stream we cut, in the API's own format (after what
        ``parser`` has seen, when the format numbers its events)."""
        method = getattr(parser, "error_event", None)
        if method is not None:
            return method(message, type=type, code=code)
        return self.module.error_event(message, type=type, code=code)

    def error_body(self, message: str, *, type: str, code: str) -> bytes:
        """A JSON error body in the API's own format (for an HTTP error response)."""
        return self.module.error_body(message, type=type, code=code)


def route_for(method: str, path: str) -> Route | None:
    """The route of a request, or ``None`` when no module handles it (passed through)."""
    for name, module in APIS.items():
        kind = module.route_for(method, path)
        if kind is not None:
            return Route(name, kind)
    return None


def as_route(route: Route | str) -> Route:
    """``route`` itself, or the OpenAI route of that kind (``"chat"``, ``"completions"``):
    callers written before the registry passed the OpenAI module's route names."""
    return route if isinstance(route, Route) else Route("openai", route)
