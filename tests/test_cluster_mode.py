"""The whole E+PD path with the embedding cache on a real 3-master Redis Cluster (embedded
valkey-servers): encoders, an LM worker and the proxy all in cluster mode."""

from __future__ import annotations

import threading

import pytest
import redis

from models.testing import ImageItem
from tests.cluster_helpers import Cluster, image_bytes

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint, redis_cluster):
    c = Cluster(
        tmp_path_factory.mktemp("cluster-mode"),
        tiny_checkpoint,
        store=redis_cluster,
        connector={"url": redis_cluster.url, "mode": "cluster", "namespace": "epdpath"},
    )
    yield c
    c.stop()


def expected(ref, text: str, images=()) -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return ref.generate(
        [{"role": "user", "content": content}],
        [ImageItem(b) for b in images],
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    )


def entries_per_master(redis_cluster) -> list[int]:
    counts = []
    for m in redis_cluster.masters:
        with redis.Redis(host=m.host, port=m.port) as client:
            counts.append(sum(1 for _ in client.scan_iter("epdpath:ec:*{*}", count=1000)))
    return counts


def test_greedy_output_equals_reference_and_entries_spread(cluster, tiny_ref, redis_cluster):
    images = [image_bytes(64, 64, 100 + i) for i in range(9)]
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    for i, image in enumerate(images):
        tokens, last = cluster.generate(f"Image {i}", [image], max_tokens=MAX_TOKENS)
        assert tokens == expected(tiny_ref, f"Image {i}", [image])
        assert last.usage.mm_items_held == 0
    # (Counted when the encoder's reply reaches the proxy, which may be after the LM is done.)
    cluster.wait_metric("epd_mm_items_total", encoded + 9, result="encoded")
    counts = entries_per_master(redis_cluster)
    assert sum(counts) >= 9 and min(counts) > 0, counts


def test_same_image_twice_is_held(cluster):
    image = image_bytes(80, 80, 10)
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    _, first = cluster.generate("First look", [image], max_tokens=2)
    cluster.wait_metric("epd_mm_items_total", encoded + 1, result="encoded")
    _, second = cluster.generate("Second look", [image], max_tokens=2)
    assert first.usage.mm_items_held == 0
    assert second.usage.mm_items_held == 1 and second.usage.mm_items_encoded == 0
    assert second.timings.encode_seconds == 0


def test_flushed_item_is_encoded_again(cluster, tiny_ref, redis_cluster):
    image = image_bytes(64, 96, 12)
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    cluster.generate("Before the flush", [image], max_tokens=2)
    cluster.wait_metric("epd_mm_items_total", encoded + 1, result="encoded")
    redis_cluster.flushall()
    tokens, last = cluster.generate("After the flush", [image], max_tokens=MAX_TOKENS)
    assert tokens == expected(tiny_ref, "After the flush", [image])
    assert last.usage.mm_items_held == 0
    cluster.wait_metric("epd_mm_items_total", encoded + 2, result="encoded")


def test_ten_concurrent_identical_images_encode_once(cluster):
    image = image_bytes(72, 72, 11)
    encoded_before = cluster.metric("epd_mm_items_total", result="encoded")
    results = []

    def call(i):
        results.append(cluster.generate(f"Request {i}", [image], max_tokens=2)[1].usage)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 10
    assert sum(u.mm_items_deduplicated + u.mm_items_held for u in results) == 9
    cluster.wait_metric("epd_mm_items_total", encoded_before + 1, result="encoded")
    assert cluster.metric("epd_mm_items_total", result="encoded") == encoded_before + 1


def test_dashboard_reads_the_whole_cluster(cluster):
    import time

    deadline = time.monotonic() + 30
    while True:
        status, state = cluster.http("/dashboard/state")
        assert status == 200
        info = state["cache"]["redis"]
        if info["reachable"] and info["keys"] > 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    assert info["used_memory_bytes"] > 0
