"""The gateway's one settings object (env `CLAWRL_<SECTION>__<FIELD>`, or `clawrl.toml`)."""

from __future__ import annotations

import ipaddress
import socket
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from clawrl.common.episodes import EpisodeSettings
from clawrl.common.feedback import FeedbackSettings
from clawrl.common.settings import ClawrlSettings, ModelSettings, RedisSettings, Section
from clawrl.common.tenants import TenantSettings

TurnType = Literal["main", "side"]


class ServingSettings(Section):
    """The OpenAI-compatible HTTP API and how it reaches the policy engine."""

    host: str = Field("127.0.0.1", description="Address the HTTP API listens on.")
    port: int = Field(30000, gt=0, lt=65536, description="Port of the HTTP API.")
    engine_url: str = Field(
        "http://localhost:30010", description="Base URL of the policy engine (SGLang API)."
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Accepted `Authorization: Bearer` keys (JSON list in the environment). "
        "When neither this nor api_keys_file gives a key, the API is open.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="A file with one accepted key per line (a mounted Kubernetes Secret); "
        "read once at start, added to api_keys.",
    )
    default_turn_type: TurnType = Field(
        "main",
        description="Turn type of a request that sends no X-Turn-Type (body `turn_type`): main "
        "turns are recorded for training, side turns are only served.",
    )
    tool_call_parser: Literal["hermes", "qwen", "none"] = Field(
        "hermes",
        description="How tool calls are read from the model's output: hermes/qwen parse "
        '`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; none returns text only.',
    )
    default_max_tokens: int | None = Field(
        4096,
        gt=0,
        description="Completion limit of a request that gives none (chat completions without "
        "max_tokens / max_completion_tokens, Responses without max_output_tokens or with "
        "null), on every route, clamped to what is left of the context window (a larger limit "
        "a request asks for is kept). Without a default, one such request generates to the end "
        "of the context (16k tokens in `make run`, minutes on CPU). Empty (`CLAWRL_SERVING__"
        "DEFAULT_MAX_TOKENS=`): no default, whatever is left of the window.",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted (bytes); a larger one gets a 413 before it "
        "is read whole (counted in clawrl_gateway_oversized_requests_total). 8 MiB holds any "
        "conversation a 128k-token context takes.",
    )

    @field_validator("default_max_tokens", mode="before")
    @classmethod
    def _empty_is_no_default(cls, value):
        return None if value == "" else value

    engine_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for the engine (whole generation, or a gap "
        "between two streamed tokens).",
    )
    engine_connect_timeout_s: float = Field(
        3.0, gt=0, description="Timeout of connecting to the engine."
    )
    engine_max_connections: int = Field(
        1024, gt=0, description="Connection pool size towards the engine."
    )
    offload_render_chars: int = Field(
        8192,
        ge=0,
        description="Prompts whose messages+tools are longer than this many characters are "
        "rendered and tokenised in a worker thread (measured: ~30 ms for 30 KB on a 2-core "
        "CPU, ~0.1 ms for a short chat), so one big prompt does not stall the event loop.",
    )
    retry_after_s: int = Field(5, ge=0, description="Retry-After (seconds) sent with 503 answers.")


class SessionSettings(Section):
    """Session state in Redis: pending turns, idle finalisation, anonymous matching."""

    key_prefix: str = Field("clawrl:gw", description="Prefix of every Redis key the gateway owns.")
    idle_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A session with no request for this long has its pending turn finalised "
        "with no next state (IDLE_TIMEOUT).",
    )
    ttl_s: int = Field(
        86400,
        gt=0,
        description="Expiry of a session's state in Redis, refreshed on every request; must "
        "exceed idle_timeout_s so the sweeper sees every pending turn first.",
    )
    sweep_interval_s: float = Field(
        5.0, gt=0, description="How often each replica scans for idle sessions."
    )
    sweep_batch: int = Field(200, gt=0, description="Most idle sessions finalised per scan.")
    anonymous_matching: bool = Field(
        True,
        description="Recognise the sessions of clients that send no session id by matching "
        "their history against the conversations recorded for the same caller (API key, or "
        "bearer token when keys are off, and the OpenAI `user` field).",
    )
    dedupe_ttl_s: int = Field(
        120,
        gt=0,
        description="How long a session script's result is kept under its request id, so a "
        "write the Redis client retries after a timeout is recognised and not applied twice "
        "(retries come within seconds; each main request keeps two such keys this long).",
    )
    spool_dir: Path | None = Field(
        Path(tempfile.gettempdir()) / "clawrl-gateway-spool",
        description="Where recording calls Redis did not take wait until it answers again "
        "(a subdirectory per HTTP port; keep it on a volume that outlives the process: a "
        "restarted gateway replays it). Empty: no spool, and turns served while Redis is "
        "down are lost (counted as recording failures).",
    )

    @field_validator("spool_dir", mode="before")
    @classmethod
    def _empty_is_off(cls, value):
        return None if value == "" else value

    spool_max_bytes: int = Field(
        256 * 1024 * 1024,
        gt=0,
        description="Bound of the spool on disk; calls past it are dropped, counted and logged.",
    )
    spool_replay_interval_s: float = Field(
        1.0, gt=0, description="How often a non-empty spool is replayed against Redis."
    )


class ControlSettings(Section):
    """GatewayControl (gRPC): pause/resume around weight syncs."""

    host: str = Field("127.0.0.1", description="Address the gRPC server listens on.")
    port: int = Field(
        30001,
        ge=0,
        lt=65536,
        description="gRPC port (30001, next to the HTTP API's 30000; 0 = pick a free port).",
    )
    token: SecretStr | None = Field(
        None,
        description="When set, control calls must send metadata `authorization: Bearer <token>`"
        " (health and reflection stay open for probes).",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve GatewayControl without a token on an address other than loopback. "
        "Off, the gateway refuses to start so: whoever reaches the port could pause serving or "
        "re-route tenants. The chart sets it only where its NetworkPolicy admits the weight "
        "sync alone.",
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Default time Pause waits for in-flight generations to finish.",
    )
    hold_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a request that arrives while paused waits for Resume before it "
        "gets 503 with Retry-After.",
    )
    lease_s: float = Field(
        30.0,
        gt=0,
        description="Default lease of a pause: unless its holder renews it (Pause again) within "
        "this time, the gateway resumes on its current version by itself, so a sync job that "
        "dies never leaves serving paused. Keep it below hold_timeout_s.",
    )
    initial_policy_version: int | None = Field(
        None,
        description="Policy version before the first Resume; unset = the LoRA version recorded "
        "at `served_key` when there is one, else the engine's weight_version when it is an "
        "integer, else 0.",
    )
    served_key: str = Field(
        "clawrl:serving",
        description="Redis hash where the weight-sync job records the LoRA adapter the gateways "
        "route to (the sync's sync.served_key); read at start, so a restarted or added replica "
        "serves the current adapter.",
    )

    @model_validator(mode="after")
    def _guarded(self) -> ControlSettings:
        if self.token is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"control.host {self.host!r} is not a loopback address and control.token is "
                "unset: anyone who reaches the port could pause serving or re-route tenants. "
                "Set control.token (the weight sync's gateways.token sends it), or "
                "control.allow_unauthenticated = true where a network policy guards the port"
            )
        return self


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class GatewaySettings(ClawrlSettings):
    """Everything the gateway needs, built once at start and passed down."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    serving: ServingSettings = Field(default_factory=ServingSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    control: ControlSettings = Field(default_factory=ControlSettings)
    feedback: FeedbackSettings = Field(
        default_factory=FeedbackSettings, description="POST /v1/feedback (shared with the judge)."
    )
    episodes: EpisodeSettings = Field(
        default_factory=EpisodeSettings,
        description="X-Episode turns and POST /v1/outcomes (shared with the judge).",
    )
    tenants: TenantSettings = Field(
        default_factory=TenantSettings,
        description="Who a request's tenant is (recorded with its turn) and, per tenant, the "
        "adapter that serves it (shared with the trainer and the weight sync).",
    )
    gateway_id: str = Field(
        default_factory=socket.gethostname,
        description="This replica's name in logs, GetStatus and finalised turns (pod name).",
    )

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.sessions.ttl_s <= self.sessions.idle_timeout_s:
            raise ValueError(
                f"sessions.ttl_s ({self.sessions.ttl_s}) must exceed sessions.idle_timeout_s "
                f"({self.sessions.idle_timeout_s}), else pending turns expire unpublished"
            )
        return self

    def api_keys(self) -> list[str]:
        """Accepted API keys (settings + key file); empty = open."""
        keys = [key.get_secret_value() for key in self.serving.api_keys]
        if self.serving.api_keys_file is not None:
            text = self.serving.api_keys_file.read_text()
            keys += [line.strip() for line in text.splitlines() if line.strip()]
        return [key for key in keys if key]
