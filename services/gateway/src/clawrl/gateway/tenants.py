"""The tenant of each request (common/tenants.py says what a tenant is): set on the request's
session once it is parsed, recorded with its turn."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from clawrl.common.tenants import TenantSettings, request_tenant
from clawrl.gateway.protocol import ChatRequest, api_credential


def identify(
    chat: ChatRequest, settings: TenantSettings, keys_on: bool, headers: Mapping[str, str]
) -> ChatRequest:
    """`chat` with its session's tenant set (in place; returned for chaining)."""
    tenant = request_tenant(
        settings,
        keys_on=keys_on,
        credential=api_credential(headers),
        header_value=headers.get(settings.header) if settings.header else None,
        user=chat.session.user,
    )
    chat.session = dataclasses.replace(chat.session, tenant=tenant)
    return chat
