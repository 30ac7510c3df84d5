"""Text from the queen is shown literally: a refusal reason that looks like HTML (an image,
bold) stays text in the header, the settings and models messages, and tray notifications."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import Qt as GuiQt
from PySide6.QtWidgets import QLabel

from desktop_worker.gui.common import notification_text, plain_label
from desktop_worker.gui.services.worker import as_sentence
from tests.desktop_worker.gui.conftest import open_app, until

HOSTILE = 'refused: <b>x</b><img src="http://127.0.0.1:9/track.png"><a href="x">click</a>'


def shows_literally(label: QLabel, text: str) -> bool:
    return label.textFormat() == Qt.TextFormat.PlainText and label.text() == text


async def test_a_refusal_reason_from_the_queen_shows_literally(settings_for, qtbot):
    async with open_app(settings_for()) as app:
        app.controller.state_changed.emit("error", HOSTILE)
        # Shown as a whole sentence (a capital, a full stop), every character as it came.
        assert shows_literally(app.header.detail, as_sentence(HOSTILE))
        app.controller.failed.emit(HOSTILE)
        await until(lambda: any(HOSTILE in n.message for n in app.tray.notices), 5,
                    "the notice")
        for label in (app.header.status, app.header.queen, app.header.today,
                      app.window.settings.message, app.window.settings.payout.verdict):
            assert label.textFormat() == Qt.TextFormat.PlainText


def test_plain_labels_never_render_markup(qtbot):
    label = plain_label(HOSTILE)
    qtbot.addWidget(label)
    assert shows_literally(label, HOSTILE)
    # The same text in a default label would be rich text: what this guards against.
    assert GuiQt.mightBeRichText(HOSTILE)


def test_notification_bodies_are_escaped_where_servers_read_markup():
    assert notification_text(HOSTILE, "linux") == (
        'refused: &lt;b&gt;x&lt;/b&gt;&lt;img src="http://127.0.0.1:9/track.png"&gt;'
        '&lt;a href="x"&gt;click&lt;/a&gt;')
    assert notification_text(HOSTILE, "win32") == HOSTILE
    assert notification_text("plain & simple", "darwin") == "plain & simple"
