"""Packaging of the desktop worker (PyInstaller spec, per-OS installer scripts).

Not part of the installed package; a package only so that tests can import its helpers.
"""
