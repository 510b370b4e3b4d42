"""Gateway settings (pydantic-settings): environment variables `DIALSPEC_<FIELD>` or a config file.

Precedence, highest first: explicit keyword arguments (the CLI), environment variables, the config
file named by `DIALSPEC_CONFIG` or `load_settings(config_file=...)` (`.toml` or `.json`), defaults.

Terms (the dial's own terms are defined in `verifier.dial`, which validates its fields):
    tier      a named quality level, mapped to a number in [0, 1] by `tiers`.
    quality   the dial input: 1 = lossless (exactly the target model), 0 = the draft model.
    running   requests admitted and generating; `max_running` bounds them (None = engine max_batch).
    waiting   requests queued for a running slot; beyond `max_waiting` the gateway answers 429.
    brownout  with `brownout_ttft_s` set, overload lowers the quality of new requests that allow it
              (`min_quality`) before it queues them past that time to first token (brownout.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from verifier.dial import DEFAULT_TIERS, DialConfig, DialError

# Set only for the duration of one `load_settings` call; the env var is the other way in.
_config_file: Path | None = None


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DIALSPEC_", extra="ignore")

    # The dial: `dial_config()` hands these to `verifier.dial`, which owns their meaning and ranges.
    tiers: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_quality: str | float = "exact"  # lossless unless the client turns the dial
    dial_gamma: float = 1.0  # w = quality ** gamma; 1 keeps w = quality
    auto_dial: float | None = None  # the head's dial for quality "auto"; None = the head's own default
    lossy_min_lenience: float = 0.05  # lossy: lenience = max(quality, this)
    cascade_alpha_max: float = 1.0  # cascade: alpha = (1 - quality) * this

    # Admission control.
    max_running: int | None = Field(None, ge=1)
    max_waiting: int = Field(32, ge=0)
    retry_after_s: int = Field(1, ge=0)
    # Brownout (off by default): the time to first token to hold by serving requests that set a
    # `min_quality` lower under overload. Clients that send no floor are never lowered.
    brownout_ttft_s: float = Field(0.0, ge=0)  # 0 = off

    # Request limits.
    max_body_bytes: int = Field(1_000_000, ge=1024)
    max_n: int = Field(4, ge=1)  # choices per request (n x prompts); also capped by max_running
    default_max_tokens: int = Field(256, ge=1)  # when the client sends none (capped by context)
    # (the per-request `num_draft` limit is the engine's: EngineInfo.num_draft_limit)

    # Security and operations. With api_keys set, /v1/* needs a key; /health and /ready never do
    # (probes); /metrics and the API docs (/docs, /redoc, /openapi.json) do when these say so.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)  # empty = no auth
    metrics_need_key: bool = False
    docs_need_key: bool = False
    log_content: bool = False  # prompts/completions never reach logs unless this is set
    # Shutdown (SIGTERM): requests in flight get up to this long to finish; new ones get 503.
    drain_timeout_s: float = Field(30.0, ge=0)

    # Slow clients (server/gateway/slow_clients.py): a request head must be complete this long
    # after the connection opens (or the previous response ends), its body this long after the
    # head (else 408); idle keep-alive connections close after keep_alive_timeout_s. Beyond
    # max_connections open connections (or requests) uvicorn answers 503. Heads over
    # max_header_bytes get 400. None of these bounds a streamed response.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    max_connections: int = Field(1024, ge=1)
    max_header_bytes: int = Field(16384, ge=1024)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value):
        """`DIALSPEC_API_KEYS=k1,k2` (commas) or a JSON list from a config file."""
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @model_validator(mode="after")
    def _check_dial(self):
        self.dial_config()  # DialError (a ValueError) becomes a settings validation error
        return self

    def dial_config(self) -> DialConfig:
        try:
            return DialConfig(
                tiers=self.tiers, default_quality=self.default_quality, gamma=self.dial_gamma,
                auto_dial=self.auto_dial, lossy_min_lenience=self.lossy_min_lenience,
                cascade_alpha_max=self.cascade_alpha_max,
            )  # fmt: skip
        except DialError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, **_):
        path = _config_file or (
            Path(os.environ["DIALSPEC_CONFIG"]) if os.environ.get("DIALSPEC_CONFIG") else None
        )
        sources = [init_settings, env_settings]
        if path is not None:
            if path.suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(JsonConfigSettingsSource(settings_cls, json_file=path))
        return tuple(sources)


def load_settings(config_file: str | Path | None = None, **overrides) -> GatewaySettings:
    """Build settings; raises FileNotFoundError for a named config file that does not exist."""
    global _config_file
    path = Path(config_file) if config_file else None
    if path is None and os.environ.get("DIALSPEC_CONFIG"):
        path = Path(os.environ["DIALSPEC_CONFIG"])
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    _config_file = path
    try:
        return GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _config_file = None
