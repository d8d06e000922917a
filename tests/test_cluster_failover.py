"""A master failover under load: kill -9 of a master (with a replica) of the Redis Cluster that
holds the embedding cache, while requests keep coming. Nothing fails: the lost master's entries
are misses for the proxy and the LM worker until its replica takes over, they are encoded
again, and the puts to its slots wait for the new master."""

from __future__ import annotations

import signal
import threading
import time

import redis

from common.config import load_config
from common.served_model import resolve_model
from connector.embedded import EmbeddedCluster
from models import MediaInput
from proxy.prepare import mm_hash
from tests.cluster_helpers import Cluster, image_bytes


def serves(node, key: str) -> bool:
    with redis.Redis(host=node.host, port=node.port) as client:
        try:
            client.type(key)
            return True
        except redis.exceptions.MovedError:
            return False


def test_master_failover_under_load_fails_no_request(tmp_path, tiny_checkpoint):
    # A node timeout long enough that the failover outlasts the clients' own retries: the
    # proxy and the LM worker see the lost master's entries as misses for a while.
    store = EmbeddedCluster(masters=3, replicas=1, node_timeout_ms=3000).start()
    cluster = None
    try:
        cluster = Cluster(
            tmp_path,
            tiny_checkpoint,
            store=store,
            connector={
                "url": store.url,
                "mode": "cluster",
                "namespace": "failover",
                "local_cache_bytes": 0,  # every LM fetch goes to the cluster
            },
        )
        fingerprint = resolve_model(load_config(cluster.config_path)).fingerprint
        images = [image_bytes(48, 48, 300 + i) for i in range(12)]
        for i, image in enumerate(images):
            cluster.generate(f"warm {i}", [image], max_tokens=2)
        keys = [
            f"failover:ec:{fingerprint}:{{{mm_hash(fingerprint, MediaInput('image', image=b))}}}"
            for b in images
        ]
        victim = store.masters[0]  # the master with the replica
        lost = [i for i, k in enumerate(keys) if serves(victim, k)]
        kept = [i for i in range(len(keys)) if i not in lost]
        assert lost and kept, "the entries are not spread over the masters"
        claimed = cluster.metric("epd_encode_marks_total", result="claimed")

        stop = threading.Event()
        done: list[int] = []
        failures: list[BaseException] = []

        def load(worker: int) -> None:
            i = worker
            while not stop.is_set():
                # Each request has an item on the master that is killed, and one elsewhere.
                pair = [images[lost[i % len(lost)]], images[kept[i % len(kept)]]]
                try:
                    tokens, _ = cluster.generate(f"load {worker} {i}", pair, max_tokens=2)
                    assert len(tokens) == 2
                    done.append(i)
                except BaseException as e:  # every failure is reported below
                    failures.append(e)
                i += 3

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        victim.child.signal(signal.SIGKILL)
        victim.child.proc.wait(10)
        before_kill = len(done)
        replica = store.replicas[0]
        deadline = time.monotonic() + 60
        with redis.Redis(host=replica.host, port=replica.port) as client:
            while client.info("replication")["role"] != "master":
                assert time.monotonic() < deadline, "the replica was not promoted"
                time.sleep(0.1)
        time.sleep(2.0)  # keep the load on the new master for a while
        stop.set()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]
        assert len(done) > before_kill > 0
        # The lost master's entries were encoded again while it was gone (they were held).
        assert cluster.metric("epd_encode_marks_total", result="claimed") > claimed
        # And the cluster serves them again from the promoted replica.
        assert all(serves(replica, keys[i]) for i in lost)
        tokens, _ = cluster.generate("after", [images[0]], max_tokens=2)
        assert len(tokens) == 2
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()
