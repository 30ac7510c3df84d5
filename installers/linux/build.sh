#!/usr/bin/env bash
# Build the Linux desktop worker: the one-folder app, a tarball of it and a .deb.
#
#   installers/linux/build.sh [--variant cpu|cuda|vulkan] [--out DIR] [--work DIR]
#
# Run from any directory, in an environment where Apiary and the variant's llama-cpp-python are
# installed (installers/build_llama.sh VARIANT does the latter). PYTHON picks the interpreter
# (default: .venv/bin/python of the checkout, else python3). Outputs, in DIR (default
# installers/dist/):
#   apiary-worker-<ver>-linux-<variant>-x86_64/        the app folder (run ./apiary-worker)
#   apiary-worker-<ver>-linux-<variant>-x86_64.tar.gz  that folder, as apiary-worker/
#   apiary-worker_<ver>_<variant>_amd64.deb            /opt/apiary-worker, /usr/bin/apiary-worker,
#                                                      a .desktop entry and hicolor icons
# DEB_COMPRESSION (gzip, xz or zstd; default gzip) is passed to dpkg-deb -Z.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VARIANT="${APIARY_VARIANT:-cpu}"
OUT="$ROOT/installers/dist"
WORK=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --variant) VARIANT="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
case "$VARIANT" in
    cpu|cuda|vulkan) ;;
    *) echo "build.sh: --variant must be cpu, cuda or vulkan, not '$VARIANT'" >&2; exit 2 ;;
esac
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
for tool in dpkg-deb tar; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool is needed (apt-get install dpkg)" >&2; exit 2; }
done

ARCH_DEB=amd64
ARCH=x86_64
[[ "$(uname -m)" == "x86_64" ]] || { echo "build.sh: only x86_64 builds are set up" >&2; exit 2; }
VERSION="$("$PYTHON" -c 'import desktop_worker; print(desktop_worker.__version__)')"
NAME="apiary-worker-$VERSION-linux-$VARIANT-$ARCH"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if [[ -z "$WORK" ]]; then WORK="$ROOT/installers/build/linux-$VARIANT"; fi
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"

echo "==> apiary-worker $VERSION, variant $VARIANT: app folder"
APIARY_VARIANT="$VARIANT" "$PYTHON" -m PyInstaller --noconfirm --log-level WARN \
    --distpath "$WORK/pyinstaller-dist" --workpath "$WORK/pyinstaller-work" \
    "$ROOT/installers/apiary-worker.spec"
rm -rf "${OUT:?}/$NAME"
mv "$WORK/pyinstaller-dist/apiary-worker" "$OUT/$NAME"
APP="$OUT/$NAME"
# Shared libraries need no execute bit, and no VCS files belong in an app.
find "$APP" -type f -name "*.so*" -exec chmod 0644 {} +
find "$APP" -name ".gitignore" -type f -delete
"$APP/apiary-worker" --version

echo "==> tarball"
# The folder inside the tarball is plain apiary-worker/, whatever the archive is called.
tar -C "$OUT" --transform "s|^$NAME|apiary-worker|" -czf "$OUT/$NAME.tar.gz" "$NAME"

echo "==> .deb"
STAGE="$WORK/deb"
rm -rf "$STAGE"
mkdir -p "$STAGE/DEBIAN" "$STAGE/opt" "$STAGE/usr/bin" "$STAGE/usr/share/applications" \
    "$STAGE/usr/share/icons/hicolor/scalable/apps"
cp -a "$APP" "$STAGE/opt/apiary-worker"
ln -s /opt/apiary-worker/apiary-worker "$STAGE/usr/bin/apiary-worker"
install -m 0644 "$ROOT/installers/linux/apiary-worker.desktop" "$STAGE/usr/share/applications/"
DOC="$STAGE/usr/share/doc/apiary-worker"
mkdir -p "$DOC"
install -m 0644 "$ROOT/installers/linux/copyright" "$DOC/copyright"
printf 'apiary-worker (%s) stable; urgency=medium\n\n  * Release %s (%s build).\n\n -- Apiary developers <dev@apiary.net>  %s\n' \
    "$VERSION" "$VERSION" "$VARIANT" "$(date -R)" | gzip -9n > "$DOC/changelog.gz"
chmod 0644 "$DOC/changelog.gz"
ICON_SVG="$ROOT/resources/icons/app.svg"
install -m 0644 "$ICON_SVG" "$STAGE/usr/share/icons/hicolor/scalable/apps/apiary-worker.svg"
QT_QPA_PLATFORM=offscreen "$PYTHON" "$ROOT/installers/render_icon.py" "$ICON_SVG" \
    --png-dir "$WORK/icons" --sizes 16,24,32,48,64,128,256,512
for size in 16 24 32 48 64 128 256 512; do
    dir="$STAGE/usr/share/icons/hicolor/${size}x${size}/apps"
    mkdir -p "$dir"
    install -m 0644 "$WORK/icons/$size.png" "$dir/apiary-worker.png"
done
# Every bundled library is glibc-linked on this machine: require at least its glibc. The rest
# are what Qt's xcb platform plugin loads from the system (PyInstaller bundles the others).
GLIBC="$(getconf GNU_LIBC_VERSION | awk '{print $2}')"
EXTRA_DEPENDS=""
# The Vulkan loader is the system's (it finds the installed GPU drivers); so is NVIDIA's driver.
if [[ "$VARIANT" == "vulkan" ]]; then EXTRA_DEPENDS=", libvulkan1"; fi
INSTALLED_KB="$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)"
sed -e "s|@VERSION@|$VERSION|" -e "s|@ARCH@|$ARCH_DEB|" -e "s|@GLIBC@|$GLIBC|" \
    -e "s|@SIZE@|$INSTALLED_KB|" -e "s|@VARIANT@|$VARIANT|" -e "s|@EXTRA_DEPENDS@|$EXTRA_DEPENDS|" \
    "$ROOT/installers/linux/control.in" > "$STAGE/DEBIAN/control"
install -m 0755 "$ROOT/installers/linux/postinst" "$STAGE/DEBIAN/postinst"
install -m 0755 "$ROOT/installers/linux/postrm" "$STAGE/DEBIAN/postrm"
DEB="$OUT/apiary-worker_${VERSION}_${VARIANT}_${ARCH_DEB}.deb"
dpkg-deb --root-owner-group -Z"${DEB_COMPRESSION:-gzip}" --build "$STAGE" "$DEB"

echo "==> done"
du -sh "$APP" "$OUT/$NAME.tar.gz" "$DEB"
