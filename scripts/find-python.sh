#!/usr/bin/env bash
# Print the path of a working Python >= 3.12, or fail with a clear message.
# pyenv shims named python3.12/python3.13 exist but fail unless that version is
# selected, so every candidate is run, not just looked up.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in "${CROSSTALK_PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if ok "$cand"; then command -v "$cand" 2>/dev/null || echo "$cand"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root)
    for cand in "$root"/versions/3.13*/bin/python3 "$root"/versions/3.12*/bin/python3; do
        if [ -x "$cand" ] && ok "$cand"; then echo "$cand"; exit 0; fi
    done
fi
echo "crosstalk needs Python >= 3.12 (mitmproxy 12 requires it) and found none." >&2
echo "Install one (e.g. 'pyenv install 3.12') or set CROSSTALK_PYTHON=/path/to/python3.12." >&2
exit 1
