"""``apiary-worker``: the worker's command line (the engine and link land with the worker core)."""

from __future__ import annotations

import argparse
import sys

from desktop_worker import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="apiary-worker", description="The Apiary worker.")
    parser.add_argument("--version", action="version", version=f"apiary-worker {__version__}")
    parser.parse_args(argv)
    parser.error("the worker core is not built yet; only --version works in this release")
    return 2


if __name__ == "__main__":
    sys.exit(main())
