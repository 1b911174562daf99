"""``crosstalk hash-key``: the line that maps an API key to a tenant without the key."""

from __future__ import annotations

import argparse
import getpass
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tenant", metavar="TENANT", help="the tenant this key belongs to")


def main(args: argparse.Namespace) -> int:
    """Reads the key from standard input (a prompt on a terminal), never from the command
    line, where shell history and ``ps`` would keep it. Prints the ``[tenants.api_keys]``
    line. Exit status: 0 done, 2 no key given."""
    from proxy.tenants import hash_key

    tty = sys.stdin.isatty()
    key = (getpass.getpass("API key (not echoed): ") if tty else sys.stdin.readline()).strip()
    if not key:
        print("crosstalk hash-key: no key on standard input", file=sys.stderr)
        return 2
    print(f'"{hash_key(key)}" = "{args.tenant}"')
    return 0
