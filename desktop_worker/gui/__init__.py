"""The desktop app: a PySide6 tray app and main window over the widget-free worker services.

``services/`` holds QObjects that wrap ``WorkerService``, the model store, the earnings API and
hardware detection, and speak to the views only through signals. ``views/`` are thin widgets.
``app.py`` wires it together on one qasync event loop.
"""
