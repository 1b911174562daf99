"""``crosstalk run``: mitmproxy in reverse mode with the crosstalk addon, embedded.

Without an upstream, the built-in simulator is started on a free loopback port and
the proxy fronts it, so a fresh checkout shows the whole thing working.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field

from mitmproxy import options
from mitmproxy.tools.dump import DumpMaster

from proxy.config import Config, ProxySection, TLSSection
from proxy.mitm.addon import CrossTalk
from proxy.mitm.capture import capture_addons
from proxy.mitm.certstore import UnreadableCA, ensure_ca
from proxy.mitm.wiring import default_addons
from proxy.sim.server import SimConfig, start_sim


@dataclass(frozen=True, slots=True)
class RunRequest:
    config: Config
    config_path: str | None
    sim: SimConfig | None = None  # settings of the built-in simulator, if one is started
    capture: str | None = None  # flow file the proxied traffic is appended to
    # The addon's options given on the command line (``crosstalk_mode``, ...): they
    # override the file at start and at every reload; what the file says is read anew.
    options: dict[str, str] = field(default_factory=dict)


class _ReadyBanner:
    """Prints how to use the proxy once mitmproxy's servers are up (``running`` runs
    after the proxyserver addon, added before this one, has started listening) and the
    detector process is ready; not when it failed (the proxy is stopping, and said why).
    In a task of its own: ``running`` returns at once, as mitmproxy expects."""

    def __init__(self, text: str, crosstalk: CrossTalk) -> None:
        self.text = text
        self.crosstalk = crosstalk
        self._task: asyncio.Task | None = None

    def running(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._announce())

    async def _announce(self) -> None:
        await self.crosstalk.detector_started()
        if self.crosstalk.failed is None:
            print(self.text, flush=True)


def ready_banner(proxy_url: str, upstream: str, simulated: bool, proxy: ProxySection) -> str:
    target = "the built-in simulated LLM at " if simulated else ""
    events = proxy.log_file or "stderr"
    hint = (
        "\nTo watch leaks being caught, restart with --sim-leak-rate 0.3 and send requests"
        " as two tenants (X-Tenant-ID): leak.detected events name the source tenant."
        if simulated
        else ""
    )
    return f"""crosstalk is running ({proxy.mode} mode): {proxy_url} -> {target}{upstream}

Try it:

  curl -s {proxy_url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -H 'X-Tenant-ID: acme' \\
       -d '{{"model": "sim-llm-1", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c "import openai; c = openai.OpenAI(base_url='{proxy_url}/v1', api_key='x', \\
      default_headers={{'X-Tenant-ID': 'acme'}}); \\
      print(c.chat.completions.create(model='sim-llm-1', \\
      messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Events (JSON lines) go to {events}. Ctrl-C stops.{hint}
"""


def tls_options(tls: TLSSection) -> dict[str, object]:
    """mitmproxy's options for ``[tls]``: the certificate clients see (mitmproxy detects
    TLS on the listening port and negotiates HTTP/2 where the client offers it), upstream
    verification (on unless ``upstream_insecure``), and a client certificate upstream."""
    out: dict[str, object] = {"ssl_insecure": tls.upstream_insecure}
    if tls.certificate:
        out["certs"] = [f"*={tls.certificate}"]
    if tls.upstream_ca:
        out["ssl_verify_upstream_trusted_ca"] = tls.upstream_ca
    if tls.client_certificate:
        out["client_certs"] = tls.client_certificate
    return out


async def serve(request: RunRequest) -> int:
    cfg = request.config
    defaults = options.Options()  # crosstalk run keeps mitmproxy's confdir and key size
    try:  # before DumpMaster, whose TLS addon creates the CA unlocked when it is missing
        ensure_ca(defaults.confdir, defaults.key_size)
    except UnreadableCA as e:
        print(f"crosstalk: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"crosstalk: cannot create mitmproxy's CA in {defaults.confdir}: {e}", file=sys.stderr
        )
        return 2
    capture = None
    if request.capture:
        try:
            capture = capture_addons(request.capture)
        except OSError as e:
            print(f"crosstalk: cannot write --capture {request.capture}: {e}", file=sys.stderr)
            return 2
    sim_runner = None
    upstream = cfg.proxy.upstream
    if not upstream:
        sim_runner, port = await start_sim(request.sim or SimConfig(token_delay=0.02))
        upstream = f"http://127.0.0.1:{port}"
    opts = options.Options(
        mode=[f"reverse:{upstream}"],
        listen_host=cfg.proxy.listen_host,
        listen_port=cfg.proxy.listen_port,
    )
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    # Without the terminal log, mitmdump's start-up check says only "Error logged during
    # startup, exiting...": the operator must see which (a port in use, a bad option).
    if (errorcheck := master.addons.get("errorcheck")) is not None:
        errorcheck.repeat_errors_on_stderr = True
    try:
        master.options.update(**tls_options(cfg.tls))
    except Exception as e:  # OptionsError: a readable message, no traceback
        print(f"crosstalk: tls: {e}", file=sys.stderr)
        return 2
    crosstalk = CrossTalk()
    master.addons.add(
        *default_addons(
            crosstalk,
            before=capture[:1] if capture else (),  # writes the upstream response
            after_crosstalk=capture[1:] if capture else (),  # keeps the bodies it scans
        )
    )
    try:
        master.options.update(
            crosstalk_config=request.config_path or "",
            **request.options,
            crosstalk_metrics_port=cfg.metrics.port,
            crosstalk_metrics_host=cfg.metrics.host,
        )
    except Exception as e:  # OptionsError: a readable message, no traceback
        print(f"crosstalk: {e}", file=sys.stderr)
        return 2
    scheme = "https" if cfg.tls.certificate else "http"
    proxy_url = f"{scheme}://{cfg.proxy.listen_host}:{cfg.proxy.listen_port}"
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)
    master.addons.add(
        _ReadyBanner(
            ready_banner(proxy_url, upstream, sim_runner is not None, cfg.proxy), crosstalk
        )
    )
    try:
        await master.run()
    finally:
        if sim_runner is not None:
            await sim_runner.cleanup()
    return 2 if crosstalk.failed else 0
