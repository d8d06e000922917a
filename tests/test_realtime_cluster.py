"""Realtime sessions through a cluster of real processes (2 encoders, 1 LM worker, a proxy):
audio streamed in 80 ms chunks over GET /v1/realtime (the `websockets` client) and gRPC
Realtime comes back as text while it is still being sent, with the token ids of the whole-clip
transcription of the same audio; sessions run concurrently on one LM worker; every way a
session ends leaves no KV blocks, session rows, encoder streams or Redis keys behind; a
session whose encoder is killed (-9) goes on on the other with the same tokens."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest
import redis
import soundfile
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from models.registry import load_family
from models.testing import make_checkpoint
from proto import epd_pb2, epd_pb2_grpc
from proxy.pd import realtime_pick
from proxy.workers import Breaker, Worker, WorkerPool
from tests.cluster_helpers import Cluster
from tests.helpers import wait_until, worker_channel
from tests.voxtral_helpers import encode, speech_like

RATE = 16000
CHUNK = 1280  # 80 ms
IDLE = 2.0
MAX_SESSIONS = 4
MAX_CHUNK_SECONDS = 1.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("vx") / "ckpt", "voxtral_realtime")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("cluster"),
        checkpoint,
        encoders=2,
        lm={"block_size": 8},
        proxy={
            "realtime_max_sessions": MAX_SESSIONS,
            "realtime_idle_timeout_seconds": IDLE,
            "realtime_max_session_seconds": 6.0,
            "realtime_max_chunk_seconds": MAX_CHUNK_SECONDS,
        },
    )
    yield c
    c.stop()


def pcm16_wav(seconds: float, seed: int) -> tuple[bytes, bytes]:
    """(a PCM16 WAV, its raw PCM16 samples): the same audio two ways."""
    wav = encode(speech_like(seconds, seed=seed), RATE, "WAV", "PCM_16")
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == RATE
    return wav, samples.astype("<i2").tobytes()


def whole_clip_ids(cluster, wav: bytes) -> list[int]:
    """The whole-clip transcription (gRPC Generate with the WAV), output ids only."""
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=wav))],
        sampling=epd_pb2.SamplingParams(temperature=0.0),
    )
    return [t for r in cluster.stub.Generate(request, timeout=60) for t in r.token_ids]


@pytest.fixture(scope="module")
def clips(cluster):
    out = {}
    for seed, seconds in ((1, 2.4), (2, 1.6), (3, 2.0), (4, 1.2)):
        wav, pcm = pcm16_wav(seconds, seed)
        out[seed] = (pcm, whole_clip_ids(cluster, wav))
    return out


def chunks(pcm: bytes, size: int = CHUNK) -> list[bytes]:
    step = 2 * size
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


def leftovers(cluster) -> dict:
    """What realtime state is left anywhere: KV blocks, LM sessions and rows, encoder
    streams, Redis keys of session streams."""
    with worker_channel(cluster.lm_address) as channel:
        lm = epd_pb2_grpc.LanguageModelStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
    streams = 0
    for role in cluster.roles.values():
        if role.kind == "encoder" and role.child.proc.poll() is None:
            with worker_channel(role.address) as channel:
                stub = epd_pb2_grpc.EncoderStub(channel)
                streams += stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5).active_streams
    keys = redis.Redis.from_url(cluster.redis.url).keys("epd:rt:*")
    return {
        "kv_blocks": lm.kv_blocks_used,
        "lm_sessions": lm.realtime_sessions,
        "lm_rows": lm.realtime_rows,
        "encoder_streams": streams,
        "redis_keys": len(keys),
        "proxy_sessions": cluster.metric("epd_realtime_sessions_open"),
    }


def assert_nothing_left(cluster, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers(cluster)
        if not any(left.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"realtime state left behind: {left}")
        time.sleep(0.1)


# -- gRPC ---------------------------------------------------------------------------------------


def grpc_session(cluster, pcm: bytes, pace: float = 0.08, events=None, on_chunk=None):
    """One Realtime call: (responses, time the last chunk was sent)."""
    sent = {}

    def requests():
        yield epd_pb2.RealtimeRequest(
            config=epd_pb2.RealtimeConfig(
                model="tiny",
                format=epd_pb2.AUDIO_FORMAT_PCM_S16LE,
                sample_rate=RATE,
                sampling=epd_pb2.SamplingParams(temperature=0.0),
            )
        )
        for i, chunk in enumerate(chunks(pcm)):
            yield epd_pb2.RealtimeRequest(audio=chunk)
            if on_chunk is not None:
                on_chunk(i)
            if pace:
                time.sleep(pace)
        sent["last"] = time.monotonic()
        yield epd_pb2.RealtimeRequest(input_done=epd_pb2.RealtimeInputDone())

    responses = []
    for r in cluster.stub.Realtime(requests(), timeout=120):
        responses.append((time.monotonic(), r))
    return responses, sent["last"]


def test_grpc_realtime_streams_text_while_audio_arrives(cluster, clips):
    pcm, expected = clips[1]
    assert len(expected) > 20  # the clip's tokens, not an early end
    responses, last_sent = grpc_session(cluster, pcm)
    ids = [t for _, r in responses for t in r.token_ids]
    assert ids == expected
    first_at, first = next((t, r) for t, r in responses if r.token_ids)
    assert first_at < last_sent  # text came back before the audio was all sent
    final = responses[-1][1]
    assert final.finish_reason == epd_pb2.FINISH_REASON_STOP
    assert final.usage.completion_tokens == len(expected)
    assert abs(final.audio_seconds - len(pcm) / 2 / RATE) < 1e-6
    covered = [r.audio_seconds for _, r in responses]
    assert covered == sorted(covered) and 0 < first.audio_seconds < covered[-1]
    assert_nothing_left(cluster)


def test_four_concurrent_sessions_each_get_their_tokens_and_a_fifth_is_refused(cluster, clips):
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(MAX_SESSIONS + 1)

    def run(seed: int) -> None:
        pcm, _ = clips[seed]
        try:
            responses, _ = grpc_session(
                cluster, pcm, on_chunk=lambda i: i == 2 and started.wait(30)
            )
            results[seed] = [t for _, r in responses for t in r.token_ids]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in clips]
    for t in threads:
        t.start()
    started.wait(30)  # all four are streaming
    with pytest.raises(grpc.RpcError) as refused:
        grpc_session(cluster, clips[4][0][: 2 * CHUNK], pace=0)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "realtime_max_sessions" in refused.value.details()

    async def websocket_refused() -> dict:
        async with connect(f"ws://127.0.0.1:{cluster.proxy_http}/v1/realtime") as ws:
            return json.loads(await ws.recv())

    error = asyncio.run(websocket_refused())
    assert error["type"] == "error" and error["code"] == "resource_exhausted", error
    assert "realtime_max_sessions" in error["error"]
    for t in threads:
        t.join(120)
    assert not errors, errors
    for seed, (_, expected) in clips.items():
        assert results[seed] == expected, seed
    assert_nothing_left(cluster)


def test_audio_faster_than_real_time_is_taken_in_order(cluster, clips):
    pcm, expected = clips[2]
    responses, _ = grpc_session(cluster, pcm, pace=0)
    assert [t for _, r in responses for t in r.token_ids] == expected
    assert_nothing_left(cluster)


def test_grpc_session_errors(cluster, clips):
    def call(messages):
        return list(cluster.stub.Realtime(iter(messages), timeout=30))

    config = epd_pb2.RealtimeConfig(format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=RATE)
    cases = [
        ([epd_pb2.RealtimeRequest(audio=b"\0\0")], grpc.StatusCode.INVALID_ARGUMENT, "config"),
        (
            [epd_pb2.RealtimeRequest(config=epd_pb2.RealtimeConfig(sample_rate=RATE))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "PCM_S16LE",
        ),
        (
            [
                epd_pb2.RealtimeRequest(
                    config=epd_pb2.RealtimeConfig(
                        format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=8000
                    )
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "16000 Hz",
        ),
        (
            [epd_pb2.RealtimeRequest(config=config), epd_pb2.RealtimeRequest(audio=b"\0")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "whole number",
        ),
        (
            # Over proxy.realtime_max_session_seconds (6 s) in one chunk.
            [
                epd_pb2.RealtimeRequest(config=config),
                epd_pb2.RealtimeRequest(audio=b"\0\0" * (7 * RATE)),
            ],
            grpc.StatusCode.OUT_OF_RANGE,
            "realtime_max_session_seconds",
        ),
        (
            # Within the session's length, but more than one chunk may hold.
            [
                epd_pb2.RealtimeRequest(config=config),
                epd_pb2.RealtimeRequest(audio=b"\0\0" * (2 * RATE)),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "realtime_max_chunk_seconds",
        ),
    ]
    for messages, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            call(messages)
        assert e.value.code() == code and words in e.value.details(), e.value.details()
    assert_nothing_left(cluster)


def test_cancel_and_idle_timeout_leave_nothing(cluster, clips):
    pcm = clips[1][0]
    # Cancel: the client cancels the call mid-session.
    call = None
    go = threading.Event()

    def requests():
        yield epd_pb2.RealtimeRequest(
            config=epd_pb2.RealtimeConfig(format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=RATE)
        )
        for chunk in chunks(pcm)[:15]:
            yield epd_pb2.RealtimeRequest(audio=chunk)
        go.wait(30)

    call = cluster.stub.Realtime(requests(), timeout=60)
    got = 0
    for r in call:
        got += len(r.token_ids)
        if got >= 2:
            break
    call.cancel()
    go.set()
    assert got >= 2
    assert_nothing_left(cluster)

    # Idle: audio, then nothing for longer than the idle timeout.
    def idle_requests():
        yield epd_pb2.RealtimeRequest(
            config=epd_pb2.RealtimeConfig(format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=RATE)
        )
        for chunk in chunks(pcm)[:10]:
            yield epd_pb2.RealtimeRequest(audio=chunk)
        time.sleep(IDLE * 3)

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub.Realtime(idle_requests(), timeout=60))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "realtime_idle_timeout_seconds" in e.value.details()
    assert time.monotonic() - started < IDLE * 3
    assert_nothing_left(cluster)
    assert cluster.metric("epd_realtime_sessions_total", end="idle") >= 1
    assert cluster.metric("epd_realtime_sessions_total", end="cancel") >= 1


# -- WebSocket ----------------------------------------------------------------------------------


async def ws_session(cluster, pcm: bytes, pace: float = 0.08, stop_after: int | None = None):
    """Stream `pcm` through /v1/realtime as a vLLM realtime client does: (events with their
    arrival times, the time the last chunk was sent)."""
    url = f"ws://127.0.0.1:{cluster.proxy_http}/v1/realtime"
    events: list[tuple[float, dict]] = []
    async with connect(url) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["id"]
        await ws.send(json.dumps({"type": "session.update", "model": "tiny"}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

        async def receive():
            async for message in ws:
                event = json.loads(message)
                events.append((time.monotonic(), event))
                if event["type"] in ("transcription.done", "error"):
                    return

        receiver = asyncio.create_task(receive())
        for i, chunk in enumerate(chunks(pcm)):
            if stop_after is not None and i == stop_after:
                receiver.cancel()
                return events, None  # leaves: the socket closes mid-session
            audio = base64.b64encode(chunk).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await asyncio.sleep(pace)
        last_sent = time.monotonic()
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        await asyncio.wait_for(receiver, 60)
    return events, last_sent


async def test_websocket_realtime_streams_text_while_audio_arrives(cluster, clips):
    pcm, expected = clips[1]
    events, last_sent = await ws_session(cluster, pcm)
    deltas = [(t, e) for t, e in events if e["type"] == "transcription.delta"]
    done = events[-1][1]
    assert done["type"] == "transcription.done", events[-1]
    assert deltas[0][0] < last_sent  # the first delta came before the last chunk was sent
    assert "".join(e["delta"] for _, e in deltas) == done["text"]
    ids = [t for _, e in deltas for t in e["token_ids"]]
    assert ids == expected == done["token_ids"]
    assert done["usage"]["completion_tokens"] == len(expected)
    await asyncio.to_thread(assert_nothing_left, cluster)


async def test_websocket_disconnect_and_errors(cluster, clips):
    pcm = clips[3][0]
    await ws_session(cluster, pcm, stop_after=12)
    await asyncio.to_thread(assert_nothing_left, cluster)
    assert cluster.metric("epd_realtime_sessions_total", end="disconnect") >= 1

    url = f"ws://127.0.0.1:{cluster.proxy_http}/v1/realtime"
    async with connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and "base64" in error["error"]
        await ws.send(json.dumps({"type": "nonsense"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and "unknown event type" in error["error"]
        await ws.send(json.dumps({"type": "session.update", "model": "other"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "not_found"
    await asyncio.to_thread(assert_nothing_left, cluster)


async def _handshake_then_leave(port: int) -> None:
    """A WebSocket upgrade request, and the connection dropped before any answer is read: a
    page closed before it could speak."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    writer.transport.abort()  # RST: gone, no close frame


async def test_websocket_clients_that_leave_before_the_audio_leak_no_session(cluster):
    """Clients that leave before sending audio, in every way a page can, end their sessions:
    three times proxy.realtime_max_sessions of them, and sessions still open afterwards."""
    url = f"ws://127.0.0.1:{cluster.proxy_http}/v1/realtime"
    for i in range(3 * MAX_SESSIONS):
        how = i % 4
        if how == 0:
            await _handshake_then_leave(cluster.proxy_http)
        elif how == 1:  # session.created read, then the socket closed cleanly
            async with connect(url) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
        elif how == 2:  # the settings sent, then closed
            async with connect(url) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "session.update", "model": "tiny"}))
        else:  # the TCP connection dropped under an open session
            ws = await connect(url)
            await ws.recv()
            ws.transport.abort()
    await asyncio.to_thread(assert_nothing_left, cluster)
    for _ in range(MAX_SESSIONS):  # every slot is free again
        async with connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
    await asyncio.to_thread(assert_nothing_left, cluster)


async def test_websocket_hostile_events_get_an_error_event_and_the_session_goes_on(cluster):
    """An event nested 50,000 deep, a number of 100,000 digits and a chunk over
    proxy.realtime_max_chunk_seconds each get an `error` event, and the session stays usable;
    a frame larger than any chunk's event (a million digits, megabytes of audio) is refused
    before it is read whole (close code 1009)."""
    url = f"ws://127.0.0.1:{cluster.proxy_http}/v1/realtime"
    too_long = base64.b64encode(b"\0\0" * int(1.5 * RATE * MAX_CHUNK_SECONDS)).decode()
    async with connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for event, words in (
            ("[" * 50_000 + "]" * 50_000, "JSON object"),
            ('{"type": "session.update", "temperature": ' + "9" * 100_000 + "}", "JSON object"),
            (
                json.dumps({"type": "input_audio_buffer.append", "audio": too_long}),
                "realtime_max_chunk_seconds",
            ),
        ):
            await ws.send(event)
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and words in error["error"], error
        await ws.send(json.dumps({"type": "session.update", "model": "tiny"}))
        await ws.send(json.dumps({"type": "nonsense"}))  # still answered: the session lives
        assert "unknown event type" in json.loads(await ws.recv())["error"]
    async with connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send("x" * (8 << 20))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    await asyncio.to_thread(assert_nothing_left, cluster)


# -- faults (last: it kills an encoder) ----------------------------------------------------------


def test_encoder_killed_mid_session_the_other_replays_the_audio(cluster, clips):
    pcm, expected = clips[1]
    killed: list[str] = []

    def kill_the_sessions_encoder(i: int) -> None:
        if i != 12:
            return
        for name, role in cluster.roles.items():
            if role.kind != "encoder":
                continue
            with worker_channel(role.address) as channel:
                load = epd_pb2_grpc.EncoderStub(channel).GetLoad(
                    epd_pb2.GetLoadRequest(), timeout=5
                )
            if load.active_streams:
                cluster.kill(name)
                killed.append(name)
                return

    before = cluster.metric("epd_realtime_failovers_total", role="encoder")
    responses, _ = grpc_session(cluster, pcm, on_chunk=kill_the_sessions_encoder)
    assert len(killed) == 1
    assert [t for _, r in responses for t in r.token_ids] == expected
    assert cluster.metric("epd_realtime_failovers_total", role="encoder") == before + 1
    assert_nothing_left(cluster)


def test_metrics_and_dashboard_show_the_sessions(cluster):
    assert cluster.metric("epd_realtime_chunk_latency_seconds_count") > 0
    # Each chunk is a stage of the session's trace (common/tracing.py), counted once.
    chunks = cluster.metric("epd_stage_seconds_count", role="proxy", stage="realtime_chunk")
    assert chunks == cluster.metric("epd_realtime_chunk_latency_seconds_count")
    assert cluster.metric("epd_realtime_audio_seconds_total") > 0
    assert cluster.metric("epd_realtime_sessions_open") == 0
    status, state = cluster.http("/dashboard/state")
    assert status == 200
    rt = state["traffic"]["realtime"]
    assert rt["sessions_open"] == 0 and rt["audio_seconds"] > 10
    # Paced audio: the LM had steps where a session waited for its next embedding.
    assert rt["waiting_steps"] > 0
    assert rt["chunk_latency"]["count"] > 0 and rt["chunk_latency"]["p50"] > 0


# -- per-worker limits, then an LM worker killed mid-session (a cluster of its own: one encoder
# that takes one stream, two LM workers that take one session each, lm-0 a decode worker and
# lm-1 a `both` worker: the split's preference is held by the same cluster) --------------------


@pytest.fixture(scope="module")
def two_lms(tmp_path_factory, checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("two-lms"),
        checkpoint,
        encoders=1,
        lms=2,
        lm_roles=("decode", "both"),
        lm={"block_size": 8, "max_realtime_sessions": 1},
        encoder={"max_streams": 1},
    )
    yield c
    c.stop()


class HeldCall:
    """A stream-in call held open: its requests come from a queue until `close`."""

    def __init__(self, method, first):
        self.requests: queue.Queue = queue.Queue()
        self.requests.put(first)
        self.call = method(iter(self.requests.get, None), timeout=60)

    def send(self, msg) -> None:
        self.requests.put(msg)

    def close(self) -> list:
        self.requests.put(None)
        return list(self.call)


def lm_load(address: str) -> epd_pb2.GetLoadResponse:
    with worker_channel(address) as channel:
        return epd_pb2_grpc.LanguageModelStub(channel).GetLoad(epd_pb2.GetLoadRequest(), timeout=5)


def wait_lm_sessions(address: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while lm_load(address).realtime_sessions != count:
        assert time.monotonic() < deadline, f"{address}: never {count} realtime sessions"
        time.sleep(0.05)


def test_an_encoder_takes_at_most_its_max_streams(two_lms, clips):
    encoder = next(r.address for r in two_lms.roles.values() if r.kind == "encoder")
    channel = worker_channel(encoder)
    stub = epd_pb2_grpc.EncoderStub(channel)

    def start(session_id: str) -> epd_pb2.EncodeStreamRequest:
        return epd_pb2.EncodeStreamRequest(
            start=epd_pb2.EncodeStreamStart(
                session_id=session_id, format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=RATE
            )
        )

    audio = epd_pb2.EncodeStreamRequest(audio=b"\0\0" * CHUNK)
    held = HeldCall(stub.EncodeStream, start("held-1"))
    try:
        held.send(audio)
        assert next(held.call).num_published == 0  # accepted: the stream is open there
        with pytest.raises(grpc.RpcError) as full:
            list(stub.EncodeStream(iter([start("held-2"), audio]), timeout=10))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "encoder.max_streams" in full.value.details()

        # Sessions through the proxy find no other encoder: they fail as full, not broken
        # (the proxy sends audio only once accepted, so the refusal never races a write), and
        # at once: every encoder it tried was full, so it waits for no other to come up
        # (proxy/realtime.py `_wait`). Six of them, two at a time (one per LM worker's session
        # slot, freed before the next pair).
        def refused_session() -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as refused:
                grpc_session(two_lms, clips[4][0], pace=0)
            return refused.value

        with futures.ThreadPoolExecutor(2) as pool:
            for _ in range(3):
                for error in pool.map(lambda _: refused_session(), range(2)):
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "encoder.max_streams" in error.details()
                for address in two_lms.lm_addresses:  # their LM sessions ended
                    wait_lm_sessions(address, 0)
    finally:
        held.send(epd_pb2.EncodeStreamRequest(input_done=epd_pb2.RealtimeInputDone()))
        last = held.close()
    assert last[-1].done
    channel.close()
    redis.Redis.from_url(two_lms.redis.url).delete("epd:rt:{held-1}")
    # The slot is free again, and the encoder was not set aside: the next session runs.
    pcm, expected = clips[4]
    responses, _ = grpc_session(two_lms, pcm, pace=0)
    assert [t for _, r in responses for t in r.token_ids] == expected
    assert_nothing_left(two_lms)


def test_an_lm_worker_takes_at_most_its_max_realtime_sessions(two_lms, clips, checkpoint):
    prompt = load_family(checkpoint).realtime_prompt()
    lm0, lm1 = two_lms.lm_addresses

    def held_session(address: str, session_id: str):
        """A realtime request straight to an LM worker: it waits there for audio."""
        msg = epd_pb2.LMGenerateRequest(
            request_id=session_id,
            prompt_token_ids=prompt,
            sampling=epd_pb2.SamplingParams(temperature=0.0),
            realtime_session_id=session_id,
        )
        msg.mm_features.add(
            mm_hash=session_id, modality=epd_pb2.MODALITY_AUDIO, offset=0, length=len(prompt)
        )
        channel = worker_channel(address)
        return channel, epd_pb2_grpc.LanguageModelStub(channel).Generate(msg, timeout=60)

    # lm-1, the `both` worker sessions prefer, full: a second session there is refused.
    held = [held_session(lm1, "held-lm-1")]
    wait_lm_sessions(lm1, 1)
    channel, refused = held_session(lm1, "held-lm-2")
    with pytest.raises(grpc.RpcError) as full:
        list(refused)
    channel.close()
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "lm.max_realtime_sessions" in full.value.details()

    # One LM worker full: a session through the proxy runs on the other (the decode worker,
    # past the full `both` worker it prefers), whole.
    pcm, expected = clips[2]
    responses, _ = grpc_session(two_lms, pcm, pace=0)
    assert [t for _, r in responses for t in r.token_ids] == expected

    # Both full: the session fails as full (RESOURCE_EXHAUSTED), and leaves nothing.
    held.append(held_session(lm0, "held-lm-3"))
    wait_lm_sessions(lm0, 1)
    with pytest.raises(grpc.RpcError) as refused:
        grpc_session(two_lms, pcm, pace=0)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "lm.max_realtime_sessions" in refused.value.details()

    for channel, call in held:
        call.cancel()
        channel.close()
    wait_lm_sessions(lm0, 0)
    wait_lm_sessions(lm1, 0)
    # The refused session's encoder stream ends as the session fails (the encoder takes one
    # stream here): the next session waits for its slot.
    wait_until(lambda: leftovers(two_lms)["encoder_streams"] == 0, "the encoder's slot free")
    responses, _ = grpc_session(two_lms, pcm, pace=0)
    assert [t for _, r in responses for t in r.token_ids] == expected
    assert_nothing_left(two_lms)


def test_lm_worker_killed_mid_session_the_decode_worker_continues_without_repeating(two_lms, clips):
    """The session starts on the `both` worker (lm-1) whatever the load order of the two; when
    it is killed, the decode worker takes the session whole and it goes on unchanged: every
    token once, in order, and the same text."""
    pcm, expected = clips[1]
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while True:  # until the proxy has learned both workers' roles (from GetLoad)
        _, state = two_lms.http("/dashboard/state")
        if sum(1 for w in state["workers"] if w["role"] == "lm" and w["load"]) == 2:
            break
        assert time.monotonic() < deadline, state["workers"]
        time.sleep(0.1)

    def kill_the_both_worker(i: int) -> None:
        if i != 14:
            return
        seen.extend(n for n, load in _lm_loads(two_lms).items() if load.realtime_sessions)
        two_lms.kill("lm-1")

    wav, _ = pcm16_wav(2.4, 1)  # clips[1]'s audio
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=wav))],
        sampling=epd_pb2.SamplingParams(temperature=0.0),
    )
    whole_text = "".join(r.text for r in two_lms.stub.Generate(request, timeout=60))
    # (earlier tests here moved sessions off full workers: those count too)
    failovers = two_lms.metric("epd_realtime_failovers_total", role="lm")
    responses, _ = grpc_session(two_lms, pcm, on_chunk=kill_the_both_worker)
    assert seen == ["lm-1"]
    # Every token once, in order: the new worker re-prefilled the prompt and the tokens sent
    # from the session's stream and went on; and the text too (what the first worker held
    # back at the cut is released by the second, once).
    assert [t for _, r in responses for t in r.token_ids] == expected
    assert "".join(r.text for _, r in responses) == whole_text
    assert two_lms.metric("epd_realtime_failovers_total", role="lm") == failovers + 1
    assert _lm_loads(two_lms)["lm-0"].realtime_rows == 0  # the session ended there


# -- the prefill / decode split: sessions stay on `both` workers ---------------------------------


def test_realtime_sessions_prefer_both_then_decode_then_prefill_workers():
    lms = WorkerPool("lm", None, (), None)
    for address, role, queued in (
        ("p:1", "prefill", 0),
        ("d:1", "decode", 10),
        ("d:2", "decode", 5),
        ("b:1", "both", 100),
    ):
        w = Worker("lm", address, "static", None, None, Breaker(3, 1.0), status="SERVING")
        w.set_load(epd_pb2.LMLoad(role=role, running_tokens=queued))
        lms.workers[address] = w
    assert realtime_pick(lms, set()).address == "b:1"  # busier, but the only `both` worker
    assert realtime_pick(lms, {"b:1"}).address == "d:2"  # then decode, least loaded first
    assert realtime_pick(lms, {"b:1", "d:1", "d:2"}).address == "p:1"
    assert realtime_pick(lms, set(lms.workers)) is None


def _lm_loads(cluster) -> dict[str, epd_pb2.LMLoad]:
    """The live LM workers' own loads, by name."""
    out = {}
    for name, role in cluster.roles.items():
        if role.kind != "lm" or role.child.proc.poll() is not None:
            continue
        with worker_channel(role.address) as channel:
            out[name] = epd_pb2_grpc.LanguageModelStub(channel).GetLoad(
                epd_pb2.GetLoadRequest(), timeout=5
            )
    return out
