#!/usr/bin/env bash
# redis-server for the scale-out tests (tests/test_scaleout.py starts its own on a free
# loopback port): from the distribution's packages, installed only when missing. Without
# root or sudo it says so; the scale-out tests then skip (and fail under CI=true).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "redis-server is missing and cannot be installed without root: apt-get install redis-server" >&2
        exit 0
    fi
    sudo="sudo"
fi
log="$(mktemp)"
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    $sudo apt-get install -y -qq --no-install-recommends redis-server; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "could not install redis-server" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
