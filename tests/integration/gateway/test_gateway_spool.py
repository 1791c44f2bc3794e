"""A Redis outage loses nothing that was served: record-script calls Redis did not take wait in
the gateway's local spool and are replayed, in order and exactly once, when it is back — also
when the gateway itself restarts while Redis is down (real redis-server with AOF, SIGKILLed under
load and restarted on its AOF; real gateway processes; the CPU engine)."""

from __future__ import annotations

import itertools
import signal
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import free_port, start_redis, wait_until

from .helpers import user

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SESSIONS = 6
TURNS = 6


def test_turns_served_while_redis_is_down_are_recorded_once_when_it_is_back(
    gateways, log_dir, tmp_path
):
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    redis_child = start_redis(port, log_dir, f"redis-aof-{port}", aof_dir=data)
    spool = tmp_path / "spool"
    handle = gateways.ready(gateways.start(
        "spool", redis_url=f"redis://127.0.0.1:{port}/0",
        CLAWRL_SESSIONS__SPOOL_DIR=str(spool), CLAWRL_SESSIONS__SPOOL_REPLAY_INTERVAL_S="0.2",
    ))  # fmt: skip
    handle.redis_url = f"redis://127.0.0.1:{port}/0"
    run = uuid.uuid4().hex[:6]
    sids = [f"spool-{run}-{i}" for i in range(SESSIONS)]
    histories: dict[str, list[dict]] = {sid: [] for sid in sids}
    served: Counter[str] = Counter()  # main turns answered 200, by session

    def turn(sid: str, index: int) -> None:
        history = histories[sid]
        history.append(user(f"question {index} of {sid}"))
        headers = {"X-Session-Id": sid}
        if index == TURNS - 1:
            headers["X-Session-Done"] = "true"
        reply = handle.chat(history, headers=headers, max_tokens=3, temperature=0)
        assert reply.status_code == 200, reply.text
        served[sid] += 1
        history.append(reply.json()["choices"][0]["message"])

    def all_sessions(index: int) -> None:
        """Turn `index` of every session at once."""
        with ThreadPoolExecutor(SESSIONS) as pool:
            list(pool.map(lambda sid: turn(sid, index), sids))

    all_sessions(0)
    all_sessions(1)
    redis_child.proc.send_signal(signal.SIGKILL)  # no shutdown save: the AOF is what is left
    redis_child.proc.wait()
    all_sessions(2)
    all_sessions(3)
    assert handle.metric("clawrl_gateway_spool_entries") >= 2 * SESSIONS
    # The gateway restarts while Redis is still down (same port, so the same spool)...
    gateways.restart(handle)
    all_sessions(4)
    time.sleep(2)
    # ...and Redis comes back on its AOF: the last turns queue behind the spool.
    redis_child = start_redis(port, log_dir, f"redis-aof-{port}-back", aof_dir=data)
    try:
        all_sessions(5)
        assert sum(served.values()) == SESSIONS * TURNS
        wait_until(lambda: handle.metric("clawrl_gateway_spool_entries") == 0, 60,
                   "spool drained", handle.child.proc)  # fmt: skip
        for sid, count in served.items():
            turns = handle.wait_turns(sid, count, timeout_s=60)
            ids = [t.turn_id for t in turns]
            requests = [t.request_id for t in turns]
            assert len(ids) == count, f"{sid}: {len(ids)} turns recorded, {count} served"
            assert len(set(ids)) == len(ids) and len(set(requests)) == len(requests)
            assert [t.turn_index for t in turns] == list(range(count))
            # Each turn's next state is the next request's question: order was kept.
            for recorded, following in itertools.pairwise(turns):
                assert f"question {following.turn_index} " in recorded.next_state_json
        assert handle.metric("clawrl_gateway_spool_replayed_calls_total") >= SESSIONS
        assert handle.metric("clawrl_gateway_spool_dropped_calls_total") == 0
    finally:
        redis_child.stop()
