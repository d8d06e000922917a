"""The dashboard's timeline (proxy/timeline.py) in-process: hand-built proxy stages and LM
timings in, the slowest requests' waterfalls and the window's mean breakdown out."""

from __future__ import annotations

import pytest

from common.tracing import Stage
from proto import epd_pb2
from proxy.timeline import Timeline

T0 = 1_760_000_000.0  # wall-clock seconds: a request's first stage starts here
MS = 1_000_000  # ns


def stage(name: str, start_ms: float, end_ms: float, at: float = T0) -> Stage:
    base = int(at * 1e9)
    return Stage(name, base + int(start_ms * MS), base + int(end_ms * MS))


def proxy_stages(at: float = T0, lm_end_ms: float = 300.0) -> list[Stage]:
    """validate, cache_check, encode, a failed LM attempt and the one that answered."""
    return [
        stage("validate", 0, 2, at),
        stage("cache_check", 2, 3, at),
        stage("encode", 3, 40, at),
        stage("lm_call", 5, 20, at),
        stage("lm_call", 20, lm_end_ms, at),
    ]


TIMINGS = epd_pb2.StageTimings(
    queue_seconds=0.01, embedding_wait_seconds=0.03, prefill_seconds=0.05, decode_seconds=0.2
)


def by_name(record: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for b in record["stages"]:
        out.setdefault(b["name"], []).append(b)
    return out


def test_lm_stages_are_laid_inside_the_last_lm_call():
    timeline = Timeline()
    timeline.add("req-a", proxy_stages(), TIMINGS, ok=True, now=T0 + 0.31)
    (record,) = timeline.state(now=T0 + 1)["slowest"]
    assert record["request_id"] == "req-a" and record["ok"] is True
    assert record["ended"] == T0 + 0.31
    assert record["total_seconds"] == pytest.approx(0.31)
    starts = [b["start"] for b in record["stages"]]
    assert starts == sorted(starts) and starts[0] == 0.0

    stages = by_name(record)
    for name in ("validate", "cache_check", "encode", "lm_call"):
        assert {b["role"] for b in stages[name]} == {"proxy"}
    assert [(b["start"], b["seconds"]) for b in stages["lm_call"]] == [
        pytest.approx((0.005, 0.015)),
        pytest.approx((0.02, 0.28)),
    ]
    call = stages["lm_call"][-1]
    lm = {n: stages[n][0] for n in ("queue_wait", "embedding_wait", "prefill", "decode")}
    assert {b["role"] for b in lm.values()} == {"lm"}
    # From the last call's start: its queue, then prefill, then decode; the embedding wait from
    # the start too (beside the prefill).
    assert lm["queue_wait"]["start"] == pytest.approx(0.02)
    assert lm["embedding_wait"]["start"] == pytest.approx(0.02)
    assert lm["prefill"]["start"] == pytest.approx(0.03)
    assert lm["decode"]["start"] == pytest.approx(0.08)
    for b, seconds in zip(lm.values(), (0.01, 0.03, 0.05, 0.2), strict=True):
        assert b["seconds"] == pytest.approx(seconds)
        assert call["start"] <= b["start"] <= b["start"] + b["seconds"]
        assert b["start"] + b["seconds"] <= call["start"] + call["seconds"] + 1e-9

    # A failed request (no timings) keeps its proxy stages only; one without stages is not kept.
    timeline.add("req-failed", proxy_stages(), None, ok=False, now=T0 + 0.31)
    timeline.add("req-empty", [], TIMINGS, ok=True, now=T0 + 0.31)
    state = timeline.state(now=T0 + 1)
    assert state["requests"] == 2
    failed = next(r for r in state["slowest"] if r["request_id"] == "req-failed")
    assert failed["ok"] is False and {b["role"] for b in failed["stages"]} == {"proxy"}


def test_slowest_first_at_most_keep_and_the_window_expires_old_records():
    timeline = Timeline(window=60, keep=3)
    # Five requests ending one second apart, 0.1 s to 0.5 s long, in no order of length.
    lengths = [0.3, 0.1, 0.5, 0.2, 0.4]
    for i, seconds in enumerate(lengths):
        start = T0 + i
        stages = [stage("validate", 0, 1, start), stage("lm_call", 1, seconds * 1000, start)]
        timeline.add(f"req-{i}", stages, None, ok=True, now=start + seconds)

    state = timeline.state(now=T0 + 10)
    assert state["window_seconds"] == 60 and state["requests"] == 5
    assert [r["request_id"] for r in state["slowest"]] == ["req-2", "req-4", "req-0"]
    assert [r["total_seconds"] for r in state["slowest"]] == pytest.approx([0.5, 0.4, 0.3])
    assert state["mean_seconds"] == pytest.approx(0.3)

    # 60 s after the third ended (T0 + 2.5), the first three are gone; the slowest left is req-4.
    state = timeline.state(now=T0 + 2.5 + 60 + 0.01)
    assert state["requests"] == 2
    assert [r["request_id"] for r in state["slowest"]] == ["req-4", "req-3"]
    assert state["mean_seconds"] == pytest.approx(0.3)

    state = timeline.state(now=T0 + 3600)
    assert state == {
        "window_seconds": 60,
        "requests": 0,
        "mean_seconds": None,
        "breakdown": {},
        "slowest": [],
    }


def test_breakdown_is_the_mean_seconds_per_request_of_each_role_stage():
    timeline = Timeline()
    timeline.add("req-a", proxy_stages(), TIMINGS, ok=True, now=T0 + 0.31)
    later = T0 + 5
    timeline.add("req-b", [stage("validate", 0, 4, later)], None, ok=False, now=later + 0.01)
    breakdown = timeline.state(now=T0 + 10)["breakdown"]
    assert list(breakdown) == sorted(breakdown)
    assert breakdown == pytest.approx(
        {
            "proxy validate": (0.002 + 0.004) / 2,
            "proxy cache_check": 0.001 / 2,
            "proxy encode": 0.037 / 2,
            "proxy lm_call": (0.015 + 0.28) / 2,  # both attempts
            "lm queue_wait": 0.01 / 2,
            "lm embedding_wait": 0.03 / 2,
            "lm prefill": 0.05 / 2,
            "lm decode": 0.2 / 2,
        }
    )


def test_records_are_capped():
    timeline = Timeline(cap=4, keep=8)
    for i in range(10):
        timeline.add(f"req-{i}", [stage("validate", 0, 1)], None, ok=True, now=T0 + 1)
    state = timeline.state(now=T0 + 2)
    assert state["requests"] == 4
    assert {r["request_id"] for r in state["slowest"]} == {f"req-{i}" for i in range(6, 10)}
