"""Render the app's SVG icon to the bitmaps each installer needs, with Qt's own SVG renderer.

    python installers/render_icon.py SVG --png-dir DIR [--sizes 16,32,...]   # DIR/<size>.png
    python installers/render_icon.py SVG --ico FILE                          # Windows .ico
    python installers/render_icon.py SVG --iconset DIR                       # macOS, for iconutil

Runs with the build venv's PySide6 on any OS, with no display (offscreen platform).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
ICONSET = {  # iconutil's names
    "icon_16x16.png": 16, "icon_16x16@2x.png": 32, "icon_32x32.png": 32,
    "icon_32x32@2x.png": 64, "icon_128x128.png": 128, "icon_128x128@2x.png": 256,
    "icon_256x256.png": 256, "icon_256x256@2x.png": 512, "icon_512x512.png": 512,
    "icon_512x512@2x.png": 1024,
}


class IconError(Exception):
    """The SVG cannot be rendered (missing or not an SVG Qt can read)."""


def render_png(svg: Path, size: int) -> bytes:
    """The SVG drawn on a transparent ``size`` x ``size`` square, as PNG bytes."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise IconError(f"{svg} is not an SVG that Qt can render")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    renderer.render(painter)
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """A multi-size .ico holding PNG images (the format Windows has read since Vista)."""
    sizes = sorted(pngs)
    header = struct.pack("<HHH", 0, 1, len(sizes))
    offset = len(header) + 16 * len(sizes)
    entries, blobs = b"", b""
    for size in sizes:
        blob = pngs[size]
        dim = 0 if size >= 256 else size  # 0 means 256 in an ICONDIRENTRY
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(blob), offset)
        offset += len(blob)
        blobs += blob
    return header + entries + blobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("svg", type=Path)
    parser.add_argument("--png-dir", type=Path)
    parser.add_argument("--sizes", default=",".join(map(str, PNG_SIZES)))
    parser.add_argument("--ico", type=Path)
    parser.add_argument("--iconset", type=Path)
    args = parser.parse_args(argv)
    if not args.svg.is_file():
        parser.error(f"no such SVG: {args.svg}")
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication([])  # noqa: F841 (Qt needs one)
    try:
        if args.png_dir:
            args.png_dir.mkdir(parents=True, exist_ok=True)
            for size in (int(s) for s in args.sizes.split(",")):
                (args.png_dir / f"{size}.png").write_bytes(render_png(args.svg, size))
        if args.ico:
            args.ico.parent.mkdir(parents=True, exist_ok=True)
            args.ico.write_bytes(ico_bytes({s: render_png(args.svg, s) for s in ICO_SIZES}))
        if args.iconset:
            args.iconset.mkdir(parents=True, exist_ok=True)
            for name, size in ICONSET.items():
                (args.iconset / name).write_bytes(render_png(args.svg, size))
    except IconError as exc:
        sys.stderr.write(f"render_icon: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
