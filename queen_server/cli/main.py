"""``apiary-queen``: run the queen."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

import uvicorn
from pydantic import ValidationError

from queen_server import __version__
from queen_server.app import create_app
from queen_server.cli.admin import add_commands, run_command
from queen_server.errors import QueenError
from queen_server.settings import QueenSettings
from queen_server.storage.engine import DatabaseError

log = logging.getLogger("queen_server")

GC_THRESHOLDS = (50_000, 20, 100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apiary-queen",
        description="Run the Apiary queen: an OpenAI-compatible API served by connected workers. "
        "Every option can also be set as an APIARY_* environment variable.",
    )
    parser.add_argument("--version", action="version", version=f"apiary-queen {__version__}")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument("--db", help="database URL: sqlite:///queen.db, sqlite:////abs/path.db "
                        "or postgresql://user:password@host/db (default: SQLite in the user "
                        "data dir)")
    parser.add_argument("--redis-url", help="the Redis replicas share (redis://, rediss://, "
                        "unix://); none: one queen on its own")
    parser.add_argument("--forwarded-allow-ips", help="addresses or networks of the proxy "
                        "whose X-Forwarded-For/-Proto headers are believed, or '*' (default: "
                        "$FORWARDED_ALLOW_IPS, else 127.0.0.1)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    add_commands(parser)
    return parser


def settings_from(args: argparse.Namespace) -> QueenSettings:
    overrides = {
        name: value
        for name, value in vars(args).items()
        if value is not None and name in QueenSettings.model_fields and name != "command"
    }
    return QueenSettings(**overrides)


def describe(exc: ValidationError) -> str:
    """What is wrong with each setting, without the values given (a database or Redis URL
    carries a password)."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        problems.append(f"{name}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        print(f"apiary-queen: bad setting: {describe(exc)}", file=sys.stderr)  # noqa: T201
        return 2
    if args.command:
        try:
            return run_command(settings, args, sys.stdout)
        except QueenError as exc:
            print(f"apiary-queen: {exc}", file=sys.stderr)  # noqa: T201
            return 1
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    try:
        app = create_app(settings)
    except DatabaseError as exc:
        print(f"apiary-queen: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    log.info("queen %s (replica %s) on http://%s:%d (database %s)", __version__,
             settings.replica_id, settings.host, settings.port,
             app.state.queen.db.url.render_as_string(hide_password=True))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        ws_max_size=settings.max_frame_bytes,
        # X-Forwarded-For/-Proto are believed from these peers only (the TLS proxy): they give
        # the client's address (rate limits, login guards) and https (Secure cookies, links).
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        ws_per_message_deflate=False,  # small JSON frames: compression costs more than it saves
        # The queen's own heartbeat (protocol ``ping`` every heartbeat_interval_s) finds silent
        # workers; uvicorn's websocket pings on top would double that traffic (issue 18: at
        # 5,000 workers, hundreds of pings a second).
        ws_ping_interval=None,
        access_log=False,
    )
    server = uvicorn.Server(config)
    # Start-up objects (modules, routes, settings) live as long as the process: stop the cycle
    # collector from re-scanning them on every pass (it halved p99 latency under load).
    gc.collect()
    gc.freeze()
    # Thousands of connected workers are thousands of long-lived objects that every full
    # collection scans: collect the young generation less often (50,000 allocations rather
    # than 700) and the oldest rarely. Measured with bench/routing_scale.py at 5,000 workers:
    # 498 -> 404 µs of queen CPU per request (issue 18).
    gc.set_threshold(*GC_THRESHOLDS)
    server.run()
    return 0

