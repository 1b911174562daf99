"""The detector process: crosstalk's addons, run on copies of the proxy's exchanges.

Started by the proxy (``proxy.mitm.detector_process``), never by hand: ``python -m
proxy.mitm.detector_worker`` reads frames on stdin and answers on stdout. The first frame is
the configuration (the proxy's ``crosstalk_*`` options and the fingerprint key, so both
processes name tenants alike); then, in the order the proxy saw them, the hooks of each
exchange. A headless mitmproxy master runs ``CrossTalk`` (inline shadow mode: this
process has nothing else to do), prevention (the canaries' registration and events),
the degenerate signal and the metrics endpoint, with the same hooks mitmproxy would
call, on rebuilt flows. Everything they log goes to the same event log.

It ignores SIGINT and SIGTERM (the proxy's process group gets them too): it stops when
the proxy says ``stop`` or closes the pipe, after finishing every exchange it was sent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

from mitmproxy import connection, http, options
from mitmproxy.flow import Error
from mitmproxy.hooks import ConfigureHook
from mitmproxy.master import Master
from mitmproxy.proxy.layers.http import (
    HttpErrorHook,
    HttpRequestHook,
    HttpResponseHeadersHook,
    HttpResponseHook,
)

from proxy.mitm.addon import CrossTalk
from proxy.mitm.detector_process import READ_SIZE, FrameDecoder, encode
from proxy.mitm.flowstate import CLAIMS_TRUSTED_KEY, METADATA_KEY
from proxy.mitm.wiring import default_addons
from proxy.pipeline.exchange import GC_PAUSES
from proxy.redaction import error_text

_PEER = ("127.0.0.1", 0)  # a copy's client when the proxy sent no peer


class ExchangeCopies:
    """Rebuilds each copied exchange as a flow and runs the master's hooks on it."""

    def __init__(self, master: Master, reply: Any, confirm: Any = None) -> None:
        self.master = master
        self.reply = reply
        self.confirm = confirm or (lambda xid: None)
        self.flows: dict[int, http.HTTPFlow] = {}

    async def handle(self, message: tuple) -> None:
        kind, xid, data, at = message
        if kind == "reload":  # the proxy got SIGHUP: this process reads the file too
            crosstalk = self.master.addons.get("crosstalk")
            if crosstalk is not None:
                crosstalk.reload()
            return
        if kind == "request":
            await self._request(xid, data, at)
            return
        flow = self.flows.get(xid)
        if flow is None:
            return  # its request was not understood: nothing to continue
        monitor = flow.metadata.get(METADATA_KEY)
        if kind == "responseheaders":
            flow.response = http.Response.from_state(data)
            await self._hook(HttpResponseHeadersHook(flow))
        elif kind == "chunk":
            stream = flow.response.stream if flow.response else None
            if monitor is not None and data and monitor.first_output is None:
                monitor.first_output = at
            if callable(stream):
                stream(data)
        elif kind == "response":
            assert flow.response is not None  # set by the copy's responseheaders, sent first
            del self.flows[xid]
            if monitor is not None:
                monitor.ended = at
            if data is not None:
                flow.response.raw_content = data
            await self._hook(HttpResponseHook(flow))
            self._confirm(xid, flow, monitor)
            if data is not None:
                self.reply(xid, flow.response.headers.get("x-crosstalk-verdict"))
        elif kind == "error":
            del self.flows[xid]
            if monitor is not None:
                monitor.ended = at
            flow.error = Error(data)
            await self._hook(HttpErrorHook(flow))
            self._confirm(xid, flow, monitor)

    def _confirm(self, xid: int, flow: http.HTTPFlow, monitor: Any) -> None:
        """Tell the proxy once this exchange's line is written (it settles after the
        hooks' own callbacks, which log it), and let go of the copy."""

        def settled() -> None:
            self.confirm(xid)
            # The addons' state refers back to the flow and to itself: cycles that would
            # wait for a full collection (``ExchangeMonitor.release``). Nothing reads a
            # finished copy again.
            if monitor is not None:
                monitor.release()
            flow.metadata.clear()

        if monitor is None:
            settled()
        else:
            monitor.when_settled(settled)

    async def _request(self, xid: int, data: tuple, at: float) -> None:
        state, peer, trusted = data
        flow = rebuilt_flow(state, peer)
        flow.metadata[CLAIMS_TRUSTED_KEY] = trusted
        await self._hook(HttpRequestHook(flow))
        monitor = flow.metadata.get(METADATA_KEY)
        if monitor is not None:
            monitor.started = at
            self.flows[xid] = flow

    async def _hook(self, hook: Any) -> None:
        await self.master.addons.handle_lifecycle(hook)


def rebuilt_flow(request_state: dict, peer: tuple[str, int] | None) -> http.HTTPFlow:
    """A live flow around the request the proxy copied (``Request.get_state()``)."""
    request = http.Request.from_state(request_state)
    flow = http.HTTPFlow(
        connection.Client(peername=peer or _PEER, sockname=_PEER, timestamp_start=time.time()),
        connection.Server(address=(request.host, request.port)),
        live=True,
    )
    flow.request = request
    return flow


async def serve(read_fd: int, write_fd: int) -> int:
    loop = asyncio.get_running_loop()
    frames: asyncio.Queue[tuple | None] = asyncio.Queue()
    decoder = FrameDecoder()

    def readable() -> None:
        try:
            data = os.read(read_fd, READ_SIZE)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(read_fd)
            frames.put_nowait(None)
            return
        for message in decoder.feed(data):
            frames.put_nowait(message)

    os.set_blocking(read_fd, False)
    loop.add_reader(read_fd, readable)

    def reply(xid: int, value: Any) -> None:
        os.write(write_fd, encode("reply", xid, value))

    def confirm(xid: int) -> None:
        os.write(write_fd, encode("logged", xid))

    hello = await frames.get()
    if hello is None or hello[0] != "hello":
        print("crosstalk detector: no configuration received", file=sys.stderr)
        return 2
    config: dict[str, Any] = hello[1]
    opts = options.Options()
    # The one proxy option the addons read (a proxy server's addon declares it).
    opts.add_option("connection_strategy", str, "lazy", "Never used: no connections here.")
    # Deferred: each option is set as the addon declaring it loads, so the addons are
    # configured once, with the proxy's values.
    opts.update_defer(**config["options"])
    master = Master(opts, with_termlog=False)
    crosstalk = CrossTalk(inline=True, key=config["key"], upstreams=config.get("upstreams"))
    addons = default_addons(crosstalk)
    try:
        master.addons.add(*addons)
        # Deferred options are applied as each addon loads, before it joins the chain:
        # the last one added is configured by nobody. CrossTalk has its values by then.
        master.addons.invoke_addon_sync(addons[-1], ConfigureHook(set(opts.keys())))
        if crosstalk.engine is None:
            raise RuntimeError("crosstalk could not be configured (see its log)")
    except Exception as e:  # noqa: BLE001 -- reported to the proxy, which stops
        os.write(write_fd, encode("failed", str(e)))
        return 1
    GC_PAUSES.settle()
    try:
        os.write(write_fd, encode("ready", os.getpid()))
    except BrokenPipeError:  # the proxy stopped (or was killed) while this one started
        return 0
    running = asyncio.create_task(master.run())
    copies = ExchangeCopies(master, reply, confirm)
    while (message := await frames.get()) is not None and message[0] != "stop":
        try:
            await copies.handle(message)
        except Exception as e:  # noqa: BLE001 -- one bad copy never stops detection
            crosstalk.log.error("detector.error", reason=f"copy not processed: {error_text(e)}")
    master.shutdown()
    await running
    return 0


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Replies get their own copy of stdout; fd 1 becomes stderr, so that nothing printed
    # by accident can corrupt the frames.
    replies = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return asyncio.run(serve(sys.stdin.fileno(), replies))


if __name__ == "__main__":
    sys.exit(main())
