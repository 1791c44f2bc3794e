"""Pause/resume around weight syncs: the gate every generation passes, and GatewayControl, the
gRPC service (grpc.aio, same event loop as the HTTP API) the weight-sync job drives.

Pause semantics: from Pause on, new requests are held (not refused) before they reach the
engine, while generations already running finish; Pause returns once they drained or the drain
timeout passed. Resume(v) sets the policy version and releases the held requests, so every turn
generated after it carries v. A request held longer than the hold timeout gets 503 with
Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.gateway.errors import Overloaded
from clawrl.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

SERVICE = control_pb2.DESCRIPTOR.services_by_name["GatewayControl"].full_name


class PauseGate:
    """Admission of generations: counts in-flight work, holds new work while paused."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        hold_timeout_s: float,
        retry_after_s: int,
        policy_version: int = 0,
    ) -> None:
        self.metrics = metrics
        self.hold_timeout_s = hold_timeout_s
        self.retry_after_s = retry_after_s
        self.paused = False
        self.paused_at = 0.0
        self.in_flight = 0
        self.held = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.set_policy_version(policy_version)

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version
        self.metrics.policy_version.set(version)

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[int]:
        """Hold while paused, then count the caller in flight; yields the policy version the
        generation runs under."""
        if self.paused:
            await self._hold()
        self.in_flight += 1
        self._drained.clear()
        self.metrics.in_flight.inc()
        try:
            yield self.policy_version
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            if self.in_flight == 0:
                self._drained.set()

    async def _hold(self) -> None:
        start = time.monotonic()
        deadline = start + self.hold_timeout_s
        self.held += 1
        self.metrics.held.inc()
        try:
            # A loop, not one wait: a Pause right after a Resume holds the request again.
            while self.paused:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.hold_timeouts.inc()
                    raise Overloaded(
                        f"the gateway is paused for a policy update and did not resume within "
                        f"{self.hold_timeout_s:g}s; retry later",
                        retry_after_s=self.retry_after_s,
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._resumed.wait(), remaining)
        finally:
            self.held -= 1
            self.metrics.held.dec()
            self.metrics.hold_time.observe(time.monotonic() - start)

    async def pause(self, drain_timeout_s: float) -> bool:
        """Hold new work and wait for in-flight work to drain; True when it did."""
        if not self.paused:
            self.paused = True
            self.paused_at = time.monotonic()
            self._resumed.clear()
            self.metrics.paused.set(1)
        try:
            await asyncio.wait_for(self._drained.wait(), drain_timeout_s)
        except TimeoutError:
            return False
        return True

    def resume(self, policy_version: int | None) -> int:
        """Release held work; returns how many requests were held."""
        if policy_version is not None:
            self.set_policy_version(policy_version)
        released = self.held
        self.paused = False
        self.paused_at = 0.0
        self._resumed.set()
        self.metrics.paused.set(0)
        return released

    def paused_for_s(self) -> float:
        return time.monotonic() - self.paused_at if self.paused else 0.0


class ControlServicer(control_pb2_grpc.GatewayControlServicer):
    """Thin gRPC methods over the gate."""

    def __init__(self, gate: PauseGate, *, gateway_id: str, drain_timeout_s: float) -> None:
        self.gate = gate
        self.gateway_id = gateway_id
        self.drain_timeout_s = drain_timeout_s

    def status(self) -> control_pb2.GatewayStatus:
        return control_pb2.GatewayStatus(
            paused=self.gate.paused,
            in_flight=self.gate.in_flight,
            held=self.gate.held,
            policy_version=self.gate.policy_version,
            paused_for_s=self.gate.paused_for_s(),
            gateway_id=self.gateway_id,
        )

    async def Pause(self, request, context):
        timeout = request.drain_timeout_s if request.drain_timeout_s > 0 else self.drain_timeout_s
        log.info("pause requested (%s); draining up to %.1fs", request.reason or "-", timeout)
        drained = await self.gate.pause(timeout)
        log.info("paused: drained=%s in_flight=%d", drained, self.gate.in_flight)
        return control_pb2.PauseResponse(
            drained=drained, in_flight=self.gate.in_flight, status=self.status()
        )

    async def Resume(self, request, context):
        if request.policy_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "policy_version must be >= 0")
        # 0 is proto3's "not set": keep the current version.
        released = self.gate.resume(request.policy_version or None)
        log.info(
            "resumed at policy version %d; released %d held requests",
            self.gate.policy_version,
            released,
        )
        return control_pb2.ResumeResponse(released=released, status=self.status())

    async def GetStatus(self, request, context):
        return self.status()


class TokenAuth(grpc.aio.ServerInterceptor):
    """GatewayControl calls need `authorization: Bearer <token>`; health and reflection stay
    open so probes work without the secret."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong control token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE}/"):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self.expected):
                    return await continuation(handler_call_details)
        return self._deny


async def start_control_server(
    gate: PauseGate,
    *,
    host: str,
    port: int,
    token: str | None,
    gateway_id: str,
    drain_timeout_s: float,
) -> tuple[grpc.aio.Server, int]:
    """Start GatewayControl + health + reflection; returns the server and its bound port."""
    server = grpc.aio.server(interceptors=[TokenAuth(token)] if token else None)
    control_pb2_grpc.add_GatewayControlServicer_to_server(
        ControlServicer(gate, gateway_id=gateway_id, drain_timeout_s=drain_timeout_s), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the control gRPC server to {host}:{port}")
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
