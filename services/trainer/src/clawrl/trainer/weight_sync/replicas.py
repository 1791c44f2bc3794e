"""The replicas a sync acts on: gateways through GatewayControl (gRPC), policy engines through
SGLang's HTTP API. Found by settings locally, by a headless Service's DNS name on Kubernetes
(it resolves to the address of every ready pod, so no API permission is needed)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from redis.asyncio import Redis

from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.served import write_served, write_served_tenant
from clawrl.common.sglang_client import EngineError, SGLangClient
from clawrl.trainer.weight_sync.settings import EngineTargets, GatewayTargets

log = logging.getLogger(__name__)
T = TypeVar("T")


async def resolve(name: str, port: int) -> list[str]:
    """Every address `name` resolves to, as `host:port` (IPv6 in brackets), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({info[4][0] for info in infos})
    if not hosts:
        raise LookupError(f"{name} resolves to no address")
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


async def gateway_addresses(targets: GatewayTargets) -> list[str]:
    if targets.service:
        return await resolve(targets.service, targets.port)
    return list(targets.addresses)


async def engine_urls(targets: EngineTargets) -> list[str]:
    if targets.service:
        return [f"http://{a}" for a in await resolve(targets.service, targets.port)]
    return [url.rstrip("/") for url in targets.urls]


class ReplicaError(Exception):
    """A replica did not do what the sync asked; the message names it and says why. `refused`:
    the gateway answered that another holder's pause runs (it was not paused by this sync)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Gateway:
    """One gateway replica's GatewayControl."""

    def __init__(self, address: str, targets: GatewayTargets, holder: str) -> None:
        self.address = address
        self.targets = targets
        self.holder = holder
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = control_pb2_grpc.GatewayControlStub(self._channel)
        token = targets.token.get_secret_value() if targets.token else None
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request, extra_timeout_s: float = 0.0):
        """One GatewayControl call; ReplicaError when the gateway refuses or is unreachable."""
        try:
            return await getattr(self._stub, method)(
                request,
                timeout=self.targets.call_timeout_s + extra_timeout_s,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            raise ReplicaError(
                f"gateway {self.address}: {method} failed: {exc.code().name} {exc.details()}",
                refused=exc.code() == grpc.StatusCode.FAILED_PRECONDITION,
            ) from exc

    async def pause(self, reason: str, drain_timeout_s: float) -> control_pb2.PauseResponse:
        """Pause, or renew this holder's lease (the call waits up to the drain)."""
        request = control_pb2.PauseRequest(
            drain_timeout_s=drain_timeout_s,
            reason=reason,
            lease_s=self.targets.lease_s,
            holder=self.holder,
        )
        return await self._call("Pause", request, drain_timeout_s)

    async def resume(self, policy_version: int | None) -> control_pb2.ResumeResponse:
        """Resume this holder's pause (refused while another holder's runs) on the version."""
        request = control_pb2.ResumeRequest(policy_version=policy_version or 0, holder=self.holder)
        return await self._call("Resume", request)

    async def switch_adapter(
        self, policy_version: int, adapter: str, tenant: str = ""
    ) -> control_pb2.GatewayStatus:
        """Route new requests to `adapter` (no pause): `tenant`'s alone when set, else every
        request without a tenant adapter of its own; the gateway's status after it."""
        request = control_pb2.SwitchAdapterRequest(
            policy_version=policy_version, adapter=adapter, tenant=tenant
        )
        return (await self._call("SwitchAdapter", request)).status

    async def unroute(self, tenant: str) -> control_pb2.GatewayStatus:
        """Serve `tenant`'s new requests the shared policy again (SwitchAdapter with the tenant
        and no adapter); the gateway's status after it."""
        request = control_pb2.SwitchAdapterRequest(tenant=tenant)
        return (await self._call("SwitchAdapter", request)).status

    async def status(self) -> control_pb2.GatewayStatus:
        return await self._call("GetStatus", control_pb2.GetStatusRequest())


@dataclass(frozen=True)
class EngineWeights:
    """What an engine serves: its weight_version and where those weights are."""

    version: str
    path: str


class Engine:
    """One policy engine replica's SGLang API."""

    def __init__(self, url: str, targets: EngineTargets) -> None:
        self.url = url
        self._client = SGLangClient(url, timeout_s=targets.load_timeout_s)  # loads
        self._quick = SGLangClient(url, timeout_s=targets.call_timeout_s)  # everything else

    async def close(self) -> None:
        await asyncio.gather(self._client.aclose(), self._quick.aclose())

    async def weights(self) -> EngineWeights:
        try:
            info = await self._quick.get_model_info()
        except EngineError as exc:
            raise ReplicaError(f"engine {self.url}: /get_model_info failed: {exc}") from exc
        return EngineWeights(str(info.get("weight_version")), str(info.get("model_path")))

    async def load(self, path: str, version: str) -> int:
        """/update_weights_from_disk; how many paused generations go on under the new weights.
        ReplicaError with the engine's message when it fails."""
        try:
            reply = await self._client.update_weights_from_disk(path, weight_version=version)
        except EngineError as exc:
            raise ReplicaError(f"engine {self.url}: weight update failed: {exc}") from exc
        if not reply.get("success"):
            raise ReplicaError(
                f"engine {self.url}: weight update refused: {reply.get('message', 'no message')}"
            )
        return int(reply.get("num_paused_requests") or 0)

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters the engine holds, name -> path."""
        try:
            return await self._quick.lora_adapters()
        except EngineError as exc:
            raise ReplicaError(f"engine {self.url}: listing its adapters failed: {exc}") from exc

    async def load_adapter(self, name: str, path: str) -> None:
        """/load_lora_adapter while the engine keeps serving; ReplicaError with its reason."""
        try:
            await self._client.load_lora_adapter(name, path)
        except EngineError as exc:
            raise ReplicaError(f"engine {self.url}: loading adapter {name} failed: {exc}") from exc

    async def unload_adapter(self, name: str) -> None:
        """/unload_lora_adapter: returns once the engine's requests using it have finished."""
        try:
            await self._client.unload_lora_adapter(name)
        except EngineError as exc:
            raise ReplicaError(
                f"engine {self.url}: unloading adapter {name} failed: {exc}"
            ) from exc

    async def pause_generation(self) -> None:
        """Retract the running generations (KV dropped, re-prefilled on continue) and admit
        none: SGLang then applies a weight update at once instead of after them."""
        try:
            await self._quick.pause_generation("retract")
        except EngineError as exc:
            raise ReplicaError(f"engine {self.url}: /pause_generation failed: {exc}") from exc

    async def continue_generation(self) -> None:
        try:
            await self._quick.continue_generation()
        except EngineError as exc:
            raise ReplicaError(f"engine {self.url}: /continue_generation failed: {exc}") from exc


async def continue_every_engine(targets: EngineTargets) -> list[str]:
    """/continue_generation on every policy engine (idempotent); the errors. For a job that
    died between its engines' /pause_generation and its own /continue_generation."""
    try:
        urls = await engine_urls(targets)
    except (OSError, LookupError) as exc:
        return [f"cannot find the engines: {exc}"]
    engines = [Engine(url, targets) for url in urls]
    try:
        results = await asyncio.gather(
            *(e.continue_generation() for e in engines), return_exceptions=True
        )
    finally:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, ReplicaError):
            raise result
    return [str(r) for r in results if isinstance(r, ReplicaError)]


async def gather_answers(calls: list[Awaitable[T]]) -> tuple[list[T], list[str]]:
    """Run the calls at once; the answers of those that succeeded and the messages of those
    that raised ReplicaError."""
    answers, errors = [], []
    for result in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(result, ReplicaError):
            errors.append(str(result))
        elif isinstance(result, BaseException):
            raise result
        else:
            answers.append(result)
    return answers, errors


async def gather_errors(calls: list[Awaitable[object]]) -> list[str]:
    """Run the calls at once; the messages of those that raised ReplicaError."""
    return (await gather_answers(calls))[1]


async def record_served(
    redis: Redis, key: str, version: int, adapter: str, path: str, tenant: str = ""
) -> None:
    """What the gateways route to from now on (`tenant`'s requests, with a tenant), recorded at
    `key` for gateways and engines that (re)start."""
    try:
        if tenant:
            await write_served_tenant(redis, key, tenant, version, adapter, path)
        else:
            await write_served(redis, key, version, adapter, path)
    except REDIS_ERRORS as exc:  # serving goes on; only a restart would miss it
        log.error("cannot record the served version at %s: %s", key, exc)
