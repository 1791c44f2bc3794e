"""GatewayControl over real gRPC: pause holds requests until resume (which sets the version
the held turns carry), hold timeout, drain, auth; API keys on the HTTP side."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clawrl.common.proto import control_pb2, control_pb2_grpc

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration

TOKEN = [("authorization", "Bearer control-secret")]


def stub(handle):
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.grpc_port}")
    return channel, control_pb2_grpc.GatewayControlStub(channel)


def in_background(fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as exc:  # surfaced by the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def wait_for(predicate, timeout_s=30.0):  # generous: a loaded host is slow to get there
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_pause_holds_requests_until_resume_with_new_version(gateway, session_id):
    channel, control = stub(gateway)
    with channel:
        try:
            _pause_and_resume(gateway, control, session_id)
        finally:
            control.Resume(control_pb2.ResumeRequest())


def _pause_and_resume(gateway, control, session_id):
    if True:
        # A long generation is in flight when Pause arrives: Pause waits for it. Seconds long
        # (greedy: the random model never ends early), so a poller on a loaded host sees it run.
        long_call, long_result = in_background(
            lambda: httpx.post(
                f"{gateway.base_url}/chat/completions",
                json={"messages": [user("write a lot")], "max_tokens": 2000, "temperature": 0},
                headers={"X-Turn-Type": "side"},
                timeout=300,  # a loaded host makes it several times slower
            )
        )
        wait_for(lambda: control.GetStatus(control_pb2.GetStatusRequest()).in_flight == 1)
        # Drain and lease far beyond the generation, however slow: only Resume ends this pause.
        paused = control.Pause(
            control_pb2.PauseRequest(drain_timeout_s=300, lease_s=600, reason="test")
        )
        assert paused.drained and paused.in_flight == 0 and paused.status.paused
        long_call.join()
        assert long_result["value"].status_code == 200
        # A new request is held, not refused.
        held_call, held_result = in_background(
            lambda: gateway.chat(
                [user("held")], headers={"X-Session-Id": session_id, "X-Session-Done": "1"}
            )
        )
        wait_for(lambda: control.GetStatus(control_pb2.GetStatusRequest()).held == 1)
        assert gateway.metric("clawrl_gateway_held_requests") == 1
        assert gateway.metric("clawrl_gateway_paused") == 1
        time.sleep(0.3)
        assert held_call.is_alive()
        resumed = control.Resume(control_pb2.ResumeRequest(policy_version=7))
        assert resumed.released == 1 and not resumed.status.paused
        assert resumed.status.policy_version == 7
        held_call.join(timeout=30)
        reply = held_result["value"]
        assert reply.status_code == 200 and reply.json()["system_fingerprint"] == "clawrl-policy-v7"
        [turn] = gateway.wait_turns(session_id, 1)
        assert turn.policy_version == 7
        status = control.GetStatus(control_pb2.GetStatusRequest())
        assert (status.paused, status.held, status.in_flight) == (False, 0, 0)
        assert status.gateway_id == "main"


def test_hold_timeout_gives_503_with_retry_after(secured):
    channel, control = stub(secured)
    with channel:
        control.Pause(control_pb2.PauseRequest(drain_timeout_s=5), metadata=TOKEN)
        try:
            started = time.monotonic()
            reply = secured.chat([user("x")], headers={"Authorization": "Bearer sk-test-1"})
            assert 0.9 < time.monotonic() - started < 10
            assert reply.status_code == 503 and reply.headers["retry-after"] == "3"
            assert reply.json()["error"]["code"] == "gateway_paused"
            stream = secured.chat(
                [user("x")], headers={"Authorization": "Bearer sk-test-1"}, stream=True
            )
            assert stream.status_code == 503 and stream.json()["error"]["type"]
        finally:
            control.Resume(control_pb2.ResumeRequest(), metadata=TOKEN)
    assert secured.metric("clawrl_gateway_hold_timeouts_total") >= 2


def test_control_token_health_and_reflection(secured):
    channel, control = stub(secured)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            control.GetStatus(control_pb2.GetStatusRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            control.Pause(control_pb2.PauseRequest(), metadata=[("authorization", "Bearer wrong")])
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert control.GetStatus(control_pb2.GetStatusRequest(), metadata=TOKEN).paused is False
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "clawrl.v1.GatewayControl"):
            check = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(
            iter(
                reflection.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            )
        )
        names = {s.name for s in answer.list_services_response.service}
        assert "clawrl.v1.GatewayControl" in names


def test_api_keys(secured):
    with pytest.raises(openai.AuthenticationError) as info:
        secured.openai(api_key="sk-wrong").chat.completions.create(
            model="m", messages=[user("x")], max_tokens=2
        )
    assert info.value.status_code == 401
    body = httpx.post(
        f"{secured.base_url}/chat/completions", json={"messages": [user("x")]}, timeout=TIMEOUT
    )
    assert body.status_code == 401
    assert set(body.json()["error"]) == {"message", "type", "param", "code"}
    reply = secured.openai(api_key="sk-test-2").chat.completions.create(
        model="m", messages=[user("x")], max_tokens=2, extra_headers={"X-Turn-Type": "side"}
    )
    assert reply.choices[0].message.role == "assistant"
    # Probes stay open.
    assert httpx.get(f"{secured.url}/healthz", timeout=TIMEOUT).status_code == 200


def test_pause_lease_expires_renews_and_refuses_another_holder(gateway):
    channel, control = stub(gateway)
    with channel:
        try:
            expiries = gateway.metric("clawrl_gateway_pause_lease_expiries_total")
            version = control.GetStatus(control_pb2.GetStatusRequest()).policy_version
            # Leases seconds longer than a renewal's interval: a loaded host delays renewals.
            lease_s = 3.0
            paused = control.Pause(control_pb2.PauseRequest(lease_s=lease_s, holder="sync-1"))
            assert paused.status.paused and paused.status.holder == "sync-1"
            assert 0 < paused.status.lease_remaining_s <= lease_s
            with pytest.raises(grpc.RpcError) as info:
                control.Pause(control_pb2.PauseRequest(lease_s=5, holder="sync-2"))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "sync-1" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                control.Pause(control_pb2.PauseRequest(lease_s=-1, holder="sync-1"))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # The holder renews, past the first lease's end: still the same pause.
            for _ in range(4):
                time.sleep(0.8)
                renewed = control.Pause(control_pb2.PauseRequest(lease_s=lease_s, holder="sync-1"))
                assert renewed.status.paused
            assert renewed.status.paused_for_s > lease_s
            # A request arrives (held under a long lease, however slowly it gets there), then the
            # holder renews for 1 s and goes silent: the lease ends the pause and the request is
            # served on the version from before.
            control.Pause(control_pb2.PauseRequest(lease_s=60, holder="sync-1"))
            held_call, held_result = in_background(
                lambda: gateway.chat([user("held")], headers={"X-Turn-Type": "side"})
            )
            wait_for(lambda: control.GetStatus(control_pb2.GetStatusRequest()).held == 1)
            control.Pause(control_pb2.PauseRequest(lease_s=1.0, holder="sync-1"))
            wait_for(lambda: not control.GetStatus(control_pb2.GetStatusRequest()).paused, 15)
            held_call.join(timeout=30)
            assert held_result["value"].status_code == 200
            status = control.GetStatus(control_pb2.GetStatusRequest())
            assert (status.holder, status.lease_remaining_s, status.policy_version) == (
                "",
                0,
                version,
            )
            assert gateway.metric("clawrl_gateway_pause_lease_expiries_total") == expiries + 1
            # Resume after the expiry is a harmless no-op.
            again = control.Resume(control_pb2.ResumeRequest())
            assert again.released == 0 and not again.status.paused
        finally:
            control.Resume(control_pb2.ResumeRequest())
