#!/usr/bin/env bash
# Build the macOS desktop worker: "Apiary Worker.app" and its .dmg.
#
#   installers/macos/build.sh [--variant metal|cpu] [--out DIR]
#
# metal (Apple Silicon, the default) and cpu (Intel Macs) need llama-cpp-python built for them
# first: installers/build_llama.sh metal|cpu. Signing and notarisation run only when their
# credentials are set (see make_dmg.sh). Outputs in DIR (default installers/dist/):
#   apiary-worker-<ver>-macos-<variant>-<arch>.dmg
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VARIANT="${APIARY_VARIANT:-metal}"
OUT="$ROOT/installers/dist"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --variant) VARIANT="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
case "$VARIANT" in metal|cpu) ;; *) echo "build.sh: --variant must be metal or cpu" >&2; exit 2 ;; esac
[[ "$(uname -s)" == "Darwin" ]] || { echo "build.sh: run this on macOS" >&2; exit 2; }
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
VERSION="$("$PYTHON" -c 'import desktop_worker; print(desktop_worker.__version__)')"
ARCH="$(uname -m)"
WORK="$ROOT/installers/build/macos-$VARIANT"
mkdir -p "$OUT" "$WORK"

echo "==> icon"
"$PYTHON" "$ROOT/installers/render_icon.py" "$ROOT/resources/icons/app.svg" \
    --iconset "$WORK/apiary-worker.iconset"
iconutil -c icns -o "$WORK/apiary-worker.icns" "$WORK/apiary-worker.iconset"

echo "==> Apiary Worker.app ($VARIANT)"
# PyInstaller signs every binary and the bundle (hardened runtime) when given an identity.
export APIARY_VARIANT="$VARIANT" APIARY_ICON="$WORK/apiary-worker.icns"
if [[ -n "${APPLE_SIGNING_IDENTITY:-}" ]]; then
    export APIARY_CODESIGN_IDENTITY="$APPLE_SIGNING_IDENTITY"
    export APIARY_ENTITLEMENTS="$ROOT/installers/macos/entitlements.plist"
fi
"$PYTHON" -m PyInstaller --noconfirm --log-level WARN --distpath "$WORK/dist" \
    --workpath "$WORK/pyinstaller-work" "$ROOT/installers/apiary-worker.spec"
APP="$WORK/dist/Apiary Worker.app"
"$APP/Contents/MacOS/apiary-worker" --version

bash "$ROOT/installers/macos/make_dmg.sh" "$APP" \
    "$OUT/apiary-worker-$VERSION-macos-$VARIANT-$ARCH.dmg"
