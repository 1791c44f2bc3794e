"""Tenants: who a turn belongs to, and whether that caller learns an adapter of its own.

A tenant is the caller the gateway already identifies: with API keys on, a hash of the key
(never the key itself); with keys off, the configured header or the request's `user` field.
Every turn and sample records its tenant (`Turn.tenant`, `Sample.tenant`). In
`[tenants] mode = "per_tenant"` the tenants these settings select each train and are served
their own LoRA adapter, `tenant-<id>-v<N>`; every other caller shares the policy as in
`shared` mode (the default, today's behaviour: one policy for everyone).

This module holds what the gateway, the judge and the trainer share: the `[tenants]` settings
section and pure functions of strings.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from pydantic import Field, field_validator

from clawrl.common.settings import Section

TenantMode = Literal["shared", "per_tenant"]
SHARED = ""  # the tenant of a caller the gateway cannot tell apart, and of the shared policy
# A tenant id names adapters, directories, metric labels and Kubernetes label values: short, no
# separators of paths, alphanumeric at both ends.
_ID = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,46}[A-Za-z0-9])?"
TENANT_ID = re.compile(_ID)
ADAPTER = re.compile(rf"tenant-(?P<tenant>{_ID})-v(?P<version>[0-9]+)")
# The `tenant` label of the shared policy's series (its tenant id is ""; an empty label value is
# no label to Prometheus): no tenant may take it as its id.
SHARED_LABEL = "shared"


def is_tenant_id(name: str) -> bool:
    return TENANT_ID.fullmatch(name) is not None and name != SHARED_LABEL


class TenantSettings(Section):
    """Per-tenant adapters: who gets one, and how each is trained (gateway, trainer, sync)."""

    mode: TenantMode = Field(
        "shared",
        description="`shared`: one policy learns from every caller and serves them all. "
        "`per_tenant`: each selected tenant trains and is served its own LoRA adapter (needs "
        "[lora] enabled); the other callers share the policy.",
    )
    max_adapters: int = Field(
        8,
        gt=0,
        description="Most tenants with an adapter of their own; samples of further tenants "
        "train the shared policy (counted) until `clawrl-trainer tenants reset` or `remove` "
        "frees a slot.",
    )
    min_samples_per_step: int = Field(
        4,
        gt=0,
        description="Samples of one tenant that make a step of its adapter (the shared policy "
        "keeps train.batch_size).",
    )
    allow: list[str] = Field(
        default_factory=list,
        description="Tenant ids that get an adapter of their own. With neither this nor "
        "`pattern`, every identified tenant does (up to max_adapters).",
    )
    pattern: str | None = Field(
        None,
        description="A regular expression; tenant ids it matches whole also get their own adapter.",
    )
    header: str | None = Field(
        None,
        description="With API keys off: the request header that names the tenant (e.g. "
        "`x-clawrl-tenant`); without it, or when a request lacks it, the `user` field does.",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"tenants.pattern is not a regular expression: {exc}") from exc
        return value

    @field_validator("allow")
    @classmethod
    def _ids(cls, value: list[str]) -> list[str]:
        bad = [t for t in value if not is_tenant_id(t)]
        if bad:
            raise ValueError(
                f"tenants.allow holds ids that are not tenant ids ({TENANT_ID.pattern}, "
                f"not {SHARED_LABEL!r}): {bad}"
            )
        return value

    @property
    def per_tenant(self) -> bool:
        return self.mode == "per_tenant"

    def owns_adapter(self, tenant: str) -> bool:
        """Whether `tenant` is selected for an adapter of its own (max_adapters aside)."""
        if not self.per_tenant or tenant == SHARED:
            return False
        if not self.allow and self.pattern is None:
            return True
        if tenant in self.allow:
            return True
        return self.pattern is not None and re.fullmatch(self.pattern, tenant) is not None


def key_tenant(credential: str) -> str:
    """The tenant id of an API key: a hash, so the key never reaches a record or a label."""
    return "k" + hashlib.blake2b(credential.encode(), digest_size=8).hexdigest()


def named_tenant(name: str) -> str:
    """The tenant id of a header or `user` value: itself when it is a valid id, else a hash
    (a value that could not name an adapter or a directory, or would take the shared policy's
    metric label)."""
    if is_tenant_id(name):
        return name
    return "u" + hashlib.blake2b(name.encode(), digest_size=8).hexdigest()


def request_tenant(
    settings: TenantSettings,
    *,
    keys_on: bool,
    credential: str | None,
    header_value: str | None,
    user: str | None,
) -> str:
    """The tenant of a request (see the module docstring). With keys on, only the key counts:
    a header or `user` could name someone else's tenant. With keys off, the header, else
    `user`; a bearer token sent anyway (clients that must send one) names nobody."""
    if keys_on:
        return key_tenant(credential) if credential else SHARED
    for value in (header_value if settings.header else None, user):
        if value and value.strip():
            return named_tenant(value.strip())
    return SHARED


def tenant_adapter(tenant: str, version: int) -> str:
    """The name tenant `tenant`'s adapter of version `version` is loaded and requested under."""
    return f"tenant-{tenant}-v{version}"


def tenant_versions_stream(versions_stream: str) -> str:
    """Where the trainer announces tenants' adapter versions: beside the shared versions'
    stream, so a reader of that stream only ever sees the shared policy's."""
    return f"{versions_stream}:tenants"


def parse_tenant_adapter(name: str) -> tuple[str, int] | None:
    """(tenant, version) of a tenant adapter's name; None for any other name."""
    found = ADAPTER.fullmatch(name)
    return (found["tenant"], int(found["version"])) if found else None
