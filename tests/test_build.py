"""Building the compiled core (proxy/engine/_*.pyx): without a C compiler, the ordinary
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


def build_wheel(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """``pip wheel`` of the tree at ``tmp_path/src`` (copied from the checkout first if
    absent) into ``tmp_path/out``: (the process, its output)."""
    tree = tmp_path / "src"
    if not tree.exists():
        shutil.copytree(ROOT, tree, ignore=NOT_SOURCES)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "out"), str(tree)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return done, done.stdout + done.stderr


def test_without_a_c_compiler_the_install_says_what_to_install(tmp_path):
    done, output = build_wheel(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert done.returncode != 0, output
    assert "needs a C compiler" in output, output
    assert "apt-get install gcc python3-dev" in output and "dnf install gcc" in output
    assert not list((tmp_path / "out").glob("*.whl"))


def test_a_core_cython_cannot_translate_is_not_called_a_missing_compiler(tmp_path):
    shutil.copytree(ROOT, tmp_path / "src", ignore=NOT_SOURCES)
    with (tmp_path / "src" / "proxy" / "engine" / "_scan.pyx").open("a") as f:
        f.write("\ncdef int broken(:\n")
    done, output = build_wheel(tmp_path)
    assert done.returncode != 0, output
    assert "Error compiling Cython file" in output, output
    assert "needs a C compiler" not in output, output
