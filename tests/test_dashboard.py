"""The proxy's health dashboard: its JSON state on a real cluster, the page in headless
Chromium (what a person sees, with screenshots under test-artifacts/), and the state builder
in-process with 50 workers and an hour of samples (bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry

from common.config import load_config
from common.process import free_port
from common.served_model import resolve_model
from proto import epd_pb2
from proxy.dashboard import (
    HISTORY_SECONDS,
    RECENT_SECONDS,
    SERIES,
    Dashboard,
    add_dashboard,
)
from proxy.metrics import LATENCY_SAMPLES, ProxyMetrics
from proxy.server import Proxy
from tests.cluster_helpers import Cluster, image_bytes
from tests.helpers import TEST_CLUSTER_SECRET

CHROMIUM = "/usr/bin/chromium"
NO_CHROMIUM = "needs Debian's chromium: apt-get install chromium (.ci/run installs it)"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
IMAGE = image_bytes(64, 64, seed=11)


def needs_chromium() -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(NO_CHROMIUM)


def chromium_args(url: str, *extra: str, budget_ms: int = 2500) -> list[str]:
    """Headless Chromium on a new empty profile; the page's script gets `budget_ms` of virtual
    time (it polls the state once a second) before the DOM is dumped or the screenshot taken."""
    profile = tempfile.mkdtemp(prefix="epd-chromium-")
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *extra,
        url,
    ]


def dump_dom(url: str) -> Dom:
    out = subprocess.run(
        chromium_args(url, "--dump-dom"), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return Dom(out.stdout)


def screenshot(url: str, name: str, size: str, folder: Path = ARTIFACTS) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.unlink(missing_ok=True)
    args = chromium_args(url, f"--screenshot={path}", f"--window-size={size}")
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and path.stat().st_size > 10_000, out.stderr[-2000:]
    return path


class Dom(HTMLParser):
    """The dumped DOM as a person reads it: the text of every element with an id, and each
    worker row (its data-* attributes and its visible text)."""

    VOID = frozenset({"br", "img", "input", "meta", "link", "hr", "col", "area", "source", "wbr"})

    def __init__(self, html: str):
        super().__init__()
        self.text: dict[str, str] = {}
        self.rows: list[tuple[dict, str]] = []
        self._stack: list[tuple[str, dict, list[str]]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self._stack.append((tag, dict(attrs), []))

    def handle_data(self, data):
        if self._stack and self._stack[-1][0] not in ("script", "style"):
            self._stack[-1][2].append(data)

    def handle_endtag(self, tag):
        while self._stack:
            name, attrs, parts = self._stack.pop()
            text = " ".join(" ".join(parts).split())
            if self._stack:
                self._stack[-1][2].append(text)
            if "id" in attrs:
                self.text[attrs["id"]] = text
            if name == "tr" and "worker" in attrs.get("class", "").split():
                self.rows.append((attrs, text))
            if name == tag:
                return

    def row(self, address: str) -> tuple[dict, str]:
        (row,) = [r for r in self.rows if r[0].get("data-address") == address]
        return row


# -- a real cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(tmp_path_factory.mktemp("cluster"), tiny_checkpoint)
    yield c
    c.stop()


def state_of(cluster: Cluster, since: float | None = None) -> dict:
    status, body = cluster.http("/dashboard/state" + (f"?since={since}" if since else ""))
    assert status == 200, body
    return body


def wait_state(cluster: Cluster, ok, what: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = state_of(cluster)
        if ok(state):
            return state
        assert time.monotonic() < deadline, f"{what}; last state: {json.dumps(state)[:3000]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def traffic(cluster):
    """The same image twice (the second is a cache hit), a text request, a bad request."""
    for text in ("Describe it", "And again"):
        cluster.generate(text, [IMAGE], max_tokens=8)
    cluster.generate("Only text", max_tokens=8)
    status, _ = cluster.http("/v1/chat/completions", {"model": "tiny", "messages": "nope"})
    assert status == 400

    def settled(s: dict) -> bool:
        lm = [w for w in s["workers"] if w["role"] == "lm"]
        return (
            s["traffic"]["requests_total"] >= 4
            and all(x["recent"] == x["total"] for x in s["traffic"]["by_status"])  # sampled
            and s["cache"]["redis"]["reachable"]
            and all(w["load"] and w["load"]["ec_local_hits"] >= 1 for w in lm)
            and any(x is not None for x in s["history"]["series"]["ttft_p50"])
        )

    return wait_state(cluster, settled, "the dashboard never showed the traffic")


def test_state_json_has_the_documented_shape(cluster, traffic):
    s = traffic
    assert s["version"] == 1 and s["time"] >= s["started"]
    assert s["proxy"] == {
        "model": "tiny",
        "serving": True,
        "status": "healthy",
        "pending_requests": 0,
        "max_pending_requests": 1024,
    }
    assert s["roles"] == {
        "encoder": {"workers": 2, "up": 2, "status": "healthy"},
        "lm": {"workers": 1, "up": 1, "status": "healthy"},
    }
    expected = sorted(
        [("encoder", a) for a in cluster.encoder_addresses] + [("lm", cluster.lm_address)]
    )
    assert [(w["role"], w["address"]) for w in s["workers"]] == expected
    fields = {
        "role",
        "address",
        "source",
        "health",
        "circuit",
        "queued",
        "queued_tokens",
        "outstanding",
        "state_seconds",
        "last_error",
        "load",
    }
    for w in s["workers"]:
        assert set(w) == fields
        assert (w["health"], w["circuit"], w["source"]) == ("SERVING", "closed", "static")
        assert w["state_seconds"] > 0
    lm = next(w for w in s["workers"] if w["role"] == "lm")["load"]
    assert lm["kv_blocks_total"] > 0 and lm["kv_usage"] is not None
    encoders = [w["load"] for w in s["workers"] if w["role"] == "encoder"]
    assert sum(e["batch_items"] for e in encoders) >= 1  # one forward of one item, recently

    cache = s["cache"]
    assert cache["items"] == {"held": 1, "encoded": 1, "deduplicated": 0}
    assert cache["tiers"]["proxy"] == {"hits": 1, "misses": 1, "hit_rate": 0.5}
    local, redis_tier = cache["tiers"]["lm_local"], cache["tiers"]["redis"]
    assert local["hits"] >= 1 and local["misses"] >= 1 and 0 < local["hit_rate"] < 1
    assert redis_tier["hits"] >= 1  # the first fetch came from Redis
    assert cache["reencodes"] == 0
    redis_info = cache["redis"]
    assert redis_info["reachable"] and redis_info["error"] == ""
    assert redis_info["used_memory_bytes"] > 0 and redis_info["keys"] >= 1
    assert redis_info["evicted_keys"] == 0

    traffic_ = s["traffic"]
    by_status = {(x["api"], x["status"]): x for x in traffic_["by_status"]}
    assert by_status["grpc", "OK"]["total"] == 3 and not by_status["grpc", "OK"]["error"]
    assert by_status["http", "400"] == {
        "api": "http",
        "status": "400",
        "error": True,
        "total": 1,
        "recent": 1,
    }
    for name in ("ttft", "itl"):
        p = traffic_[name]
        assert p["count"] >= 3 and 0 < p["p50"] <= p["p95"] <= p["p99"]

    history = s["history"]
    assert history["interval_seconds"] == 1.0 and history["capacity"] == HISTORY_SECONDS
    assert set(history["series"]) == set(SERIES)
    assert all(len(v) == len(history["t"]) for v in history["series"].values())
    assert history["t"] == sorted(history["t"]) and len(history["t"]) >= 1

    # ?since= hands out only the newer samples (what the page polls); a bad one is a 400
    later = wait_state(cluster, lambda x: x["history"]["t"][-1] > history["t"][-1], "no sample")
    newer = state_of(cluster, since=history["t"][-1])["history"]
    assert newer["t"] and min(newer["t"]) > history["t"][-1]
    assert len(newer["t"]) < len(later["history"]["t"])
    status, body = cluster.http("/dashboard/state?since=yesterday")
    assert status == 400 and "since" in body["error"]


def test_page_in_chromium_shows_workers_hit_rate_and_a_killed_worker(cluster, traffic):
    needs_chromium()
    url = f"http://127.0.0.1:{cluster.proxy_http}/dashboard"
    dom = dump_dom(url)
    assert len(dom.rows) == 3
    for address in [*cluster.encoder_addresses, cluster.lm_address]:
        attrs, text = dom.row(address)
        assert attrs["data-health"] == "SERVING" and "SERVING" in text and address in text
        assert "closed" in text and "up " in text
    assert dom.text["hit-proxy"] == "50.0%"
    assert dom.text["kpi-hit"] == "50.0%"
    assert dom.text["hit-lm_local"] not in ("0.0%", "–")
    assert dom.text["overall"] == "healthy"
    assert "400" in dom.text["statuses"]
    assert dom.text["banner"] == ""
    screenshot(url, "dashboard.png", "1440,1320")

    victim = cluster.encoder_addresses[1]
    cluster.kill("encoder-1")

    def shown_down(s: dict) -> bool:
        return any(w["address"] == victim and w["health"] == "UNREACHABLE" for w in s["workers"])

    wait_state(cluster, shown_down, "the killed encoder was never shown UNREACHABLE")
    dom = dump_dom(url)
    attrs, text = dom.row(victim)
    assert attrs["data-health"] == "UNREACHABLE" and "UNREACHABLE" in text and "down" in text
    assert "class" in attrs and "down" in attrs["class"].split()
    for address in [cluster.encoder_addresses[0], cluster.lm_address]:
        assert dom.row(address)[0]["data-health"] == "SERVING"
    assert dom.text["overall"] == "degraded"
    screenshot(url, "dashboard-worker-down.png", "1440,1320")


def generate_as(cluster: Cluster, request_id: str, text: str, images=(), max_tokens: int = 8):
    """A chat request under a request id of the client's choosing (through the gRPC API)."""
    request = epd_pb2.GenerateRequest(
        request_id=request_id,
        media=[epd_pb2.MediaItem(image=b) for b in images],
        sampling=epd_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens),
    )
    parts = [epd_pb2.ContentPart(media_index=i) for i in range(len(images))]
    parts.append(epd_pb2.ContentPart(text=text))
    request.chat.messages.add(role="user", content=parts)
    return list(cluster.stub.Generate(request, timeout=60))


def test_page_in_chromium_shows_where_time_goes_and_the_slowest_requests(
    cluster, traffic, tmp_path
):
    """The timeline: a stacked bar of the last minute's mean time per stage, and a waterfall
    per slow request. A request id is the client's: the page shows it as text, never markup.
    (It runs after a worker was killed above: one encoder is enough for these requests.)"""
    needs_chromium()
    slow_id = 'req-<b class="x">slow</b> & "long"'
    cluster.generate("A quick one", max_tokens=4)
    generate_as(cluster, "req-image", "Describe it", [image_bytes(48, 48, seed=21)])
    # The slowest request in the window by far (a cold first request takes some 0.4 s; 600
    # tokens decode in about 1 s on a loaded CPU): the first waterfall the page draws.
    generate_as(cluster, slow_id, "Describe it", [image_bytes(64, 48, seed=22)], max_tokens=600)

    def timed(s: dict) -> bool:
        return any(r["request_id"] == slow_id for r in s["timeline"]["slowest"])

    timeline = wait_state(cluster, timed, "the slow request never reached the timeline")["timeline"]
    slowest = timeline["slowest"][0]
    assert slowest["request_id"] == slow_id, [
        (r["request_id"], r["total_seconds"]) for r in timeline["slowest"]
    ]
    names = [b["name"] for b in slowest["stages"]]
    for name in ("validate", "cache_check", "encode", "lm_call", "prefill", "decode"):
        assert name in names, names
    assert timeline["requests"] >= 3 and timeline["mean_seconds"] > 0
    assert {"proxy validate", "proxy lm_call", "lm decode"} <= set(timeline["breakdown"])

    url = f"http://127.0.0.1:{cluster.proxy_http}/dashboard"
    dom = dump_dom(url)
    assert re.search(r"\d+ requests in the last 60 s · mean [\d.]+ m?s", dom.text["timeline-note"])
    bars = dom.text["timeline-bar"]
    assert "proxy ·" in bars and "LM worker" in bars, bars
    legend = dom.text["timeline-legend"]
    for key in ("proxy validate", "proxy encode", "proxy lm_call", "lm prefill", "lm decode"):
        assert key in legend, legend
    assert re.search(r"proxy lm_call [\d.]+ ms", legend), legend

    first = dom.text["waterfall-0"]  # the slowest request's block, its id as plain text
    assert first.startswith(slow_id), first
    for name in ("validate", "cache_check", "encode", "lm_call", "prefill", "decode"):
        assert name in first, first
    assert "proxy" in first and "lm" in first and " ok " in f"{first} "
    assert re.search(r"decode lm [\d.]+ ms", first), first
    waterfalls = [k for k in dom.text if k.startswith("waterfall-")]
    assert len(waterfalls) == min(8, len(timeline["slowest"])) >= 3
    assert any("req-image" in dom.text[k] for k in waterfalls)

    shot = screenshot(url, "dashboard-timeline.png", "1440,2400", folder=tmp_path)
    assert shot.stat().st_size > 30_000


# -- in-process: before the proxy loads ------------------------------------------------------


def test_state_before_the_proxy_has_loaded():
    state = Dashboard().state()
    assert state["proxy"] == {"model": "", "serving": False, "status": "starting"}
    assert state["workers"] == [] and state["cache"] == {} and state["traffic"] == {}
    assert state["history"]["t"] == [] and set(state["history"]["series"]) == set(SERIES)


# -- in-process: 50 workers and an hour of samples -----------------------------------------


@pytest.fixture
async def big_proxy(tmp_path, tiny_checkpoint):
    """A real Proxy whose pools hold 50 workers at addresses where nothing listens."""
    ports: set[int] = set()
    while len(ports) < 50:  # free_port() may hand out a port twice while nothing binds it
        ports.add(free_port())
    addresses = [f"127.0.0.1:{p}" for p in sorted(ports)]
    encoders, lms = addresses[:25], addresses[25:]
    path = tmp_path / "cluster.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_checkpoint), "name": "tiny"},
                "connector": {"url": f"redis://127.0.0.1:{free_port()}/0"},  # nothing there either
                "proxy": {"encoders": encoders, "lm_workers": lms},
                "registry": {"enabled": False},
                "cluster": {"secret": TEST_CLUSTER_SECRET},
            }
        )
    )
    config = load_config(path, environ={})
    proxy = Proxy(config, resolve_model(config), ProxyMetrics(CollectorRegistry()))
    await proxy.start()
    for i, worker in enumerate([*proxy.encoders.workers.values(), *proxy.lms.workers.values()]):
        worker.last_error = "health watch: UNAVAILABLE " + "x" * 200  # worst case: long errors
        if worker.role == "lm":
            worker.load = epd_pb2.LMLoad(
                running_requests=i,
                waiting_requests=3,
                running_tokens=4000,
                waiting_tokens=900,
                kv_blocks_used=700,
                kv_blocks_total=1000,
                tokens_per_second=312.5,
                waiting_for_embeddings=1,
                ec_local_hits=10**9,
                ec_local_misses=10**8,
                ec_redis_hits=9 * 10**7 + 1,
                ec_redis_misses=10**7,
                batch_size=24.5,
            )
        else:
            worker.load = epd_pb2.EncoderLoad(
                queued_items=5,
                queued_tokens=1280,
                running_items=4,
                items_per_second=14.2,
                busy_fraction=0.83,
                batch_items=3.6,
            )
    yield proxy
    await proxy.close()
    # Its connector registered its metrics in the default registry, as in a real proxy: free
    # the names for the next in-process Proxy.
    for collector in vars(proxy.connector.metrics).values():
        with contextlib.suppress(KeyError, TypeError):
            REGISTRY.unregister(collector)


def feed_an_hour(dashboard: Dashboard, proxy: Proxy, t0: float) -> None:
    """3600 per-second samples, t0 to t0 + 3599, with traffic in every one: requests (one in
    20 failing), latencies, media items."""
    m = proxy.metrics
    for i in range(3600):
        now = t0 + i
        for k in range(20):  # 20 requests a second
            m.requests.labels("grpc", "OK" if k else "UNAVAILABLE").inc()
            m.ttft_window.add(0.05 + (k % 7) * 0.02 + (i % 60) * 0.001, now)
            m.itl_window.add(0.01 + (k % 5) * 0.002 + (i % 300) * 0.0001, now)
        m.mm_items.labels("held").inc(12)
        m.mm_items.labels("encoded").inc(4)
        m.mm_items.labels("deduplicated").inc(1)
        dashboard.sample(now)


async def test_state_stays_bounded_with_50_workers_and_an_hour_of_samples(big_proxy):
    dashboard = Dashboard(big_proxy)
    t0 = time.time() - 3600
    feed_an_hour(dashboard, big_proxy, t0)
    end = t0 + 3599.5
    state = dashboard.state(now=end)

    assert len(state["workers"]) == 50 and len({w["address"] for w in state["workers"]}) == 50
    assert all(w["health"] in ("UNREACHABLE", "UNKNOWN") for w in state["workers"])
    assert state["roles"]["lm"] == {"workers": 25, "up": 0, "status": "unavailable"}
    history = state["history"]
    assert len(history["t"]) == HISTORY_SECONDS  # the ring buffer kept the last 15 minutes
    assert history["t"][0] == pytest.approx(t0 + 3600 - HISTORY_SECONDS, abs=0.2)
    assert all(len(v) == HISTORY_SECONDS for v in history["series"].values())
    assert set(history["series"]["rps"]) == {20.0} and set(history["series"]["errors"]) == {1.0}
    assert len(dashboard._recent) <= RECENT_SECONDS

    traffic = state["traffic"]
    assert traffic["requests_total"] == 72_000
    assert {(x["status"], x["recent"]) for x in traffic["by_status"]} == {
        ("OK", 19 * RECENT_SECONDS),
        ("UNAVAILABLE", RECENT_SECONDS),
    }
    assert traffic["ttft"]["count"] == 20 * 60  # the last minute's values only
    assert traffic["ttft"]["p50"] <= traffic["ttft"]["p99"] <= 0.23
    cache = state["cache"]
    assert cache["tiers"]["proxy"]["hit_rate"] == pytest.approx(12 / 17, abs=1e-3)
    assert cache["tiers"]["lm_local"]["hits"] == 25 * 10**9
    lm_rows = [w for w in state["workers"] if w["role"] == "lm"]
    assert lm_rows[0]["load"]["ec_redis_hits"] == 9 * 10**7 + 1  # counters stay exact
    assert cache["redis"]["reachable"] is False  # nothing answers there; the state still builds

    # Small enough to poll every second: the full state (what a page loads first) and what a
    # poll with ?since= brings.
    full = len(json.dumps(state))
    poll = len(json.dumps(dashboard.state(since=history["t"][-2], now=end)))
    assert full < 200_000, full
    assert poll < 40_000, poll

    # However fast latencies come, a window keeps LATENCY_SAMPLES values at most.
    for k in range(LATENCY_SAMPLES + 5000):
        big_proxy.metrics.itl_window.add(0.001 * (k % 100), end)
    assert len(big_proxy.metrics.itl_window.values) == LATENCY_SAMPLES
    assert big_proxy.metrics.itl_window.percentiles(end)["count"] == LATENCY_SAMPLES


async def test_page_with_50_workers_and_an_hour_of_data_in_chromium(big_proxy):
    needs_chromium()
    app = web.Application()
    dashboard = add_dashboard(app, lambda: True, big_proxy)
    feed_an_hour(dashboard, big_proxy, time.time() - 3600)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        url = f"http://127.0.0.1:{port}/dashboard"
        args = chromium_args(url, "--dump-dom")
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        dom = Dom(out.decode())
        assert len(dom.rows) == 50
        assert {a["data-health"] for a, _ in dom.rows} <= {"UNREACHABLE", "UNKNOWN"}
        assert dom.text["overall"] == "unavailable"
        assert float(dom.text["kpi-rps"]) > 0
        assert dom.text["hit-proxy"] == "70.6%"
        assert f"{HISTORY_SECONDS} kept" in dom.text["history-note"]
        assert dom.text["timeline-bar"] == "no requests in the last 60 s"
        assert dom.text["waterfalls"] == ""

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard-50-workers.png"
        shot.unlink(missing_ok=True)
        args = chromium_args(url, f"--screenshot={shot}", "--window-size=1440,2700")
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0 and shot.stat().st_size > 10_000, err.decode()[-2000:]
    finally:
        await runner.cleanup()


# -- the Grafana dashboard --------------------------------------------------------------------


def test_grafana_dashboard_queries_only_metrics_the_cluster_exports():
    from connector.metrics import ConnectorMetrics
    from encoder_worker.metrics import EncoderMetrics
    from lm_worker.engine import EngineMetrics

    registry = CollectorRegistry()
    for metrics in (ProxyMetrics, ConnectorMetrics, EncoderMetrics, EngineMetrics):
        metrics(registry)
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    exported = {f.name + s for f in registry.collect() for s in suffixes[f.type]}

    path = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "epd-dashboard.json"
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"] == "epd-cluster"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\bepd_[a-z_]+", e)}
    assert used <= exported, used - exported
    for name in (
        "epd_requests_total",
        "epd_time_to_first_token_seconds_bucket",
        "epd_inter_token_latency_seconds_bucket",
        "epd_mm_items_total",
        "epd_encode_dispatch_seconds_bucket",
        "epd_worker_up",
        "epd_worker_circuit_open",
        "epd_reencodes_total",
        "epd_pending_requests",
        "epd_ec_lookups_total",
        "epd_lm_kv_blocks_used",
        "epd_encoder_tower_seconds_sum",
        "epd_stage_seconds_sum",
        "epd_stage_seconds_bucket",
    ):
        assert name in used, name
