"""`epd bench connector`: the connector next to raw redis-py on the same bytes, same server.

For each entry size: put vs raw SET and get_many vs raw GET of the very same bytes (the encoded
entry), interleaved call by call so drift hits both sides alike (gets: the ratio at the
median call, and over all calls); get_many again vs a raw client reading the socket 1 MiB at a
time as the connector's does (what is left is the connector's own per-value cost); then
local-tier hits vs a plain memory copy of the same bytes. Prints one line per figure and, last,
one JSON object.

`--cluster`: the connector in cluster mode on a 3-master cluster (embedded, or `--redis-url`
naming a node of an external one) next to raw redis-py RedisCluster calls of the same bytes
(get, set, a pipeline of EXISTS for has_many), and next to the connector on a single node.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import redis
import torch

from connector import wire
from connector.client import READ_BYTES, sync_client
from connector.ec import ECConnector
from connector.embedded import EmbeddedCluster, EmbeddedRedis, redis_or_embedded

FP = "bench"


def _calls(
    baseline: Callable[[int], object], ours: Callable[[int], object], n: int
) -> tuple[list[float], list[float]]:
    """Seconds of each call of baseline(i) and ours(i), timed call by call in alternation over
    i in range(n), so that whatever the server does meanwhile (allocation, eviction) hits both
    alike."""
    spent: tuple[list[float], list[float]] = ([], [])
    for i in range(n):
        for side, fn in enumerate((baseline, ours)):
            started = time.perf_counter()
            fn(i)
            spent[side].append(time.perf_counter() - started)
    return spent


def _interleaved(
    nbytes: int, baseline: Callable[[int], object], ours: Callable[[int], object], n: int
) -> tuple[float, float]:
    """GB/s of baseline(i) and ours(i) over all their calls (see `_calls`)."""
    a, b = _calls(baseline, ours, n)
    return nbytes * n / sum(a) / 1e9, nbytes * n / sum(b) / 1e9


def _median_rates(
    nbytes: int, baseline: Callable[[int], object], ours: Callable[[int], object], n: int
) -> tuple[float, float, float, float]:
    """GB/s of baseline(i) and ours(i) over all their calls, then at their median calls. On a
    shared host a burst of other work stalls a few calls by milliseconds, whichever side they
    fall on: the totals carry that, the medians do not."""
    a, b = _calls(baseline, ours, n)
    med = statistics.median
    return (
        nbytes * n / sum(a) / 1e9,
        nbytes * n / sum(b) / 1e9,
        nbytes / med(a) / 1e9,
        nbytes / med(b) / 1e9,
    )


def bench_size(url: str, size_mib: float, rounds: int, mib_per_round: float = 64) -> dict:
    width = 2048
    rows = max(1, int(size_mib * 2**20) // (2 * width))
    tensor = torch.randn(rows, width).to(torch.bfloat16)
    value = wire.encode(tensor)
    raw = redis.Redis.from_url(url)
    # The same reads as the connector's client: what is left between them is the connector's
    # own per-value cost (decode, checksum, bookkeeping).
    raw_reads = redis.Redis.from_url(url, socket_read_size=READ_BYTES)
    ours = ECConnector(url, FP, registry=None)
    cached = ECConnector(url, FP, registry=None, local_tier_bytes=len(value) * 2)
    n = max(3, int(mib_per_round * 2**20 // len(value)))  # bytes moved per round and side

    put_raw, put_ours, get_raw, get_ours, memcpy, hit = ([] for _ in range(6))
    get_raw_reads, get_ours_again, get_raw_p50, get_ours_p50 = [], [], [], []
    raw.set("raw:get", value)
    ours.put("get", tensor)
    cached.get_many(["get"])  # into the local tier
    dst = np.empty(len(value), dtype=np.uint8)
    src = np.frombuffer(value, dtype=np.uint8)
    for r in range(rounds):
        a, b = _interleaved(
            len(value),
            lambda i, r=r: raw.set(f"raw:put:{r}:{i}", value),
            lambda i, r=r: ours.put(f"put-{r}-{i}", tensor),
            n,
        )
        put_raw.append(a)
        put_ours.append(b)
        raw.delete(*[f"raw:put:{r}:{i}" for i in range(n)])
        ours.delete([f"put-{r}-{i}" for i in range(n)])
        a, b, a50, b50 = _median_rates(
            len(value), lambda i: raw.get("raw:get"), lambda i: ours.get_many(["get"]), n
        )
        get_raw.append(a)
        get_ours.append(b)
        get_raw_p50.append(a50)
        get_ours_p50.append(b50)
        a, b, a50, b50 = _median_rates(
            len(value), lambda i: raw_reads.get("raw:get"), lambda i: ours.get_many(["get"]), n
        )
        get_raw_reads.append(a50)
        get_ours_again.append(b50)
        a, b = _interleaved(
            len(value), lambda i: np.copyto(dst, src), lambda i: cached.get_many(["get"]), n * 10
        )
        memcpy.append(a)
        hit.append(b)
    raw.delete("raw:get")
    ours.delete(["get"])
    raw_reads.close()
    med = statistics.median
    return {
        "size_mib": size_mib,
        "raw_set_gbps": med(put_raw),
        "put_gbps": med(put_ours),
        "raw_get_gbps": med(get_raw),
        "get_gbps": med(get_ours),
        "local_hit_gbps": med(hit),
        "memcpy_gbps": med(memcpy),
        "put_vs_raw_set": med(put_ours) / med(put_raw),
        # Per-call medians (robust to other work's bursts on a shared host); the totals too.
        "get_vs_raw_get": med(get_ours_p50) / med(get_raw_p50),
        "get_vs_raw_get_total": med(get_ours) / med(get_raw),
        "raw_get_same_reads_gbps": med(get_raw_reads),
        "get_vs_raw_get_same_reads": med(get_ours_again) / med(get_raw_reads),
        "local_hit_vs_memcpy": med(hit) / med(memcpy),
    }


HAS_BATCH = 32  # hashes per has_many call (a request's items, a few requests' worth)


def _has_many_rate(has: Callable[[int], object], n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        has(i)
    return n * HAS_BATCH / (time.perf_counter() - started)


def bench_cluster_size(
    cluster_url: str, single_url: str, size_mib: float, rounds: int, mib_per_round: float
) -> dict:
    width = 2048
    rows = max(1, int(size_mib * 2**20) // (2 * width))
    tensor = torch.randn(rows, width).to(torch.bfloat16)
    value = wire.encode(tensor)
    raw = sync_client(cluster_url, mode="cluster")
    ours = ECConnector(cluster_url, FP, registry=None, mode="cluster")
    single = ECConnector(single_url, FP, registry=None)
    n = max(3, int(mib_per_round * 2**20 // len(value)))
    figures: dict[str, list[float]] = {
        k: []
        for k in (
            "raw_set", "put", "raw_get", "get", "single_put", "single_get",
            "raw_exists", "has_many", "single_has_many",
        )
    }  # fmt: skip
    raw.set("raw:get", value)
    ours.put("get", tensor)
    single.put("get", tensor)
    hashes = [f"h{i}" for i in range(HAS_BATCH)]
    for h in hashes[::2]:  # half held: has_many answers both ways
        ours.put(h, torch.ones(1))
        single.put(h, torch.ones(1))
    keys = [ours.key(h) for h in hashes]

    def raw_exists(_i: int) -> None:
        pipe = raw.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        pipe.execute()

    for r in range(rounds):
        a, b = _interleaved(
            len(value),
            lambda i, r=r: raw.set(f"raw:put:{r}:{i}", value),
            lambda i, r=r: ours.put(f"put-{r}-{i}", tensor),
            n,
        )
        _, c = _interleaved(
            len(value), lambda i: None, lambda i, r=r: single.put(f"put-{r}-{i}", tensor), n
        )
        figures["raw_set"].append(a)
        figures["put"].append(b)
        figures["single_put"].append(c)
        for i in range(n):
            raw.delete(f"raw:put:{r}:{i}")
        ours.delete([f"put-{r}-{i}" for i in range(n)])
        single.delete([f"put-{r}-{i}" for i in range(n)])
        a, b = _interleaved(
            len(value), lambda i: raw.get("raw:get"), lambda i: ours.get_many(["get"]), n
        )
        _, c = _interleaved(len(value), lambda i: None, lambda i: single.get_many(["get"]), n)
        figures["raw_get"].append(a)
        figures["get"].append(b)
        figures["single_get"].append(c)
        m = 50
        figures["raw_exists"].append(_has_many_rate(raw_exists, m))
        figures["has_many"].append(_has_many_rate(lambda i: ours.has_many(hashes), m))
        figures["single_has_many"].append(_has_many_rate(lambda i: single.has_many(hashes), m))
    raw.delete("raw:get")
    ours.delete(["get", *hashes])
    single.delete(["get", *hashes])
    raw.close()
    ours.close()
    single.close()
    med = {k: statistics.median(v) for k, v in figures.items()}
    return {
        "size_mib": size_mib,
        "raw_cluster_set_gbps": med["raw_set"],
        "cluster_put_gbps": med["put"],
        "single_put_gbps": med["single_put"],
        "raw_cluster_get_gbps": med["raw_get"],
        "cluster_get_gbps": med["get"],
        "single_get_gbps": med["single_get"],
        "raw_cluster_exists_per_s": med["raw_exists"],
        "cluster_has_many_per_s": med["has_many"],
        "single_has_many_per_s": med["single_has_many"],
        "cluster_get_vs_raw_cluster_get": med["get"] / med["raw_get"],
        "cluster_put_vs_raw_cluster_set": med["put"] / med["raw_set"],
        "cluster_has_many_vs_raw_exists": med["has_many"] / med["raw_exists"],
        "cluster_get_vs_single_get": med["get"] / med["single_get"],
    }


def run_cluster(args: argparse.Namespace) -> int:
    sizes = [float(s) for s in args.sizes.split(",")]
    cluster = None if args.redis_url else EmbeddedCluster(masters=3).start()
    single = EmbeddedRedis().start()
    try:
        url = args.redis_url or cluster.url
        results = []
        for size in sizes:
            r = bench_cluster_size(url, single.url, size, args.rounds, args.mib_per_round)
            results.append(r)
            print(
                f"{size:g} MiB  cluster get {r['cluster_get_gbps']:.2f} GB/s vs raw cluster GET "
                f"{r['raw_cluster_get_gbps']:.2f} ({r['cluster_get_vs_raw_cluster_get']:.2f}x), "
                f"single node {r['single_get_gbps']:.2f}   put {r['cluster_put_gbps']:.2f} vs "
                f"raw SET {r['raw_cluster_set_gbps']:.2f} "
                f"({r['cluster_put_vs_raw_cluster_set']:.2f}x), single {r['single_put_gbps']:.2f}"
                f"   has_many {r['cluster_has_many_per_s']:.0f}/s vs raw EXISTS pipeline "
                f"{r['raw_cluster_exists_per_s']:.0f}/s, single {r['single_has_many_per_s']:.0f}/s",
                flush=True,
            )
    finally:
        single.stop()
        if cluster is not None:
            cluster.stop()

    def per_size(key: str, digits: int = 3) -> dict:
        return {f"{r['size_mib']:g}MiB": round(r[key], digits) for r in results}

    print(
        json.dumps(
            {
                "bench": "connector-cluster",
                "server": "external cluster" if args.redis_url else "embedded valkey, 3 masters",
                "cluster_get_vs_raw_cluster_get": per_size("cluster_get_vs_raw_cluster_get"),
                "cluster_put_vs_raw_cluster_set": per_size("cluster_put_vs_raw_cluster_set"),
                "cluster_has_many_vs_raw_exists": per_size("cluster_has_many_vs_raw_exists"),
                "cluster_get_vs_single_get": per_size("cluster_get_vs_single_get"),
                "results": results,
            }
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.cluster:
        return run_cluster(args)
    sizes = [float(s) for s in args.sizes.split(",")]
    with redis_or_embedded(args.redis_url) as (url, server):
        results = []
        for size in sizes:
            r = bench_size(url, size, args.rounds, args.mib_per_round)
            results.append(r)
            print(
                f"{size:g} MiB  put {r['put_gbps']:.2f} GB/s vs raw SET {r['raw_set_gbps']:.2f}"
                f" ({r['put_vs_raw_set']:.2f}x)   get {r['get_gbps']:.2f} GB/s vs raw GET "
                f"{r['raw_get_gbps']:.2f} ({r['get_vs_raw_get']:.2f}x at the median call, "
                f"{r['get_vs_raw_get_total']:.2f}x over all calls; "
                f"{r['get_vs_raw_get_same_reads']:.2f}x one reading 1 MiB at a time)   local hit "
                f"{r['local_hit_gbps']:.1f} GB/s vs memcpy {r['memcpy_gbps']:.1f}"
                f" ({r['local_hit_vs_memcpy']:.1f}x)",
                flush=True,
            )
    summary = {
        "bench": "connector",
        "server": server,
        "get_vs_raw_get": {f"{r['size_mib']:g}MiB": round(r["get_vs_raw_get"], 3) for r in results},
        "get_vs_raw_get_total": {
            f"{r['size_mib']:g}MiB": round(r["get_vs_raw_get_total"], 3) for r in results
        },
        "get_vs_raw_get_same_reads": {
            f"{r['size_mib']:g}MiB": round(r["get_vs_raw_get_same_reads"], 3) for r in results
        },
        "put_vs_raw_set": {f"{r['size_mib']:g}MiB": round(r["put_vs_raw_set"], 3) for r in results},
        "local_hit_vs_memcpy": {
            f"{r['size_mib']:g}MiB": round(r["local_hit_vs_memcpy"], 2) for r in results
        },
        "results": results,
    }
    print(json.dumps(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("connector", help="connector put/get vs raw redis-py, local tier vs memcpy")
    p.add_argument("--redis-url", help="benchmark this Redis (default: an embedded one)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="cluster mode on a 3-master cluster (or the cluster --redis-url names) vs raw "
        "redis-py cluster calls and vs a single node",
    )
    p.add_argument("--sizes", default="0.25,4,16", help="entry sizes in MiB (default 0.25,4,16)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported")
    p.add_argument("--mib-per-round", type=float, default=64, help="data moved per round and side")
    p.set_defaults(func=run)
