"""installers/render_icon.py: the app's SVG to PNG sizes and a Windows .ico, with QSvgRenderer.

It runs in a subprocess, as the build scripts run it: it makes a QGuiApplication, which must not
become the QApplication of the Qt tests sharing this process.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

from installers.render_icon import ICO_SIZES

ROOT = Path(__file__).resolve().parents[2]
SVG = ROOT / "resources/icons/app.svg"


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "installers/render_icon.py"), *args],
                          capture_output=True, text=True, timeout=60)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_pngs_are_rendered_at_each_size(tmp_path):
    done = render(str(SVG), "--png-dir", str(tmp_path), "--sizes", "16,48,256")
    assert done.returncode == 0, done.stderr
    for size in (16, 48, 256):
        assert png_size((tmp_path / f"{size}.png").read_bytes()) == (size, size)


def test_the_ico_holds_every_size_as_png(tmp_path):
    ico = tmp_path / "app.ico"
    done = render(str(SVG), "--ico", str(ico))
    assert done.returncode == 0, done.stderr
    data = ico.read_bytes()
    reserved, kind, count = struct.unpack("<HHH", data[:6])
    assert (reserved, kind, count) == (0, 1, len(ICO_SIZES))
    for index, size in enumerate(ICO_SIZES):
        width, height, _, _, _, bits, length, offset = struct.unpack(
            "<BBBBHHII", data[6 + 16 * index: 22 + 16 * index])
        assert (width or 256, height or 256, bits) == (size, size, 32)
        assert png_size(data[offset: offset + length]) == (size, size)


def test_the_macos_iconset_has_iconutils_names(tmp_path):
    done = render(str(SVG), "--iconset", str(tmp_path / "a.iconset"))
    assert done.returncode == 0, done.stderr
    assert png_size((tmp_path / "a.iconset/icon_512x512@2x.png").read_bytes()) == (1024, 1024)
    assert len(list((tmp_path / "a.iconset").iterdir())) == 10


def test_a_file_that_is_not_svg_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.svg"
    bad.write_text("not an svg")
    done = render(str(bad), "--png-dir", str(tmp_path / "out"), "--sizes", "16")
    assert done.returncode == 1
    assert "not an SVG that Qt can render" in done.stderr
