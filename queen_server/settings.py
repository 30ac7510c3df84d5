"""The queen's settings: environment variables with the ``APIARY_`` prefix, or CLI flags."""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import platformdirs
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from queen_server.cluster.seal import MIN_SECRET_CHARS
from shared_schema import queen_origin

# The database URLs the queen takes, as the messages show them.
DB_FORMS = "sqlite:///queen.db, sqlite:////abs/path.db or postgresql://user:password@host/db"
# The async driver the queen uses for each database it runs on, when the URL names none.
ASYNC_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}
REDIS_SCHEMES = ("redis", "rediss", "unix")
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
PAYOUT_NOTE_MAX = 160  # characters: one line in the worker's app


def default_db_url() -> str:
    data_dir = Path(platformdirs.user_data_dir("apiary", appauthor=False))
    return f"sqlite+aiosqlite:///{data_dir / 'queen.sqlite3'}"


def default_files_dir() -> Path:
    return Path(platformdirs.user_data_dir("apiary", appauthor=False)) / "files"


def async_database_url(text: str) -> str:
    """The URL an operator wrote, as the async SQLAlchemy URL the queen opens.

    ``sqlite:///queen.db`` becomes ``sqlite+aiosqlite:///queen.db``; ``postgresql://`` and
    ``postgres://`` (Heroku's and many hosts' form) become ``postgresql+asyncpg://``. An async
    driver written out stays as written; a sync one (``postgresql+psycopg2``) and any other
    database are refused with a ``ValueError`` that names the form to write. Pure (no
    connection); messages never carry the password."""
    raw = (text or "").strip()
    scheme, sep, rest = raw.partition("://")
    if not sep or not scheme:
        raise ValueError(f"not a database URL: write {DB_FORMS}")
    backend, _plus, driver = scheme.lower().partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend not in ASYNC_DRIVERS:
        raise ValueError(f"the queen runs on SQLite or PostgreSQL, not {backend!r}: write "
                         f"{DB_FORMS}")
    written = f"{backend}+{driver or ASYNC_DRIVERS[backend]}://{rest}"
    instead = (f"write {backend}://… (the queen then uses {ASYNC_DRIVERS[backend]}) or "
               f"{backend}+{ASYNC_DRIVERS[backend]}://…")
    try:
        url = make_url(written)
    except (ArgumentError, ValueError):
        raise ValueError(f"not a database URL ({scheme}://…): write {DB_FORMS}") from None
    try:
        is_async = bool(url.get_dialect(_is_async=True).is_async)
    except NoSuchModuleError:
        raise ValueError(f"no database driver is called {driver!r}: {instead}") from None
    if not is_async:
        raise ValueError(f"the queen needs an async database driver, and {scheme}:// is not "
                         f"one: {instead}")
    return written


def check_redis_url(text: str) -> str:
    """``text`` when it is a URL the redis client opens (``redis://``, ``rediss://`` for TLS,
    ``unix://`` for a socket), else a ``ValueError`` naming them (never echoing a password)."""
    raw = text.strip()
    scheme = urlsplit(raw).scheme.lower() if "://" in raw else ""
    if scheme not in REDIS_SCHEMES:
        shown = f"{scheme}://" if scheme else "a URL without a scheme"
        raise ValueError(f"the Redis URL must start with redis://, rediss:// (TLS) or unix:// "
                         f"(a socket), not {shown}: e.g. redis://redis:6379/0")
    if scheme != "unix" and not urlsplit(raw).hostname:
        raise ValueError("the Redis URL names no host: e.g. redis://redis:6379/0")
    if scheme == "unix" and not urlsplit(raw).path:
        raise ValueError("the Redis URL names no socket: e.g. unix:///run/redis/redis.sock")
    return raw


def default_replica_id() -> str:
    """A short id for this queen process among its replicas: the host name (a container's id
    under Docker), the process id and 4 random hex digits, so that a restarted container (same
    host name, often pid 1) is never taken for its former self."""
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")[:24] or "queen"
    return f"{host}-{os.getpid()}-{secrets.token_hex(2)}"


class QueenSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="APIARY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # The URL(s) workers dial to reach this queen (comma-separated; ws/wss/http/https, paths
    # ignored): what their hello and earnings signatures must name (``queen_origin``), so that
    # a signature made for another queen is never accepted here. Set it when the queen sits
    # behind a proxy or is reached by a DNS name. Unset: derived from ``host`` and the port
    # (127.0.0.1 and localhost both); on a wildcard host (0.0.0.0, ::) each request's Host
    # header is taken as the origin, which gives no relay protection (warned at start).
    public_url: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # The database: sqlite:///queen.db (relative), sqlite:////abs/path.db, or
    # postgresql://user:password@host/db (postgres:// too); mapped to the async drivers
    # (aiosqlite, asyncpg). Held as the async URL, password included (never logged).
    db: str = Field(default_factory=default_db_url, description="database URL")
    # PostgreSQL: how long a statement waits on a lock before it fails (0: for ever).
    db_lock_timeout_s: float = Field(default=30.0, ge=0)
    # Replicas (issue 18): the Redis the queens share (redis://, rediss://, unix://; None: one
    # queen on its own, with an in-process bus), and this process's name among them (default:
    # host name, pid and a random suffix, new at each start).
    redis_url: str | None = None
    # The secret the replicas seal the bus's messages with (issue 40: ``cluster.seal``): the
    # same on every replica, at least 16 characters; required with ``redis_url``.
    cluster_secret: SecretStr | None = None
    replica_id: str = Field(default_factory=default_replica_id)
    # Which peers' X-Forwarded-For/-Proto uvicorn believes (comma-separated addresses or
    # networks, or "*"): the TLS proxy in front of the queen. None: uvicorn's own default,
    # $FORWARDED_ALLOW_IPS else 127.0.0.1.
    forwarded_allow_ips: str | None = None
    log_level: str = "info"

    # Clients. "keys": every request needs a key (made with `apiary-queen keys create`);
    # "open": requests without a known key are served for free (demos only).
    auth: Literal["keys", "open"] = "keys"
    # Development keys: accepted, never billed (logged loudly at start).
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)

    # Workers.
    heartbeat_interval_s: float = Field(default=15.0, gt=0)
    heartbeat_misses: int = Field(default=3, ge=1)
    hello_timeout_s: float = Field(default=10.0, gt=0)
    max_hello_bytes: int = Field(default=256 * 1024, ge=1024)
    max_frame_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)
    max_bad_frames: int = Field(default=50, ge=1)
    # Workers from before protocol v1 (the original GPUtopia workerbee): unsigned, unverifiable,
    # served in the lowest routing tier and billed by the queen's own count. "on": they take any
    # job; "unbilled": only jobs of unbilled callers (open access, development keys), so no
    # billed job reaches a worker the queen cannot verify; "off": they are refused.
    legacy_workers: Literal["on", "unbilled", "off"] = "on"
    # Where the landing page sends people for the desktop worker app (its "Run a worker" part):
    # the project's releases page (its homepage, as the installers name it) by default.
    worker_download_url: str = "https://apiary.net/releases"

    # Jobs.
    queue_timeout_s: float = Field(default=30.0, ge=0)
    max_queued_jobs: int = Field(default=1000, ge=0)
    max_attempts: int = Field(default=3, ge=1)
    first_token_timeout_s: float = Field(default=120.0, gt=0)
    total_timeout_s: float = Field(default=600.0, gt=0)
    retry_after_s: int = Field(default=5, ge=1)
    # Per caller (an API key; a development key; an open-access client's address), so that one
    # caller flooding cannot fill the queue or hold every slot while another is refused: at
    # most this many of its jobs waiting for a worker (a quarter of the default queue, so it
    # takes four flooding callers to fill it), and at most this many of its requests in flight,
    # queued or running (enough for a batch client's parallelism, well under the queue). Past
    # either: 429 before anything is reserved. 0: no limit.
    max_queued_per_key: int = Field(default=250, ge=0)
    max_concurrent_per_key: int = Field(default=64, ge=0)
    # Prompt caches (issue 36). A worker reuses a cached prompt prefix only between jobs of one
    # caller: each job carries an HMAC of its caller under this secret. Unset: a random secret
    # the queen keeps in its database, the same for every replica (per process without one).
    cache_scope_secret: SecretStr | None = None
    # The next turn of a chat goes back to the worker that served the last one (it holds the
    # conversation's prefix) when that worker is free: the conversations remembered for it, the
    # most recently used kept (0: off).
    affinity_entries: int = Field(default=100_000, ge=0)

    # The /admin API is on only with a token.
    admin_token: str | None = None
    # The admin session cookie's Secure flag. "auto": Secure when the login came over https,
    # which behind a TLS proxy means its X-Forwarded-Proto, trusted only from the addresses
    # in uvicorn's FORWARDED_ALLOW_IPS (loopback by default); "always" when the operator knows
    # the pages are only ever reached over https; "never" for plain-http test setups.
    admin_cookie_secure: Literal["auto", "always", "never"] = "auto"
    # Wrong admin tokens allowed per client address per minute, then 429 until one expires;
    # the global figure caps all addresses together (a backstop against many addresses).
    admin_login_failures_per_minute: int = Field(default=5, ge=1)
    admin_login_global_failures_per_minute: int = Field(default=60, ge=1)

    # Billing.
    prices_file: Path | None = None
    # The size class of a model the queen cannot read itself (not on the hub, or the hub is
    # out of reach) and the price file does not name. None: the largest class.
    unverified_price_class: str | None = None
    # Where the queen reads hub models' GGUF headers to price them (None: HF_ENDPOINT, else
    # huggingface.co), with an optional token for gated repos.
    hub_endpoint: str | None = None
    hub_token: SecretStr | None = None
    hub_timeout_s: float = Field(default=10.0, gt=0)
    # How long a model's reading is trusted before the hub is asked again (a repo may change),
    # how soon a failed reading is retried, and how long a billed request waits for the first
    # reading of its model before it is priced as unverified.
    catalog_ttl_s: float = Field(default=3600.0, gt=0)
    catalog_retry_s: float = Field(default=300.0, gt=0)
    price_wait_s: float = Field(default=10.0, ge=0)
    # Model names the operator vouches for, each with the sha256s of the files that may serve
    # it, as JSON (local names, whose files the queen cannot read; a hub name here is never
    # read on the hub, for a queen that cannot reach it):
    # APIARY_LOCAL_MODEL_PINS='{"my-model": ["<64 hex>", ...]}'. A holder of one of those
    # files serves the name and its answers are audited by holders of the same file; a holder
    # of any other file does not serve it. An unpinned local name is served unverified (priced
    # as such) and never audited.
    local_model_pins: dict[str, list[str]] = Field(default_factory=dict)
    # The most of a file the queen reads for its header (vocabularies make some headers MBs).
    max_header_bytes: int = Field(default=64 << 20, ge=1 << 16, le=1 << 30)
    # Models on demand (issue 17): a request for a hub model no worker holds makes the queen
    # resolve it, place it on a worker that fits and wait for it (up to model_wait_s; else a
    # 503 model_loading with an estimate). The lists are shell-style repo patterns
    # ("bartowski/*"); the deny-list wins. model_wait_s 0: never wait, answer the estimate.
    on_demand: bool = True
    model_allow: list[str] = Field(default_factory=list)
    model_deny: list[str] = Field(default_factory=list)
    max_model_gb: float | None = Field(default=64.0, gt=0)
    model_wait_s: float = Field(default=20.0, ge=0, le=600)
    fetch_stall_s: float = Field(default=120.0, gt=0)
    max_fetch_attempts: int = Field(default=3, ge=1, le=20)
    assumed_download_mb_s: float = Field(default=20.0, gt=0)
    max_copies_per_model: int = Field(default=4, ge=1)
    placements_per_hour: int = Field(default=30, ge=1)
    # Per caller (an API key; a development key; an open-access client's address): new
    # placements its requests may start in an hour, counted before the hub is read, whatever
    # comes of them (a name the hub lacks, a model too large or that no worker fits counts;
    # one the queen already refused, a placement under way, a model workers serve do not).
    placements_per_key_per_hour: int = Field(default=10, ge=1)
    demand_interval_s: float = Field(default=60.0, gt=0)
    # Model groups (issue 19): a model no single worker can hold, served by several workers
    # through llama.cpp's RPC backend. Heads (they send members the graphs to run) are workers
    # in good standing with the audits or those named here (public ids or keys; "*": any).
    # The planner keeps headroom_fraction of each worker's memory plus reserve_mb free.
    groups: bool = True
    group_heads: Annotated[list[str], NoDecode] = Field(default_factory=list)
    group_interval_s: float = Field(default=15.0, gt=0)
    group_setup_timeout_s: float = Field(default=30.0, gt=0)
    group_load_timeout_s: float = Field(default=600.0, gt=0)
    group_headroom_fraction: float = Field(default=0.10, ge=0, le=0.9)
    group_reserve_mb: int = Field(default=512, ge=0)
    group_retry_s: float = Field(default=300.0, ge=0)
    # An answer whose group lost a worker mid-way waits this long for the group to re-form, then
    # goes on on its head (the request's own deadline bounds it too).
    group_failover_wait_s: float = Field(default=120.0, ge=0)
    # Carry group traffic through this queen for workers that cannot reach each other (other
    # LANs, NAT, ``lan_groups`` off): every token's RPC round trips cross the queen.
    group_relay: bool = True
    group_relay_channels: int = Field(default=8, ge=1, le=64)
    worker_share: float = Field(default=0.8, ge=0, le=1)
    escrow_jobs: int = Field(default=10, ge=0)
    default_max_tokens: int = Field(default=4096, ge=1)
    # Tokens a model's chat template may add to a prompt beyond its messages' bytes (a default
    # system prompt, a date line): part of the queen's bound on what a prompt can be billed.
    template_allowance_tokens: int = Field(default=64, ge=0, le=100_000)
    billing_refresh_s: float = Field(default=2.0, gt=0)
    # Payouts. "none" records payouts due for an admin to settle by hand.
    lightning_backend: Literal["none", "lnbits"] = "none"
    # What the operator tells its workers about payouts, shown in their app's Earnings tab:
    # who pays, how and when, whom to ask ("Paid by hand each Friday; ask bob@example.com").
    # One line of at most 160 characters.
    payout_note: str | None = Field(default=None, max_length=PAYOUT_NOTE_MAX)
    lnbits_url: str | None = None
    lnbits_admin_key: str | None = None
    payout_threshold_sats: int = Field(default=1000, ge=1)
    payout_interval_s: float = Field(default=600.0, gt=0)
    # Hosts whose Lightning addresses may use plain http (local test servers only). They are
    # also the only hosts whose payout services may resolve to a private or loopback address.
    lnurl_insecure_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # How long each request to a worker's LNURL-pay service may take, all told.
    lnurl_timeout_s: float = Field(default=10.0, gt=0)
    # A failed payout is tried again after base * 2**(failures in a row - 1), at most max.
    payout_retry_base_s: float = Field(default=600.0, ge=0)
    payout_retry_max_s: float = Field(default=86400.0, ge=0)

    # Audits (issue 16): re-scoring a sample of answers on another worker holding the same file.
    audits: bool = True
    # The share of an established worker's jobs audited, and of a new one's (in escrow, or no
    # verdict yet); the rate rises from the first toward the second as a worker's test drifts.
    audit_base_rate: float = Field(default=0.03, ge=0, le=1)
    audit_new_rate: float = Field(default=0.8, ge=0, le=1)
    # Audits run at once, answers kept waiting for an auditor, and how long one may wait.
    audit_concurrency: int = Field(default=2, ge=1, le=64)
    audit_queue: int = Field(default=256, ge=1)
    audit_max_wait_s: float = Field(default=600.0, gt=0)
    # A new worker with this many answers waiting for audits gets traffic only when no other
    # worker is free ("real traffic only as audits can cover it").
    audit_backlog: int = Field(default=4, ge=1)
    # Workers the operator runs as auditors (public keys, hex, or public ids), audited by no one
    # and asked first; a developer's prompt then goes to the operator's machines only.
    trusted_auditors: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Honest bands learned from real runs (``bench/trust.py --bands``): {sha256: bands}; a file
    # not named there is judged by the built-in bands.
    audit_bands_file: Path | None = None
    # The share of honest answers whose scores may look like a cheat's (a word the auditor
    # tokenizes otherwise than the worker generated it): a job whose only evidence is its scores
    # weighs at most Huber's censoring point for it in the sequential test (issue 39). Higher:
    # fewer honest workers flagged, subtle cheats (a smaller quant) flagged a few jobs later.
    audit_contamination: float = Field(default=0.01, ge=0, lt=0.5)

    # Files (issue 37): uploads for fine-tuning. Kept in files_dir (made on the first upload),
    # or, with files_s3_bucket set, in that S3-compatible bucket (made by the operator):
    # files_s3_url is its endpoint (unset: AWS), the access key and secret its credentials
    # (unset: boto3's own chain). An upload is at most files_max_bytes and files_max_examples
    # lines (and at least 10, OpenAI's minimum).
    files_dir: Path = Field(default_factory=default_files_dir)
    files_max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    files_max_examples: int = Field(default=50_000, ge=10)
    files_s3_url: str | None = None
    files_s3_bucket: str | None = None
    files_s3_access_key: str | None = None
    files_s3_secret_key: SecretStr | None = None
    files_s3_region: str = "us-east-1"
    # Image generation (issue 38): an image is billed as its megapixels times its steps times
    # image_tokens_per_megapixel_step tokens at the model's completion rate (512x512, 20 steps:
    # 525 tokens). A url answer's images are kept in the files' storage for image_url_ttl_s,
    # then deleted (swept every image_sweep_interval_s).
    image_tokens_per_megapixel_step: float = Field(default=100.0, gt=0, le=1_000_000)
    image_url_ttl_s: float = Field(default=3600.0, gt=0, le=7 * 86_400)
    image_sweep_interval_s: float = Field(default=60.0, gt=0, le=86_400)
    # Image audits (issue 38): a drawn image job is rendered again by another holder of the
    # file; an image further than image_audit_max_distance from the auditor's (the mean absolute
    # difference per pixel and channel, as a share of 255; honest renders on one kind of
    # backend are identical, other seeds, prompts, models or random pixels 0.10 or more apart)
    # fails the job.
    image_audit_max_distance: float = Field(default=0.05, gt=0, lt=1)
    # Fine-tuning (issue 37): a trained token costs the base model's completion rate times
    # finetune_price_factor; a job no worker takes within finetune_queue_timeout_s fails, and
    # its hold goes back.
    finetune_price_factor: float = Field(default=4.0, gt=0, le=1000)
    finetune_queue_timeout_s: float = Field(default=3600.0, gt=0)
    # Training on workers: a queued job is offered to a free trainer every
    # finetune_dispatch_interval_s; an attempt with no report for finetune_progress_timeout_s is
    # given up, and a job resumes from its last checkpoint at most finetune_max_attempts times
    # in all. Workers report every finetune_progress_every_steps steps and checkpoint every
    # finetune_checkpoint_every_steps. One upload (a checkpoint, the adapter) may be at most
    # finetune_upload_factor times the base model's size, and never less than
    # finetune_upload_min_bytes. The learning rate is finetune_base_learning_rate times the
    # job's multiplier.
    finetune_dispatch_interval_s: float = Field(default=1.0, gt=0, le=60)
    finetune_progress_timeout_s: float = Field(default=600.0, gt=0)
    finetune_max_attempts: int = Field(default=3, ge=1, le=100)
    finetune_progress_every_steps: int = Field(default=25, ge=1, le=1000)
    finetune_checkpoint_every_steps: int = Field(default=100, ge=1, le=1_000_000)
    finetune_upload_factor: float = Field(default=2.0, gt=0, le=100)
    finetune_upload_min_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    finetune_base_learning_rate: float = Field(default=2e-4, gt=0, le=0.1)
    # Fine-tuned models served: each replica reloads the list of them (new ones, deletions
    # elsewhere) every finetune_models_refresh_s.
    finetune_models_refresh_s: float = Field(default=10.0, gt=0, le=3600)
    # The held-out check (issue 37): a job without a validation file trains on its file minus
    # finetune_holdout_fraction of its examples (at least 1, at most finetune_check_examples;
    # 0 holds nothing back and checks nothing). Before it succeeds, at most
    # finetune_check_examples held-out examples are scored with the base and with the new
    # adapter; the adapter must lower the loss by more than finetune_check_margin (relative).
    # One score job may take finetune_check_timeout_s; at most finetune_check_max_scorers
    # workers are tried.
    finetune_holdout_fraction: float = Field(default=0.1, gt=0, lt=1)
    finetune_check_examples: int = Field(default=16, ge=0, le=1000)
    # A worker whose adapters failed the held-out check this many times (its jobs failed
    # adapter_not_learned, as the database remembers) is given no more fine-tuning jobs.
    finetune_max_not_learned: int = Field(default=3, ge=1, le=1000)
    finetune_check_margin: float = Field(default=0.01, ge=0, lt=1)
    finetune_check_timeout_s: float = Field(default=120.0, gt=0)
    finetune_check_max_scorers: int = Field(default=3, ge=1, le=20)

    @field_validator("api_keys", "lnurl_insecure_hosts", "trusted_auditors", "group_heads",
                     mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @field_validator("public_url", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            value = [url.strip() for url in value.split(",") if url.strip()]
        if isinstance(value, list):
            for url in value:
                queen_origin(url)  # InvalidQueenUrl is a ValueError: a clear start-up error
        return value

    @field_validator("local_model_pins")
    @classmethod
    def _sha256_lists(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, shas in value.items():
            if not shas:
                raise ValueError(f"{name!r} is pinned to no sha256")
            for sha in shas:
                if not _SHA256.fullmatch(sha):
                    raise ValueError(f"{name!r}: {sha!r} is not a sha256 (64 hex digits)")
        return {name: [sha.lower() for sha in shas] for name, shas in value.items()}

    @field_validator("payout_note")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
            raise ValueError("the payout note is one line of text, with no control characters")
        return " ".join(value.split())

    @field_validator("db")
    @classmethod
    def _async_db(cls, value: str) -> str:
        return async_database_url(value)

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, value: str | None) -> str | None:
        return None if value is None or not value.strip() else check_redis_url(value)

    @model_validator(mode="after")
    def _cluster_secret(self) -> QueenSettings:
        secret = self.cluster_secret.get_secret_value() if self.cluster_secret else ""
        if self.redis_url and not secret:
            raise ValueError("APIARY_CLUSTER_SECRET is required with APIARY_REDIS_URL: the "
                             "replicas seal the bus's messages with it, so that nobody else "
                             "with Redis's password can speak on it (the same secret on every "
                             f"replica, at least {MIN_SECRET_CHARS} characters)")
        if secret and len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"APIARY_CLUSTER_SECRET must be at least {MIN_SECRET_CHARS} "
                             "characters")
        return self

    @field_validator("replica_id")
    @classmethod
    def _replica(cls, value: str) -> str:
        if not _REPLICA_ID.fullmatch(value):
            raise ValueError("a replica id is 1 to 64 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        return value

    @field_validator("files_s3_url")
    @classmethod
    def _s3_endpoint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the S3 endpoint is an http:// or https:// URL with a host: e.g. "
                             "http://minio:9000")
        return value.strip()

    @field_validator("files_s3_bucket")
    @classmethod
    def _s3_bucket(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if not _S3_BUCKET.fullmatch(value.strip()):
            raise ValueError(f"{value!r} is not an S3 bucket name (3 to 63 lowercase letters, "
                             "digits, '.' or '-')")
        return value.strip()

    @model_validator(mode="after")
    def _s3_complete(self) -> QueenSettings:
        if self.files_s3_bucket is None and self.files_s3_url is not None:
            raise ValueError("APIARY_FILES_S3_URL is set without APIARY_FILES_S3_BUCKET: name "
                             "the bucket the queen keeps files in")
        if (self.files_s3_access_key is None) != (self.files_s3_secret_key is None):
            raise ValueError("set both APIARY_FILES_S3_ACCESS_KEY and APIARY_FILES_S3_SECRET_KEY, "
                             "or neither (boto3's own credentials)")
        return self

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses
