"""Pause/resume around weight syncs: the gate every generation passes, and GatewayControl, the
gRPC service (grpc.aio, same event loop as the HTTP API) the weight-sync job drives.

LoRA versions need no pause: SwitchAdapter(v, adapter) only changes what the gate hands to
requests it admits from then on (the adapter they are generated with, the version their turns
record). The engine never changes a running request's adapter, so a turn is never mixed; the
gate counts requests in flight per adapter, so the job knows when an old one is idle.
SwitchAdapter with a tenant and no adapter unroutes the tenant (its adapter was reset or removed,
or it is no longer selected): its new requests are served the shared policy again.

Pause semantics: from Pause on, new requests are held (not refused) before they reach the
engine, while generations already running finish; Pause returns once they drained or the drain
timeout passed. Resume(v) sets the policy version and releases the held requests, so every turn
generated after it carries v. A request held longer than the hold timeout gets 503 with
Retry-After.

A pause is a lease: it ends by itself after `lease_s` unless its holder renews it (Pause again
with the same holder), so a sync job that dies (even by SIGKILL) never leaves serving paused.
An expired lease resumes on the version the engine reports (a job may have died between its
load and its Resume: the gateway then follows the engines, never stays behind them; the current
version when the engine's is not an integer or it does not answer), is counted and logged.
While one holder's lease runs, a Pause or a Resume from another holder is refused (two syncs
must never interleave). Resume is idempotent: on a gateway that is not paused it only sets the
version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from clawrl.common.grpc_serving import start_with_health
from clawrl.common.metrics import tenant_label
from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.common.tenants import SHARED
from clawrl.gateway.errors import Overloaded
from clawrl.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

SERVICE = control_pb2.DESCRIPTOR.services_by_name["GatewayControl"].full_name


class PauseHeld(Exception):
    """Pause from a holder other than the one whose lease is running."""


@dataclass(frozen=True)
class Admission:
    """What an admitted generation runs under, fixed at admission: a switch meanwhile changes
    only later requests."""

    policy_version: int
    adapter: str = ""  # LoRA adapter to generate with (SGLang's lora_path); "" = full weights
    pauses: int = 0  # the gate's pause count then: a pause since may have retracted it


class PauseGate:
    """Admission of generations: counts in-flight work, holds new work while paused."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        hold_timeout_s: float,
        retry_after_s: int,
        policy_version: int = 0,
        adapter: str = "",
        lease_s: float = 30.0,
        base_version: int = 0,
        engine_version: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.hold_timeout_s = hold_timeout_s
        self.retry_after_s = retry_after_s
        self.default_lease_s = lease_s
        self.base_version = base_version  # what weights the engine names (not a number) are
        self.engine_version = engine_version  # the engine's integer version, for lease expiry
        self.pauses = 0  # pauses begun: a generation that saw one may have been retracted
        self._expiring: asyncio.Task | None = None
        self.paused = False
        self.paused_at = 0.0
        self.holder = ""
        self.lease_until = 0.0
        self._expiry: asyncio.TimerHandle | None = None
        self.in_flight = 0
        self.in_flight_by_adapter: Counter[str] = Counter()
        self.held = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.adapter = adapter
        # Per-tenant adapters: tenant -> (version, adapter) its requests are admitted under.
        self.tenant_adapters: dict[str, tuple[int, str]] = {}
        self.set_policy_version(policy_version)

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version
        self.metrics.policy_version.set(version)

    def switch(self, policy_version: int, adapter: str, tenant: str = "") -> None:
        """Admit new work under `adapter` and `policy_version` from now on; no pause, no wait.
        With `tenant`: only that tenant's new work; everyone else's routing stays as it is."""
        if tenant:
            self.tenant_adapters[tenant] = (policy_version, adapter)
            self.metrics.tenant_policy_version.labels(tenant).set(policy_version)
        else:
            self.adapter = adapter
            self.set_policy_version(policy_version)
        self.metrics.adapter_switches.inc()

    def unroute(self, tenant: str) -> tuple[int, str] | None:
        """Admit `tenant`'s new work under the shared policy again, as any caller without an
        adapter of its own; what it was routed to (None: nothing). Admitted work finishes on the
        adapter it started with."""
        previous = self.tenant_adapters.pop(tenant, None)
        if previous is not None:
            with contextlib.suppress(KeyError):  # its version is no longer served
                self.metrics.tenant_policy_version.remove(tenant)
        self.metrics.adapter_switches.inc()
        return previous

    @contextlib.asynccontextmanager
    async def admit(self, tenant: str = "") -> AsyncIterator[Admission]:
        """Hold while paused, then count the caller in flight; yields the policy version and
        adapter the generation runs under: the tenant's own when it has one, else the shared."""
        if self.paused:
            await self._hold()
        own = self.tenant_adapters.get(tenant)
        version, adapter = own or (self.policy_version, self.adapter)
        self.metrics.tenant_requests.labels(tenant_label(tenant if own else SHARED)).inc()
        admission = Admission(version, adapter, self.pauses)
        self.in_flight += 1
        self.in_flight_by_adapter[admission.adapter] += 1
        self._drained.clear()
        self.metrics.in_flight.inc()
        try:
            yield admission
        finally:
            self.in_flight -= 1
            self.in_flight_by_adapter[admission.adapter] -= 1
            if not self.in_flight_by_adapter[admission.adapter]:
                del self.in_flight_by_adapter[admission.adapter]
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

    async def pause(
        self, drain_timeout_s: float, *, lease_s: float | None = None, holder: str = ""
    ) -> bool:
        """Hold new work (or renew the holder's lease) and wait for in-flight work to drain;
        True when it did. PauseHeld when another holder's lease is running."""
        if self.paused and holder != self.holder:
            self.metrics.pause_refusals.inc()
            raise PauseHeld(
                f"paused by {self.holder or 'an anonymous holder'} for another "
                f"{self.lease_remaining_s():.1f}s"
            )
        if not self.paused:
            self.pauses += 1
            self.paused = True
            self.paused_at = time.monotonic()
            self.holder = holder
            self._resumed.clear()
            self.metrics.paused.set(1)
            self.metrics.pauses.inc()
        self._lease(lease_s or self.default_lease_s)
        try:
            await asyncio.wait_for(self._drained.wait(), drain_timeout_s)
        except TimeoutError:
            return False
        return True

    def _lease(self, lease_s: float) -> None:
        """(Re)start the lease: the pause ends by itself lease_s from now."""
        if self._expiry is not None:
            self._expiry.cancel()
        self.lease_until = time.monotonic() + lease_s
        self._expiry = asyncio.get_running_loop().call_later(lease_s, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self.metrics.pause_lease_expiries.inc()
        self._expiring = asyncio.get_running_loop().create_task(self._end_expired(self.holder))

    async def _end_expired(self, holder: str) -> None:
        """Resume an expired pause on the engine's version: its holder may have died after the
        engines loaded a new version, and a gateway left behind them would label its turns
        with the old one."""
        version = await self.engine_version() if self.engine_version is not None else None
        if not self.paused or self.holder != holder or self._expiry is not None:
            return  # resumed or renewed meanwhile
        if version is None:
            outcome = "unknown"
        else:
            outcome = "same" if version == self.policy_version else "adopted"
        self.metrics.lease_version_adoptions.labels(outcome=outcome).inc()
        log.warning(
            "pause lease of %s expired after %.1fs without renewal; resuming on policy version "
            "%d (%s)",
            holder or "an anonymous holder",
            self.paused_for_s(),
            self.policy_version if version is None else version,
            {
                "unknown": "the engine's version is unknown: kept the current one",
                "same": "the engine's",
                "adopted": f"the engine's; was {self.policy_version}",
            }[outcome],
            extra={"policy_version": self.policy_version if version is None else version},
        )
        self.resume(version)

    def resume(self, policy_version: int | None) -> int:
        """Release held work (a no-op apart from the version when not paused); returns how many
        requests were held."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if policy_version is not None:
            self.adapter = ""  # a version resumed with is full weights
            self.set_policy_version(policy_version)
        released = self.held if self.paused else 0
        self.paused = False
        self.paused_at = 0.0
        self.holder = ""
        self.lease_until = 0.0
        self._resumed.set()
        self.metrics.paused.set(0)
        return released

    def paused_for_s(self) -> float:
        return time.monotonic() - self.paused_at if self.paused else 0.0

    def lease_remaining_s(self) -> float:
        return max(0.0, self.lease_until - time.monotonic()) if self.paused else 0.0


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
            lease_remaining_s=self.gate.lease_remaining_s(),
            holder=self.gate.holder,
            adapter=self.gate.adapter,
            in_flight_by_adapter=dict(self.gate.in_flight_by_adapter),
            tenant_adapters={t: a for t, (_, a) in self.gate.tenant_adapters.items()},
        )

    async def Pause(self, request, context):
        if request.drain_timeout_s < 0 or request.lease_s < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s and lease_s must be >= 0"
            )
        timeout = request.drain_timeout_s if request.drain_timeout_s > 0 else self.drain_timeout_s
        renewal = self.gate.paused and self.gate.holder == request.holder
        log.info(
            "%s by %s (%s); draining up to %.1fs",
            "pause renewed" if renewal else "pause requested",
            request.holder or "-",
            request.reason or "-",
            timeout,
        )
        try:
            drained = await self.gate.pause(
                timeout, lease_s=request.lease_s or None, holder=request.holder
            )
        except PauseHeld as exc:
            log.warning("pause by %s refused: %s", request.holder or "-", exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if not renewal:
            log.info("paused: drained=%s in_flight=%d", drained, self.gate.in_flight)
        return control_pb2.PauseResponse(
            drained=drained, in_flight=self.gate.in_flight, status=self.status()
        )

    async def Resume(self, request, context):
        if request.policy_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "policy_version must be >= 0")
        if self.gate.paused and request.holder and request.holder != self.gate.holder:
            self.gate.metrics.pause_refusals.inc()
            message = (
                f"paused by {self.gate.holder or 'an anonymous holder'}, not {request.holder}: "
                "only the holder of a pause resumes it"
            )
            log.warning("resume refused: %s", message)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        # 0 is proto3's "not set": keep the current version.
        released = self.gate.resume(request.policy_version or None)
        log.info(
            "resumed at policy version %d; released %d held requests",
            self.gate.policy_version,
            released,
        )
        return control_pb2.ResumeResponse(released=released, status=self.status())

    async def SwitchAdapter(self, request, context):
        if request.tenant and not request.adapter:
            return self._unroute(request.tenant)
        if request.policy_version <= 0 or not request.adapter:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "policy_version must be > 0 and adapter set (or, to unroute a tenant, tenant set "
                "and adapter empty)",
            )
        previous = self.gate.tenant_adapters.get(
            request.tenant, (self.gate.policy_version, self.gate.adapter)
        )
        self.gate.switch(request.policy_version, request.adapter, request.tenant)
        log.info(
            "switched %s from v%d (%s) to v%d (adapter %s) with no pause",
            f"tenant {request.tenant}" if request.tenant else "the shared policy",
            previous[0],
            previous[1] or "full weights",
            request.policy_version,
            request.adapter,
            extra={"policy_version": request.policy_version},
        )
        return control_pb2.SwitchAdapterResponse(status=self.status())

    def _unroute(self, tenant: str) -> control_pb2.SwitchAdapterResponse:
        previous = self.gate.unroute(tenant)
        if previous is None:
            log.info("tenant %s unrouted: it had no adapter of its own here", tenant)
        else:
            log.info("unrouted tenant %s from v%d (adapter %s): the shared policy serves it "
                     "(v%d, %s)", tenant, previous[0], previous[1], self.gate.policy_version,
                     self.gate.adapter or "full weights")  # fmt: skip
        return control_pb2.SwitchAdapterResponse(status=self.status())

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
    bound = await start_with_health(server, SERVICE, host, port)
    return server, bound
