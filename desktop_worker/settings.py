"""The worker's settings: CLI flags over ``APIARY_*`` environment variables over the saved
``settings.json`` (``desktop_worker/desktop/config.py``) over defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import platformdirs
from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from desktop_worker.desktop.config import SavedSettingsSource, config_dir


def default_models_dir() -> Path:
    return Path(platformdirs.user_data_dir("apiary", appauthor=False)) / "models"


def default_key_path() -> Path:
    return config_dir() / "worker_key.pem"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="APIARY_", extra="ignore")

    queen_url: str = "ws://127.0.0.1:8000/worker"
    ln_url: str | None = None
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    models_dir: Path = Field(default_factory=default_models_dir)
    key_path: Path = Field(default_factory=default_key_path)
    max_jobs: int = Field(default=1, ge=1, le=64)
    gpu_layers: int | Literal["auto"] = "auto"
    n_ctx: int | None = Field(default=None, ge=512)
    threads: int | None = Field(default=None, ge=1)
    disk_quota_gb: float | None = Field(default=None, gt=0)
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

    @field_validator("models", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
