#!/usr/bin/env bash
# The wheel as a user installs it: build it, install it without -e into a fresh venv
# outside the checkout (so nothing can be imported from the source tree), then run
# `crosstalk audit` against the simulator and a short detection check from that install.
# A wheel without its shipped data (proxy/defaults) fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
python="$(./scripts/find-python.sh)"
compiled=$(cd proxy && ls */*.pyx | sed 's/\.pyx$//')  # what setup.py builds
[ -n "$compiled" ] || { echo "no proxy/*/*.pyx in the checkout" >&2; exit 1; }
work="$(mktemp -d)"
sim_pid=""
cleanup() { [ -n "$sim_pid" ] && kill "$sim_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

"$python" -m pip wheel -q --no-deps -w "$work/dist" . 2>&1 | grep -v '^WARNING: Location' || true
wheel=$(ls "$work"/dist/crosstalk-*.whl)
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel" 2>&1 | grep -v '^WARNING: Location' || true
cd "$work"  # away from the checkout: only the installed package can be imported

"$work/venv/bin/python" -m zipfile -l "$wheel" >"$work/contents.txt"
for data in vocabulary/en.txt baseline/boilerplate.txt advisories.toml; do
    grep -q "proxy/defaults/$data" "$work/contents.txt" || { echo "wheel lacks proxy/defaults/$data" >&2; exit 1; }
done
for ext in $compiled; do
    grep -Eq "proxy/$ext\..*(so|pyd)" "$work/contents.txt" || { echo "wheel lacks the compiled proxy/$ext" >&2; exit 1; }
done

port=$("$work/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$work/venv/bin/crosstalk" sim --port "$port" --engine vllm --engine-version 0.10.2 >"$work/sim.log" 2>&1 &
sim_pid=$!
for _ in $(seq 1 100); do
    "$work/venv/bin/python" -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null && break
    sleep 0.1
done
status=0
"$work/venv/bin/crosstalk" audit --target "http://127.0.0.1:$port" >"$work/audit.txt" || status=$?
cat "$work/audit.txt"
# 0: no advisory applies, 1: one applies; 2 would mean the engine or the advisories
# could not be read.
if [ "$status" -gt 1 ]; then echo "crosstalk audit from the wheel failed ($status)" >&2; exit 1; fi
grep -q "^verdict:" "$work/audit.txt"

"$work/venv/bin/python" - <<'PY'
"""A planted cross-tenant leak is found with its source, and the shipped vocabulary and
baseline are loaded (not silently empty), from the installed wheel."""
import proxy
from proxy.config import load
from proxy.defaults import load_baseline, load_vocabulary
from proxy.factory import build_engine

assert "site-packages" in proxy.__file__, proxy.__file__
from proxy.engine import _scan
assert _scan.__file__.endswith((".so", ".pyd")), _scan.__file__  # compiled, not source
assert len(load_vocabulary()) > 10_000 and load_baseline(), "shipped data not loaded"
engine = build_engine(load(None, detection__key="ab" * 32))
secret = "the merger of Holloway Dynamics with Brightwater closes on the fourth of March"
engine.observe_prompt("tenant-a", "req-a", f"Summarise this: {secret}.").finish()
scan = engine.observe_prompt("tenant-b", "req-b", "What is the weather like today?")
findings = list(scan.feed(f"Sunny. Also {secret}, as discussed."))
findings += list(scan.finish() or [])
assert any(f.source_tenant == "tenant-a" for f in findings), findings
clean = engine.observe_prompt("tenant-c", "req-c", "Say hello.")
assert not list(clean.feed("Hello! How can I help you today?")), "clean answer flagged"
print("wheel smoke test: leak found from", {f.source_tenant for f in findings})
PY
echo "wheel smoke test passed"
