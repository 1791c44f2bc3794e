"""Starting a grpc.aio server the way every clawrl control service does: its own service plus the
standard health service (for probes) and reflection (so `grpcurl list` works)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


async def start_with_health(server: grpc.aio.Server, service: str, host: str, port: int) -> int:
    """Add health + reflection to `server` (its servicers already added), bind `host:port`,
    start it and mark `service` serving; returns the bound port (useful with port 0)."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the {service} gRPC server to {host}:{port}")
    await server.start()
    for name in ("", service):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound
