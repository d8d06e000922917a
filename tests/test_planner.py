"""The encoder planner (proxy/planner.py): its arithmetic on recorded reports, and `epd up
--encoders auto` growing and draining a local cluster on it."""

from __future__ import annotations

import io
import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from PIL import Image

from common.config import ConfigError, load_config
from epd.launcher import parse_encoders
from proxy.planner import Planner, fresh_desired
from tests.test_up import child_named, generate, up, wait_for  # noqa: F401 (the fixture)


@dataclass
class Report:  # the EncoderLoad fields the planner reads
    busy_fraction: float = 0.0
    items_per_second: float = 0.0
    queued_items: int = 0
    running_items: int = 0


def planner(**kw) -> Planner:
    options = dict(
        target_utilisation=0.7, wait_slo=1.0, minimum=1, maximum=8, scale_down_seconds=60.0
    )
    return Planner(**{**options, **kw})


def test_idle_encoders_want_the_minimum():
    p = planner(minimum=2)
    d = p.update([Report(), Report()], now=0.0)
    assert (d.desired, d.recommended, d.need, d.work) == (2, 0, 0.0, 0.0)
    assert d.serving == 2 and d.seconds_per_item is None


def test_steady_work_is_sized_at_the_target_utilisation():
    # Two encoders each busy 80% at 8 items/s: 1.6 encoder-seconds a second of work, 0.1 s an
    # item; at 70% that takes 1.6 / 0.7 = 2.29 encoders -> 3.
    p = planner()
    d = p.update([Report(0.8, 8.0, 0, 1), Report(0.8, 8.0, 0, 1)], now=0.0)
    assert d.work == 1.6 and d.seconds_per_item == pytest.approx(0.1)
    assert d.backlog_seconds == pytest.approx(0.2)  # the two items in a forward
    assert d.need == pytest.approx((1.6 + 0.2 / 1.0) / 0.7, abs=1e-3)
    assert d.recommended == d.desired == 3


def test_a_queue_beyond_the_objective_scales_up_even_when_busy_stops_at_one():
    # One saturated encoder (busy 1.0 at 5 items/s: 0.2 s an item) with 20 items waiting: 4 s
    # of backlog; to clear it within a 0.5 s objective takes 8 encoder-seconds a second more.
    p = planner(wait_slo=0.5, maximum=6)
    d = p.update([Report(1.0, 5.0, 20, 0)], now=0.0)
    assert d.backlog_seconds == pytest.approx(4.0)
    assert d.need == pytest.approx((1.0 + 4.0 / 0.5) / 0.7, abs=1e-3)
    assert d.recommended == 13 and d.desired == 6  # clamped to encoders_max


def test_seconds_per_item_is_remembered_while_nothing_finishes():
    p = planner()
    p.update([Report(0.5, 10.0)], now=0.0)  # 0.05 s an item
    d = p.update([Report(0.0, 0.0, 30, 0)], now=1.0)  # a burst queued, no forward done yet
    assert d.seconds_per_item == pytest.approx(0.05)
    assert d.backlog_seconds == pytest.approx(1.5) and d.recommended == 3


def test_work_waiting_with_nothing_measured_yet_wants_one():
    d = planner(minimum=1).update([Report(0.0, 0.0, 3, 1)], now=0.0)
    assert d.recommended == 1


def test_a_hair_over_a_whole_number_does_not_ask_for_one_more():
    # Busy 0.71 of one encoder at 70%: need 1.014 -> 1 (the tenth of an encoder of tolerance).
    d = planner().update([Report(0.71, 10.0)], now=0.0)
    assert d.need == pytest.approx(1.014, abs=1e-3) and d.recommended == 1


def test_scale_up_is_immediate_and_scale_down_waits_out_the_window():
    p = planner(scale_down_seconds=30.0)
    busy = [Report(1.0, 10.0, 10, 0)] * 2  # 2 s backlog... need (2 + 2) / 0.7 = 5.7 -> 6
    assert p.update(busy, now=0.0).desired == 6
    quiet = [Report(0.1, 1.0)] * 2
    for t in (1.0, 10.0, 29.9):
        d = p.update(quiet, now=t)
        assert d.recommended == 1 and d.desired == 6, t
    assert p.update(quiet, now=30.5).desired == 1
    # And up again at once.
    assert p.update(busy, now=31.0).desired == 6


def test_several_proxies_entries_take_the_largest_fresh_one():
    now = 1000.0
    entries = {
        b"proxy-a": json.dumps({"desired": 2, "time": now - 1}),
        b"proxy-b": json.dumps({"desired": 3, "time": now - 2}),
        b"proxy-c": json.dumps({"desired": 7, "time": now - 60}),  # stale: its proxy is gone
        b"proxy-d": b"not json",
    }
    assert fresh_desired(entries, now, max_age=10) == 3
    assert fresh_desired({}, now, max_age=10) is None


def test_bench_serve_compares_each_encoder_setting_with_the_first():
    from epd.bench.serve import _encoder_ratios, _ratios

    def row(topology, encoders, p50, p99, encoder_seconds=None):
        r = {"topology": topology, "request_rate": 2.0, "reuse": 0.0, "goodput_rps": 1.0}
        r |= {"ttft_ms": {"p50": p50, "p99": p99}, "itl_ms": {"p50": 10.0}}
        if encoders is not None:
            r |= {"encoders": encoders, "encoder_seconds": encoder_seconds}
        return r

    rows = [
        row("e+pd", "1", 100.0, 400.0, 60.0),
        row("e+pd", "auto:1:3", 80.0, 200.0, 90.0),
        row("aggregated", None, 50.0, 100.0),
    ]
    (ratio,) = _encoder_ratios(rows)
    assert ratio == {
        "encoders": "auto:1:3",
        "baseline": "1",
        "request_rate": 2.0,
        "reuse": 0.0,
        "ttft_p50": 0.8,
        "ttft_p99": 0.5,
        "encoder_seconds": 1.5,
    }
    # Against aggregated, each encoder setting keeps its own row.
    versus = _ratios(rows)
    assert [(r["encoders"], r["ttft_p50_vs_aggregated"]) for r in versus] == [
        ("1", 2.0),
        ("auto:1:3", 1.6),
    ]


def test_encoders_flag():
    config = load_config(None, environ={})
    assert parse_encoders("2", config) == (2, None)
    assert parse_encoders("auto", config) == (1, (1, 8))
    assert parse_encoders("auto:2:5", config) == (2, (2, 5))
    for bad in ("auto:3", "auto:0:2", "auto:4:2", "two", "2:3"):
        with pytest.raises(ConfigError, match="--encoders"):
            parse_encoders(bad, config)


# -- epd up --encoders auto ------------------------------------------------------------------

# Distinct 896x896 images, 32 clients at a time: about 35 ms of tower each on the tiny model,
# seconds of work queued at one encoder for longer than new encoders take to start.
BURST = 160
SIZE = 896


def image_bytes(width: int, height: int, seed: int) -> bytes:
    """A distinct gradient per seed, made in numpy (tests/cluster_helpers' makes it pixel by
    pixel: half a second at this size)."""
    y, x = np.mgrid[:height, :width]
    pixels = np.stack([(x * 7 + seed * 31), (y * 5 + seed * 17), (x + y + seed)], axis=-1)
    buf = io.BytesIO()
    Image.fromarray((pixels % 256).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def metric(cluster, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def encoders_running(cluster) -> int:
    return sum(child_named(cluster, f"encoder-{i}") is not None for i in range(8))


def burst(port: int, images: list[bytes], clients: int = 32) -> list[list[int] | Exception]:
    """One request per image, `clients` at a time; each one's tokens or its error."""

    def one(image: bytes) -> list[int] | Exception:
        try:
            return generate(port, (image,), max_tokens=3)
        except Exception as e:  # a failed request is the finding
            return e

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, images))


def test_up_grows_encoders_for_a_burst_and_drains_them_when_idle(up):  # noqa: F811
    """`epd up --encoders auto:1:3`: repeated images (held after the first) leave it at one
    encoder; a burst of distinct images grows it; an idle spell drains it back to one, with
    every request answered, and answered as the same requests are once it is settled."""
    cluster = up(
        "--encoders",
        "auto:1:3",
        env={
            "EPD_PROXY_ENCODER_SCALE_DOWN_SECONDS": "5",
            "EPD_PROXY_ENCODER_WAIT_SLO_SECONDS": "0.25",
            "EPD_PROXY_METRICS_PUBLIC": "1",
            "EPD_PROXY_DASHBOARD_PUBLIC": "1",
            "EPD_LM_BATCH_INVARIANT": "1",  # answers independent of what they were batched with
        },
    )
    cluster.wait_serving()
    assert "1..3, as the planner asks" in "".join(cluster.stdout)
    assert encoders_running(cluster) == 1

    # One image asked about again and again: encoded once, then held; no scaling.
    same = image_bytes(SIZE, SIZE, seed=1)
    answers = burst(cluster.grpc_port, [same] * 48)
    assert all(isinstance(a, list) and len(a) == 3 for a in answers), answers
    time.sleep(2)  # the planner's next ticks see the (lack of) work
    assert metric(cluster, "epd_encoders_desired") == 1
    assert encoders_running(cluster) == 1

    # Distinct images: the encoder's queue is seconds of work -> more encoders.
    images = [image_bytes(SIZE, SIZE, seed=100 + i) for i in range(BURST)]
    desired: list[float] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            desired.append(metric(cluster, "epd_encoders_desired"))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    answers = burst(cluster.grpc_port, images)
    watching.set()
    watcher.join()
    failed = [a for a in answers if not isinstance(a, list)]
    assert not failed, failed
    burst_seconds = time.monotonic() - started
    assert max(desired) > 1, desired
    wait_for(lambda: "encoder-1 SERVING" in "".join(cluster.stderr), "a second encoder", 60)

    # Quiet (a trickle of new images, one at a time, which one encoder keeps up with): back
    # to one encoder, the others drained (not restarted), the trickle answered throughout.
    trickle: list = []
    stop = threading.Event()

    def drip() -> None:
        for i in range(1000):
            if stop.is_set():
                return
            trickle.extend(burst(cluster.grpc_port, [image_bytes(SIZE, SIZE, seed=900 + i)]))
            time.sleep(0.3)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    quiet = time.monotonic()
    wait_for(lambda: encoders_running(cluster) == 1, "the extra encoders to drain", 60)
    drained = time.monotonic() - quiet
    stop.set()
    dripper.join(60)
    assert trickle and all(isinstance(a, list) and len(a) == 3 for a in trickle), trickle
    assert metric(cluster, "epd_encoders_desired") == 1
    status, state = cluster.http_get("/dashboard/state")
    plan = state["planner"]
    assert status == 200 and (plan["min"], plan["max"], plan["scale_down_seconds"]) == (1, 3, 5)
    assert plan["decision"]["desired"] == 1 and plan["decision"]["seconds_per_item"] > 0, plan
    assert state["history"]["series"]["encoders_up"][-1] is not None
    log = "".join(cluster.stderr)
    assert "drained and stopped" in log and "stopped unexpectedly" not in log, log
    print(
        f"planner: {BURST} distinct images answered in {burst_seconds:.1f} s, desired up to "
        f"{max(desired):.0f}, {log.count(' starting: the planner')} encoders started; back to "
        f"one {drained:.1f} s after the burst, {len(trickle)} trickle requests answered meanwhile"
    )

    # The burst's first requests again (their images held now): the same answers.
    assert burst(cluster.grpc_port, images[:48]) == answers[:48]
