"""Every turn records its tenant (issue 20): the API key's hash with keys on, `user` with keys
off, through the real gateway (OpenAI client) in front of the CPU engine."""

from __future__ import annotations

import uuid

import pytest

from clawrl.common.tenants import key_tenant

from .helpers import user

pytestmark = pytest.mark.integration


def finished_turns(handle, tag: str, count: int) -> list:
    import time

    deadline = time.monotonic() + 15
    while True:
        turns = [t for t in handle.turns() if tag in t.messages_json]
        if len(turns) >= count or time.monotonic() > deadline:
            return turns
        time.sleep(0.05)


def test_two_api_keys_record_two_tenants(secured):
    tag = uuid.uuid4().hex
    for key in ("sk-test-1", "sk-test-2"):
        secured.openai(api_key=key).chat.completions.create(
            model="m",
            messages=[user(f"hello {tag} from {key}")],
            max_tokens=2,
            user="same-user",  # with keys on, `user` never picks the tenant
            extra_headers={"X-Session-Done": "true"},
        )
    turns = finished_turns(secured, tag, 2)
    by_key = {t.messages_json.split(" from ")[1].split('"')[0]: t.tenant for t in turns}
    assert by_key == {"sk-test-1": key_tenant("sk-test-1"), "sk-test-2": key_tenant("sk-test-2")}


def test_with_keys_off_user_names_the_tenant(gateway):
    tag = uuid.uuid4().hex
    for name in ("alice", None):
        extra = {"user": name} if name else {}
        gateway.openai().chat.completions.create(
            model="m",
            messages=[user(f"hello {tag} from {name}")],
            max_tokens=2,
            extra_headers={"X-Session-Done": "true"},
            **extra,
        )
    turns = finished_turns(gateway, tag, 2)
    assert sorted(t.tenant for t in turns) == ["", "alice"]
