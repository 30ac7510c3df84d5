"""Image speed: seconds per image of the diffusion engine (``engine/diffusion.py``) on this
machine, for the random-weight SDXS-512-DS test model (``tests/support/diffusion_models.py``),
at 64x64, 256x256 and 512x512; with the model's load time, the peak memory, and whether 1 and 2
threads render the same pixels.

Each size renders ``--runs`` times after one warm-up, through ``DiffusionModel.render`` (the
path a job takes: the prompt encoded, the steps, TAESD's decode, the PNG); the table gives the
median, and seconds per megapixel-step (the unit image work is timed and priced in). The model
is written first in a child process (its arrays would otherwise count in the peak memory).

    .venv/bin/python bench/image_speed.py [--steps 4] [--runs 3] [--threads 2] [--model PATH]
                                          [--sides 64 256 512]
"""

from __future__ import annotations

import argparse
import base64
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.engine.diffusion import DiffusionModel  # noqa: E402
from shared_schema.images import ImageOrder, megapixel_steps  # noqa: E402

SIDES = (64, 256, 512)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_model(folder: Path) -> tuple[Path, float]:
    path = folder / "sdxs-512-ds-random-seed0.gguf"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from tests.support.diffusion_models import write_sdxs_model; "
                    "write_sdxs_model(Path(sys.argv[1]))", str(path)],
                   check=True, cwd=ROOT)
    return path, time.perf_counter() - started


def order(side: int, steps: int, seed: int = 11) -> ImageOrder:
    return ImageOrder(model="bench", prompt="a lighthouse on a cliff at dusk, oil painting",
                      width=side, height=side, steps=steps, guidance=7.0, sampler="euler",
                      seed=seed, n=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--sides", type=int, nargs="+", default=list(SIDES))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        path, made_s = (args.model, 0.0) if args.model else write_model(Path(scratch))
        print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads; "
              f"model {path.stat().st_size / 1e6:.0f} MB"
              + (f", written in {made_s:.1f} s" if made_s else ""))
        before = rss_mb()
        started = time.perf_counter()
        model = DiffusionModel(path, n_threads=args.threads)
        load_s = time.perf_counter() - started
        print(f"load: {load_s:.2f} s, resident memory +{rss_mb() - before:.0f} MB")
        print(f"\n| size | steps | s/image (median of {args.runs}) | s per MP-step | "
              "peak RSS MB |")
        print("|---|---|---|---|---|")
        for side in args.sides:
            model.render(order(side, args.steps))  # warm-up: sd.cpp sizes its buffers
            times = []
            for run in range(args.runs):
                started = time.perf_counter()
                model.render(order(side, args.steps, seed=100 + run))
                times.append(time.perf_counter() - started)
            median = statistics.median(times)
            work = megapixel_steps(side, side, args.steps)
            print(f"| {side}x{side} | {args.steps} | {median:.2f} | {median / work:.2f} | "
                  f"{peak_rss_mb():.0f} |", flush=True)
        model.close()

        print("\nthreads 1 vs", args.threads, "at 256x256:")
        pictures = {}
        for threads in sorted({1, args.threads}):
            with DiffusionModel(path, n_threads=threads) as loaded:
                started = time.perf_counter()
                [image] = loaded.render(order(256, args.steps))
                pictures[threads] = base64.b64decode(image.b64_json)
                print(f"  {threads} thread(s): {time.perf_counter() - started:.2f} s")
        same = len(set(pictures.values())) == 1
        print(f"  the PNGs are {'identical, byte for byte' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
