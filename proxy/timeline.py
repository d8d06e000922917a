"""The dashboard's timeline: the slowest recent requests with their stages, and where the last
minute's time went.

Each finished request leaves one record: the proxy's own stages (common/tracing.py: validate,
cache_check, encode, lm_call) and the LM worker's, laid out inside its last LM call from the
timings the worker returns (queue_wait, embedding_wait, prefill, decode). Records are kept for
`window` seconds, at most `cap` of them; the slowest `keep` are drawn as waterfalls.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from common.tracing import Stage
from proto import epd_pb2

WINDOW_SECONDS = 60.0
KEEP = 8
CAP = 512


def lm_stages(call: Stage, timings: epd_pb2.StageTimings) -> list[dict[str, Any]]:
    """The LM worker's stages inside `call` (offsets in seconds from the call's start): its
    queue, then its prefill and decode; its embedding wait from its start (it overlaps the
    prefill of the text before the media)."""
    out = []
    queue, prefill = timings.queue_seconds, timings.prefill_seconds
    if timings.embedding_wait_seconds:
        out.append(("embedding_wait", 0.0, timings.embedding_wait_seconds))
    if queue:
        out.append(("queue_wait", 0.0, queue))
    if prefill:
        out.append(("prefill", queue, prefill))
    if timings.decode_seconds:
        out.append(("decode", queue + prefill, timings.decode_seconds))
    start = call.start / 1e9
    return [{"name": n, "role": "lm", "start": start + at, "seconds": s} for n, at, s in out]


class Timeline:
    def __init__(self, window: float = WINDOW_SECONDS, keep: int = KEEP, cap: int = CAP):
        self.window = window
        self.keep = keep
        self.records: deque[dict[str, Any]] = deque(maxlen=cap)

    def add(
        self,
        request_id: str,
        stages: Sequence[Stage],
        timings: epd_pb2.StageTimings | None,
        ok: bool,
        now: float | None = None,
    ) -> None:
        """A finished request: its proxy stages and, on success, the LM's timings."""
        if not stages:
            return
        now = time.time() if now is None else now
        start = min(s.start for s in stages) / 1e9
        bars = [
            {"name": s.name, "role": "proxy", "start": s.start / 1e9, "seconds": s.seconds}
            for s in stages
        ]
        calls = [s for s in stages if s.name == "lm_call"]
        if timings is not None and calls:
            bars += lm_stages(calls[-1], timings)
        bars.sort(key=lambda b: b["start"])
        for b in bars:
            b["start"] = round(b["start"] - start, 6)
            b["seconds"] = round(b["seconds"], 6)
        self.records.append(
            {
                "request_id": request_id,
                "ended": now,
                "total_seconds": round(now - start, 6),
                "ok": ok,
                "stages": bars,
            }
        )

    def state(self, now: float | None = None) -> dict[str, Any]:
        """The slowest recent requests, and the mean seconds per request of each stage over
        the window ("role stage": seconds)."""
        now = time.time() if now is None else now
        while self.records and self.records[0]["ended"] < now - self.window:
            self.records.popleft()
        recent = list(self.records)
        totals: dict[str, float] = defaultdict(float)
        for r in recent:
            for b in r["stages"]:
                totals[f"{b['role']} {b['name']}"] += b["seconds"]
        n = len(recent)
        return {
            "window_seconds": self.window,
            "requests": n,
            "mean_seconds": round(sum(r["total_seconds"] for r in recent) / n, 6) if n else None,
            "breakdown": {k: round(v / n, 6) for k, v in sorted(totals.items())},
            "slowest": sorted(recent, key=lambda r: -r["total_seconds"])[: self.keep],
        }
