"""The local hot tier: a byte-bounded LRU of decoded embeddings in the consumer's process.

A repeated item costs a dictionary lookup instead of a Redis round trip. Entries are the
connector's read-only tensors; the tier never copies them. Thread-safe: the asyncio flavour of
the connector fills it from worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class LocalTier:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def get(self, mm_hash: str) -> torch.Tensor | None:
        with self._lock:
            tensor = self._entries.get(mm_hash)
            if tensor is not None:
                self._entries.move_to_end(mm_hash)
            return tensor

    def put(self, mm_hash: str, tensor: torch.Tensor) -> None:
        size = tensor.nbytes
        if size > self.capacity_bytes:
            return  # larger than the whole tier: keeping it would evict everything else
        with self._lock:
            old = self._entries.pop(mm_hash, None)
            if old is not None:
                self.nbytes -= old.nbytes
            while self._entries and self.nbytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
            self._entries[mm_hash] = tensor
            self.nbytes += size

    def discard(self, mm_hash: str) -> None:
        with self._lock:
            old = self._entries.pop(mm_hash, None)
            if old is not None:
                self.nbytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
