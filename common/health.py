"""Client side of grpc.health.v1: what the launcher, the proxy and the tests ask each role."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import ClusterTLSConfig
from common.tls import cluster_channel

UNREACHABLE = "UNREACHABLE"


def health_status(
    address: str, service: str = "", timeout: float = 1.0, tls: ClusterTLSConfig | None = None
) -> str:
    """'SERVING', 'NOT_SERVING', ... or UNREACHABLE when nothing answers at `address`. With
    `tls` (cluster.tls), over mTLS with the cluster's client certificate: what a worker that
    requires it accepts."""
    with cluster_channel(address, tls) as channel:
        return channel_status(channel, service, timeout)


def channel_status(channel: grpc.Channel, service: str = "", timeout: float = 1.0) -> str:
    """health_status over a channel the caller made (e.g. TLS to the proxy's client port)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        # CANCELLED: the server stopped while it held the call (a role exiting), which the
        # launcher's start-up poll met as a traceback in place of the role's exit code.
        if e.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
        ):
            return UNREACHABLE
        raise
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
