"""The desktop app's platform layer, with no widgets: persisted settings (``config``), run at
login (``autostart``) and the single-instance guard (``single_instance``, which needs QtNetwork
and so is not imported here)."""
