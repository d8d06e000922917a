"""The EC connector and the worker registry in cluster mode, against a real 3-master cluster of
embedded valkey-servers (and one with a replica for the failover)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from common.config import ConfigError, ConnectorConfig, load_config
from connector import AsyncECConnector, ECConnector
from connector.client import store_stats, wait_until_reachable
from connector.registry import Heartbeat, live_workers

FP = "fpcluster"


def make(cluster, **kwargs) -> ECConnector:
    # A namespace per test: the cluster is shared by the whole session.
    kwargs.setdefault("namespace", f"t{uuid.uuid4().hex[:8]}")
    return ECConnector(cluster.url, FP, registry=CollectorRegistry(), mode="cluster", **kwargs)


def node_client(node) -> redis.Redis:
    return redis.Redis(host=node.host, port=node.port)


def owner(cluster, key: str):
    """The master that serves `key`, asked of the servers themselves (the others answer a
    command on it with a MOVED redirection)."""
    for node in cluster.masters:
        try:
            node_client(node).type(key)
            return node
        except redis.exceptions.MovedError:
            pass
    raise AssertionError(f"no master serves {key}")


def test_round_trip_over_all_masters(redis_cluster):
    ec = make(redis_cluster)
    tensors = {f"item{i}": torch.randn(16, 8).to(torch.bfloat16) for i in range(30)}
    for h, t in tensors.items():
        assert ec.put(h, t).stored
    assert not ec.put("item0", torch.zeros(1)).stored  # set-if-absent across the cluster
    hashes = [*tensors, "absent-1", "absent-2"]
    assert ec.has_many(hashes) == [True] * 30 + [False, False]
    found, misses = ec.get_many(hashes)
    assert misses == ["absent-1", "absent-2"]
    for h, t in tensors.items():
        assert torch.equal(found[h].view(torch.uint8), t.view(torch.uint8))
    # Spread: every master holds some of them, and each entry sits where its slot says.
    per_master = {m.port: len(node_client(m).keys(f"{ec.prefix}*")) for m in redis_cluster.masters}
    assert sum(per_master.values()) == 30 and min(per_master.values()) > 0, per_master
    assert node_client(owner(redis_cluster, ec.key("item7"))).exists(ec.key("item7")) == 1
    ttl = node_client(owner(redis_cluster, ec.key("item7"))).ttl(ec.key("item7"))
    assert 3500 < ttl <= 3600
    assert ec.delete(["item0", "item1", "never"]) == 2
    assert ec.has_many(["item0", "item1", "item2"]) == [False, False, True]
    ec.close()


def test_mark_and_channel_share_the_entry_slot(redis_cluster):
    ec = make(redis_cluster)
    slot = node_client(redis_cluster.masters[0]).execute_command("CLUSTER", "KEYSLOT", ec.key("h"))
    for name in (ec.mark_key("h"), ec.shard_channel("h")):
        assert (
            node_client(redis_cluster.masters[0]).execute_command("CLUSTER", "KEYSLOT", name)
            == slot
        )
    ec.close()


PUBLISH_LATER = (
    "import sys, time, torch; from connector import ECConnector\n"
    "c = ECConnector(sys.argv[1], sys.argv[2], registry=None, mode='cluster',\n"
    "                namespace=sys.argv[3])\n"
    "time.sleep(float(sys.argv[4]))\n"
    "for h in sys.argv[5:]:\n"
    "    c.put(h, torch.ones(8))\n"
)


def publish_later(ec: ECConnector, delay: float, *hashes: str) -> subprocess.Popen:
    args = [ec.url, FP, ec.namespace, str(delay), *hashes]
    return subprocess.Popen([sys.executable, "-c", PUBLISH_LATER, *args])


def test_blocking_wait_for_is_woken_by_a_shard_publish(redis_cluster):
    ec = make(redis_cluster)
    ec.put("already", torch.ones(1))
    publisher = publish_later(ec, 0.5, "late-1", "late-2", "late-3")
    missing = ec.wait_for(["already", "late-1", "late-2", "late-3"], timeout=60)
    publisher.wait(30)
    assert missing == set()
    assert ec.metrics.notifications._value.get() >= 1
    started = time.monotonic()
    assert ec.wait_for(["never"], timeout=0.3) == {"never"}
    assert time.monotonic() - started < 5
    ec.close()


async def test_async_waiters_subscribe_on_the_owning_shard_only(redis_cluster):
    ec = make(redis_cluster)
    connector = AsyncECConnector(
        redis_cluster.url, FP, registry=CollectorRegistry(), mode="cluster", namespace=ec.namespace
    )
    hashes = [f"w{i}" for i in range(10)]
    try:
        waits = [asyncio.create_task(connector.wait_for([h], 60)) for h in hashes]
        # Each hash's channel is subscribed on the master that holds its slot, and nowhere else.
        deadline = time.monotonic() + 10
        while len(connector._notifier.where) < len(hashes):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        for h in hashes:
            channel = ec.shard_channel(h)
            home = owner(redis_cluster, channel)
            for m in redis_cluster.masters:
                (_, n) = node_client(m).execute_command("PUBSUB", "SHARDNUMSUB", channel)
                assert n == (1 if m is home else 0), (h, m.port, home.port)
        publisher = publish_later(ec, 0.1, *hashes)
        assert await asyncio.wait_for(asyncio.gather(*waits), 60) == [set()] * 10
        publisher.wait(30)
        # Waiters gone: their shard subscriptions are dropped.
        deadline = time.monotonic() + 10
        while any(
            node_client(m).execute_command("PUBSUB", "SHARDCHANNELS") for m in redis_cluster.masters
        ):
            assert time.monotonic() < deadline, "shard subscriptions left behind"
            await asyncio.sleep(0.05)
        assert await connector.has_many(["w0", "nope"]) == [True, False]
        assert await connector.wait_for(["nope"], 0.2) == {"nope"}
    finally:
        await connector.close()
        ec.close()


async def test_registry_and_reachability_in_cluster_mode(redis_cluster):
    await wait_until_reachable(redis_cluster.url, 10, mode="cluster")
    namespace = f"t{uuid.uuid4().hex[:8]}"
    beat = Heartbeat(redis_cluster.url, namespace, "encoder", "10.0.0.1:1", 0.1, mode="cluster")
    from connector.client import async_client

    client = async_client(redis_cluster.url, mode="cluster")
    try:
        await beat.start()
        assert await live_workers(client, namespace, "encoder", ttl=5) == {"10.0.0.1:1"}
        await beat.stop()
        assert await live_workers(client, namespace, "encoder", ttl=5) == set()
        memory, _, keys = await store_stats(client)
        assert memory["used_memory"] > 0 and keys >= 0
    finally:
        await client.aclose()


def test_config_mode_and_its_env_variable():
    config = load_config(
        environ={"EPD_CONNECTOR_MODE": "cluster", "EPD_CONNECTOR_URL": "redis://n1:7000"}
    )
    assert config.connector.mode == "cluster"
    assert config.connector.connector_options()["mode"] == "cluster"
    with pytest.raises(ConfigError, match="EPD_CONNECTOR_MODE: must be one of standalone, cluster"):
        load_config(environ={"EPD_CONNECTOR_MODE": "sharded"})
    with pytest.raises(ConfigError, match="only database 0"):
        ConnectorConfig(url="redis://n1:7000/3", mode="cluster")
    assert ConnectorConfig(url="redis://n1:7000/3").mode == "standalone"


async def test_master_failover_entries_lost_are_misses_and_waiters_follow(
    redis_cluster_with_replica,
):
    """kill -9 of a master with a replica: reads never fail (the lost master's entries are
    misses while its replica takes over), a waiter's subscription moves to the new master,
    and puts to those slots work again once it is promoted."""
    cluster = redis_cluster_with_replica
    ec = make(cluster)
    victim = cluster.masters[0]
    hashes = [f"f{i}" for i in range(24)]
    for h in hashes:
        ec.put(h, torch.ones(4))
    on_victim = [h for h in hashes if owner(cluster, ec.key(h)) is victim]
    assert on_victim and len(on_victim) < len(hashes)
    # A waiter on an item of the victim's slots, subscribed before the failure.
    waiting_for = next(f"x{i}" for i in range(100) if owner(cluster, ec.key(f"x{i}")) is victim)
    connector = AsyncECConnector(
        cluster.url, FP, registry=CollectorRegistry(), mode="cluster", namespace=ec.namespace
    )
    try:
        waiter = asyncio.create_task(connector.wait_for([waiting_for], 90))
        while waiting_for not in connector._notifier.where:
            await asyncio.sleep(0.02)

        victim.child.signal(signal.SIGKILL)
        victim.child.proc.wait(10)
        # Straight after the kill: no error, the others are there, the victim's are misses.
        found, misses = await connector.get_many(hashes)
        assert set(found) | set(misses) == set(hashes)
        assert set(hashes) - set(on_victim) <= set(found)
        # has_many answers (a lost entry, or one the client could not reach while it refreshed
        # its slot map, is a miss: re-encoded, never an error).
        assert len(await connector.has_many(hashes)) == len(hashes)

        # The replica takes over (it held a copy: replication is asynchronous, so some may
        # be lost; either way nothing fails); publishing to its slots works again.
        replica = node_client(cluster.replicas[0])
        deadline = time.monotonic() + 30
        while replica.info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the replica was not promoted"
            await asyncio.sleep(0.1)
        await asyncio.to_thread(ec.put, waiting_for, torch.ones(2))
        assert await asyncio.wait_for(waiter, 60) == set()
        assert await connector.has_many([waiting_for]) == [True]
        found, misses = await connector.get_many(hashes)
        assert set(found) | set(misses) == set(hashes)
    finally:
        await connector.close()
        ec.close()


# The ACL rules README "Redis Cluster" gives for a cluster-mode user.
README_ACL = "~epd:* &epd:* +@read +@write +@pubsub +@scripting +ping +cluster|slots +command"


async def test_readme_acl_user_is_enough_in_cluster_mode(redis_cluster):
    for node in redis_cluster.masters:
        node_client(node).execute_command(
            "ACL", "SETUSER", "epd-acl", "on", ">pw-1", *README_ACL.split()
        )
    url = redis_cluster.url.replace("redis://", "redis://epd-acl:pw-1@")
    ec = ECConnector(url, FP, registry=None, mode="cluster", namespace="epd")
    connector = AsyncECConnector(url, FP, registry=None, mode="cluster", namespace="epd")
    try:
        assert ec.put("acl-item", torch.ones(2)).stored
        assert await connector.has_many(["acl-item"]) == [True]
        assert await connector.claim(["acl-item"], "me", 1000) == [True]
        assert await connector.release(["acl-item"], "me") == [True]
        waiting = asyncio.create_task(connector.wait_for(["acl-late"], 30))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(ec.put, "acl-late", torch.ones(1))
        assert await waiting == set()
    finally:
        await connector.close()
        ec.delete(["acl-item", "acl-late"])
        ec.close()
