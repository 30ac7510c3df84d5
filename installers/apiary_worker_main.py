"""Entry point of the frozen desktop worker: the same ``main`` as the ``apiary-worker`` script.

No arguments open the desktop app; ``--headless`` serves from the command line; ``detect`` and
``models`` work as in a source install. PyInstaller freezes this file (see apiary-worker.spec).
"""

import multiprocessing
import sys

from desktop_worker.cli import main

if __name__ == "__main__":
    # A model group's head and RPC server run in child processes (multiprocessing's spawn):
    # in the frozen app such a child re-enters here and must run its target, not the app.
    multiprocessing.freeze_support()
    sys.exit(main())
