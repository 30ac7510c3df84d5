#!/usr/bin/env bash
# The newcomer's walk (docs/screenshots/walk.py) on a virtual X display with a window manager
# and a system tray host, all from Debian's packages:
#   apt-get install xvfb openbox trayer imagemagick x11-utils libxcb-cursor0 libxcb-icccm4 \
#                   libxcb-keysyms1 libxkbcommon-x11-0 (the last four: Qt's xcb plugin)
set -euo pipefail
cd "$(dirname "$0")/../.."
display=:77
Xvfb "$display" -screen 0 1600x1000x24 -nolisten tcp &
xvfb=$!
trap 'kill $tray $wm $xvfb 2>/dev/null || true' EXIT
export DISPLAY=$display
for _ in $(seq 50); do xdpyinfo >/dev/null 2>&1 && break; sleep 0.1; done
openbox &
wm=$!
trayer --edge top --align right --widthtype request --height 32 --transparent false \
       --tint 0xdddddd --SetDockType true &
tray=$!
sleep 1  # the tray host's selection is claimed: nothing to wait on from here
QT_QPA_PLATFORM=xcb .venv/bin/python docs/screenshots/walk.py
