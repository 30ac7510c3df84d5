#!/usr/bin/env bash
# Wrap "Apiary Worker.app" in a .dmg (drag to Applications); sign, notarise and staple it when
# the credentials are in the environment.
#
#   installers/macos/make_dmg.sh "path/Apiary Worker.app" path/out.dmg
#
# Signing (skipped, with a note, when unset):
#   APPLE_SIGNING_IDENTITY  "Developer ID Application: Name (TEAMID)", in the keychain
# Notarisation (skipped when any is unset; needs a signed app):
#   APPLE_ID, APPLE_TEAM_ID, APPLE_APP_PASSWORD (an app-specific password)
set -euo pipefail

APP="${1:?usage: make_dmg.sh APP OUT.dmg}"
DMG="${2:?usage: make_dmg.sh APP OUT.dmg}"
[[ -d "$APP" ]] || { echo "make_dmg.sh: no app at $APP" >&2; exit 2; }
command -v hdiutil >/dev/null || { echo "make_dmg.sh: hdiutil is macOS only" >&2; exit 2; }

SIGN="${APPLE_SIGNING_IDENTITY:-}"
if [[ -n "$SIGN" ]]; then
    echo "==> checking the app's signature"
    # PyInstaller signed it (apiary-worker.spec); re-sign the bundle in case anything changed.
    codesign --force --options runtime --timestamp \
        --entitlements "$(dirname "$0")/entitlements.plist" --sign "$SIGN" "$APP"
    codesign --verify --deep --strict --verbose=2 "$APP"
else
    echo "==> APPLE_SIGNING_IDENTITY unset: the app and .dmg stay unsigned (Gatekeeper will warn)"
fi

echo "==> $DMG"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -R "$APP" "$STAGE/"
ln -s /Applications "$STAGE/Applications"
rm -f "$DMG"
hdiutil create -volname "Apiary Worker" -srcfolder "$STAGE" -fs HFS+ -format UDZO -ov "$DMG"

if [[ -n "$SIGN" ]]; then
    codesign --force --timestamp --sign "$SIGN" "$DMG"
    if [[ -n "${APPLE_ID:-}" && -n "${APPLE_TEAM_ID:-}" && -n "${APPLE_APP_PASSWORD:-}" ]]; then
        echo "==> notarising (waits for Apple's answer)"
        xcrun notarytool submit "$DMG" --apple-id "$APPLE_ID" --team-id "$APPLE_TEAM_ID" \
            --password "$APPLE_APP_PASSWORD" --wait
        xcrun stapler staple "$DMG"
        xcrun stapler validate "$DMG"
    else
        echo "==> APPLE_ID / APPLE_TEAM_ID / APPLE_APP_PASSWORD unset: not notarised"
    fi
fi
du -h "$DMG"
