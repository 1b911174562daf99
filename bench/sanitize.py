"""The compiled parts under AddressSanitizer and UndefinedBehaviorSanitizer (issue 16's
memory-safety run; not in CI: a sanitized build and a slowed test run).

Builds the compiled parts (every ``proxy/<folder>/<name>.pyx``, as ``setup.py`` does) with
``-fsanitize=address,undefined`` (the ordinary ``pip wheel`` of a copy of the tree, so
Cython comes from the build requirements), puts those extensions into the copy, and runs
the tests that drive them there, with the
sanitizers' runtimes preloaded into Python and Python's allocator switched to plain
``malloc`` (``PYTHONMALLOC=malloc``): every buffer the core reads or writes is then one
ASan tracks, including the ones Python objects own. Leak checking is off: CPython frees
little at exit by design, which LeakSanitizer would report as thousands of leaks.

    python bench/sanitize.py [TEST ...]      # default: parity, engine, SSE, framer and fuzz tests

Exit status 0 when the tests pass and no sanitizer reported anything, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The core's parity tests, the engine's, the SSE decoder's and event cut's (test_enforce:
# the framer, with the gate that uses it), the parsers' fuzz targets, and the monitor's
# per-event path (its properties, the deferred shadow path): deterministic. The
# end-to-end tests also reach the core, but compare live streams whose interleaving the
# sanitizers' slowdown changes (test_replay failed so once, with no sanitizer report).
DEFAULT_TESTS = (
    "tests/test_core_parity.py",
    "tests/test_engine.py",
    "tests/test_sse.py",
    "tests/test_enforce.py",
    "tests/test_fuzz.py",
    "tests/test_shadow_path.py",
    "tests/test_shadow_deferred.py",
)
# The compiled extensions of the package, each checked to be the sanitized one.
# What setup.py builds: every proxy/<folder>/<name>.pyx.
EXTENSIONS = tuple(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in sorted(ROOT.glob("proxy/*/*.pyx"))
)
# A double free through ctypes: the preloaded runtime must report it, or it is not active.
SELF_CHECK = (
    "import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
    "libc.free.argtypes = [ctypes.c_void_p]; p = libc.malloc(16); libc.free(p); libc.free(p)"
)
FLAGS = (
    "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g -O1"
)
# What the sanitizers print when they find something (ASan's report, UBSan's runtime error).
REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)")
SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.so", "__pycache__", "*.egg-info", ".pytest_cache"
)


def runtime(name: str) -> str:
    """The path of a sanitizer's shared runtime (``libasan.so``) as the C compiler knows it."""
    path = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(path) or not Path(path).exists():
        raise SystemExit(f"sanitize: gcc has no {name} (install libasan/libubsan for gcc)")
    return path


def build(tree: Path, out: Path) -> list[Path]:
    """A sanitized wheel of ``tree``; its extensions, unpacked into ``tree``."""
    env = {**os.environ, "CFLAGS": FLAGS, "LDFLAGS": "-fsanitize=address,undefined"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(tree)],
        env=env, check=True, timeout=900,
    )  # fmt: skip
    (wheel,) = out.glob("crosstalk-*.whl")
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.endswith(".so")]
        z.extractall(tree, members)
    extensions = [tree / member for member in members]
    if len(extensions) != len(EXTENSIONS):
        raise SystemExit(f"sanitize: the wheel's extensions are {members}")
    for extension in extensions:
        # The flags reached the compiler only if the extension calls the sanitizers' hooks.
        symbols = subprocess.run(
            ["nm", "-D", "--undefined-only", str(extension)], capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
        if "__asan_" not in symbols or "__ubsan_handle_" not in symbols:
            raise SystemExit(f"sanitize: {extension.name} was built without the sanitizers")
    return extensions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS))
    args = p.parse_args()
    preload = f"{runtime('libasan.so')}:{runtime('libubsan.so')}"
    with tempfile.TemporaryDirectory(prefix="crosstalk-sanitize-") as tmp:
        tree = Path(tmp) / "src"
        shutil.copytree(ROOT, tree, ignore=SKIP)
        started = time.monotonic()
        extensions = build(tree, Path(tmp) / "wheel")
        names = ", ".join(e.name for e in extensions)
        print(f"sanitized build: {names} in {time.monotonic() - started:.0f} s")
        env = {
            **os.environ,
            "LD_PRELOAD": preload,
            "PYTHONMALLOC": "malloc",
            "PYTHONPATH": str(tree),
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        }
        # The copy, not the editable install, must be what the tests import.
        where = subprocess.run(
            [sys.executable, "-c", "import importlib\n"
             f"for name in {EXTENSIONS!r}: print(importlib.import_module(name).__file__)"],
            cwd=tree, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if sorted(map(Path, where.stdout.split())) != sorted(extensions):
            print(f"sanitize: the tests would import {where.stdout.strip() or where.stderr}")
            return 1
        check = subprocess.run(
            [sys.executable, "-c", SELF_CHECK], env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        if "attempting double-free" not in check.stderr:
            print(f"sanitize: AddressSanitizer is not active in the tests' Python:\n{check.stderr}")
            return 1
        print("self-check: ASan reported a planted double free")
        started = time.monotonic()
        done = subprocess.run(
            # --capture=sys: pytest's default capture of the file descriptors loses what
            # a sanitizer writes to fd 2 before it ends the process (seen: "no summary").
            [sys.executable, "-m", "pytest", "-q", "--capture=sys", "-p", "no:cacheprovider",
             *args.tests],
            cwd=tree, env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
    output = done.stdout + done.stderr
    reports = [line for line in output.splitlines() if REPORT.search(line)]
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    print(f"tests under ASan+UBSan in {time.monotonic() - started:.0f} s: "
          f"{summary[-1] if summary else 'no summary'} (exit {done.returncode})")  # fmt: skip
    for line in reports[:40]:
        print(line)
    if done.returncode != 0 or reports:
        print(output[-6000:])
        return 1
    print("no sanitizer report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
