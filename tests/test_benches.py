"""Every `epd bench` runs end to end on the tiny model and prints its JSON last (the figures
themselves are measured on purpose, never asserted here)."""

from __future__ import annotations

import json
import subprocess

import pytest

from common.process import epd_command, free_port


def bench(*args: str) -> dict:
    result = subprocess.run(
        epd_command("bench", *args), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_connector(redis_server):
    summary = bench(
        "connector",
        "--redis-url",
        redis_server.url,
        "--sizes",
        "0.01,0.05",
        "--rounds",
        "1",
        "--mib-per-round",
        "1",
    )
    assert summary["bench"] == "connector"
    assert set(summary["get_vs_raw_get"]) == {"0.01MiB", "0.05MiB"}
    assert all(r["raw_get_gbps"] > 0 and r["get_gbps"] > 0 for r in summary["results"])


def test_bench_encoder(tiny_checkpoint, redis_server):
    summary = bench(
        "encoder",
        "--model",
        str(tiny_checkpoint),
        "--redis-url",
        redis_server.url,
        "--items",
        "4",
        "--image-size",
        "56",
        "--rounds",
        "1",
        "--concurrency",
        "2",
    )
    assert summary["batched_vs_one_at_a_time"] > 0


def test_bench_lm(tiny_checkpoint):
    summary = bench(
        "lm",
        "--model",
        str(tiny_checkpoint),
        "--tokens",
        "4",
        "--streams",
        "2",
        "--hf-batch",
        "2",
        "--rounds",
        "1",
    )
    assert summary["batch1_ours_tps"] > 0 and summary["batch1_hf_tps"] > 0
    assert summary["roofline_tps"] > 0 and summary["streams_vs_hf_batch"] > 0


@pytest.mark.timeout(300)
def test_bench_proxy(tiny_checkpoint):
    summary = bench(
        "proxy",
        "--model",
        str(tiny_checkpoint),
        "--requests",
        "3",
        "--image-requests",
        "1",
        "--image-size",
        "56",
        "--grpc-port",
        str(free_port()),
        "--http-port",
        str(free_port()),
    )
    assert summary["proxy_p50_ms"] > 0 and summary["held_vs_cold_ttft"] > 0


@pytest.mark.timeout(300)
def test_bench_soak(tiny_checkpoint):
    summary = bench(
        "soak",
        "--model",
        str(tiny_checkpoint),
        "--minutes",
        "0.15",
        "--interval-seconds",
        "4",
        "--concurrency",
        "2",
        "--max-tokens",
        "4",
        "--image-size",
        "56",
        "--grpc-port",
        str(free_port()),
        "--http-port",
        str(free_port()),
    )
    assert summary["bench"] == "soak" and summary["requests"] > 0
    assert summary["errors"] == 0, summary["intervals"]
    assert len(summary["intervals"]) >= 2
    assert set(summary["rss_growth_mib"]) >= {"proxy", "lm-0", "encoder-0", "redis"}
