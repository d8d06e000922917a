"""The whole E+PD path with the embedding cache on a real 3-master Redis Cluster (embedded
valkey-servers): encoders, an LM worker and the proxy all in cluster mode."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
import redis

from models.testing import ImageItem
from proto import epd_pb2_grpc
from tests.cluster_helpers import Cluster, http_json, image_bytes
from tests.helpers import wait_until

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint, redis_cluster):
    c = Cluster(
        tmp_path_factory.mktemp("cluster-mode"),
        tiny_checkpoint,
        store=redis_cluster,
        connector={"url": redis_cluster.url, "mode": "cluster", "namespace": "epdpath"},
        proxy={"encode_mark_ttl_seconds": 1.0},
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


# -- several proxies: single flight through the "being encoded" marks ---------------------------


def proxy_metric(port: int, name: str, **labels) -> float:
    status, _ = http_json(port, "/health")
    assert status == 200
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in text.splitlines():
        if line.startswith(name + (want if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def second_proxy(cluster):
    role, grpc_port, http_port = cluster.add_proxy("proxy-b")
    role.wait_status("SERVING", timeout=120)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    yield epd_pb2_grpc.InferenceStub(channel), http_port
    channel.close()


MM_RESULTS = ("held", "encoded", "deduplicated")  # every media item counted once, under one


def mm_items(cluster, http_b: int, *results: str) -> float:
    """Media items both proxies counted under `results` (epd_mm_items_total)."""
    return sum(
        cluster.metric("epd_mm_items_total", result=r)
        + proxy_metric(http_b, "epd_mm_items_total", result=r)
        for r in results
    )


def test_two_proxies_encode_ten_identical_new_images_once(cluster, second_proxy, tiny_ref):
    stub_b, http_b = second_proxy
    image = image_bytes(60, 60, 21)
    before = mm_items(cluster, http_b, "encoded")
    counted = mm_items(cluster, http_b, *MM_RESULTS)
    results: dict[int, list[int]] = {}

    def call(i):
        stub = stub_b if i % 2 else None
        results[i] = cluster.generate(f"Two proxies {i}", [image], max_tokens=4, stub=stub)[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 10
    for i, tokens in results.items():
        assert tokens == expected(tiny_ref, f"Two proxies {i}", [image])[:4]
    # An item a proxy encodes is counted when the encoder's reply reaches it, which may be after
    # the LM is done: once all ten requests' items are counted, a second encode would be too.
    wait_until(
        lambda: mm_items(cluster, http_b, *MM_RESULTS) >= counted + 10,
        "both proxies to count the ten requests' media items",
        timeout=20,
    )
    assert mm_items(cluster, http_b, *MM_RESULTS) == counted + 10
    assert mm_items(cluster, http_b, "encoded") == before + 1


def marks(redis_cluster) -> list[bytes]:
    found = []
    for m in redis_cluster.masters:
        with redis.Redis(host=m.host, port=m.port) as client:
            found += [client.get(k) for k in client.scan_iter("epdpath:ec:*:encoding:*")]
    return [v for v in found if v is not None]


def test_the_proxy_holding_the_mark_dies_and_the_other_takes_over(cluster, tiny_ref, redis_cluster):
    """Encoders paused, so the encode is in flight: proxy C claims the item's mark, the main
    proxy follows it; kill -9 of C; its mark lapses, the main proxy takes the encode over, and
    every request completes (C's clients retry on the main proxy, as a load balancer would)."""
    role, grpc_port, _ = cluster.add_proxy("proxy-c")
    role.wait_status("SERVING", timeout=120)
    stub_c = epd_pb2_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    image = image_bytes(68, 52, 22)
    taken_over = cluster.metric("epd_encode_marks_total", result="taken_over")
    followed = cluster.metric("epd_encode_marks_total", result="followed")
    results: dict[str, list[int]] = {}
    errors: list[Exception] = []

    def call(name: str, stub) -> None:
        try:
            try:
                results[name] = cluster.generate(name, [image], max_tokens=4, stub=stub)[0]
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e  # its proxy was killed
                results[name] = cluster.generate(name, [image], max_tokens=4)[0]
        except Exception as e:  # reported below
            errors.append(e)

    encoders = [cluster.roles[n].child for n in cluster.roles if n.startswith("encoder")]
    for child in encoders:
        child.signal(signal.SIGSTOP)
    threads = []
    try:
        threads.append(threading.Thread(target=call, args=("via C", stub_c)))
        threads[-1].start()
        deadline = time.monotonic() + 20
        while not marks(redis_cluster):  # C holds the mark
            assert time.monotonic() < deadline, "proxy C did not mark the item"
            time.sleep(0.02)
        for i in range(4):
            threads.append(threading.Thread(target=call, args=(f"via main {i}", None)))
            threads[-1].start()
        cluster.wait_metric("epd_encode_marks_total", followed + 1, result="followed")
        cluster.kill("proxy-c")
        cluster.wait_metric("epd_encode_marks_total", taken_over + 1, result="taken_over")
    finally:
        for child in encoders:
            child.signal(signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert set(results) == {"via C", *(f"via main {i}" for i in range(4))}
    for name, tokens in results.items():
        assert tokens == expected(tiny_ref, name, [image])[:4]
    assert cluster.metric("epd_encode_marks_total", result="taken_over") == taken_over + 1
