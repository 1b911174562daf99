"""Building the compiled core (proxy/engine/_core.pyx): without a C compiler, the ordinary
``pip`` build stops with a message that names what to install, not a compiler's
traceback (setup.py's BuildCore)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import ROOT

# What a wheel is built from; what a checkout may hold besides (a venv, builds, caches).
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.so", "__pycache__", "*.egg-info", ".*_cache"
)


def test_without_a_c_compiler_the_install_says_what_to_install(tmp_path):
    tree = tmp_path / "src"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCES)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "out"), str(tree)],
        env={**os.environ, "CC": str(tmp_path / "no-such-cc")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "needs a C compiler" in output, output
    assert "apt-get install gcc python3-dev" in output and "dnf install gcc" in output
    assert not list((tmp_path / "out").glob("*.whl"))
