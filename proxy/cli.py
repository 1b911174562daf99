"""The ``crosstalk`` command line: dispatches to the modules of ``proxy.commands``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from proxy import __version__
from proxy.defaults import DefaultsMissing

#: name -> (one-line help, module). Each module: ``add_arguments(parser)``, ``main(args)``.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run the proxy (in front of the simulator by default)", "proxy.commands.run"),
    "sim": ("run the simulated LLM engine", "proxy.sim.server"),
    "replay": ("find leaks in captured traffic (flows, HAR, JSON lines)", "proxy.commands.replay"),
    "audit": (
        "identify the engine and check it against isolation advisories",
        "proxy.commands.audit",
    ),
    "probe": (
        "send multi-tenant traffic and check answers for cross-tenant data",
        "proxy.commands.probe",
    ),
    "verify-evidence": ("check the SHA-256 of evidence records", "proxy.commands.verify_evidence"),
    "hash-key": (
        "print a [tenants.api_keys] line that maps a key by its hash",
        "proxy.commands.hash_key",
    ),
    "baseline": (
        "fingerprint a public corpus (docs, templates) that is nobody's private text",
        "proxy.commands.baseline",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # numpy's OpenBLAS starts a thread a core at import that spins ~0.1 s of CPU (measured
    # on every start); crosstalk does no linear algebra. Set before numpy's first import,
    # which the commands make; the processes they start inherit it.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if argv and argv[0] == "sim":
        # The simulator parses its own arguments: it also runs as ``python -m``.
        from proxy.sim.server import main as sim_main

        return sim_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="crosstalk", description="Catch cross-tenant data leaks in LLM responses."
    )
    parser.add_argument("--version", action="version", version=f"crosstalk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (help_text, module_name) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=name != "sim")
        if name == chosen and name != "sim":
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(handler=module.main)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except DefaultsMissing as e:  # a broken installation: say so, no traceback
        print(f"crosstalk: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
