"""TLS set-up for every role, from PEM files named in the config.

Two kinds, kept apart:

- clients -> proxy (proxy.tls_cert / proxy.tls_key): HTTPS and gRPC over TLS; clients check
  the proxy's certificate; who they are is the API key's business (proxy/auth.py).
- proxy -> workers (cluster.tls: ca, cert, key): mutual TLS. A worker's gRPC port accepts only
  clients presenting a certificate signed by the cluster CA, and the proxy checks the worker's
  certificate against the same CA. Health checks (`epd health`, the launcher) use the same
  client certificate over the same port.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from common.cluster_auth import aio_interceptors, with_token
from common.config import ClusterTLSConfig, ConfigError


def read_pem(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """Server-side TLS without client certificates (the proxy's client-facing port)."""
    pair = (read_pem(key, "proxy.tls_key"), read_pem(cert, "proxy.tls_cert"))
    return grpc.ssl_server_credentials([pair])


def http_context(cert: str, key: str) -> ssl.SSLContext:
    """The proxy's HTTPS context."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError("proxy.tls_cert", f"cannot load {cert} / {key}: {e}") from None
    return context


def cluster_server_credentials(tls: ClusterTLSConfig) -> grpc.ServerCredentials | None:
    """A worker's mTLS credentials: clients must present a certificate the CA signed. None
    when cluster.tls is not set."""
    if not tls.enabled:
        return None
    pair = (read_pem(tls.key, "cluster.tls.key"), read_pem(tls.cert, "cluster.tls.cert"))
    return grpc.ssl_server_credentials(
        [pair], root_certificates=read_pem(tls.ca, "cluster.tls.ca"), require_client_auth=True
    )


def cluster_channel_credentials(tls: ClusterTLSConfig) -> grpc.ChannelCredentials | None:
    """What the proxy (and a health check) presents to workers; None without cluster.tls."""
    if not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca, "cluster.tls.ca"),
        private_key=read_pem(tls.key, "cluster.tls.key"),
        certificate_chain=read_pem(tls.cert, "cluster.tls.cert"),
    )


def cluster_channel_options(tls: ClusterTLSConfig) -> list[tuple[str, str]]:
    """Workers are dialled by IP (the registry): the name their certificates carry instead."""
    if tls.enabled and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


def cluster_aio_channel(
    address: str, tls: ClusterTLSConfig, options: list, token: str | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to a worker: mTLS when cluster.tls is set, plaintext otherwise;
    with `token` (common/cluster_auth.py), every call carries the cluster token."""
    credentials = cluster_channel_credentials(tls)
    interceptors = aio_interceptors(token)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        credentials,
        options=[*options, *cluster_channel_options(tls)],
        interceptors=interceptors,
    )


def cluster_channel(
    address: str, tls: ClusterTLSConfig | None, options: list = (), token: str | None = None
) -> grpc.Channel:
    """The blocking flavour of cluster_aio_channel (health checks, tools)."""
    credentials = cluster_channel_credentials(tls) if tls is not None else None
    if credentials is None:
        return with_token(grpc.insecure_channel(address, options=list(options)), token)
    channel = grpc.secure_channel(
        address, credentials, options=[*options, *cluster_channel_options(tls)]
    )
    return with_token(channel, token)
