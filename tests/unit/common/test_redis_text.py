"""Redis replies as text, in one place (bytes from redis-py, str with decode_responses)."""

from clawrl.common.redis_text import text, text_fields
from clawrl.common.versions import VersionReady


def test_bytes_and_str_read_the_same():
    assert text(b"1-10") == text("1-10") == "1-10"
    assert text(3) == "3"
    assert text_fields({b"version": b"3", "path": "/p"}) == {"version": "3", "path": "/p"}


def test_an_announcement_reads_from_bytes_or_str_fields_alike():
    ready = VersionReady(version=3, path="/ckpt/policy/v3", step=7, created_at=1.5,
                         adapter="policy-v3")  # fmt: skip
    as_bytes = {k.encode(): v.encode() for k, v in ready.fields().items()}
    assert VersionReady.from_fields(as_bytes) == VersionReady.from_fields(ready.fields()) == ready
