"""Widget-free services for the app: each is a QObject that reports through signals."""
