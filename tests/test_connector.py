"""The EC connector against a real Redis-compatible server (the embedded valkey-server)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from connector import AsyncECConnector, ConnectorError, ECConnector, EmbeddedRedis, wire
from connector.client import sync_client
from connector.local_tier import LocalTier
from tests.helpers import wait_until_async

FP = "fp0123abcd"


def make(url: str, **kwargs) -> tuple[ECConnector, CollectorRegistry]:
    registry = CollectorRegistry()
    return ECConnector(url, FP, registry=registry, **kwargs), registry


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def ec(redis_server):
    connector, registry = make(redis_server.url, local_tier_bytes=64 << 20)
    connector.registry = registry
    yield connector
    connector.close()


# -- wire format ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 16), (257, 2048 + 3), (4,), (2, 3, 5)])
def test_round_trip_keeps_dtype_shape_and_bits(ec, dtype, shape):
    tensor = torch.randn(shape).to(dtype)
    assert ec.put("item", tensor).stored
    ec.local.clear()  # fetch from Redis, not from the local tier
    found, misses = ec.get_many(["item"])
    assert misses == []
    assert found["item"].dtype == dtype and found["item"].shape == tensor.shape
    assert torch.equal(found["item"].view(torch.uint8), tensor.view(torch.uint8))


def test_embeddings_wider_than_hidden_keep_their_width(ec):
    # EVS appends position channels: the entry records its own width.
    tensor = torch.randn(100, 2048 + 4, dtype=torch.bfloat16)
    ec.put("evs", tensor)
    ec.local.clear()
    assert ec.get_many(["evs"])[0]["evs"].shape == (100, 2052)


def test_decode_is_zero_copy_and_header_is_fixed():
    value = wire.encode(torch.arange(6, dtype=torch.float32).view(2, 3))
    assert len(value) == wire.HEADER_BYTES + 24
    tensor = wire.decode(value)
    # A view into the bytes object itself (CPython keeps a bytes object's data inline).
    assert id(value) < tensor.untyped_storage().data_ptr() < id(value) + sys.getsizeof(value)
    assert tensor.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda v: b"JUNK" + v[4:], "bad magic"),
        (lambda v: v[:4] + bytes([9]) + v[5:], "format version"),
        (lambda v: v[:-1], "length mismatch"),
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum"),
        (lambda v: v[:10], "shorter than"),
    ],
)
def test_wire_rejects_corruption(mangle, reason):
    value = wire.encode(torch.randn(8, 8))
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(mangle(value))


# -- operations -------------------------------------------------------------------------------


def test_key_schema_namespace_fingerprint_and_hash_tag(redis_server):
    a = ECConnector(redis_server.url, "model-a", namespace="prod", registry=None)
    b = ECConnector(redis_server.url, "model-b", namespace="prod", registry=None)
    assert a.key("abc") == "prod:ec:model-a:{abc}"
    a.put("abc", torch.ones(2))
    # Another model (or dtype) never sees model-a's entries.
    assert b.has_many(["abc"]) == [False]
    with pytest.raises(ValueError, match="mm_hash"):
        a.key("bad:hash{}")


def test_put_is_set_if_absent_with_ttl(ec, redis_server):
    first, second = torch.zeros(4), torch.ones(4)
    assert ec.put("h", first).stored is True
    assert ec.put("h", second).stored is False
    ec.local.clear()
    assert torch.equal(ec.get_many(["h"])[0]["h"], first)
    raw = redis.Redis.from_url(redis_server.url)
    assert 3500 < raw.ttl(ec.key("h")) <= 3600
    assert sample(ec.registry, "epd_ec_puts_total", result="held") == 1


def test_concurrent_writers_store_once(redis_server):
    # Eight encoders, each with its own connection, race to publish the same item.
    connectors = [make(redis_server.url)[0] for _ in range(8)]
    start = threading.Barrier(len(connectors))
    outcomes: dict[int, bool] = {}

    def race(i: int) -> None:
        start.wait()
        outcomes[i] = connectors[i].put("raced", torch.full((1024, 256), float(i))).stored

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(connectors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, stored in outcomes.items() if stored]
    assert len(winners) == 1 and len(outcomes) == 8
    fetched = connectors[0].get_many(["raced"])[0]["raced"]
    assert torch.all(fetched == float(winners[0]))


def test_has_many_and_get_many_report_misses(ec):
    ec.put("a", torch.ones(3))
    ec.put("c", torch.ones(3) * 3)
    assert ec.has_many(["a", "b", "c"]) == [True, False, True]
    found, misses = ec.get_many(["a", "b", "c"])
    assert set(found) == {"a", "c"} and misses == ["b"]


def test_ttl_expiry_is_a_miss(redis_server):
    connector, _ = make(redis_server.url, ttl_seconds=1)
    connector.put("short", torch.ones(2))
    assert connector.has_many(["short"]) == [True]
    time.sleep(1.5)
    assert connector.get_many(["short"]) == ({}, ["short"])


def test_eviction_under_maxmemory_is_a_miss_not_an_error():
    with EmbeddedRedis(maxmemory="6mb", maxmemory_policy="allkeys-lru") as server:
        connector, registry = make(server.url)
        hashes = [f"item{i}" for i in range(16)]
        for h in hashes:
            assert connector.put(h, torch.randn(256, 1024)).stored  # 1 MiB each
        found, misses = connector.get_many(hashes)
        assert misses, "maxmemory should have evicted the oldest entries"
        assert "item15" in found
        assert sample(registry, "epd_ec_redis_errors_total", kind="response") == 0


def test_delete(ec):
    ec.put("gone", torch.ones(2))
    assert ec.delete(["gone", "never"]) == 1
    assert ec.get_many(["gone"]) == ({}, ["gone"])


# -- corruption and failures ------------------------------------------------------------------


def test_corrupt_value_is_counted_deleted_and_a_miss(ec, redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    good = wire.encode(torch.ones(16))
    raw.set(ec.key("bad-magic"), b"not an embedding at all, not even close to one...." * 2)
    raw.set(ec.key("bit-flip"), good[:-1] + bytes([good[-1] ^ 0x40]))
    raw.set(ec.key("truncated"), good[:-4])
    ec.put("fine", torch.ones(16))
    ec.local.clear()
    found, misses = ec.get_many(["bad-magic", "bit-flip", "truncated", "fine"])
    assert list(found) == ["fine"]
    assert misses == ["bad-magic", "bit-flip", "truncated"]
    assert sample(ec.registry, "epd_ec_corrupt_entries_total") == 3
    assert raw.exists(ec.key("bad-magic"), ec.key("bit-flip"), ec.key("truncated")) == 0


def test_server_restart_reconnects_and_lost_entries_are_misses():
    server = EmbeddedRedis().start()
    connector, registry = make(server.url, retries=2)
    try:
        connector.put("before", torch.ones(4))
        port = server.port
        server.stop()
        with pytest.raises(ConnectorError, match=rf"127\.0\.0\.1:{port}/0 is unreachable"):
            connector.get_many(["before"])
        assert sample(registry, "epd_ec_redis_errors_total", kind="connection") >= 1

        server = EmbeddedRedis(port=port).start()
        assert connector.get_many(["before"]) == ({}, ["before"])  # lost with the restart
        assert connector.put("after", torch.ones(4)).stored
        assert connector.has_many(["after"]) == [True]
    finally:
        server.stop()


def test_unreachable_error_names_url_without_password():
    connector, _ = make("redis://epd:hunter2@127.0.0.1:1/0", retries=1, op_timeout=0.5)
    with pytest.raises(ConnectorError) as info:
        connector.has_many(["x"])
    assert "redis://epd:***@127.0.0.1:1/0 is unreachable" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_tls_and_acl_user_urls_are_passed_through():
    client = sync_client("rediss://reader:s3cret@cache.example:6380/2?ssl_cert_reqs=none")
    pool = client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["username"] == "reader"
    assert pool.connection_kwargs["password"] == "s3cret"
    assert pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["host"] == "cache.example"


def test_acl_user_authenticates_against_a_real_server(redis_server):
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser(
        "encoder",
        enabled=True,
        passwords=["+pw-123"],
        keys=["epd:*"],
        channels=["epd:*"],
        commands=["+@all"],
    )
    url = redis_server.url.replace("redis://", "redis://encoder:pw-123@")
    connector, _ = make(url)
    assert connector.put("acl", torch.ones(2)).stored
    wrong, _ = make(url.replace("pw-123", "nope"), retries=0)
    with pytest.raises(ConnectorError, match="encoder:\\*\\*\\*@"):
        wrong.has_many(["acl"])


# -- wait_for ---------------------------------------------------------------------------------

PUBLISH_LATER = (
    "import sys, time, torch; from connector import ECConnector\n"
    "c = ECConnector(sys.argv[1], sys.argv[2], registry=None)\n"
    "time.sleep(float(sys.argv[3]))\n"
    "for h in sys.argv[4:]:\n"
    "    c.put(h, torch.ones(8))\n"
)


def publish_later(url: str, delay: float, *hashes: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PUBLISH_LATER, url, FP, str(delay), *hashes])


def test_wait_for_is_woken_by_a_publish_from_another_process(ec, redis_server):
    ec.put("already", torch.ones(1))
    publisher = publish_later(redis_server.url, 1.0, "late-1", "late-2")
    started = time.monotonic()
    missing = ec.wait_for(["already", "late-1", "late-2"], timeout=30)
    elapsed = time.monotonic() - started
    publisher.wait(30)
    assert missing == set()
    assert elapsed < 20, "woken by the notification, well before the timeout"
    assert sample(ec.registry, "epd_ec_notifications_total") >= 2


def test_wait_for_times_out_cleanly(ec):
    started = time.monotonic()
    assert ec.wait_for(["never"], timeout=0.3) == {"never"}
    assert 0.3 <= time.monotonic() - started < 5


async def test_async_flavour_round_trip_and_shared_subscription(redis_server):
    connector = AsyncECConnector(
        redis_server.url, FP, registry=CollectorRegistry(), local_tier_bytes=1 << 20
    )
    raw = redis.Redis.from_url(redis_server.url)
    try:
        assert (await connector.put("x", torch.ones(4, dtype=torch.bfloat16))).stored
        assert await connector.has_many(["x", "y"]) == [True, False]
        found, misses = await connector.get_many(["x", "y"])
        assert found["x"].dtype == torch.bfloat16 and misses == ["y"]

        # Ten requests wait on different items: one subscription serves them all.
        waits = [asyncio.create_task(connector.wait_for([f"w{i}"], 30)) for i in range(10)]
        while raw.pubsub_numsub(connector.sync.channel)[0][1] == 0:
            await asyncio.sleep(0.01)
        assert raw.pubsub_numsub(connector.sync.channel)[0][1] == 1
        publisher = publish_later(redis_server.url, 0.2, *[f"w{i}" for i in range(10)])
        assert await asyncio.gather(*waits) == [set()] * 10
        publisher.wait(30)
        assert await connector.wait_for(["nope"], 0.2) == {"nope"}
    finally:
        await connector.close()


async def test_async_waiters_recheck_after_the_subscription_comes_back():
    server = EmbeddedRedis().start()
    registry = CollectorRegistry()
    connector = AsyncECConnector(server.url, FP, registry=registry)
    try:
        waiting = asyncio.create_task(connector.wait_for(["after-restart"], 60))
        with redis.Redis.from_url(server.url) as raw:
            await wait_until_async(
                lambda: raw.pubsub_numsub(connector.sync.channel)[0][1] == 1,
                "the waiter's subscription",
            )
        lost = sample(registry, "epd_ec_redis_errors_total", kind="connection")
        port = server.port
        server.stop()
        await wait_until_async(
            lambda: sample(registry, "epd_ec_redis_errors_total", kind="connection") > lost,
            "the connector to see its subscription lost",
        )
        server = EmbeddedRedis(port=port).start()
        # Published before the subscription is back: only the re-check can see it.
        ECConnector(server.url, FP, registry=None).put("after-restart", torch.ones(1))
        assert await asyncio.wait_for(waiting, 30) == set()
    finally:
        await connector.close()
        server.stop()


# -- local tier -------------------------------------------------------------------------------


def test_local_tier_serves_repeats_and_counts_per_tier(ec):
    ec.put("hot", torch.ones(64))
    ec.local.clear()
    ec.get_many(["hot"])
    ec.get_many(["hot"])
    ec.get_many(["hot"])
    r = ec.registry
    assert sample(r, "epd_ec_lookups_total", op="get", tier="redis", result="hit") == 1
    assert sample(r, "epd_ec_lookups_total", op="get", tier="local", result="hit") == 2
    assert sample(r, "epd_ec_lookups_total", op="get", tier="local", result="miss") == 1


def test_local_tier_is_byte_bounded_lru():
    tier = LocalTier(capacity_bytes=3 * 400)
    for name in "abc":
        tier.put(name, torch.zeros(100))  # 400 bytes each
    assert tier.get("a") is not None  # a is now most recent
    tier.put("d", torch.zeros(100))  # evicts b, the least recent
    assert "b" not in tier and {"a", "c", "d"} <= {k for k in "abcd" if k in tier}
    assert tier.nbytes == 1200
    tier.put("huge", torch.zeros(1000))  # larger than the tier: not kept
    assert "huge" not in tier and tier.nbytes == 1200


def test_local_tier_is_thread_safe():
    tier = LocalTier(capacity_bytes=50 * 400)

    def churn(offset: int):
        for i in range(2000):
            tier.put(f"{offset}-{i % 80}", torch.zeros(100))
            tier.get(f"{offset}-{(i * 7) % 80}")

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.nbytes == len(tier) * 400 <= 50 * 400
