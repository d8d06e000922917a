"""API keys at the proxy: who is calling, for both APIs.

Keys come from proxy.api_keys (EPD_PROXY_API_KEYS) and proxy.api_keys_file (one key per
line, optionally followed by a tenant name; '#' starts a comment). With no key configured the
APIs are open and every caller is the anonymous principal.

    HTTP   Authorization: Bearer KEY  (or Basic with KEY as the password: what a browser
           sends for /dashboard after its login prompt)          -> 401 otherwise
    WS     /v1/realtime also takes the key as an offered subprotocol
           `openai-insecure-api-key.KEY` (a browser's WebSocket cannot set headers; the
           server selects the `realtime` subprotocol, never the key's)
    gRPC   metadata  authorization: Bearer KEY                   -> UNAUTHENTICATED otherwise

/health is always open, but says only healthy or not (its status code and {"status": ...})
to a caller without a key: the workers' addresses and last errors need one. /metrics and
/dashboard are open only when proxy.metrics_public / proxy.dashboard_public say so. A
presented key is compared with every configured key in constant time (hmac.compare_digest
over SHA-256 digests, all of them, whichever matches), so the time taken tells nothing about
how much of a key was right.

A key's principal carries its tenant (what scopes client-given media uuids, proxy/prepare.py)
and a key id (the owner of the requests the key starts: only it may abort them).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web

from common.config import ConfigError, ProxyConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    tenant: str  # "" for the anonymous caller (no keys configured)
    key_id: str  # a digest prefix of the key: names it in logs, owns its requests


ANONYMOUS = Principal("", "")


class Unauthenticated(Exception):
    """No key, or not a configured one (HTTP 401 / UNAUTHENTICATED)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str) -> list[tuple[str, str | None]]:
    """(key, tenant or None) per line of an API keys file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError("proxy.api_keys_file", f"cannot read {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ConfigError(
                "proxy.api_keys_file",
                f"{path} line {n}: expected 'KEY' or 'KEY TENANT', got {len(fields)} fields",
            )
        out.append((fields[0], fields[1] if len(fields) == 2 else None))
    return out


class KeyRing:
    def __init__(self, entries: list[tuple[str, str | None]]):
        self._entries: list[tuple[bytes, Principal]] = []
        for key, tenant in entries:
            digest = _digest(key)
            key_id = digest.hex()[:16]
            self._entries.append((digest, Principal(tenant or f"key-{key_id}", key_id)))
        if len({d for d, _ in self._entries}) != len(self._entries):
            raise ConfigError("proxy.api_keys", "the same key is configured twice")

    @classmethod
    def from_config(cls, proxy: ProxyConfig) -> KeyRing:
        entries: list[tuple[str, str | None]] = [(k, None) for k in proxy.api_keys]
        if proxy.api_keys_file is not None:
            entries += read_keys_file(proxy.api_keys_file)
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, key: str | None) -> Principal:
        """The key's principal; Unauthenticated when it is missing or unknown."""
        if not self.enabled:
            return ANONYMOUS
        if not key:
            raise Unauthenticated("an API key is required (Authorization: Bearer KEY)")
        presented = _digest(key)
        found = None
        for digest, principal in self._entries:  # all of them: no early exit
            if hmac.compare_digest(digest, presented):
                found = principal
        if found is None:
            raise Unauthenticated("the API key is not valid")
        return found

    def from_authorization(self, header: str | None) -> Principal:
        """An HTTP Authorization (or gRPC `authorization` metadata) value's principal."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, value = (header or "").strip().partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer":
            return self.check(value.strip())
        if scheme == "basic":
            try:
                decoded = base64.b64decode(value.strip(), validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise Unauthenticated("malformed Basic credentials") from None
            return self.check(decoded.partition(":")[2])
        return self.check(None)


# The subprotocol prefix that carries an API key on a browser's WebSocket (the OpenAI
# realtime API's convention: the page offers ["realtime", PREFIX + key]).
WS_KEY_PROTOCOL = "openai-insecure-api-key."


def websocket_key(request: web.Request) -> str | None:
    """The API key offered as a WebSocket subprotocol, if any."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    for protocol in (p.strip() for p in offered.split(",")):
        if protocol.startswith(WS_KEY_PROTOCOL):
            return protocol[len(WS_KEY_PROTOCOL) :]
    return None


def http_middleware(keys: KeyRing, proxy: ProxyConfig) -> Callable:
    """The aiohttp middleware that admits a request or answers 401 (OpenAI error shape);
    the admitted request carries its Principal as request["principal"]."""

    def public(path: str) -> bool:
        if path == "/metrics":
            return proxy.metrics_public
        if path == "/dashboard" or path.startswith("/dashboard/"):
            return proxy.dashboard_public
        return False

    @web.middleware
    async def authenticate(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if public(request.path):
            request["principal"] = ANONYMOUS
            return await handler(request)
        if request.path == "/health":  # open; its detail (workers, errors) needs the key
            try:
                request["principal"] = keys.from_authorization(request.headers.get("Authorization"))
            except Unauthenticated:
                request["principal"] = None
            return await handler(request)
        try:
            header = request.headers.get("Authorization")
            if header is None and request.path == "/v1/realtime":
                request["principal"] = keys.check(websocket_key(request))
            else:
                request["principal"] = keys.from_authorization(header)
        except Unauthenticated as e:
            challenge = 'Bearer realm="epd"'
            if request.path.startswith("/dashboard"):  # a browser prompts for Basic
                challenge = 'Basic realm="epd", charset="UTF-8"'
            body = {
                "error": {
                    "message": str(e),
                    "type": "AuthenticationError",
                    "param": None,
                    "code": 401,
                }
            }
            return web.json_response(body, status=401, headers={"WWW-Authenticate": challenge})
        return await handler(request)

    return authenticate


async def grpc_principal(keys: KeyRing, context: grpc.aio.ServicerContext) -> Principal:
    """The caller's principal from its `authorization` metadata; aborts the call with
    UNAUTHENTICATED otherwise."""
    if not keys.enabled:
        return ANONYMOUS
    header = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            header = value if isinstance(value, str) else value.decode(errors="replace")
    try:
        return keys.from_authorization(header)
    except Unauthenticated as e:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{e} (metadata authorization)")
        raise  # not reached: abort raises
