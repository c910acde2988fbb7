"""Gateway configuration: built once in ``main()`` and handed out in slices.

Sources, highest priority first: command-line overrides, ``GATEWAY_*`` environment variables
(nested fields with ``__``, e.g. ``GATEWAY_WEIGHTS__QUEUE=4``), the TOML file given with
``--config``, then the defaults below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from policies import PolicyName


class BackendSettings(BaseModel):
    """One upstream server. A bare URL string is accepted in its place."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    name: str | None = None
    api_key: SecretStr | None = None

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http:// or https://, got {v!r}")
        return v

    @property
    def id(self) -> str:
        return self.name or self.url.split("://", 1)[1]


class WeightSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    active: float = Field(2.0, ge=0)
    queue: float = Field(3.0, ge=0)
    kv: float = Field(0.0, ge=0)


class UpstreamSettings(BaseModel):
    """Timeouts and pooling for connections to the backends."""

    model_config = ConfigDict(extra="forbid")

    connect_timeout: float = Field(5.0, gt=0, description="seconds to establish a connection")
    idle_timeout: float = Field(
        120.0, gt=0, description="seconds without a byte from the backend before giving up"
    )
    max_connections: int = Field(0, ge=0, description="0 means unlimited")


class ScrapeSettings(BaseModel):
    """How backend load and model lists are read."""

    model_config = ConfigDict(extra="forbid")

    interval: float = Field(0.25, gt=0, description="seconds between /metrics scrapes")
    timeout: float = Field(1.0, gt=0)
    stale_after: float = Field(
        2.0, gt=0, description="a scraped figure older than this is not trusted"
    )
    models_interval: float = Field(10.0, gt=0, description="seconds between /v1/models reads")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    backends: Annotated[list[BackendSettings], NoDecode] = Field(default_factory=list)
    policy: PolicyName = "least_load"
    weights: WeightSettings = Field(default_factory=WeightSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After sent with a 503")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                return json.loads(v)
            v = [part for part in (p.strip() for p in v.split(",")) if part]
        if isinstance(v, list):
            return [{"url": item} if isinstance(item, str) else item for item in v]
        return v

    @field_validator("backends", mode="after")
    @classmethod
    def _unique_ids(cls, v: list[BackendSettings]) -> list[BackendSettings]:
        seen: set[str] = set()
        for b in v:
            if b.id in seen:
                raise ValueError(f"backend {b.id!r} is listed twice")
            seen.add(b.id)
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """Settings from ``config`` (TOML), the environment and ``overrides``, in rising priority."""
    if config is not None and not config.is_file():
        raise FileNotFoundError(f"config file not found: {config}")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=config)

    return _FromFile(**{k: v for k, v in overrides.items() if v is not None})
