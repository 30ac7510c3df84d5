"""``python -m desktop_worker``: the same as the ``apiary-worker`` command."""

from desktop_worker.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
