"""The proxy's health dashboard: `GET /dashboard` (one page, everything inline, nothing fetched
from anywhere but this proxy) and `GET /dashboard/state` (the same data as JSON, for scripts).

Once a second a sampler reads what the proxy already keeps (its Prometheus counters through
their public `collect()`, the workers' last GetLoad answers, `Proxy.pending`) and appends one
sample to a ring buffer of `HISTORY_SECONDS`; every other second it asks Redis for `INFO memory`,
`INFO stats` and `DBSIZE` (a poll that gets no answer counts against the store's health, as
the proxy's own store operations do: connector/health.py). Time to first token and
inter-token latency percentiles come from the raw values the proxy observes (ProxyMetrics'
latency windows: the last minute, bounded).
Everything is bounded: an hour of traffic or 50 workers cost what 15 minutes and 3 do.

`GET /dashboard/state[?since=T]` (T: unix seconds; history after T only, what the page polls):

    {
      "version": 1, "time": 1760000000.5, "started": 1759999000.0,
      "proxy": {"model": "tiny", "serving": true, "status": "healthy" | "degraded" |
                "unavailable", "pending_requests": 0, "max_pending_requests": 1024},
      "roles": {"encoder": {"workers": 2, "up": 2, "status": "healthy"}, "lm": {...}},
      "workers": [{"role": "encoder" | "lm", "address": "10.0.0.5:50061",
                   "source": "static" | "registry",
                   "health": "SERVING" | "NOT_SERVING" | "UNREACHABLE" | "UNKNOWN",
                   "circuit": "closed" | "open" | "half-open",
                   "queued": 0,          # items (encoder) / waiting requests (LM), as reported
                   "queued_tokens": 0,   # max(reported, sent by the proxy and not finished)
                   "outstanding": 0, "state_seconds": 12.5,  # time in the current health
                   "last_error": "",
                   "load": null | {encoder: queued_items, queued_tokens, running_items,
                                   items_per_second, busy_fraction, batch_items;
                                   lm: running_requests, waiting_requests, running_tokens,
                                   waiting_tokens, kv_blocks_used, kv_blocks_total, kv_usage,
                                   tokens_per_second, waiting_for_embeddings, batch_size,
                                   ec_local_hits, ec_local_misses, ec_redis_hits,
                                   ec_redis_misses, role; with a KV tier also kv_tier,
                                   kv_bytes_sent, kv_blocks_pulled, kv_blocks_corrupt,
                                   kv_address, kv_transfer_p50_seconds,
                                   kv_transfer_p99_seconds}}],
      "cache": {
        "tiers": {"proxy": {"hits": 1, "misses": 1, "hit_rate": 0.5},      # has-check
                  "lm_local": {...}, "redis": {...}},    # LM workers' fetches (null rate: none)
        "items": {"held": 1, "encoded": 1, "deduplicated": 0}, "reencodes": 0,
        "redis": {"reachable": true, "used_memory_bytes": 1048576, "maxmemory_bytes": 0,
                  "maxmemory_policy": "noeviction", "evicted_keys": 0, "expired_keys": 0,
                  "keys": 3, "error": "", "checked": 1760000000.0},
        "store": {"answering": true, "since": 1760000000.0,   # the proxy's view of Redis:
                  "error": "", "deadline_seconds": 3.0}},     # not answering: image requests
                                                              # fail at once (503)
      "traffic": {"requests_total": 10, "requests_per_second": 0.4,   # mean of the last 10 s
                  "recent_seconds": 300,
                  "by_status": [{"api": "grpc", "status": "OK", "error": false,
                                 "total": 9, "recent": 9}],
                  "latency_window_seconds": 60,
                  "ttft": {"count": 9, "p50": 0.08, "p95": 0.2, "p99": 0.2},  # seconds
                  "itl": {...}},
      "history": {"interval_seconds": 1.0, "capacity": 900, "t": [1760000000.0, ...],
                  "series": {name: [value | null, ...] for name in SERIES}},
      "timeline": {"window_seconds": 60, "requests": 12, "mean_seconds": 0.4,  # proxy/timeline.py
                   "breakdown": {"proxy encode": 0.1, "lm prefill": 0.05, ...},  # s / request
                   "slowest": [{"request_id": "req-...", "ended": 1760000000.0,
                                "total_seconds": 0.9, "ok": true,
                                "stages": [{"name": "validate", "role": "proxy",
                                            "start": 0.0, "seconds": 0.002}, ...]}]},
      "planner": {"decision": null | {"desired": 2, "recommended": 2, "need": 1.43,  # encoders
                                      "serving": 1, "work": 1.0, "items_per_second": 5.1,
                                      "seconds_per_item": 0.196, "queued_items": 3,  # see
                                      "running_items": 1, "backlog_seconds": 0.78},  # planner.py
                  "target_utilisation": 0.7, "wait_slo_seconds": 1.0,
                  "scale_down_seconds": 60.0, "min": 1, "max": 8}
    }

Until the proxy has loaded, "proxy" is {"model": "", "serving": false, "status": "starting"} and
"roles", "workers", "cache" and "traffic" are empty. Percentiles and hit rates are null while
there is nothing to compute them from.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from aiohttp import web

from connector.client import store_stats
from connector.registry import restarts_key
from proxy.core import Proxy
from proxy.workers import Worker, overall_status

logger = logging.getLogger(__name__)

HISTORY_SECONDS = 900  # per-second samples kept (15 minutes)
RECENT_SECONDS = 300  # the "recent" column of requests by status
REDIS_POLL_TICKS = 2  # Redis INFO every this many samples
REDIS_TIMEOUT = 2.0
PAGE = Path(__file__).parent / "static" / "dashboard.html"

# One value per sample and name; null where there was nothing to measure.
SERIES = (
    "rps",  # requests finished per second
    "errors",  # of those, failed ones (status not OK / 200)
    "pending",  # requests in flight in the proxy
    "ttft_p50",  # seconds, over the trailing latency window
    "ttft_p95",
    "ttft_p99",
    "itl_p50",  # the same for inter-token latency
    "itl_p95",
    "itl_p99",
    "held",  # media items per second by what the proxy did with them
    "encoded",
    "deduplicated",
    "kv_usage",  # KV blocks used / total, over the LM workers that are up
    "lm_batch",  # mean requests per step, LM workers that are up
    "kv_sent",  # KV bytes per second into / out of the KV tier, summed over the LM workers
    "kv_received",
    "kv_transfer_p50",  # seconds, the slowest LM worker's recent KV transfers
    "kv_transfer_p99",
    "prefill_queue",  # waiting requests on prefill-role / decode-role LM workers
    "decode_queue",
    "encoder_busy",  # mean tower busy fraction, encoders that are up
    "encoder_batch",  # mean items per forward, encoders that are up
    "encoders_desired",  # the encoder planner's answer (proxy/planner.py)
    "encoders_up",  # encoders SERVING
    "workers_up",
)
OK_STATUSES = frozenset({"OK", "200"})
ENCODER_LOAD = (
    "queued_items",
    "queued_tokens",
    "running_items",
    "items_per_second",
    "busy_fraction",
    "batch_items",
)
LM_LOAD = (
    "running_requests",
    "waiting_requests",
    "running_tokens",
    "waiting_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "tokens_per_second",
    "waiting_for_embeddings",
    "batch_size",
    "ec_local_hits",
    "ec_local_misses",
    "ec_redis_hits",
    "ec_redis_misses",
    "role",
)
# An LM worker's KV tier, shown only where it has one (lm.kv_connector shared or direct).
KV_LOAD = (
    "kv_tier",
    "kv_bytes_sent",
    "kv_blocks_pulled",
    "kv_blocks_corrupt",
    "kv_address",
    "kv_transfer_p50_seconds",
    "kv_transfer_p99_seconds",
)


def _r(x: float | None) -> float | None:
    """Four significant digits: plenty for a plot, and a short JSON."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.4g}")


def _rounded(percentiles: dict[str, Any]) -> dict[str, Any]:
    return {k: v if k == "count" else _r(v) for k, v in percentiles.items()}


def _rate(hits: float, misses: float) -> float | None:
    total = hits + misses
    return _r(hits / total) if total else None


def _counts(metric) -> dict[tuple[str, ...], float]:
    """A Prometheus counter's values by label values, read in-process (no text parsing)."""
    return {
        tuple(s.labels.values()): s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


class History:
    """Per-second samples in a ring buffer of `capacity`, handed out column by column."""

    def __init__(self, capacity: int = HISTORY_SECONDS):
        self.capacity = capacity
        self.samples: deque[tuple] = deque(maxlen=capacity)  # (t, *values in SERIES order)

    def add(self, t: float, values: dict[str, float | None]) -> None:
        self.samples.append((t, *(_r(values.get(name)) for name in SERIES)))

    def last(self, name: str, n: int) -> Iterator[float]:
        """The last `n` non-null values of one series."""
        i = 1 + SERIES.index(name)
        tail = list(self.samples)[-n:]
        return (s[i] for s in tail if s[i] is not None)

    def columns(self, since: float | None = None, interval: float = 1.0) -> dict:
        rows = [s for s in self.samples if since is None or s[0] > since]
        cols = list(zip(*rows, strict=True)) if rows else [()] * (1 + len(SERIES))
        return {
            "interval_seconds": interval,
            "capacity": self.capacity,
            "t": [round(t, 1) for t in cols[0]],
            "series": {name: list(cols[1 + i]) for i, name in enumerate(SERIES)},
        }


class Dashboard:
    """The sampler and the state builder over one proxy (`proxy`: None until it has loaded)."""

    def __init__(
        self,
        proxy: Proxy | None = None,
        serving: Callable[[], bool] = lambda: True,
        interval: float = 1.0,
        history_seconds: int = HISTORY_SECONDS,
    ):
        self.proxy = proxy
        self.serving = serving
        self.interval = interval
        self.started = time.time()
        self.history = History(history_seconds)
        self.redis_info: dict[str, Any] = {"reachable": False, "error": "not checked yet"}
        # Role name -> {"restarts", "last", "reason", "backed_off", "until", ...}: what `epd up`'s
        # supervisor did (connector.registry.restarts_key).
        self.restarts: dict[str, dict[str, Any]] = {}
        self._last: dict[str, Any] | None = None  # counters at the previous sample
        self._recent: deque[tuple[float, dict]] = deque(maxlen=RECENT_SECONDS)
        self._ticks = 0

    # -- sampling -----------------------------------------------------------------------------

    def _counters(self, proxy: Proxy) -> dict[str, Any]:
        m = proxy.metrics
        return {
            "requests": _counts(m.requests),  # (api, status) -> total
            "items": {k[0]: v for k, v in _counts(m.mm_items).items()},  # result -> total
            "reencodes": sum(_counts(m.reencodes).values()),
            "kv": _kv_totals(proxy),
        }

    def sample(self, now: float | None = None) -> None:
        """Append one sample (rates since the previous one) to the history."""
        proxy = self.proxy
        if proxy is None:
            return
        now = time.time() if now is None else now
        counters = self._counters(proxy)
        last, self._last = self._last, {**counters, "t": now}
        if last is None:  # the first sample is the baseline
            return
        dt = max(now - last["t"], 1e-3)
        deltas = {
            k: v - last["requests"].get(k, 0.0)
            for k, v in counters["requests"].items()
            if v != last["requests"].get(k, 0.0)
        }
        if deltas:
            self._recent.append((now, deltas))
        errors = sum(v for (_, status), v in deltas.items() if status not in OK_STATUSES)
        values: dict[str, float | None] = {
            "rps": sum(deltas.values()) / dt,
            "errors": errors / dt,
            "pending": proxy.pending,
        }
        windows = (("ttft", proxy.metrics.ttft_window), ("itl", proxy.metrics.itl_window))
        for name, window in windows:
            p = window.percentiles(now)
            for q in ("p50", "p95", "p99"):
                values[f"{name}_{q}"] = _r(p[q])
        for result in ("held", "encoded", "deduplicated"):
            values[result] = (
                counters["items"].get(result, 0.0) - last["items"].get(result, 0.0)
            ) / dt
        lms = [w.load for w in proxy.lms.workers.values() if w.up and w.load is not None]
        encoders = [w.load for w in proxy.encoders.workers.values() if w.up and w.load is not None]
        kv_total = sum(x.kv_blocks_total for x in lms)
        values["kv_usage"] = sum(x.kv_blocks_used for x in lms) / kv_total if kv_total else None
        values["lm_batch"] = _mean(x.batch_size for x in lms)
        for name in ("sent", "received"):
            moved = counters["kv"][name] - last["kv"][name]
            values[f"kv_{name}"] = max(moved, 0) / dt  # a restarted worker counts from 0
        tiered = [x for x in lms if x.kv_tier not in ("", "none")]
        for q in ("p50", "p99"):
            values[f"kv_transfer_{q}"] = max(
                (getattr(x, f"kv_transfer_{q}_seconds") for x in tiered), default=None
            )
        for role in ("prefill", "decode"):
            values[f"{role}_queue"] = sum(x.waiting_requests for x in lms if x.role == role)
        values["encoder_busy"] = _mean(x.busy_fraction for x in encoders)
        values["encoder_batch"] = _mean(x.batch_items for x in encoders)
        plan = proxy.planner.last
        values["encoders_desired"] = plan.desired if plan is not None else None
        values["encoders_up"] = sum(w.up for w in proxy.encoders.workers.values())
        values["workers_up"] = sum(
            w.up for pool in (proxy.encoders, proxy.lms) for w in pool.workers.values()
        )
        self.history.add(round(now, 1), values)

    async def poll_redis(self) -> None:
        """Redis memory, evictions and key count through the proxy's own client."""
        proxy = self.proxy
        if proxy is None:
            return
        started = time.monotonic()
        try:
            async with asyncio.timeout(REDIS_TIMEOUT):
                memory, stats, keys = await store_stats(proxy.redis)
                restarts = await proxy.redis.hgetall(restarts_key(proxy.config.connector.namespace))
        except (redis.RedisError, OSError, TimeoutError, ValueError) as e:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self.redis_info = {**self.redis_info, "reachable": False, "error": error}
            # NOTE: a cluster's INFO asks every master, and one lost master (its entries are
            # misses until its replica takes over) is not a store that does not answer.
            lost = (redis.ConnectionError, redis.TimeoutError, OSError, TimeoutError)
            if isinstance(e, lost) and proxy.config.connector.mode == "standalone":
                proxy.connector.unanswered(started, f"INFO: {error}")
            return
        proxy.connector.answered()
        self.redis_info = {
            "reachable": True,
            "used_memory_bytes": int(memory.get("used_memory", 0)),
            "maxmemory_bytes": int(memory.get("maxmemory", 0)),
            "maxmemory_policy": str(memory.get("maxmemory_policy", "")),
            "evicted_keys": int(stats.get("evicted_keys", 0)),
            "expired_keys": int(stats.get("expired_keys", 0)),
            "keys": int(keys),
            "error": "",
            "checked": round(time.time(), 1),
        }
        self.restarts = {}
        for name, value in sorted(restarts.items()):
            name = name.decode() if isinstance(name, bytes) else name
            try:
                self.restarts[name] = json.loads(value)
            except ValueError:
                continue  # not ours

    async def run(self) -> None:
        """Sample every `interval` seconds, on the second; Redis every REDIS_POLL_TICKS."""
        redis_task: asyncio.Task | None = None
        try:
            while self.proxy is None:
                await asyncio.sleep(0.05)
            while True:
                try:
                    self.sample()
                except Exception:  # a dashboard must never take the proxy's loop down
                    logger.exception("dashboard sample failed")
                idle = redis_task is None or redis_task.done()
                if self._ticks % REDIS_POLL_TICKS == 0 and idle:
                    redis_task = asyncio.create_task(self.poll_redis(), name="dashboard-redis")
                self._ticks += 1
                await asyncio.sleep(self.interval - time.time() % self.interval)
        finally:
            if redis_task is not None:
                redis_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await redis_task

    # -- the state ----------------------------------------------------------------------------

    def state(self, since: float | None = None, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        proxy = self.proxy
        state: dict[str, Any] = {
            "version": 1,
            "time": round(now, 3),
            "started": round(self.started, 3),
            "proxy": {"model": "", "serving": False, "status": "starting"},
            "roles": {},
            "workers": [],
            "cache": {},
            "traffic": {},
            "history": self.history.columns(since, self.interval),
            "restarts": self.restarts,
        }
        if proxy is None:
            return state
        pools = (proxy.encoders, proxy.lms)
        state["roles"] = {
            p.role: {
                "workers": len(p.workers),
                "up": sum(w.up for w in p.workers.values()),
                "status": p.summary(),
            }
            for p in pools
        }
        state["proxy"] = {
            "model": proxy.served.name,
            "serving": bool(self.serving()),
            "status": overall_status(proxy.lms, proxy.encoders),
            "pending_requests": proxy.pending,
            "max_pending_requests": proxy.config.proxy.max_pending_requests,
        }
        workers = sorted(
            (w for p in pools for w in p.workers.values()), key=lambda w: (w.role, w.address)
        )
        state["workers"] = [_worker(w, now) for w in workers]
        state["cache"] = self._cache(proxy)
        state["traffic"] = self._traffic(proxy, now)
        state["timeline"] = proxy.timeline.state(now)
        state["planner"] = _planner(proxy)
        return state

    def _cache(self, proxy: Proxy) -> dict[str, Any]:
        counters = self._counters(proxy)
        items = {k: int(counters["items"].get(k, 0)) for k in ("held", "encoded", "deduplicated")}
        loads = [w.load for w in proxy.lms.workers.values() if w.load is not None]
        tier = {}
        for name in ("local", "redis"):
            hits = sum(getattr(x, f"ec_{name}_hits") for x in loads)
            misses = sum(getattr(x, f"ec_{name}_misses") for x in loads)
            tier[name] = {"hits": hits, "misses": misses, "hit_rate": _rate(hits, misses)}
        held, not_held = items["held"], items["encoded"] + items["deduplicated"]
        proxy_tier = {"hits": held, "misses": not_held, "hit_rate": _rate(held, not_held)}
        return {
            "tiers": {"proxy": proxy_tier, "lm_local": tier["local"], "redis": tier["redis"]},
            "items": items,
            "reencodes": int(counters["reencodes"]),
            "redis": self.redis_info,
            "store": proxy.connector.health.state(),
        }

    def _traffic(self, proxy: Proxy, now: float) -> dict[str, Any]:
        totals = _counts(proxy.metrics.requests)
        recent: dict[tuple[str, ...], float] = {}
        for t, deltas in self._recent:
            if t >= now - RECENT_SECONDS:
                for k, v in deltas.items():
                    recent[k] = recent.get(k, 0.0) + v
        by_status = [
            {
                "api": api,
                "status": status,
                "error": status not in OK_STATUSES,
                "total": int(total),
                "recent": int(recent.get((api, status), 0)),
            }
            for (api, status), total in sorted(totals.items())
        ]
        return {
            "requests_total": int(sum(totals.values())),
            "requests_per_second": _r(_mean(self.history.last("rps", 10)) or 0.0),
            "recent_seconds": RECENT_SECONDS,
            "by_status": by_status,
            "latency_window_seconds": proxy.metrics.ttft_window.window,
            "ttft": _rounded(proxy.metrics.ttft_window.percentiles(now)),
            "itl": _rounded(proxy.metrics.itl_window.percentiles(now)),
            "realtime": self._realtime(proxy, now),
        }

    def _realtime(self, proxy: Proxy, now: float) -> dict[str, Any]:
        """Realtime sessions: open, audio in, LM steps that waited for audio, per-chunk
        latency (a chunk received -> the first delta covering it sent)."""
        m = proxy.metrics
        loads = [w.load for w in proxy.lms.workers.values() if w.load is not None]
        return {
            "sessions_open": len(proxy.realtime.sessions),
            "audio_seconds": _r(proxy.realtime.audio_seconds),
            "waiting_steps": int(sum(x.realtime_waiting_steps for x in loads)),
            "chunk_latency": _rounded(m.chunk_window.percentiles(now)),
        }

    # -- HTTP ---------------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=PAGE.read_bytes(),
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-store"},
        )

    async def state_handler(self, request: web.Request) -> web.Response:
        since = request.query.get("since")
        try:
            since_t = float(since) if since else None
        except ValueError:
            return web.json_response(
                {"error": f"since must be unix seconds, got {since!r}"}, status=400
            )
        return web.json_response(self.state(since_t), headers={"Cache-Control": "no-store"})


def _planner(proxy: Proxy) -> dict[str, Any]:
    """The encoder planner's last decision and its settings."""
    p = proxy.config.proxy
    last = proxy.planner.last
    return {
        "decision": None if last is None else dataclasses.asdict(last),
        "target_utilisation": p.encoder_target_utilisation,
        "wait_slo_seconds": p.encoder_wait_slo_seconds,
        "scale_down_seconds": p.encoder_scale_down_seconds,
        "min": p.encoders_min,
        "max": p.encoders_max,
    }


def _kv_totals(proxy: Proxy) -> dict[str, int]:
    """KV bytes the LM workers that are up sent to / received from the KV tier so far."""
    loads = [w.load for w in proxy.lms.workers.values() if w.up and w.load is not None]
    return {
        "sent": sum(x.kv_bytes_sent for x in loads),
        "received": sum(x.kv_bytes_received for x in loads),
    }


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _worker(w: Worker, now: float) -> dict[str, Any]:
    load = None
    queued = 0
    if w.load is not None:
        names = ENCODER_LOAD if w.role == "encoder" else LM_LOAD
        if w.role == "lm" and w.load.kv_tier not in ("", "none"):
            names = LM_LOAD + KV_LOAD
        values = {name: getattr(w.load, name) for name in names}
        load = {k: v if isinstance(v, (int, str)) else _r(v) for k, v in values.items()}
        if w.role == "lm":
            total = w.load.kv_blocks_total
            load["kv_usage"] = _r(w.load.kv_blocks_used / total) if total else None
            queued = w.load.waiting_requests
        else:
            queued = w.load.queued_items
    return {
        "role": w.role,
        "address": w.address,
        "source": w.source,
        "health": w.status,
        "circuit": w.breaker.state.value,
        "queued": queued,
        "queued_tokens": w.queued_tokens(),
        "outstanding": w.outstanding,
        "state_seconds": round(max(now - w.since, 0.0), 1),
        "last_error": w.last_error,
        "load": load,
    }


def add_dashboard(
    app: web.Application, serving: Callable[[], bool], proxy: Proxy | None = None
) -> Dashboard:
    """Register GET /dashboard and GET /dashboard/state on `app`; the sampler runs while the
    app does. Set the dashboard's `proxy` once it has loaded."""
    dashboard = Dashboard(proxy, serving)
    app.router.add_get("/dashboard", dashboard.page)
    app.router.add_get("/dashboard/state", dashboard.state_handler)

    async def sampler(app: web.Application):
        task = asyncio.create_task(dashboard.run(), name="dashboard-sampler")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(sampler)
    return dashboard
