"""The worker's settings, and where they come from: CLI flags over ``APIARY_*`` environment
variables over the saved ``settings.json`` over defaults, for the app and ``--headless`` alike.

``settings.json`` lives in ``platformdirs.user_config_dir("apiary")`` (``~/.config/apiary`` on
Linux, ``%LOCALAPPDATA%\\apiary`` on Windows, ``~/Library/Application Support/apiary`` on macOS),
or in ``$APIARY_CONFIG_DIR`` when that is set. Reading it is here, beside the settings, because
the headless worker reads it too; the desktop app saves it (``desktop_worker/desktop/config.py``).

A file that is not a JSON object is moved aside to ``settings.json.bad`` with a warning and read
as empty; a value in it that is not valid for its setting is skipped with a warning. A bad file
never stops the worker from starting.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import platformdirs
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from desktop_worker.errors import QueenAddressError
from desktop_worker.group_family import normalise_family_code
from desktop_worker.queen_url import normalise_queen_url, parse_queen_urls
from desktop_worker.resources import resources_dir
from shared_schema.fitting import MAX_BATCH_SLOTS

log = logging.getLogger(__name__)

CONFIG_DIR_ENV = "APIARY_CONFIG_DIR"
SETTINGS_FILE = "settings.json"
# The most a frame from the queen may hold, by default: its largest job frame is a request body
# (the queen's max_body_bytes, 4 MiB) in a small envelope, and the queen takes frames up to this
# size from workers too (its max_frame_bytes). A bigger frame closes the connection with 1009.
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


def config_dir() -> Path:
    """Where the worker keeps its settings (and, by default, its key file)."""
    override = os.environ.get(CONFIG_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_config_dir("apiary", appauthor=False))


def config_path() -> Path:
    return config_dir() / SETTINGS_FILE


def load_saved() -> dict[str, Any]:
    """What ``settings.json`` holds, as a dict; ``{}`` when it is missing, unreadable or corrupt.

    A corrupt file (not JSON, or not a JSON object) is moved aside to ``settings.json.bad``
    (replacing an older one), so the next save starts clean and the owner can still look at it.
    """
    path = config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read the settings file %s (%s); using the defaults", path, exc)
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        problem = f"it is not valid JSON ({exc})"
    else:
        if isinstance(data, dict):
            return data
        problem = f"it holds a JSON {type(data).__name__}, not an object"
    bad = path.with_name(path.name + ".bad")
    try:
        os.replace(path, bad)
    except OSError as exc:
        log.warning("the settings file %s is corrupt: %s; ignoring it (could not move it "
                    "aside: %s)", path, problem, exc)
    else:
        log.warning("the settings file %s is corrupt: %s; moved it to %s and using the "
                    "defaults", path, problem, bad)
    return {}


DEVELOPER_QUEEN_URL = "ws://127.0.0.1:8000/worker"
DEFAULT_QUEEN_FILE = "default-queen.txt"


def default_queen_url() -> str:
    """The queen a fresh install joins: the one a build or installer names in
    ``resources/default-queen.txt`` (its first line that is not blank or a ``#`` comment, in
    any form ``queen_url.normalise_queen_url`` reads, e.g. ``https://queen.example``), else a
    queen on this machine (a developer's setup). The wizard shows it, and the owner can change
    it; ``APIARY_QUEEN_URL`` and settings.json still come first."""
    path = resources_dir() / DEFAULT_QUEEN_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return DEVELOPER_QUEEN_URL
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read %s (%s); using %s", path, exc, DEVELOPER_QUEEN_URL)
        return DEVELOPER_QUEEN_URL
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            try:
                return normalise_queen_url(line)
            except QueenAddressError as exc:
                log.warning("ignoring %s: %s", path, exc)
                return DEVELOPER_QUEEN_URL
    return DEVELOPER_QUEEN_URL


def default_models_dir() -> Path:
    return Path(platformdirs.user_data_dir("apiary", appauthor=False)) / "models"


def default_key_path() -> Path:
    return config_dir() / "worker_key.pem"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="APIARY_", extra="ignore")

    # The queen's worker URL. Several (replicas of one queen, issue 18) may be given comma-
    # separated (APIARY_QUEEN_URL, or --queen repeated): each is normalised, ``queen_url`` keeps
    # the first (what the app shows and edits, and where earnings are asked), ``queen_urls``
    # all of them, and the link tries them in turn (``link_urls``).
    queen_url: str = Field(default_factory=default_queen_url)
    queen_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    ln_url: str | None = None
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    models_dir: Path = Field(default_factory=default_models_dir)
    key_path: Path = Field(default_factory=default_key_path)
    # Jobs at once (issue 36): None is automatic, up to eight streams in one batch as the
    # memory budget allows for the model's context (``shared_schema.fitting.batch_slots``).
    max_jobs: int | None = Field(default=None, ge=1, le=64)
    gpu_layers: int | Literal["auto"] = "auto"
    n_ctx: int | None = Field(default=None, ge=512)
    threads: int | None = Field(default=None, ge=1)
    # The volunteer's disk (issue 34). GB is GiB.
    disk_quota_gb: float | None = Field(default=None, ge=0, description=(
        "the most the model store may hold, in GB, models the queen places included (the "
        "least recently used are evicted to stay under it); 0: no quota; None: not chosen yet "
        "(the app then saves half the disk's free space, store.disk.default_quota_gb)"))
    disk_headroom_gb: float | None = Field(default=None, ge=1, description=(
        "what the model store always leaves free on its disk, in GB: a pull that would cross "
        "it is refused before its first byte, and a download that would is stopped and "
        "deleted; None: 10 % of the disk, at least 10 GB and at most 50 GB"))
    memory_budget_mb: int | None = Field(default=None, ge=256)
    hf_endpoint: str | None = None
    status_interval_s: float = Field(default=30.0, gt=0)
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    # The most GPU memory the worker may use, in MB (None: all that is free).
    vram_cap_mb: int | None = Field(default=None, ge=256)
    start_earning_at_launch: bool = False
    first_run_done: bool = False
    # Where the worker key lives: the OS keyring, the 0600 file at key_path, or "auto" (the
    # keyring when one works, else the file, with a warning).
    key_store: Literal["auto", "keyring", "file"] = "auto"
    # The largest websocket frame taken from the queen (bytes); a bigger one ends the connection
    # (close code 1009) and the worker reconnects. The default fits the queen's largest job.
    max_frame_bytes: int = Field(default=DEFAULT_MAX_FRAME_BYTES, ge=64 * 1024)
    auditor: bool = Field(default=False, description=(
        "offer this worker as an audit-only re-scorer for the queen's operator (issue 16: the "
        "hello's capabilities then include 'auditor'; the queen decides whether it trusts it)"))
    train: bool = Field(default=False, description=(
        "take fine-tuning jobs (issue 37): the hello's capabilities then include 'train', and "
        "the queen may have this worker train a LoRA adapter of a model it holds, in a "
        "sandboxed child on the CPU, its files in a folder under models_dir counted against "
        "the disk quota; off: training jobs are refused"))
    train_on_gpu: bool = Field(default=False, description=(
        "train on the GPU when it has room for the run (the base's F32 copy and its work, plus "
        "1 GB), else on the CPU; a GPU run that fails before its first report runs again on "
        "the CPU. Off by default until it has been measured on a real GPU: training is "
        "CPU-only then. Not when gpu_layers is 0"))
    images: bool = Field(default=False, description=(
        "render images (issue 38): the hello's capabilities then include 'image', and the "
        "queen may send this worker image jobs for the diffusion models it holds, rendered by "
        "stable-diffusion.cpp in a sandboxed child; off: image jobs are refused and diffusion "
        "models are not announced"))
    # Fine-tuned models (issue 37): their LoRA adapters, kept under models_dir/adapters.
    adapter_cache_mb: int = Field(default=2048, ge=16, description=(
        "the most disk the LoRA adapters of fine-tuned ('ft:') models may take (MB); past it, "
        "or past the disk quota, the least recently used go"))
    adapter_cache_count: int = Field(default=32, ge=1, le=4096, description=(
        "the most LoRA adapters of fine-tuned models kept at once"))
    # Models on demand (issue 17).
    accept_fetch: bool = Field(default=True, description=(
        "let the queen place models on this machine (a 'fetch' command), within the disk quota "
        "and never past the disk's headroom; without swarm_models it never evicts a model to "
        "make room"))
    swarm_models: bool = Field(default=False, description=(
        "let the swarm choose this worker's models: pull what is in demand and fits, and evict "
        "the least recently used to stay within the disk quota (opt-in)"))
    # Model groups (issue 19): a model too big for one worker, its layers split over several.
    join_groups: bool = Field(default=True, description=(
        "let the queen make this worker a member of a model group: it then runs, in a child "
        "process, llama.cpp's RPC server for a head the queen trusts (the hello says 'rpc' only "
        "when llama.cpp has its RPC backend)"))
    local_group: int = Field(default=0, ge=0, le=8, description=(
        "serve models through a group of this many llama.cpp RPC servers on this machine (each "
        "in its own process, on 127.0.0.1): a demonstration of groups; 0: off"))
    group_family: str | None = Field(default=None, description=(
        "join model groups only with the owner's own machines: the same family code on each "
        "(group_family.py; the app makes one); None: any trusted worker's groups"))
    lan_groups: bool = Field(default=False, description=(
        "let a group's head on this LAN reach this worker directly (its gate listens on the LAN "
        "address, over TLS); off: nothing listens beyond 127.0.0.1"))
    # Owner controls (issue 17): when the worker pauses itself. A pause takes no new jobs, lets
    # jobs in flight finish within pause_grace_s (then hands them back to the queen), and says
    # why in its status and the tray.
    pause_on_battery: bool = True
    pause_gpu_busy_pct: int | None = Field(default=None, ge=1, le=100, description=(
        "pause while other processes use more than this share of a GPU's memory or time "
        "(NVML's process list); None: never"))
    pause_fullscreen: bool = False
    active_hours: str | None = Field(default=None, max_length=200, description=(
        "serve only within these local hours, e.g. '22:00-07:00' or '09:00-12:00,14:00-18:00'; "
        "None: always"))
    pause_grace_s: float = Field(default=30.0, ge=0, le=3600)
    pause_check_interval_s: float = Field(default=5.0, gt=0)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (init kwargs) > ``APIARY_*`` env > settings.json > defaults."""
        return (
            init_settings,
            env_settings,
            dotenv_settings,
            SavedSettingsSource(settings_cls),
            file_secret_settings,
        )

    @model_validator(mode="before")
    @classmethod
    def _queen_urls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = data.get("queen_url") or data.get("queen_urls")
        if given is None:
            return data
        try:
            urls = parse_queen_urls(given)
        except QueenAddressError as exc:
            raise ValueError(str(exc)) from None
        return {**data, "queen_url": urls[0], "queen_urls": urls}

    @property
    def jobs_at_once(self) -> int:
        """The most jobs this worker takes at once: the owner's number, or automatic (each
        model's batch then holds as many as memory allows, up to this)."""
        return self.max_jobs if self.max_jobs is not None else MAX_BATCH_SLOTS

    @property
    def disk_quota_bytes(self) -> int | None:
        """The model store's quota in bytes (None: no quota, or none chosen yet)."""
        return int(self.disk_quota_gb * 1024**3) if self.disk_quota_gb else None

    @property
    def disk_headroom_bytes(self) -> int | None:
        """What the store leaves free on its disk, in bytes (None: the default for the disk)."""
        return int(self.disk_headroom_gb * 1024**3) if self.disk_headroom_gb else None

    @property
    def link_urls(self) -> list[str]:
        """The queen URLs the link dials, in order: ``queen_urls`` while it still starts with
        ``queen_url``; ``queen_url`` alone once that was replaced (the app copies the settings
        with a new queen, which must not bring the old queen's replicas along)."""
        if self.queen_urls and self.queen_urls[0] == self.queen_url:
            return list(self.queen_urls)
        return [self.queen_url]

    @field_validator("group_family")
    @classmethod
    def _family(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        normalise_family_code(value)  # too short to be secret: refused, saying why
        return value.strip()

    @field_validator("models", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value


class SavedSettingsSource(PydanticBaseSettingsSource):
    """``settings.json`` as a pydantic-settings source, below the environment.

    Each value is checked against its field on its own: an invalid one is dropped with a warning
    (the field falls back to the env or the default) instead of making the settings fail.
    Names that are not settings are ignored.
    """

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Unused: __call__ reads the whole file at once.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        saved = load_saved()
        if not saved:
            return {}
        fields = self.settings_cls.model_fields
        values: dict[str, Any] = {}
        for name, value in saved.items():
            field = fields.get(name)
            if field is None:
                log.debug("ignoring %r in %s: not a setting", name, config_path())
                continue
            problem = _check_value(field, value)
            if problem is None and name in ("queen_url", "queen_urls"):
                try:
                    parse_queen_urls(value)
                except QueenAddressError as exc:
                    problem = str(exc)
            if problem is not None:
                log.warning("ignoring %s=%r in %s: %s", name, value, config_path(), problem)
                continue
            values[name] = value
        return values


def _check_value(field: FieldInfo, value: Any) -> str | None:
    """None when ``value`` is valid for ``field`` (type and constraints), else the reason."""
    annotation = field.annotation
    if field.metadata:
        annotation = Annotated[(annotation, *field.metadata)]  # type: ignore[assignment]
    try:
        TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        return exc.errors(include_url=False)[0]["msg"]
    return None
