"""SwitchAdapter over real gRPC: guarded by the control token like Pause/Resume, refuses a call
without a version or an adapter, and changes what GetStatus reports with no pause."""

from __future__ import annotations

import grpc
import pytest

from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.gateway.control import PauseGate, start_control_server
from clawrl.gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.integration

TOKEN = (("authorization", "Bearer s3cret"),)


async def test_switch_adapter_is_guarded_checked_and_pauses_nothing():
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=5, retry_after_s=1, policy_version=3)
    server, port = await start_control_server(
        gate, host="127.0.0.1", port=0, token="s3cret", gateway_id="g", drain_timeout_s=5
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = control_pb2_grpc.GatewayControlStub(channel)
            switch = control_pb2.SwitchAdapterRequest(policy_version=4, adapter="policy-v4")
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.SwitchAdapter(switch)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for bad in (
                control_pb2.SwitchAdapterRequest(policy_version=0, adapter="policy-v4"),
                control_pb2.SwitchAdapterRequest(policy_version=4, adapter=""),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.SwitchAdapter(bad, metadata=TOKEN)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (gate.policy_version, gate.adapter) == (3, "")
            reply = await stub.SwitchAdapter(switch, metadata=TOKEN)
            status = reply.status
            assert (status.policy_version, status.adapter, status.paused) == (4, "policy-v4", False)
            async with gate.admit():
                status = await stub.GetStatus(control_pb2.GetStatusRequest(), metadata=TOKEN)
                assert dict(status.in_flight_by_adapter) == {"policy-v4": 1}
            # A full-weight version resumed with drops the adapter.
            await stub.Resume(control_pb2.ResumeRequest(policy_version=5), metadata=TOKEN)
            status = await stub.GetStatus(control_pb2.GetStatusRequest(), metadata=TOKEN)
            assert (status.policy_version, status.adapter) == (5, "")
            assert dict(status.in_flight_by_adapter) == {}
    finally:
        await server.stop(None)
