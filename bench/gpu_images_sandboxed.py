"""Image jobs through the worker's sandboxed image child (issue 38 on a GPU, issue 41): the
random-weight SDXS-512-DS test model rendered by ``SandboxedImages`` (the child confined, its
GPU driver started inside the sandbox as any engine child's), timed against the same order in
this process (``DiffusionModel``), and whether the two give the same bytes.

    python bench/gpu_images_sandboxed.py MODEL [--side 512] [--steps 20] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop_worker.sandbox.images import SandboxedImages  # noqa: E402
from shared_schema.images import ImageOrder  # noqa: E402


def order(side: int, steps: int, seed: int) -> ImageOrder:
    return ImageOrder(model="bench", prompt="a lighthouse on a cliff at dusk, oil painting",
                      width=side, height=side, steps=steps, guidance=7.0, sampler="euler",
                      seed=seed, n=1)


async def sandboxed(model: Path, side: int, steps: int, threads: int,
                    runs: int) -> tuple[float, float, bytes, str]:
    engine = SandboxedImages(n_threads=threads)
    try:
        started = time.perf_counter()
        await engine.render(model, order(side, steps, 1), threading.Event())  # load + warm-up
        first_s = time.perf_counter() - started
        times = []
        image = b""
        for run in range(runs):
            started = time.perf_counter()
            done = await engine.render(model, order(side, steps, 100 + run), threading.Event())
            times.append(time.perf_counter() - started)
            image = done.images[0].b64_json.encode()
        child = engine._children[model].process
        confinement = child.link.hello.confinement if child.link.hello else None
        held = (f"seccomp {confinement.seccomp}, Landlock {confinement.landlock_abi}, "
                f"files {confinement.filesystem}, network {confinement.network}"
                if confinement else "no hello")
        return first_s, statistics.median(times), image, held
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    faulthandler.enable()  # the H200 run's in-process half ended with SIGSEGV and no word
    first_s, median_s, image, held = asyncio.run(
        sandboxed(args.model, args.side, args.steps, args.threads, args.runs))
    print(f"sandboxed: {args.side}x{args.side}, {args.steps} steps: first (load + render) "
          f"{first_s:.2f} s, then {median_s:.3f} s/image (median of {args.runs}); "
          f"the child: {held}", flush=True)
    from desktop_worker.engine.diffusion import DiffusionModel

    with DiffusionModel(args.model, n_threads=args.threads) as plain:
        plain.render(order(args.side, args.steps, 1))
        times = []
        for run in range(args.runs):
            started = time.perf_counter()
            [last] = plain.render(order(args.side, args.steps, 100 + run))
            times.append(time.perf_counter() - started)
    in_process = statistics.median(times)
    same = last.b64_json.encode() == image
    print(f"in process: {in_process:.3f} s/image; sandboxed/in-process "
          f"{median_s / in_process:.2f}; the last images are "
          f"{'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
