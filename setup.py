"""Builds crosstalk's compiled parts, every ``proxy/<folder>/<name>.pyx`` (Cython; today
the engine's core in ``engine/`` (``_text``, ``_tables``, ``_vocabulary``, ``_records``,
``_entities``, ``_degenerate``, ``_scan``, which ``cimport`` each other's ``.pxd``);
``protocols/_wire``, the per-event steps of a stream;
``pipeline/_monitor``, an exchange monitor's per-event path) with the machine's C
compiler; everything else about the package is in ``pyproject.toml``. A new ``.pyx``
there is built, ignored by git, a dependency of the Makefile's install, checked in the
wheel and sanitized by ``bench/sanitize.py`` with no other list to update.

Without a working C compiler the install stops with a message that names what to
install, instead of a compiler's traceback.
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

# What a missing or broken C toolchain raises (CompileError and LinkError are
# CCompilerErrors). Cython's own CompileError, a .pyx it cannot translate, is not one:
# installing a compiler would not help, so its report goes out as it is.
TOOLCHAIN_ERRORS = (CCompilerError, ExecError, PlatformError)

# pip builds with the source tree as the working directory; sources must be relative.
SOURCES = sorted(path.as_posix() for path in Path("proxy").glob("*/*.pyx"))

NO_COMPILER = """
crosstalk: building the compiled parts ({sources})
needs a C compiler and Python's headers, and this one failed:

    {error}

Install them and try again:
    Debian/Ubuntu:  apt-get install gcc python3-dev   (or build-essential)
    Fedora/RHEL:    dnf install gcc python3-devel
    Alpine:         apk add gcc musl-dev python3-dev
    macOS:          xcode-select --install
"""


class BuildCore(build_ext):
    """``build_ext`` that says in plain words when there is no usable compiler."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except TOOLCHAIN_ERRORS as e:
            message = NO_COMPILER.format(
                sources=", ".join(SOURCES), error=f"{type(e).__name__}: {e}"
            )
            raise SystemExit(message) from e


setup(
    ext_modules=[
        Extension(source[: -len(".pyx")].replace("/", "."), [source]) for source in SOURCES
    ],
    cmdclass={"build_ext": BuildCore},
)
