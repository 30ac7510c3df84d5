"""``apiary-worker``: serve headless, inspect the hardware, and manage the model store.

    apiary-worker                    open the desktop app (tray + window)
    apiary-worker --headless --queen ws://HOST:PORT/worker --ln-url ADDRESS --model NAME_OR_PATH
                  (--queen repeated, or comma-separated: replicas of one queen, tried in turn)
    apiary-worker detect
    apiary-worker models pull NAME | list | rm NAME | import PATH --name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys

from pydantic import ValidationError

from desktop_worker import __version__
from desktop_worker.errors import HandshakeRefusedError, WorkerError
from desktop_worker.settings import WorkerSettings

log = logging.getLogger("desktop_worker")


def gpu_layers(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        layers = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be 'auto' or a number of layers") from None
    if layers < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return layers


def build_parser() -> argparse.ArgumentParser:
    # Options valid before and after a command; SUPPRESS keeps a subcommand's parser from
    # overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--models-dir", default=argparse.SUPPRESS,
                        help="where models are kept (default: user data dir)")
    common.add_argument("--log-level", default=argparse.SUPPRESS,
                        choices=["debug", "info", "warning", "error"])

    parser = argparse.ArgumentParser(
        prog="apiary-worker",
        parents=[common],
        description="Lend this machine's GPU to an Apiary swarm. Settings can also be given as "
        "APIARY_* environment variables (APIARY_QUEEN_URL, APIARY_LN_URL, APIARY_MODELS, ...).",
    )
    parser.add_argument("--version", action="version", version=f"apiary-worker {__version__}")
    parser.add_argument("--headless", action="store_true", help="serve without the desktop app")
    parser.add_argument("--queen", dest="queen_url", action="append", metavar="URL",
                        help="the queen's worker URL; repeat it (or separate with commas) for "
                        "replicas of one queen, tried in turn when one cannot be reached")
    parser.add_argument("--ln-url", help="Lightning address or LNURL for payouts (optional)")
    parser.add_argument("--model", dest="models", action="append", metavar="NAME_OR_PATH",
                        help="a model to serve: hf-user/hf-repo:filter or a local .gguf file "
                        "(a diffusion model: .gguf or .safetensors, with --images; repeatable)")
    parser.add_argument("--max-jobs", type=int,
                        help="jobs served at once (default: automatic, as many as memory "
                             "allows, up to 8)")
    parser.add_argument("--gpu-layers", type=gpu_layers, help="'auto' (default) or a number")
    parser.add_argument("--ctx", dest="n_ctx", type=int, help="context size (default 4096)")
    parser.add_argument("--threads", type=int, help="CPU threads for llama.cpp")
    parser.add_argument("--local-group", type=int, metavar="N",
                        help="serve the model through a group of N RPC servers on this machine "
                        "(a demonstration of model groups; chat and completions only)")

    parser.add_argument("--train", action="store_true", default=None,
                        help="take fine-tuning jobs: train LoRA adapters of the models served "
                        "(APIARY_TRAIN; off by default)")
    parser.add_argument("--train-on-gpu", action="store_true", default=None,
                        help="train on the GPU when it has room (APIARY_TRAIN_ON_GPU; off by "
                        "default: training runs on the CPU)")
    parser.add_argument("--images", action="store_true", default=None,
                        help="render images with the diffusion models served (a .gguf or "
                        ".safetensors --model; APIARY_IMAGES; off by default)")

    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("detect", parents=[common], help="print the detected hardware as JSON")
    models = commands.add_parser("models", parents=[common], help="manage the model store")
    actions = models.add_subparsers(dest="action", metavar="ACTION", required=True)
    pull = actions.add_parser("pull", parents=[common], help="download a model")
    pull.add_argument("name", help="hf-user/hf-repo:filter")
    actions.add_parser("list", parents=[common], help="list the cached models")
    remove = actions.add_parser("rm", parents=[common], help="delete a cached model")
    remove.add_argument("name")
    imp = actions.add_parser("import", parents=[common], help="import a local .gguf file")
    imp.add_argument("path")
    imp.add_argument("--name", required=True, help="the name to serve it under")
    return parser


def settings_from(args: argparse.Namespace) -> WorkerSettings:
    names = ("queen_url", "ln_url", "models", "models_dir", "max_jobs", "gpu_layers", "n_ctx",
             "threads", "local_group", "train", "train_on_gpu", "images")
    overrides = {name: getattr(args, name, None) for name in names}
    if overrides["queen_url"] is not None:  # --queen, repeatable: one comma-separated list
        overrides["queen_url"] = ",".join(overrides["queen_url"])
    return WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        parser.error(f"bad setting: {exc.errors(include_url=False)[0]['msg']}")
    try:
        if args.command == "detect":
            return detect(settings)
        if args.command == "models":
            return manage_models(settings, args)
        if not args.headless:
            return open_app(settings)
        if not settings.models:
            parser.error("name at least one model to serve with --model")
        return asyncio.run(serve(settings))
    except HandshakeRefusedError as exc:
        print(f"apiary-worker: {exc}", file=sys.stderr)  # noqa: T201
        return 3
    except WorkerError as exc:
        print(f"apiary-worker: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    except KeyboardInterrupt:
        return 130


def open_app(settings: WorkerSettings) -> int:
    try:
        from desktop_worker.gui.app import run_app
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in {"PySide6", "shiboken6", "qasync"}:
            raise
        # pip install 'apiary[worker]' is the headless worker alone.
        raise WorkerError(f"the desktop app needs {missing}: install 'apiary[desktop]', or "
                          "run the worker with --headless") from exc
    return run_app(settings)


def detect(settings: WorkerSettings) -> int:
    from desktop_worker.hardware import detect_hardware

    report = detect_hardware(settings.models_dir)
    print(json.dumps(report.to_json_dict(), indent=2))  # noqa: T201
    return 0


def manage_models(settings: WorkerSettings, args: argparse.Namespace) -> int:
    from desktop_worker.cli_models import run_models_command

    return run_models_command(settings, args)


async def serve(settings: WorkerSettings) -> int:
    from desktop_worker.cli_models import DownloadBar
    from desktop_worker.service import WorkerService
    from desktop_worker.store.disk import fmt_bytes

    service = WorkerService(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows
            loop.add_signal_handler(signum, stop.set)
    log.info("apiary-worker %s, key %s..., queen %s", __version__, service.identity.pubkey[:12],
             ", ".join(settings.link_urls))
    store = service.store
    log.info("models may use %s of this disk%s; %s always stays free (disk_headroom_gb)",
             fmt_bytes(store.quota_bytes) if store.quota_bytes else "all",
             " (disk_quota_gb)" if settings.disk_quota_gb is not None else
             " (half of what the store could hold: set disk_quota_gb to choose)",
             fmt_bytes(store.disk.headroom_for(store.disk.usage())))
    bar = DownloadBar()
    try:
        await service.prepare(settings.models, progress=bar.update)
    finally:
        bar.close()
    await service.serve(stop)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
