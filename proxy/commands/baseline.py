"""``crosstalk baseline build DIR... --out FILE``: an operator's public corpus (docs,
templates, a RAG document store) as keyed fingerprints that ``detection.baselines``
loads. No text is stored; the file is bound to the configuration's ``detection.key``."""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = sub.add_parser("build", help="fingerprint the files under DIR... into FILE")
    build.add_argument("roots", nargs="+", metavar="DIR", help="folders (or files) to read")
    build.add_argument("--out", required=True, metavar="FILE", help="the baseline file (.npz)")
    build.add_argument(
        "--config", required=True, help="the proxy's TOML configuration (its detection.key)"
    )
    build.add_argument(
        "--rebuild", action="store_true", help="start over instead of extending FILE"
    )
    build.add_argument("--no-progress", action="store_true", help="no progress line")


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 written, 2 unusable arguments, key or existing file."""
    from pathlib import Path

    from proxy.config import ConfigError, load
    from proxy.engine.baseline import Baseline, BaselineError, build
    from proxy.engine.fingerprint import Hasher

    def fail(message: str) -> int:
        print(f"crosstalk baseline: {message}", file=sys.stderr)
        return 2

    try:
        config = load(args.config)
    except ConfigError as e:
        return fail(str(e))
    if not config.detection.key:
        return fail("the configuration has no detection.key: a baseline is keyed, set one")
    missing = [r for r in args.roots if not Path(r).exists()]
    if missing:
        return fail(f"no such file or folder: {', '.join(missing)}")
    hasher = Hasher(bytes.fromhex(config.detection.key), config.detection.k)
    out = Path(args.out)
    previous = None
    if out.exists() and not args.rebuild:
        try:
            previous = Baseline.load(out).check(hasher)
        except BaselineError as e:
            return fail(f"{e} (or pass --rebuild)")
    show = not args.no_progress and sys.stderr.isatty()
    last = 0.0

    def progress(stats, seen: int) -> None:
        nonlocal last
        if show and (now := time.monotonic()) - last >= 0.2:
            last = now
            print(
                f"\rbaseline: {seen} files, {stats.files_read} read "
                f"({stats.bytes_read / 1e6:.1f} MB), {stats.files_unchanged} unchanged",
                end="",
                file=sys.stderr,
                flush=True,
            )

    baseline, stats = build(args.roots, hasher, previous=previous, progress=progress)
    baseline.save(out)
    if show:
        print(file=sys.stderr)
    print(
        f"{out}: {baseline.kgrams.size} fingerprints, {baseline.units.size} words, "
        f"{len(baseline.entities)} entities from {len(baseline.manifest)} files "
        f"({stats.files_read} read now, {stats.files_unchanged} unchanged, "
        f"{stats.files_skipped} skipped: binary, unreadable or over 64 MB); key {hasher.key_id}"
    )
    return 0
