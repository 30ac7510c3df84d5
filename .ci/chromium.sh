#!/usr/bin/env bash
# Install Debian's chromium for the page tests (Playwright drives /usr/bin/chromium; it never
# downloads a browser). Does nothing when it is already there.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
as_root=()
if [ "$(id -u)" != 0 ]; then
    as_root=(sudo)
fi
("${as_root[@]}" apt-get install -y -q chromium \
    || ("${as_root[@]}" apt-get update -q && "${as_root[@]}" apt-get install -y -q chromium)) >&2
/usr/bin/chromium --version >&2
