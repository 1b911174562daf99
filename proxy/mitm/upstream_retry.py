"""A request sent on a kept-alive upstream connection that the engine had just closed
goes once more, on a fresh connection, instead of becoming a 502.

mitmproxy keeps an idle upstream connection for the client connection's next request.
An engine closes idle connections on its own clock (llama-server and uvicorn after 5 s,
gunicorn after 2 s); when that close reaches the proxy after it has read the client's
next request but before it has read the close, the request goes out on a dead
connection and mitmproxy answers ``502 server closed connection``: the engine never saw
the request, yet the client gets an error (seen in front of llama-server, whose idle
timeout equals the ``openai`` SDK's own 5 s). A busy event loop widens the window.
mitmproxy 12 does not retry, and its ``error`` hook cannot change the answer.

So, as HTTP clients do for a request that meets a closed kept-alive connection, the
request goes again, once, on a new connection, when all of these hold: the connection
was opened before the request (reused), nothing of a response arrived, and the whole
request is in memory (crosstalk reads request bodies; a streamed one cannot be sent
twice). ``upstream.retried`` in the event log says so. A fresh connection that closes
gives the 502 as before.

It replaces ``HttpStream.handle_protocol_error``, a mitmproxy internal, as
``error_pages`` replaces the error page builders: ``tests/test_upstream_retry.py``
brings the failure about through a real mitmdump, so an upgrade that moves it fails
loudly. Where the internals are not what this expects, nothing is replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from proxy.mitm.flowstate import METADATA_KEY
from proxy.redaction import path_only

try:
    from mitmproxy.proxy.layers.http import HttpStream, SendHttp
    from mitmproxy.proxy.layers.http._events import (
        ErrorCode,
        RequestData,
        RequestEndOfMessage,
        RequestHeaders,
        RequestTrailers,
        ResponseProtocolError,
    )
except ImportError:  # another mitmproxy layout: leave it alone
    HttpStream = None  # type: ignore[assignment,misc]

RETRIED_KEY = "crosstalk.upstream_retried"
CLOSED = "server closed connection"
_ORIGINAL = getattr(HttpStream, "handle_protocol_error", None)


def _no_log() -> Any:
    return None


_log: Callable[[], Any] = _no_log  # the event log of the CrossTalk that installed it


def _reused_and_unanswered(stream: Any, event: Any) -> bool:
    """Whether ``event`` is the close of a reused upstream connection before any byte
    of the response, on a request that is whole in memory and not yet retried."""
    flow = getattr(stream, "flow", None)
    if flow is None or not isinstance(event, ResponseProtocolError):
        return False
    server, request = flow.server_conn, flow.request
    return (
        event.code == ErrorCode.GENERIC_SERVER_ERROR
        and event.message == CLOSED
        and flow.response is None
        and not request.stream
        and stream.client_state == stream.state_done
        and stream.server_state == stream.state_wait_for_response_headers
        and server.timestamp_tcp_setup is not None
        and request.timestamp_start is not None
        and server.timestamp_tcp_setup < request.timestamp_start
        and not flow.metadata.get(RETRIED_KEY)
    )


def _handle_protocol_error(self: Any, event: Any) -> Generator[Any, Any, None]:
    if not _reused_and_unanswered(self, event):
        yield from _ORIGINAL(self, event)  # type: ignore[misc]
        return
    flow = self.flow
    flow.metadata[RETRIED_KEY] = True
    if (log := _log()) is not None:
        log.info(
            "upstream.retried",
            request_id=getattr(flow.metadata.get(METADATA_KEY), "request_id", None),
            path=path_only(flow.request.path),
            reason=CLOSED,
        )
    if not (yield from self.make_server_connection()):
        return  # could not connect: make_server_connection answered the client
    request, server = flow.request, self.context.server
    content = request.raw_content
    yield SendHttp(
        RequestHeaders(self.stream_id, request, not (content or request.trailers)), server
    )
    if content:
        yield SendHttp(RequestData(self.stream_id, content), server)
    if request.trailers:
        yield SendHttp(RequestTrailers(self.stream_id, request.trailers), server)
    yield SendHttp(RequestEndOfMessage(self.stream_id), server)


def install(log: Callable[[], Any]) -> None:
    """Retry requests that met a closed kept-alive connection (idempotent); ``log()``
    is the event log each retry is written to (None: not written)."""
    global _log
    _log = log
    if _ORIGINAL is not None:
        HttpStream.handle_protocol_error = _handle_protocol_error  # type: ignore[method-assign]


def uninstall() -> None:
    if _ORIGINAL is not None:
        HttpStream.handle_protocol_error = _ORIGINAL  # type: ignore[method-assign]
