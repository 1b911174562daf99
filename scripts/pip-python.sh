#!/usr/bin/env bash
# Prints a Python that has pip (the project's venv first, then python3), for the set-up
# scripts that download from PyPI; exits 1 with a message when there is none.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for cand in "$here/../.venv/bin/python" python3; do
    if "$cand" -m pip --version >/dev/null 2>&1; then
        echo "$cand"
        exit 0
    fi
done
echo "no Python with pip found (one is needed to download from PyPI)" >&2
exit 1
