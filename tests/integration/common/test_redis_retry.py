"""The gateway's and the judge's Redis clients retry a command once its connection dropped. They
were given redis-py's synchronous Retry, whose loop an asyncio client never enters (it returns
the command's coroutine unawaited): a connection the server closed (a restart, a failover, an
idle timeout) failed the next command every time."""

from __future__ import annotations

import pytest
import redis

from clawrl.gateway.lifespan import create_redis as gateway_redis
from clawrl.gateway.settings import GatewaySettings
from clawrl.judge.service import create_redis as judge_redis
from clawrl.judge.settings import JudgeSettings

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "client_of",
    [
        lambda url: gateway_redis(GatewaySettings(redis={"url": url})),
        lambda url: judge_redis(JudgeSettings(redis={"url": url})),
    ],
    ids=["gateway", "judge"],
)
async def test_a_command_after_the_server_dropped_the_connection_succeeds(
    redis_url: str, client_of
) -> None:
    client = client_of(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        await client.set("retry:probe", "1")
        name = "retry-probe-victim"
        await client.client_setname(name)
        [victim] = [c for c in admin.client_list() if c.get("name") == name]
        assert admin.client_kill_filter(_id=victim["id"]) == 1
        assert await client.get("retry:probe") == b"1"
    finally:
        admin.delete("retry:probe")
        admin.close()
        await client.aclose()
