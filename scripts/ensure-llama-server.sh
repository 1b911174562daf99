#!/usr/bin/env bash
# llama.cpp's llama-server for the tests that run crosstalk in front of a real engine: built
# once per pinned version into ${CROSSTALK_CACHE:-~/.cache/crosstalk}/llama.cpp/<version>/
# (outside the repo) and reused from there. No prebuilt binary can be fetched here (only
# PyPI, Debian and npm are reachable), so the source comes from the llama-cpp-python sdist
# on PyPI, which carries llama.cpp under vendor/llama.cpp; its sha256 is pinned below.
# CPU only, no curl/OpenSSL, no web UI (the UI build would download files). About 4 minutes
# on 2 cores the first time; afterwards it only prints the path.
# The source gets the test-only KV-cache fault of scripts/llama_fault.py (inert unless
# CROSSTALK_FAULT_RATE is set); the cache path carries that script's hash, so a change to
# the fault builds anew.
# Progress goes to stderr; the last (and only) stdout line is the binary's path:
#     bin=$(scripts/ensure-llama-server.sh | tail -1)
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="0.3.36"   # bundles llama.cpp commit 0c1e570
LLAMA_CPP_COMMIT="0c1e570"
SDIST="llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
fault_id="$(sha256sum "$here/llama_fault.py" | cut -c1-12)"
cache="${CROSSTALK_CACHE:-$HOME/.cache/crosstalk}/llama.cpp/${LLAMA_CPP_PYTHON_VERSION}-fault-${fault_id}"
bin="$cache/bin/llama-server"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi

say() { echo "llama-server: $*" >&2; }
die() { say "$*"; exit 1; }

for tool in cmake c++ tar sha256sum; do
    command -v "$tool" >/dev/null 2>&1 \
        || die "'$tool' is missing (apt-get install cmake g++ tar coreutils)"
done
python="$("$here/pip-python.sh")" || exit 1
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); else generator=(); fi

work="$(mktemp -d "${TMPDIR:-/tmp}/crosstalk-llama.XXXXXX")"
log="$work/build.log"
fail() {
    [ -s "$log" ] && tail -n 40 "$log" >&2
    say "$* (build dir kept for inspection: $work)"
    exit 1
}

say "downloading llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION} sdist (llama.cpp ${LLAMA_CPP_COMMIT})…"
"$python" -m pip download --quiet --no-binary :all: --no-deps --dest "$work" \
    "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" >"$log" 2>&1 \
    || fail "pip download failed"
[ -f "$work/$SDIST" ] || fail "pip download did not produce $SDIST"
got="$(sha256sum "$work/$SDIST" | cut -d' ' -f1)"
[ "$got" = "$SDIST_SHA256" ] \
    || fail "sha256 mismatch for $SDIST: expected $SDIST_SHA256, got $got"

tar -xzf "$work/$SDIST" -C "$work" || fail "could not unpack $SDIST"
src="$work/llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || fail "no vendor/llama.cpp in $SDIST"
rm -f "$work/$SDIST"
"$python" "$here/llama_fault.py" "$src" >>"$log" 2>&1 || fail "could not add the test fault"

say "building (about 4 min)…"
cmake -S "$src" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_CPP_COMMIT" \
    >>"$log" 2>&1 || fail "cmake configure failed"
cmake --build "$work/build" --target llama-server -j2 >>"$log" 2>&1 \
    || fail "cmake build failed"
built="$work/build/bin/llama-server"
[ -x "$built" ] || fail "build finished but $built is missing"

# Copy then rename, so a concurrent caller never sees a half-written binary.
mkdir -p "$cache/bin"
cp "$built" "$bin.tmp.$$"
mv -f "$bin.tmp.$$" "$bin"
rm -rf "$work"
say "ready: $bin"
echo "$bin"
