"""The main window's parts: thin widgets bound to the services' signals."""
