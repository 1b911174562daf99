"""Builds crosstalk's compiled parts (``proxy/engine/_core.pyx``, the engine's core;
``proxy/protocols/_wire.pyx``, the per-event steps of a stream; and
``proxy/pipeline/_monitor.pyx``, an exchange monitor's per-event path; Cython) with the
machine's C compiler; everything else about the package is in ``pyproject.toml``.

Without a working C compiler the install stops with a message that names what to
install, instead of a compiler's traceback.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

# What a missing or broken C toolchain raises (CompileError and LinkError are
# CCompilerErrors). Cython's own CompileError, a .pyx it cannot translate, is not one:
# installing a compiler would not help, so its report goes out as it is.
TOOLCHAIN_ERRORS = (CCompilerError, ExecError, PlatformError)

NO_COMPILER = """
crosstalk: building the compiled parts (proxy/engine/_core.pyx, proxy/protocols/_wire.pyx,
proxy/pipeline/_monitor.pyx) needs a C compiler and Python's headers, and this one failed:

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
            raise SystemExit(NO_COMPILER.format(error=f"{type(e).__name__}: {e}")) from e


setup(
    ext_modules=[
        Extension("proxy.engine._core", ["proxy/engine/_core.pyx"]),
        Extension("proxy.protocols._wire", ["proxy/protocols/_wire.pyx"]),
        Extension("proxy.pipeline._monitor", ["proxy/pipeline/_monitor.pyx"]),
    ],
    cmdclass={"build_ext": BuildCore},
)
