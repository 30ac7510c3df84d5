#!/usr/bin/env bash
# Debian packages the tests use, installed when missing:
#   chromium            the page tests (Playwright drives /usr/bin/chromium; no browser download)
#   desktop-file-utils  desktop-file-validate, for the Linux autostart entry and the .deb's entry
#   binutils            objdump, which PyInstaller needs for the installer build test
#   redis-server        the queen's cluster tests (replicas sharing Redis)
#   openssl             a certificate for the cluster bus's TLS test (a rediss:// bus)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
as_root=()
if [ "$(id -u)" != 0 ]; then
    as_root=(sudo)
fi
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v desktop-file-validate >/dev/null || missing+=(desktop-file-utils)
command -v objdump >/dev/null || missing+=(binutils)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v openssl >/dev/null || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
    ("${as_root[@]}" apt-get install -y -q "${missing[@]}" \
        || ("${as_root[@]}" apt-get update -q && "${as_root[@]}" apt-get install -y -q "${missing[@]}")) >&2
fi
/usr/bin/chromium --version >&2
