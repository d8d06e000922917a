"""Faults under a bounded concurrent load, on a real cluster of two encoders and two LM workers:
kill -9 of an LM worker and of an encoder, SIGSTOP of an LM worker, Redis killed and restarted,
FLUSHALL. Each prints `chaos NAME: sent N completed N migrated N failed N lost N` (lost: a
request that neither finished nor failed within its deadline)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import redis

from proto import epd_pb2
from tests.cluster_helpers import Cluster, image_bytes

STREAMS = 12
# Long enough that a disturbance lands mid-stream even on a quiet machine (a tiny model
# decodes a token in a few milliseconds).
MAX_TOKENS = 400
DEADLINE_S = 90


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("chaos"),
        tiny_checkpoint,
        encoders=2,
        lms=2,
        lm={"max_num_seqs": 16, "embedding_timeout_seconds": 20},
        proxy={"retries": 4},
    )
    yield c
    c.stop()


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: int = epd_pb2.FINISH_REASON_UNSPECIFIED
    error: str | None = None
    done: bool = False


@dataclass
class Report:
    name: str
    results: list[Result]
    migrated: int

    @property
    def completed(self) -> int:
        return sum(r.done and r.error is None and r.finish != 0 for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.done and r.error is not None for r in self.results)

    @property
    def lost(self) -> int:
        return len(self.results) - self.completed - self.failed

    def line(self) -> str:
        return (
            f"chaos {self.name}: sent {len(self.results)} completed {self.completed} "
            f"migrated {self.migrated} failed {self.failed} lost {self.lost}"
        )


def request(i: int, images: list[bytes] = ()) -> epd_pb2.GenerateRequest:
    """Even i greedy, odd i sampled with seed i: both continue token-identically on migration."""
    sampling = epd_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if i % 2:
        sampling.temperature, sampling.top_k, sampling.seed = 0.9, 40, i
    msg = epd_pb2.GenerateRequest(
        request_id=f"chaos-{i}",
        media=[epd_pb2.MediaItem(image=b) for b in images],
        sampling=sampling,
    )
    parts = [epd_pb2.ContentPart(media_index=j) for j in range(len(images))]
    parts.append(epd_pb2.ContentPart(text=f"Tell me about number {i} at length"))
    msg.chat.messages.add(role="user", content=parts)
    return msg


def wait_healthy(cluster: Cluster, timeout: float = 60) -> None:
    """Until the proxy sees every worker SERVING (a role's own SERVING may come first) and
    idle: the loads it last polled show nothing running, so a new load spreads over the LM
    workers instead of avoiding one whose report is still the last run's."""
    deadline = time.monotonic() + timeout
    while True:
        status, health = cluster.http("/health")
        if status == 200 and health["status"] == "healthy" and lms_idle(cluster):
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


def lm_loads(cluster: Cluster) -> dict[str, dict | None]:
    """Each LM worker's load as the proxy last polled it, by address (None: not yet)."""
    _, state = cluster.http("/dashboard/state")
    return {w["address"]: w["load"] for w in state["workers"] if w["role"] == "lm"}


def lms_idle(cluster: Cluster) -> bool:
    return all(
        load is not None and load["running_requests"] == 0 and load["waiting_requests"] == 0
        for load in lm_loads(cluster).values()
    )


def run_load(cluster: Cluster, name: str, requests, disturb=None, when_tokens: int = 0):
    """Stream every request at once, on a cluster the proxy sees healthy; once each has
    `when_tokens` tokens (0: at once), call `disturb()`. Returns the Report (printed)."""
    wait_healthy(cluster)
    results = [Result() for _ in requests]
    migrated_before = cluster.metric("epd_migrations_total")

    def stream(i: int, msg) -> None:
        r = results[i]
        try:
            for response in cluster.stub.Generate(msg, timeout=DEADLINE_S):
                r.tokens.extend(response.token_ids)
                if response.finish_reason:
                    r.finish = response.finish_reason
        except grpc.RpcError as e:
            r.error = f"{e.code().name}: {e.details()}"
        r.done = True

    threads = [
        threading.Thread(target=stream, args=(i, m), daemon=True) for i, m in enumerate(requests)
    ]
    for t in threads:
        t.start()
    if disturb is not None:
        deadline = time.monotonic() + DEADLINE_S
        while not all(len(r.tokens) >= when_tokens or r.done for r in results):
            assert time.monotonic() < deadline, "the load never got going"
            time.sleep(0.005)
        disturb()
    for t in threads:
        t.join(DEADLINE_S + 10)
    report = Report(name, results, int(cluster.metric("epd_migrations_total") - migrated_before))
    print(report.line())
    if report.failed or report.lost:
        print("errors:", [r.error for r in results if r.error])
        print("health:", cluster.http("/health")[1])
    return report


def restart(cluster: Cluster, name: str) -> None:
    role = cluster.roles[name]
    cluster.start(role.kind, name, role.address).wait_status("SERVING", timeout=120)
    wait_healthy(cluster)


def text_load() -> list[epd_pb2.GenerateRequest]:
    return [request(i) for i in range(STREAMS)]


@pytest.fixture(scope="module")
def undisturbed(cluster) -> list[list[int]]:
    """Each text request's tokens on the undisturbed cluster (the same 12 at once)."""
    report = run_load(cluster, "undisturbed", text_load())
    assert report.completed == STREAMS, report.line()
    return [r.tokens for r in report.results]


def busiest_lm(cluster: Cluster, timeout: float = 10) -> str:
    """The LM worker running the most requests, as the proxy's polled loads say: the one to
    fault, so that it has streams to migrate however the proxy spread the load (a full suite
    once saw every stream on the other worker, and nothing to migrate)."""
    names = {cluster.roles[n].address: n for n in cluster.roles if n.startswith("lm-")}
    deadline = time.monotonic() + timeout
    while True:
        loads = lm_loads(cluster)
        running = {a: load["running_requests"] for a, load in loads.items() if load is not None}
        if running and max(running.values()) > 0:
            return names[max(running, key=running.get)]
        assert time.monotonic() < deadline, loads
        time.sleep(0.05)


def test_kill_9_of_an_lm_worker_mid_stream_loses_no_stream(cluster, undisturbed):
    """12 streams (6 greedy, 6 seeded samples) over two LM workers; one of them running
    streams is killed once every stream has output. Its streams migrate: 12 of 12 complete,
    token-identical to the undisturbed run."""
    killed = []

    def kill() -> None:
        killed.append(busiest_lm(cluster))
        cluster.kill(killed[0])

    report = run_load(cluster, "kill -9 lm", text_load(), kill, when_tokens=4)
    assert report.completed == STREAMS, (report.line(), [r.error for r in report.results])
    assert report.migrated >= 1, report.line()
    for i, r in enumerate(report.results):
        assert r.tokens == undisturbed[i], i
        assert len(r.tokens) == MAX_TOKENS
    restart(cluster, killed[0])


def test_sigstop_of_an_lm_worker_mid_stream_migrates_its_streams(cluster, undisturbed):
    """A frozen worker (SIGSTOP: its TCP still answers, nothing else does) is found by the
    keepalive within seconds, and its streams migrate."""
    stopped = []

    def stop() -> None:
        stopped.append(cluster.roles[busiest_lm(cluster)].child)
        stopped[0].signal(signal.SIGSTOP)

    try:
        report = run_load(cluster, "SIGSTOP lm", text_load(), stop, when_tokens=4)
    finally:
        for child in stopped:
            child.signal(signal.SIGCONT)
    assert report.completed == STREAMS, (report.line(), [r.error for r in report.results])
    assert report.migrated >= 1, report.line()
    for i, r in enumerate(report.results):
        assert r.tokens == undisturbed[i], i


def test_a_frozen_lm_worker_is_found_within_seconds(cluster):
    """SIGSTOP: its TCP still answers, only the process does not. Keepalive pings answered
    within 3 s find it (gRPC's default ping timeout of 60 s kept it SERVING about 64 s)."""
    wait_healthy(cluster)
    frozen = cluster.roles["lm-1"]
    frozen.child.signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        while True:
            workers = cluster.http("/health")[1]["roles"]["lm"]["workers"]
            status = {w["address"]: w["status"] for w in workers}[frozen.address]
            if status != "SERVING":
                break
            assert time.monotonic() - started < 20, "the frozen worker still looks SERVING"
            time.sleep(0.05)
        found = time.monotonic() - started
    finally:
        frozen.child.signal(signal.SIGCONT)
    print(f"chaos SIGSTOP idle lm: found {status} after {found:.1f}s")
    assert found < 10


def image_load(seed: int) -> list[epd_pb2.GenerateRequest]:
    return [request(i, [image_bytes(84, 56, seed + i)]) for i in range(STREAMS)]


def flush(cluster: Cluster) -> None:
    with redis.Redis.from_url(cluster.redis.url) as client:
        client.flushall()


def test_kill_9_of_an_encoder_while_it_encodes(cluster):
    baseline = run_load(cluster, "images undisturbed", image_load(100))
    assert baseline.completed == STREAMS, baseline.line()
    flush(cluster)  # the same images must be encoded again
    report = run_load(
        cluster, "kill -9 encoder", image_load(100), lambda: cluster.kill("encoder-0")
    )
    assert report.completed == STREAMS, (report.line(), [r.error for r in report.results])
    for i, r in enumerate(report.results):
        assert r.tokens == baseline.results[i].tokens, i
    restart(cluster, "encoder-0")


def test_flushall_under_load_fails_nothing(cluster):
    stop = threading.Event()

    def storm() -> None:
        def loop():
            while not stop.is_set():
                flush(cluster)
                time.sleep(0.05)

        threading.Thread(target=loop, daemon=True).start()

    try:
        report = run_load(cluster, "FLUSHALL storm", image_load(200), storm)
    finally:
        stop.set()
    assert report.completed == STREAMS, (report.line(), [r.error for r in report.results])


def test_redis_killed_and_restarted(cluster):
    """Text streams need no Redis and go on; once Redis is back, image requests are served
    again (the connector reconnects, the proxy re-reads the registry)."""

    def kill_and_restart() -> None:
        cluster.redis.child.signal(signal.SIGKILL)
        cluster.redis.child.proc.wait(10)
        cluster.redis.stop()
        time.sleep(1.0)
        cluster.redis.start()

    report = run_load(cluster, "Redis kill + restart", text_load(), kill_and_restart, 4)
    assert report.completed == STREAMS, (report.line(), [r.error for r in report.results])
    after = run_load(cluster, "images after the Redis restart", image_load(300))
    assert after.completed == STREAMS, (after.line(), [r.error for r in after.results])
