"""``crosstalk run``: the proxy, in front of the built-in simulator by default."""

from __future__ import annotations

import argparse
import asyncio
import sys

from proxy.config import ConfigError, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", help="engine URL (http or https); default: built-in simulator")
    p.add_argument("--listen-host", help="default 127.0.0.1")
    p.add_argument("--listen-port", type=int, help="default 8080")
    p.add_argument("--config", help="TOML configuration (see config/crosstalk.example.toml)")
    p.add_argument("--log-file", help="JSON-lines event log; default stderr")
    p.add_argument("--log-level", choices=("debug", "info", "warning"))
    p.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        help="auto (default): readable on a terminal, JSON lines to files and pipes",
    )
    p.add_argument("--mode", choices=("shadow", "enforce"), help="default shadow")
    p.add_argument(
        "--journal",
        metavar="DIR",
        help="append every exchange's keyed fingerprints (no text) to a journal in DIR, for "
        "`crosstalk replay DIR`; needs a fixed detection.key",
    )
    p.add_argument(
        "--index",
        metavar="URL",
        help="redis://HOST:PORT/DB (or rediss://): share every replica's keyed fingerprints "
        "(no text) through a Redis Stream, so each replica sees all tenants; needs the same "
        "detection.key on every replica ([index] in the config for password and TLS)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics ([metrics] host to "
        'change the address; docs/operations.md, "Metrics")',
    )
    p.add_argument(
        "--capture",
        metavar="FILE",
        help="append the proxied traffic to FILE as a mitmproxy flow file, streamed bodies "
        "included, for `crosstalk replay`",
    )
    p.add_argument(
        "--sim-leak-rate",
        type=float,
        default=0.0,
        help="built-in simulator only: inject cross-tenant leaks at this rate",
    )
    p.add_argument("--sim-truth", help="built-in simulator only: write injected faults here")
    p.add_argument(
        "--sim-token-delay",
        type=float,
        default=0.02,
        help="built-in simulator only: seconds per streamed token",
    )


def main(args: argparse.Namespace) -> int:
    from proxy.mitm.runner import RunRequest, serve
    from proxy.sim.server import SimConfig

    try:
        config = load(
            args.config,
            proxy__upstream=args.upstream,
            proxy__listen_host=args.listen_host,
            proxy__listen_port=args.listen_port,
            proxy__log_file=args.log_file,
            proxy__log_level=args.log_level,
            proxy__log_format=args.log_format,
            proxy__mode=args.mode,
            journal__directory=args.journal,
            index__url=args.index,
            metrics__port=args.metrics_port,
        )
    except ConfigError as e:
        print(f"crosstalk: {e}", file=sys.stderr)
        return 2
    sim = SimConfig(
        token_delay=args.sim_token_delay, leak_rate=args.sim_leak_rate, truth_path=args.sim_truth
    )
    given = {
        "crosstalk_mode": args.mode,
        "crosstalk_log_file": args.log_file,
        "crosstalk_log_level": args.log_level,
        "crosstalk_log_format": args.log_format,
        "crosstalk_journal": args.journal,
        "crosstalk_index": args.index,
    }
    options = {name: str(value) for name, value in given.items() if value is not None}
    return asyncio.run(
        serve(RunRequest(config, args.config, sim, capture=args.capture, options=options))
    )
