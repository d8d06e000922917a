"""Signed media hashes: what lets an encoder refuse to store an embedding under a hash the
proxy did not assign.

An encoder publishes each embedding under the mm_hash it is given, and every LM worker reads
what is stored there. A caller that could pick the hash could store one image's embedding
under another image's hash (or another tenant's uuid) and so answer other clients' requests
with it. The proxy signs each hash it assigns with the cluster's shared secret (HMAC-SHA256);
the encoder checks the tag before any work and refuses the item otherwise. Only holders of the
secret (the proxy and the encoders) can make a valid tag; clients never see one.
"""

from __future__ import annotations

import hashlib
import hmac

_CONTEXT = b"epd-mm-hash-tag-v1\0"


class HashSigner:
    """sign(mm_hash) -> tag; verify(mm_hash, tag) -> bool (constant time)."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("the signing key must be at least 16 bytes")
        self._key = key

    def sign(self, mm_hash: str) -> bytes:
        return hmac.new(self._key, _CONTEXT + mm_hash.encode(), hashlib.sha256).digest()

    def verify(self, mm_hash: str, tag: bytes) -> bool:
        return hmac.compare_digest(self.sign(mm_hash), tag)

    def __repr__(self) -> str:  # never the key
        return "HashSigner(<secret>)"
