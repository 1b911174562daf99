#!/usr/bin/env bash
# Chromium for the HTML report test (tests/test_report_browser.py renders the report in
# headless Chromium): from the distribution's packages, installed only when missing.
# Without root or sudo it says so; the browser test then skips (and fails under CI=true).
set -euo pipefail
for name in chromium chromium-browser; do
    command -v "$name" >/dev/null 2>&1 && exit 0
done
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "chromium is missing and cannot be installed without root: apt-get install chromium" >&2
        exit 0
    fi
    sudo="sudo"
fi
log="$(mktemp)"
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    $sudo apt-get install -y -qq --no-install-recommends chromium; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "could not install chromium" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
