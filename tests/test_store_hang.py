"""A hung embedding store (Redis SIGSTOPped, its sockets open, nothing answered): image requests
fail fast and say so, text requests go on, the dashboard shows the store not answering, and
once it answers again image requests are served (issue 58 item 6).

Before store operations had a deadline, every image request waited out the connector's
retries (op_timeout_seconds x (retries + 1): 20 s) or the whole freeze."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time

import grpc
import pytest
import torch

from connector import AsyncECConnector, StoreUnavailable
from tests.cluster_helpers import Cluster, image_bytes

# A correctness bound on the deadline (connector.request_deadline_seconds, 3 s by default),
# not a speed benchmark: well under the 20 s the retries used to take.
FAIL_FAST_S = 8.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(tmp_path_factory.mktemp("store-hang"), tiny_checkpoint, encoders=1, lms=1)
    yield c
    c.stop()


def store_state(cluster: Cluster) -> dict:
    _, state = cluster.http("/dashboard/state")
    return state["cache"].get("store", {})


def wait_store(cluster: Cluster, answering: bool, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (store := store_state(cluster)).get("answering") != answering:
        assert time.monotonic() < deadline, f"the dashboard still shows {store}"
        time.sleep(0.1)
    return store


def timed_image_request(cluster: Cluster, seed: int) -> tuple[float, grpc.RpcError | None]:
    started = time.monotonic()
    try:
        cluster.generate("describe", images=[image_bytes(64, 64, seed)], max_tokens=4, timeout=40)
    except grpc.RpcError as e:
        return time.monotonic() - started, e
    return time.monotonic() - started, None


def test_hung_store_fails_image_requests_fast(cluster):
    tokens, _ = cluster.generate("describe", images=[image_bytes(64, 64, 1)], max_tokens=4)
    assert tokens
    pid = cluster.redis.child.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        text_done: list[float] = []

        def text() -> None:
            started = time.monotonic()
            got, _ = cluster.generate("hello there", max_tokens=8, timeout=30)
            assert got
            text_done.append(time.monotonic() - started)

        text_thread = threading.Thread(target=text)
        text_thread.start()
        seconds, error = timed_image_request(cluster, seed=2)
        print(f"first image request with the store frozen: {seconds:.1f}s, {error!r}")
        assert error is not None, "an image request succeeded with the store frozen"
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "embedding store" in error.details(), error.details()
        assert seconds < FAIL_FAST_S, f"the first image request failed only after {seconds:.1f}s"
        # Once the store is known not to answer, the next ones fail at once.
        seconds, error = timed_image_request(cluster, seed=3)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert seconds < 1.0, f"a later image request failed only after {seconds:.1f}s"
        status, body = cluster.http(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(4)}},
                    {"type": "text", "text": "describe"},
                ]}],
            },
        )  # fmt: skip
        assert status == 503, (status, body)
        assert "embedding store" in body["error"]["message"], body
        text_thread.join(30)
        assert text_done, "the text request did not complete while the store was frozen"
        store = wait_store(cluster, answering=False, timeout=5)
        assert store["since"] <= time.time() and store["error"], store
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_store(cluster, answering=True, timeout=10)
    tokens, _ = cluster.generate("describe", images=[image_bytes(64, 64, 5)], max_tokens=4)
    assert tokens


def _data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(image_bytes(64, 64, seed)).decode()


# -- the connector alone ------------------------------------------------------------------------


def test_connector_fails_fast_on_a_frozen_store_and_recovers(redis_server):
    async def run() -> None:
        ec = AsyncECConnector(
            redis_server.url,
            "fp",
            registry=None,
            deadline=1.0,
            probe_interval=0.2,
            local_tier_bytes=1 << 20,
        )
        try:
            await ec.put("a", torch.ones(2, 4))
            await ec.put("b", torch.ones(2, 4))
            found, _ = await ec.get_many(["a"])  # now in the local tier too
            assert list(found) == ["a"]
            os.kill(redis_server.child.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable, match="embedding store"):
                    await ec.has_many(["b"])
                assert time.monotonic() - started < 3.0
                assert not ec.health.answering and ec.health.error
                # What the local tier holds is still served.
                found, misses = await ec.get_many(["a"])
                assert list(found) == ["a"] and not misses
                assert await ec.has_many(["a"]) == [True]
                # Known not answering: every operation fails without a round trip.
                for op in (ec.get_many(["b"]), ec.claim(["b"], "me", 1000), ec.wait_for(["b"], 5)):
                    started = time.monotonic()
                    with pytest.raises(StoreUnavailable, match="not answering"):
                        await op
                    assert time.monotonic() - started < 0.1
            finally:
                os.kill(redis_server.child.pid, signal.SIGCONT)
            deadline = time.monotonic() + 5
            while not ec.health.answering:  # the probe finds it answering again
                assert time.monotonic() < deadline, ec.health.state()
                await asyncio.sleep(0.05)
            found, misses = await ec.get_many(["b"])
            assert list(found) == ["b"] and not misses
        finally:
            await ec.close()

    asyncio.run(run())


def test_connector_rides_out_a_restart_within_the_deadline(redis_server):
    """kill -9 of Redis, restarted 0.5 s later: an operation begun meanwhile is retried until
    it answers, and the store is never marked not answering."""

    async def run() -> None:
        ec = AsyncECConnector(redis_server.url, "fp", registry=None, deadline=3.0)
        try:
            assert await ec.has_many(["a"]) == [False]
            redis_server.child.signal(signal.SIGKILL)
            redis_server.child.proc.wait(10)
            redis_server.stop()
            restart = asyncio.get_running_loop().run_in_executor(
                None, lambda: (time.sleep(0.5), redis_server.start())
            )
            await ec.put("a", torch.ones(2, 4))  # begun with Redis down
            assert await ec.has_many(["a"]) == [True]
            assert ec.health.answering
            await restart
        finally:
            await ec.close()

    asyncio.run(run())
