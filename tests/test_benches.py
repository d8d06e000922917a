"""Every `epd bench` runs end to end on the tiny model and prints its JSON last (the figures
themselves are measured on purpose, never asserted here)."""

from __future__ import annotations

import json
import subprocess

import pytest

from common.process import epd_command, free_port
from lm_worker.cpu_kernels import KERNELS


def small_images_on_free_ports() -> tuple[str, ...]:
    """`epd bench serve`'s image size and proxy ports for a run on the tiny model."""
    ports = ("--grpc-port", str(free_port()), "--http-port", str(free_port()))
    return ("--image-width", "112", "--image-height", "84", *ports)


def bench(*args: str, stdout: list[str] | None = None) -> dict:
    result = subprocess.run(
        epd_command("bench", *args), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    if stdout is not None:
        stdout.append(result.stdout)
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
    assert set(summary["get_vs_raw_get_total"]) == {"0.01MiB", "0.05MiB"}
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
        "--device",
        "cpu",
        "--mfu-sizes",
        "224",
        "--mfu-batch",
        "2",
    )
    assert summary["batched_vs_one_at_a_time"] > 0
    # The tower's forward alone on two 224 px images: 16 x 16 patches each.
    assert summary["device"] == "cpu" and summary["mfu"]["matmul_peak_tflops"] > 0
    (row,) = summary["mfu"]["sizes"]
    assert row["side"] == 224 and row["grid_thw"] == [1, 16, 16] and row["batch"] == 2
    assert row["images_per_second"] > 0 and row["gflops_per_image"] > 0
    assert 0 < row["mfu"] <= 1


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 10, 14), (2, 6, 8)])
def test_bench_encoder_vision_flops_match_a_flop_counter(tiny_checkpoint, grid):
    """`vision_flops` against torch's FlopCounterMode over the tiny tower's forward: the 16 x 16
    grid's windows are whole, the 10 x 14 one's are cut at the edges, (2, 6, 8) has two frames.
    Both count only matrix products, so they agree exactly; the norms, activations, rotary
    embedding, softmax and bias adds neither counts. NOTE: attention runs torch's math SDPA
    here: the counter has no formula for the CPU's fused kernel and would count it as 0."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from epd.bench.encoder import vision_flops
    from models import load_family

    family = load_family(tiny_checkpoint)
    tower = family.load_encoder(torch.float32, torch.device("cpu")).tower
    t, h, w = grid
    pixels = torch.randn(t * h * w, tower.patch_embed.proj.weight[0].numel())
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        tower.embed_multimodal(pixels, [grid])
    assert counter.get_total_flops() > 0
    assert vision_flops(tower, grid) == pytest.approx(counter.get_total_flops(), rel=1e-6)


@pytest.mark.parametrize("bench_name", ["encoder", "serve", "lm"])
def test_bench_size_is_not_with_model(tiny_checkpoint, bench_name):
    args = ("bench", bench_name, "--model", str(tiny_checkpoint), "--size", "3b")
    result = subprocess.run(epd_command(*args), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--size" in result.stderr, result.stderr[-2000:]


def test_bench_lm(tiny_checkpoint):
    printed: list[str] = []
    summary = bench(
        "lm",
        "--model",
        str(tiny_checkpoint),
        "--tokens",
        "24",
        "--streams",
        "2",
        "--hf-batch",
        "2",
        "--few-streams",
        "3",
        "--rounds",
        "1",
        "--profile",
        "4",
        "--batch-invariant",
        "--prefill-tokens",
        "40,96",
        stdout=printed,
    )
    assert "1 prefill + 3 decode steps" in printed[0] and "Self CPU" in printed[0]
    invariant = summary["batch_invariant"]
    assert invariant["batch1_tps"] > 0 and invariant["streams_vs_ours"] > 0
    assert invariant["few_streams_vs_ours"] > 0
    assert summary["batch1_ours_tps"] > 0 and summary["batch1_hf_tps"] > 0
    # Prefill against HF's forward, and against the measured matmul peak.
    assert [row["tokens"] for row in summary["prefill"]] == [40, 96]
    assert all(row["ours_vs_hf"] > 0 and row["mfu"] > 0 for row in summary["prefill"])
    assert summary["matmul_peak_tflops"] > 0
    assert summary["roofline_tps"] > 0 and summary["streams_vs_hf_batch"] > 0
    assert summary["linear_kernel"] in KERNELS
    assert isinstance(summary["fused_decode"], bool)
    assert summary["few_streams"] == 3 and summary["few_streams_vs_hf"] > 0
    probes = {"sum", "gemv", "sum_4k_pages", "gemv_ours"}
    assert {"sum", "gemv", "sum_4k_pages"} <= set(summary["read_bandwidth_gbps"]) <= probes
    assert 0 <= summary["weights_on_huge_pages"] <= 1
    # Each of the 23 decode steps timed right after a read of its bytes.
    assert summary["paired_steps"] == 23 and summary["batch1_vs_roofline"] > 0
    assert summary["hf_batch1_vs_roofline"] > 0
    assert summary["dtype"] == "float32"  # the checkpoint's
    assert [row["batch"] for row in summary["decode"]] == [1, 8]  # the default on a CPU

    # In bf16 (the float32 run above is the comparison): the step's weights, with no packed
    # fp32 copies, are half the bytes, so twice the roofline at the same read rate.
    args = ("lm", "--model", str(tiny_checkpoint), "--tokens", "8", "--streams", "2")
    bf16 = bench(
        *args,
        "--hf-batch",
        "2",
        "--rounds",
        "1",
        "--dtype",
        "bfloat16",
        "--few-streams",
        "0",
        "--decode-batches",
        "",
    )
    assert bf16["dtype"] == "bfloat16" and bf16["batch1_ours_tps"] > 0
    assert "few_streams" not in bf16 and "decode" not in bf16
    assert bf16["batch1_hf_tps"] > 0 and bf16["streams_vs_hf_batch"] > 0
    assert bf16["weight_bytes"] * 2 == summary["weight_bytes"]


def test_bench_lm_decode_batches(tiny_checkpoint):
    """Our engine's steady decode at batches 1 and 4, against the roofline of the bytes a step
    reads: the weights once, and the KV of every sequence's context."""
    tokens = 8
    summary = bench(
        "lm",
        "--model",
        str(tiny_checkpoint),
        "--tokens",
        str(tokens),
        "--streams",
        "2",
        "--hf-batch",
        "2",
        "--few-streams",
        "0",
        "--rounds",
        "1",
        "--prefill-tokens",
        "",
        "--decode-batches",
        "1,4",
    )
    text = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # K and V, every layer, in fp32.
    kv_per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4
    rows = summary["decode"]
    assert [row["batch"] for row in rows] == [1, 4]
    for row in rows:
        # One prefill step (4 x 64 prompt tokens fit its budget), then every decode step is
        # timed: the i-th reads 64 + i tokens a sequence, 64 + tokens / 2 on average.
        assert row["steps"] == tokens - 1
        assert row["kv_bytes"] == row["batch"] * (64 + tokens // 2) * kv_per_token
        assert row["step_bytes"] == summary["weight_bytes"] + row["kv_bytes"]
        assert row["tps"] > 0 and row["step_ms"] > 0
        assert row["roofline_tps"] > 0 and row["vs_roofline"] > 0
    assert summary["decode_read_probe"] == "sum" and "prefill" not in summary


@pytest.mark.timeout(300)
def test_bench_proxy(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the traced roles export at once
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
        "--prefix-words",
        "20",
        "--tracing",
        "--tracing-tokens",
        "2",
        "--grpc-port",
        str(free_port()),
        "--http-port",
        str(free_port()),
    )
    assert summary["proxy_p50_ms"] > 0 and summary["held_vs_cold_ttft"] > 0
    assert summary["overlap_vs_serial_ttft"] > 0 and summary["overlap_prompt_tokens"] > 0
    # Tracing on exported every role's spans of each traced request to the bench's receiver;
    # off, none of the same requests' spans arrived.
    assert summary["tracing_on_vs_off_ttft"] > 0 and summary["tracing_on_vs_off_total"] > 0
    assert summary["tracing_spans_per_request_off"] == 0
    by_service = summary["tracing_spans_per_request_by_service"]
    assert set(by_service) == {"epd-proxy", "epd-encoder", "epd-lm"}
    assert all(n >= 1 for n in by_service.values())
    assert summary["tracing_spans_per_request_on"] == sum(by_service.values())


@pytest.mark.timeout(300)
def test_bench_serve(tiny_checkpoint, tmp_path):
    plot = tmp_path / "serve.png"
    summary = bench(
        "serve",
        "--model",
        str(tiny_checkpoint),
        "--num-requests",
        "5",
        "--request-rate",
        "inf,10",
        "--reuse",
        "0.5",
        "--output-tokens",
        "4",
        *small_images_on_free_ports(),
        "--plot",
        str(plot),
        "--topology",
        "e+pd,e+p+d,aggregated",
    )
    rows = summary["results"]
    assert {(r["topology"], r["request_rate"]) for r in rows} == {
        (t, rate) for t in ("e+pd", "e+p+d", "aggregated") for rate in ("inf", 10.0)
    }
    for row in rows:
        assert (row["completed"], row["failed"]) == (5, 0), row
        assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"]
        # Only the reused requests find their images cached (a new image set per run); all at
        # once, even they arrive before the first encode of their image is published.
        if row["request_rate"] != "inf":
            assert 0 < row["cache_hit_rate"] < 1, row
    assert {(r["topology"], r["request_rate"]) for r in summary["ratios"]} == {
        (t, rate) for t in ("e+pd", "e+p+d") for rate in ("inf", 10.0)
    }
    assert plot.read_bytes().startswith(b"\x89PNG")
    # Where each point's time went: every role's stages, read off the roles' /metrics in a
    # cluster (the aggregated server's own clocks), per request of that point.
    lm_groups = {"e+pd": ("lm",), "e+p+d": ("prefill", "decode"), "aggregated": ("aggregated",)}
    for row in rows:
        stages = row["stages"]
        means = stages["seconds"]
        assert all(s >= 0 for group in means.values() for s in group.values()), row
        assert stages["per_request"].keys() == means.keys()
        for group in lm_groups[row["topology"]]:
            assert {"prefill_chunk", "decode"} <= set(means[group]), row
        if row["topology"] == "aggregated":
            assert set(means) == {"aggregated"}
            assert {"preprocess", "encode", "queue_wait"} <= set(means["aggregated"])
            continue
        assert list(means) == ["proxy", "encoder", *lm_groups[row["topology"]]], row
        assert next(iter(means["proxy"])) == "validate" and "lm_call" in means["proxy"]
        assert stages["per_request"]["proxy"]["validate"] == 1
        calls = 2 if row["topology"] == "e+p+d" else 1  # a prefill call, then a decode call
        assert stages["per_request"]["proxy"]["lm_call"] == calls, row
        assert means["proxy"]["lm_call"] > 0 and "tower" in means["encoder"]


@pytest.mark.timeout(300)
def test_bench_serve_encoders_auto_under_a_stepped_load(tiny_checkpoint):
    """`--encoders auto:1:2 --rate-schedule`: the e+pd row with the encoder-seconds it used and
    TTFT per step of the schedule. (A fixed count beside it, `--encoders 1,auto:1:2`, is one
    more cluster of the same code: its ratios are held in tests/test_planner.py.)"""
    summary = bench(
        "serve",
        "--model",
        str(tiny_checkpoint),
        "--topology",
        "e+pd",
        "--encoders",
        "auto:1:2",
        "--rate-schedule",
        "6:1.5,2:1",
        "--reuse",
        "0",
        "--output-tokens",
        "2",
        *small_images_on_free_ports(),
    )
    assert summary["rate_schedule"] == "6:1.5,2:1"
    (row,) = summary["results"]
    assert row["encoders"] == "auto:1:2"
    assert row["requests"] > 0 and (row["completed"], row["failed"]) == (row["requests"], 0)
    assert row["encoder_seconds"] > 0 and 1 <= row["encoders_max"] <= 2, row
    steps = row["steps"]
    assert [(s["rate"], s["seconds"]) for s in steps] == [(6.0, 1.5), (2.0, 1.0)]
    assert sum(s["requests"] for s in steps) == row["completed"]
    assert all(s["encoder_seconds"] > 0 for s in steps)


def test_bench_connector_cluster(redis_cluster):
    summary = bench(
        "connector",
        "--cluster",
        "--redis-url",
        redis_cluster.url,
        "--sizes",
        "0.01",
        "--rounds",
        "1",
        "--mib-per-round",
        "0.5",
    )
    assert summary["bench"] == "connector-cluster"
    (result,) = summary["results"]
    assert result["cluster_get_gbps"] > 0 and result["raw_cluster_get_gbps"] > 0
    assert result["single_get_gbps"] > 0 and result["cluster_has_many_per_s"] > 0
    assert set(summary["cluster_get_vs_raw_cluster_get"]) == {"0.01MiB"}


def test_bench_encoder_video(tiny_checkpoint):
    summary = bench(
        "encoder",
        "--video",
        "--model",
        str(tiny_checkpoint),
        "--rounds",
        "1",
        "--video-seconds",
        "2",
        "--video-size",
        "112",
    )
    assert summary["bench"] == "encoder-video"
    assert summary["tokens_per_video_evs"] < summary["tokens_per_video_off"]
    assert summary["ttft_ms_off"] > 0 and summary["ttft_ms_evs"] > 0


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
    assert summary["after_warmup"]["from_interval"] >= 1
    # The proxy's prefix-affinity index, read off its /metrics, holds the prompts it routed.
    blocks = [row["proxy_affinity_blocks"] for row in summary["intervals"]]
    assert blocks[-1] > 0 and blocks == sorted(blocks), blocks


def test_bench_pd(tiny_checkpoint):
    summary = bench(
        "pd",
        "--model",
        str(tiny_checkpoint),
        "--topology",
        "pd,pd-steps",
        "--kv-connector",
        "direct",
        "--streams",
        "2",
        "--long-requests",
        "2",
        "--interval",
        "0.2",
        "--image-size",
        "112",
        "--raw-mb",
        "4",
        "--handover-rounds",
        "1",
        "--handover-tokens",
        "64",
        "--rounds",
        "2",
    )
    assert summary["bench"] == "pd"
    rows = {row["topology"]: row for row in summary["results"]}
    assert set(rows) == {"pd", "pd-steps"}
    for row in rows.values():
        assert row["short_requests"] > 0
        assert row["long_ttft_ms"]["p99"] >= row["long_ttft_ms"]["p50"] > 0
        # Every long prompt was handed over: its blocks went to the tier and were pulled.
        assert row["kv_bytes_sent"] > 0 and row["kv_blocks_pulled"] > 0
    assert summary["layerwise_vs_steps"]["long_ttft_ms_p50"] > 0
    assert all(v > 0 for v in summary["raw"].values())
    # The handover probe: both sides sent the same prompts' KV, and timed it.
    probe = summary["handover"]
    for side in ("layerwise", "steps"):
        assert probe[side]["handover_ms"]["p50"] > 0
        assert probe[side]["kv_bytes_sent"] > 0 and probe[side]["kv_send_gbps"] > 0
    assert probe["layerwise_vs_steps"]["p50"] > 0


def test_bench_realtime():
    summary = bench(
        "realtime",
        "--sessions",
        "2",
        "--seconds",
        "1.2",
        "--grpc-port",
        str(free_port()),
        "--http-port",
        str(free_port()),
    )
    rows = {r["topology"]: r for r in summary["results"]}
    assert set(rows) == {"e+pd", "aggregated"}
    # The same greedy transcription of the same clip on both sides, every session.
    tokens = {t for r in rows.values() for t in r["tokens_per_session"]}
    assert len(tokens) == 1 and tokens.pop() > 0
    for row in rows.values():
        assert row["chunks_measured"] == 2 * 15  # every 80 ms chunk of every session
        lat = row["chunk_latency_ms"]
        assert 0 < lat["p50"] <= lat["p99"]
        assert row["rtf"]["mean"] > 0.5  # paced at real time: about the audio's length
    assert summary["e+pd_over_aggregated_p50"] > 0
