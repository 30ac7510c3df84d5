"""The image audit's band across builds (issue 41): how far the same order's image rendered by
one stable-diffusion.cpp build (a CPU's) is from another's (a GPU's), against the distance the
queen fails an image job at (``image_audit_max_distance``, 0.05: the mean absolute difference
per pixel and RGB channel over 255, ``queen_server.images.audits.image_distance``).

An image worker's job is audited by another image worker holding the same file, trusted
auditors and the worker's own kind of backend first, but a CPU worker can be audited by a GPU
one. If honest renders of the two builds are further apart than the band, honest workers fail.

    # on each machine: the random-weight SDXS-512-DS test model, its orders' PNGs, band.json
    .venv/bin/python bench/image_band.py --write DIR [--threads 2]     # here, the CPU build
    python bench/image_band.py --write $OUT/band --threads 8           # there (gpu_images.sh)
    # here: each order's distance between the two
    .venv/bin/python bench/image_band.py --compare CPU_DIR GPU_DIR

``--write`` writes the model from its seed, renders ``ORDERS`` (PNG; 256 and 512 pixels a side,
4 steps, two seeds each) with the local build in one process, and writes them with
``band.json`` (the model's sha256, the orders, the build, the machine, the seconds each took).
``--compare`` refuses two folders of different models (another numpy drew other weights) or
orders, and prints each order's distance and the worst against the queen's band. Only
``--compare`` imports the queen: the GPU machine needs the worker's packages alone.
``--model`` renders a written model instead.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared_schema.images import ImageOrder  # noqa: E402

ORDERS = [(256, 4, 11), (256, 4, 12), (512, 4, 21), (512, 4, 22)]  # side, steps, seed
PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def order(side: int, steps: int, seed: int) -> ImageOrder:
    return ImageOrder(model="band", prompt=PROMPT, width=side, height=side, steps=steps,
                      guidance=7.0, sampler="euler", seed=seed, n=1, output_format="png")


def name_of(side: int, steps: int, seed: int) -> str:
    return f"{side}px-{steps}steps-seed{seed}.png"


def build() -> dict[str, Any]:
    try:
        version = importlib.metadata.version("stable-diffusion-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"stable_diffusion_cpp_python": version, "machine": platform.machine(),
            "processor": platform.processor(), "python": platform.python_version()}


def render_all(model: Path, threads: int) -> dict[str, tuple[bytes, float]]:
    """Each order's PNG and the seconds it took, in one process."""
    from desktop_worker.engine.diffusion import DiffusionModel

    out: dict[str, tuple[bytes, float]] = {}
    with DiffusionModel(model, n_threads=threads) as loaded:
        for side, steps, seed in ORDERS:
            started = time.perf_counter()
            [image] = loaded.render(order(side, steps, seed))
            out[name_of(side, steps, seed)] = (base64.b64decode(image.b64_json),
                                               time.perf_counter() - started)
    return out


def write(folder: Path, model: Path, sha256: str, threads: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rendered = render_all(model, threads)
    for name, (data, seconds) in rendered.items():
        (folder / name).write_bytes(data)
        print(f"{name}: {len(data):,} bytes in {seconds:.1f} s")
    (folder / "band.json").write_text(json.dumps({
        "model_sha256": sha256, "orders": ORDERS, "prompt": PROMPT, "build": build(),
        "threads": threads, "seconds": {name: round(s, 2) for name, (_, s) in rendered.items()},
    }, indent=1))
    print(f"wrote {len(rendered)} images and band.json to {folder}")


def compare(first: Path, second: Path) -> int:
    from queen_server.images.audits import image_distance
    from queen_server.settings import QueenSettings

    a, b = (json.loads((folder / "band.json").read_text()) for folder in (first, second))
    if a["model_sha256"] != b["model_sha256"]:
        print(f"the models differ ({a['model_sha256'][:12]} against {b['model_sha256'][:12]}): "
              "their weights were drawn differently; no comparison")
        return 2
    if a["orders"] != b["orders"] or a["prompt"] != b["prompt"]:
        print("the folders hold different orders; no comparison")
        return 2
    band = QueenSettings.model_fields["image_audit_max_distance"].default
    print(f"{first}: {a['build']}, {a['threads']} threads")
    print(f"{second}: {b['build']}, {b['threads']} threads")
    print(f"{'order':<28}{'distance':>10}{'s, first':>10}{'s, second':>11}")
    worst = 0.0
    for side, steps, seed in (tuple(o) for o in a["orders"]):
        name = name_of(side, steps, seed)
        distance = image_distance((first / name).read_bytes(), (second / name).read_bytes())
        worst = max(worst, distance)
        took = [f"{one['seconds'][name]:.1f}" if name in one.get("seconds", {}) else "-"
                for one in (a, b)]
        print(f"{name:<28}{distance:>10.4f}{took[0]:>10}{took[1]:>11}")
    verdict = "inside" if worst <= band else "OUTSIDE"
    print(f"worst {worst:.4f}: {verdict} the queen's band of {band} (image_audit_max_distance)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="DIR")
    mode.add_argument("--compare", type=Path, nargs=2, metavar="DIR")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a written test model")
    args = parser.parse_args()
    if args.compare is not None:
        return compare(*args.compare)
    from tests.support.diffusion_models import write_sdxs_model

    with tempfile.TemporaryDirectory() as scratch:
        if args.model is not None:
            import hashlib

            model = args.model
            sha256 = hashlib.sha256(model.read_bytes()).hexdigest()
        else:
            written = write_sdxs_model(Path(scratch) / "sdxs.gguf")
            model, sha256 = written.path, written.sha256
        write(args.write, model, sha256, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
