"""Typed settings shared by every service.

Each service builds one settings object at start (a subclass of `ClawrlSettings`) and passes it
down. Values come from, in order of precedence: keyword arguments, environment variables
(`CLAWRL_<SECTION>__<FIELD>`, e.g. `CLAWRL_MODEL__PATH`), the TOML file (`$CLAWRL_CONFIG`, else
`./clawrl.toml`; one section per concern such as `[model]`, `[serving]`), then defaults.
Sections a service does not know are ignored, so every service can read the same file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from clawrl.common.shards import Shards

DEFAULT_CONFIG_FILE = "clawrl.toml"


def config_file() -> Path:
    """The TOML file settings are read from: `$CLAWRL_CONFIG`, else `./clawrl.toml`."""
    return Path(os.environ.get("CLAWRL_CONFIG", DEFAULT_CONFIG_FILE))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clawrl" / "models"


class Section(BaseModel):
    """Base of a settings section: a misspelt key is an error at start-up, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelSettings(Section):
    """Which model a service serves, tokenizes for or trains."""

    path: str = Field(
        "SmolLM2-135M-Instruct",
        description="A local Hugging Face model directory, or the name of a model prepared by "
        "`clawrl-prepare-model` in cache_dir (SmolLM2-135M-Instruct, smollm2-tiny).",
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where prepared models (safetensors + tokenizer) are kept.",
    )
    served_name: str | None = Field(
        None, description="Model id reported by /v1/models; defaults to the directory name."
    )
    chat_template: Path | None = Field(
        None,
        description="A Jinja chat template that replaces the tokenizer's own. When unset and the "
        "tokenizer's template cannot render tools, clawrl's Hermes-style template is used.",
    )
    sanitize_control_tokens: bool = Field(
        True,
        description="Encode control tokens written in messages and tools (`<|im_end|>` in a "
        "tool result or a user message) as plain text, so only the chat template writes turn "
        "boundaries into prompts and recorded turns. False: they are tokenised as the control "
        "tokens they spell (clawrl's behaviour before; a caller can then forge turns).",
    )
    context_length: int | None = Field(
        None,
        gt=0,
        description="Context window override; defaults to the model config's. Beyond what the "
        "model was trained on, RoPE is stretched by `rope_scaling` in every process that runs "
        "the model (engines and trainer), so set it once for all of them.",
    )
    rope_scaling: Literal["yarn", "linear"] = Field(
        "yarn",
        description="How RoPE is stretched when context_length is beyond what the model was "
        "trained on (engines and the trainer apply the same stretch; logged as a quality "
        "trade-off).",
    )


class RedisSettings(Section):
    """The data plane: Redis Streams carrying turns and samples."""

    url: str = Field("redis://localhost:6390/0", description="Redis URL.")
    turns_stream: str = Field("clawrl:turns", description="Stream of finished Turn records.")
    samples_stream: str = Field("clawrl:samples", description="Stream of scored Sample records.")
    deadletter_stream: str = Field(
        "clawrl:deadletter",
        description="Where entries that cannot be processed go, with the reason (every consumer).",
    )
    versions_stream: str = Field(
        "clawrl:versions",
        description="Stream of 'policy version N is ready' announcements (trainer -> weight sync).",
    )
    stream_maxlen: int = Field(
        1_000_000, gt=0, description="Approximate cap on stream length (XADD MAXLEN ~)."
    )
    socket_timeout_s: float = Field(2.0, gt=0, description="Timeout of one Redis call.")
    cluster: bool = Field(
        False,
        description="`url` is a node of a Redis Cluster (any one: the others are discovered). "
        "Keys then carry shard hash tags, so every script stays in one slot.",
    )
    stream_shards: int = Field(
        1,
        ge=1,
        description="Shards of the turn and sample streams (and of the session and judge state "
        "beside them), one hash slot each, spread evenly over the slots: a multiple of the "
        "cluster's primaries spreads the load over all of them. With 1 on one Redis, key names "
        "are the configured ones unchanged; otherwise `clawrl:turns:{s0}`.. (common/shards.py).",
    )

    def shards(self) -> Shards:
        return Shards(self.stream_shards, self.cluster)


class LoggingSettings(Section):
    """Structured logs: JSON lines in pods, readable text locally."""

    level: str = Field("INFO", description="Root log level.")
    format: Literal["json", "text"] = Field("text", description="`json` in pods, `text` locally.")


class ClawrlSettings(BaseSettings):
    """Base of every service's settings object (see the module docstring for sources)."""

    model_config = SettingsConfigDict(
        env_prefix="CLAWRL_",
        env_nested_delimiter="__",
        extra="ignore",
        validate_default=True,
    )

    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=config_file())
        return (init_settings, env_settings, toml, file_secret_settings)

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> Self:
        """A validated copy with `{section: {field: value}}` on top (command-line flags);
        None values (flags not given) leave the field as it is."""
        data = self.model_dump()
        for section, fields in overrides.items():
            data[section].update({key: value for key, value in fields.items() if value is not None})
        return type(self).model_validate(data)
