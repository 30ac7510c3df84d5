"""Entry point of the frozen desktop worker: the same ``main`` as the ``apiary-worker`` script.

No arguments open the desktop app; ``--headless`` serves from the command line; ``detect`` and
``models`` work as in a source install. PyInstaller freezes this file (see apiary-worker.spec).
"""

import sys

from desktop_worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
