"""``apiary-worker models ...``: pull (with a progress bar), list, rm and import.

A pull keeps to the same limits as the queen's placements: the quota (``disk_quota_gb``) and the
disk's headroom (``disk_headroom_gb``, by default 10 % of the disk, 10-50 GB). One that would
cross either is refused before its first byte, in plain words (``apiary-worker: ...``, exit 1).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import threading

from tqdm import tqdm

from desktop_worker.errors import DownloadCancelled
from desktop_worker.settings import WorkerSettings
from desktop_worker.store import PullProgress, store_for


class DownloadBar:
    """A terminal progress bar fed by ``PullProgress`` reports (bytes, speed, ETA)."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None
        self._name: str | None = None

    def update(self, progress: PullProgress) -> None:
        if self._bar is None or self._name != progress.name:
            self.close()
            self._name = progress.name
            self._bar = tqdm(total=progress.total_bytes, unit="B", unit_scale=True,
                             unit_divisor=1024, desc=progress.name, file=sys.stderr,
                             dynamic_ncols=True, initial=progress.downloaded_bytes)
        self._bar.n = progress.downloaded_bytes
        self._bar.refresh()
        if progress.done:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def run_models_command(settings: WorkerSettings, args: argparse.Namespace) -> int:
    store = store_for(settings)
    out = sys.stdout
    if args.action == "pull":
        bar = DownloadBar()
        cancel = threading.Event()
        try:
            model = store.pull(args.name, progress=bar.update, cancel=cancel)
        except KeyboardInterrupt:
            cancel.set()
            raise DownloadCancelled("download interrupted; run the same pull to resume") from None
        finally:
            bar.close()
        out.write(f"{model.name}: {model.path.name}, {_size(model.size_bytes)}, "
                  f"sha256 {model.sha256[:16]}..., {model.info.parameter_count or 0:,} "
                  "parameters\n")
    elif args.action == "list":
        models = store.list()
        if not models:
            out.write(f"no models in {settings.models_dir}\n")
        for model in models:
            used = dt.datetime.fromtimestamp(model.last_used).strftime("%Y-%m-%d %H:%M")
            out.write(f"{model.name}\t{_size(model.size_bytes)}\t{model.info.quant or '-'}\t"
                      f"last used {used}\t{model.source}\n")
        total = _size(store.used_bytes)
        quota_text = f" of {_size(store.quota_bytes)} quota" if store.quota_bytes else ""
        out.write(f"{len(models)} model(s), {total}{quota_text}\n")
        usage = store.disk.usage()
        out.write(f"{_size(usage.free_bytes)} free on the disk, of which "
                  f"{_size(store.disk.headroom_for(usage))} is always left free\n")
    elif args.action == "rm":
        store.remove(args.name)
        out.write(f"removed {args.name}\n")
    elif args.action == "import":
        model = store.import_file(args.path, args.name)
        out.write(f"imported {model.path.name} as {model.name} ({_size(model.size_bytes)})\n")
    return 0
