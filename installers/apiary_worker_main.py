"""Entry point of the frozen desktop worker: the same ``main`` as the ``apiary-worker`` script.

No arguments open the desktop app; ``--headless`` serves from the command line; ``detect`` and
``models`` work as in a source install. ``--engine-child`` is how the worker starts its
sandboxed engine processes (``desktop_worker/engine_child.py``): the frozen app has no
``python -m``. PyInstaller freezes this file (see apiary-worker.spec).
"""

import multiprocessing
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine-child"]:  # before anything else is imported
        from desktop_worker.engine_child import main as engine_main

        sys.exit(engine_main())
    from desktop_worker.cli import main

    multiprocessing.freeze_support()
    sys.exit(main())
