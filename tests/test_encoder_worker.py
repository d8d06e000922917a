"""The encoder worker: a real `epd encoder` process on loopback over a real embedded Redis.

What it publishes decodes to what the tower computes in process; held items and empty requests
run no tower work; a bad item fails alone; concurrent calls share tower batches; SIGTERM
finishes every accepted item. In-process tests cover the pieces (media conversion, the batch
queue, de-duplication, the race between two encoders)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from common.config import ClusterConfig, ConfigError, ConnectorConfig, EncoderConfig, ModelConfig
from common.media import media_from_proto
from common.process import free_port
from connector import AsyncECConnector, ECConnector
from encoder_worker.encoder import BatchQueue, EncodeItem, MMEncoder, _Job
from encoder_worker.metrics import EncoderMetrics
from encoder_worker.tower import load_tower
from models import MediaError, MediaInput, load_family
from models.testing import ReferenceModel, make_checkpoint
from proto import epd_pb2, epd_pb2_grpc
from tests.encoder_helpers import (
    Scrape,
    encoder_config,
    image_item,
    noise_png,
    reference_embeddings,
    video_item,
)
from tests.helpers import sign, worker_channel

# What the Qwen2-VL family answers for an audio item.
NO_AUDIO = "audio items: this model takes images and video"
STORED = epd_pb2.ENCODE_OUTCOME_STORED
HELD = epd_pb2.ENCODE_OUTCOME_HELD
FAILED = epd_pb2.ENCODE_OUTCOME_FAILED
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
# The worker batches items as the reference forward does; both run fp32 on 2 threads here, and
# BLAS may still block a matrix product differently: embeddings agree to 1e-5 (in practice,
# exactly).
ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("encoder") / "tiny", "qwen2_5_vl", "tiny", 7)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return ReferenceModel(checkpoint)


@pytest.fixture
def encoder(tmp_path, checkpoint, redis_server, start_role):
    """start(**encoder_settings) -> (role, stub, metrics port, blocking connector)."""
    channels = []
    connectors = []

    def start(**settings):
        metrics_port = free_port()
        config = encoder_config(
            tmp_path / "cluster.yaml",
            checkpoint,
            redis_server.url,
            metrics_port=metrics_port,
            **settings,
        )
        role = start_role("encoder", config)
        role.wait_status("SERVING")
        channel = worker_channel(role.address)
        channels.append(channel)
        fingerprint = load_family(checkpoint).fingerprint(torch.float32)
        connector = ECConnector(redis_server.url, fingerprint, registry=None)
        connectors.append(connector)
        return role, epd_pb2_grpc.EncoderStub(channel), metrics_port, connector

    yield start
    for channel in channels:
        channel.close()
    for connector in connectors:
        connector.close()


# -- a real encoder process ------------------------------------------------------------------


def test_published_embeddings_equal_the_tower_in_process(encoder, ref):
    role, stub, port, cache = encoder()
    frames = [noise_png(84, 56, seed=10 + i) for i in range(3)]
    items = [
        image_item("img-a", noise_png(120, 90, seed=1)),
        image_item("img-b", noise_png(57, 200, seed=2), max_pixels=56 * 56 * 2),
        video_item("vid-c", frames, fps=2.0),
    ]
    reply = stub.Encode(epd_pb2.EncodeRequest(request_id="r1", items=items), timeout=30)

    want = reference_embeddings(ref, items)
    found, misses = cache.get_many([i.mm_hash for i in items])
    assert misses == []
    for item, result, expected in zip(items, reply.results, want, strict=True):
        assert result.mm_hash == item.mm_hash
        assert result.outcome == STORED, result.error
        got = found[item.mm_hash]
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert result.num_embeddings == got.shape[0] and result.width == got.shape[1] == 64
        assert result.dtype == epd_pb2.DTYPE_FLOAT32
        assert result.nbytes == 64 + got.numel() * 4  # the wire header + the payload
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # Three items of one call ran in one tower forward.
    m = Scrape(port)
    assert (m.batches, m.encoded) == (1, 3)
    assert m.value("epd_encoder_bytes_published_total") == sum(r.nbytes for r in reply.results)

    load = stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5)
    assert load.worker_id == "encoder"
    assert (load.queued_items, load.queued_tokens, load.running_items) == (0, 0, 0)
    assert load.items_per_second > 0 and 0 < load.busy_fraction <= 1
    assert role.terminate() == 0


def test_held_items_and_empty_requests_run_no_tower_work(encoder):
    role, stub, port, cache = encoder()
    first = image_item("first", noise_png(64, 64, seed=3))
    # Another encoder published this one already.
    cache.put("elsewhere", torch.ones(4, 64))
    reply = stub.Encode(epd_pb2.EncodeRequest(items=[first]), timeout=30)
    assert reply.results[0].outcome == STORED
    before = Scrape(port)

    # The empty request: an empty answer, no tower, not even a Redis round trip.
    assert stub.Encode(epd_pb2.EncodeRequest(request_id="empty"), timeout=5).results == []
    assert Scrape(port).epd == before.epd

    again = [first, image_item("elsewhere", noise_png(64, 64, seed=4))]
    reply = stub.Encode(epd_pb2.EncodeRequest(items=again), timeout=30)
    assert [r.outcome for r in reply.results] == [HELD, HELD]
    assert [r.mm_hash for r in reply.results] == ["first", "elsewhere"]
    after = Scrape(port)
    assert (after.batches, after.encoded) == (before.batches, before.encoded) == (1, 1)
    assert after.value("epd_encoder_items_held_total") == 2
    assert after.value("epd_encoder_preprocess_seconds_count") == 1  # held: not even decoded
    # What another encoder stored is left as it was.
    assert torch.equal(cache.get_many(["elsewhere"])[0]["elsewhere"], torch.ones(4, 64))
    assert role.terminate() == 0


def test_a_bad_item_fails_alone_and_its_batch_goes_on(encoder, ref):
    role, stub, port, cache = encoder(max_image_pixels=300 * 300)
    good = [image_item(f"good-{i}", noise_png(70 + 14 * i, 70, seed=20 + i)) for i in range(3)]
    truncated = noise_png(80, 80, seed=5)[:200]
    bad = {
        "truncated": image_item("truncated", truncated),
        "not-an-image": image_item("not-an-image", b"just some text, not an image"),
        "oversize": image_item("oversize", noise_png(400, 300, seed=6)),
        "audio": epd_pb2.EncodeItem(
            mm_hash="audio",
            mm_hash_tag=sign("audio"),
            media=epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=b"RIFF....", format=0)),
        ),
        "no-payload": epd_pb2.EncodeItem(
            mm_hash="no-payload", mm_hash_tag=sign("no-payload"), media=epd_pb2.MediaItem()
        ),
        "bad kwargs": image_item("bad-kwargs", noise_png(64, 64, seed=7), resample=0),
        "bad hash": image_item("not a hash!", noise_png(64, 64, seed=8)),
    }
    items = [good[0], *list(bad.values())[:4], good[1], *list(bad.values())[4:], good[2]]
    reply = stub.Encode(epd_pb2.EncodeRequest(items=items), timeout=30)
    by_hash = {r.mm_hash: r for r in reply.results}
    assert [r.mm_hash for r in reply.results] == [i.mm_hash for i in items]

    for item in good:
        assert by_hash[item.mm_hash].outcome == STORED
    for item in bad.values():
        result = by_hash[item.mm_hash]
        assert result.outcome == FAILED, item.mm_hash
        assert result.error.code == INVALID_ARGUMENT and result.error.message
    assert "corrupt or truncated" in by_hash["truncated"].error.message
    assert "not a recognised image format" in by_hash["not-an-image"].error.message
    assert "above the limit of 90000" in by_hash["oversize"].error.message
    assert by_hash["audio"].error.message == NO_AUDIO
    assert "no payload" in by_hash["no-payload"].error.message
    assert "unknown image processor kwargs ['resample']" in by_hash["bad-kwargs"].error.message
    assert "bad mm_hash" in by_hash["not a hash!"].error.message

    # The good items ran together, in one forward, and decode to the reference.
    m = Scrape(port)
    assert (m.batches, m.encoded) == (1, 3)
    assert m.value("epd_encoder_errors_total", kind="invalid_argument") == len(bad)
    found, misses = cache.get_many([i.mm_hash for i in good])
    assert misses == []
    for item, expected in zip(good, reference_embeddings(ref, good), strict=True):
        torch.testing.assert_close(found[item.mm_hash], expected, atol=ATOL, rtol=0)
    assert cache.has_many(["truncated", "oversize", "audio", "no-payload"]) == [False] * 4
    assert role.terminate() == 0


def test_concurrent_requests_share_tower_batches(encoder):
    role, stub, port, cache = encoder(batch_wait_ms=200)
    calls = [[image_item(f"c{i}", noise_png(64 + 14 * (i % 3), 64, seed=30 + i))] for i in range(8)]
    # Two calls ask for an item that is also in call 0: it is encoded once.
    calls[1].append(calls[0][0])
    calls[2].append(calls[0][0])

    def call(items):
        return stub.Encode(epd_pb2.EncodeRequest(items=items), timeout=30)

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        replies = list(pool.map(call, calls))

    m = Scrape(port)
    assert m.encoded == 8  # c0 once, whoever asked for it
    # Some forward ran items of several calls (8 single-item calls, fewer than 8 forwards).
    assert m.value("epd_encoder_batch_items_bucket", le="1.0") < m.batches < 8
    outcomes = [r.outcome for reply in replies for r in reply.results if r.mm_hash == "c0"]
    assert sorted(outcomes) == [STORED, HELD, HELD]
    assert all(r.outcome in (STORED, HELD) for reply in replies for r in reply.results)
    assert cache.has_many([f"c{i}" for i in range(8)]) == [True] * 8
    assert role.terminate() == 0


def test_sigterm_finishes_every_accepted_item(encoder, checkpoint):
    # A long batch wait holds the tower back until every call is accepted, so SIGTERM arrives
    # with all the work still to do, and a call sent after it sees the drain.
    calls, per_call = 6, 8
    role, stub, port, cache = encoder(
        batch_wait_ms=1500, max_batch_items=calls * per_call + 1, max_batch_tokens=100_000
    )
    requests = [
        epd_pb2.EncodeRequest(
            request_id=f"r{c}",
            items=[
                image_item(f"d{c}-{i}", noise_png(90, 70 + 14 * i, seed=100 * c + i))
                for i in range(per_call)
            ],
        )
        for c in range(calls)
    ]
    hashes = [i.mm_hash for r in requests for i in r.items]
    pool = concurrent.futures.ThreadPoolExecutor(calls)
    futures = [pool.submit(stub.Encode, r, timeout=60) for r in requests]
    processor = load_family(checkpoint).processor()
    tokens = sum(
        processor.grid(media_from_proto(i.media)).num_tokens for r in requests for i in r.items
    )
    deadline = time.monotonic() + 20
    # Accepted (queued), and every header read (their tokens count).
    while (load := stub.GetLoad(epd_pb2.GetLoadRequest(), timeout=5)).queued_tokens < tokens:
        assert time.monotonic() < deadline, "the calls were not all accepted"
        time.sleep(0.02)
    assert (load.queued_items, load.running_items, Scrape(port).encoded) == (len(hashes), 0, 0)

    role.child.signal(15)  # SIGTERM
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Encode(epd_pb2.EncodeRequest(items=[image_item("late", noise_png(64, 64, 9))]))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    for request, future in zip(requests, futures, strict=True):
        reply = future.result(timeout=60)
        assert [r.outcome for r in reply.results] == [STORED] * per_call, request.request_id
    pool.shutdown()
    assert role.child.proc.wait(30) == 0
    found, misses = cache.get_many(hashes)
    assert misses == [] and all(found[h].shape[1] == 64 for h in hashes)
    assert cache.has_many(["late"]) == [False]


# -- in process ------------------------------------------------------------------------------


def test_media_from_proto():
    item = epd_pb2.MediaItem(image=b"png bytes", uuid="u-1")
    item.processor_kwargs.update({"max_pixels": 3136, "size": {"shortest_edge": 56}})
    media = media_from_proto(item)
    assert media == MediaInput(
        "image",
        image=b"png bytes",
        kwargs={"max_pixels": 3136, "size": {"shortest_edge": 56}},
        uuid="u-1",
    )
    assert type(media.kwargs["max_pixels"]) is int  # a Struct number is a double
    video = media_from_proto(
        epd_pb2.MediaItem(video=epd_pb2.VideoFrames(frames=[b"a", b"bc"], fps=4.0))
    )
    assert (video.modality, video.frames, video.fps, video.nbytes) == ("video", (b"a", b"bc"), 4, 3)
    pcm = epd_pb2.AudioClip(data=b"\0\0", format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=16000)
    audio = media_from_proto(epd_pb2.MediaItem(audio=pcm))
    assert (audio.modality, audio.audio.format, audio.audio.sample_rate) == (
        "audio",
        "pcm_s16le",
        16000,
    )
    with pytest.raises(MediaError, match="needs its sample_rate"):
        media_from_proto(epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=b"\0", format=2)))
    with pytest.raises(MediaError, match="no payload"):
        media_from_proto(epd_pb2.MediaItem(uuid="only"))


def test_media_grid_reads_headers_and_refuses_audio(checkpoint):
    processor = load_family(checkpoint).processor()
    grid = processor.grid(MediaInput("image", image=noise_png(112, 56, seed=0)))
    assert (grid.grid_thw, grid.num_tokens) == ((1, 4, 8), 8)
    with pytest.raises(MediaError) as info:
        processor.grid(media_from_proto(epd_pb2.MediaItem(audio=epd_pb2.AudioClip())))
    assert info.value.reason == NO_AUDIO


def _job(name: str, tokens: int) -> _Job:
    job = _Job(EncodeItem(name, MediaInput("image")), done=None)
    job.num_tokens = tokens
    return job


def test_batch_queue_cuts_batches_by_token_budget_and_item_cap():
    queue = BatchQueue(max_items=3, max_tokens=100)
    for name, tokens in [("a", 40), ("b", 40), ("c", 40), ("d", 10), ("e", 250), ("f", 5)]:
        queue.add(_job(name, tokens))
    assert queue.full() and queue.tokens == 385

    def names(batch):
        return [j.mm_hash for j in batch]

    assert names(queue.schedule()) == ["a", "b"]  # c would pass the budget
    assert names(queue.schedule()) == ["c", "d"]  # e would, and nothing skips ahead of it
    assert names(queue.schedule()) == ["e"]  # larger than the budget: alone
    assert names(queue.schedule()) == ["f"]
    assert (queue.schedule(), len(queue), queue.tokens) == ([], 0, 0)
    capped = BatchQueue(max_items=2, max_tokens=10_000)
    for name in "xyz":
        capped.add(_job(name, 1))
    assert names(capped.schedule()) == ["x", "y"]


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"max_batch_items": 0}, "max_batch_items"),
        ({"max_batch_tokens": -1}, "max_batch_tokens"),
        ({"batch_wait_ms": -0.5}, "batch_wait_ms"),
        ({"preprocess_workers": -1}, "preprocess_workers"),
        ({"max_image_pixels": 0}, "max_image_pixels"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"listen": "0.0.0.0:9000", "metrics_port": 9000}, "metrics_port"),
    ],
)
def test_encoder_config_refuses_impossible_values(settings, key):
    with pytest.raises(ConfigError) as info:
        EncoderConfig(**settings)
    assert info.value.key == key


@pytest.fixture
async def engines(checkpoint, redis_server):
    """make(**encoder settings) -> (MMEncoder, its private registry), closed after the test."""
    made: list[MMEncoder] = []
    config = ClusterConfig(
        model=ModelConfig(path=str(checkpoint)), connector=ConnectorConfig(url=redis_server.url)
    )
    tower, served = load_tower(config)

    def make(**settings) -> tuple[MMEncoder, CollectorRegistry]:
        registry = CollectorRegistry()
        connector = AsyncECConnector(redis_server.url, served.fingerprint, registry=None)
        engine = MMEncoder(tower, connector, EncoderConfig(**settings), EncoderMetrics(registry))
        engine.start()
        made.append(engine)
        return engine, registry

    yield make
    for engine in made:
        await engine.close()
        await engine.connector.close()


async def test_nothing_scheduled_is_a_no_op(engines):
    engine, registry = engines()
    assert await engine.execute_mm_encoder([]) == []
    assert registry.get_sample_value("epd_encoder_batch_items_count") == 0
    assert engine.load().queued_items == 0


async def test_duplicates_in_a_call_and_across_calls_encode_once(engines):
    engine, registry = engines(batch_wait_ms=200)
    image = MediaInput("image", image=noise_png(70, 70, seed=40))
    other = MediaInput("image", image=noise_png(84, 70, seed=41))
    call_a = asyncio.create_task(
        engine.execute_mm_encoder([EncodeItem("dup", image), EncodeItem("dup", image)])
    )
    while "dup" not in engine.inflight:  # call a has it in hand
        await asyncio.sleep(0.001)
    b = await engine.execute_mm_encoder([EncodeItem("other", other), EncodeItem("dup", image)])
    a = await call_a
    assert [r.outcome for r in a] == ["stored", "stored"]  # one item, said twice
    assert a[0].nbytes == a[1].nbytes > 0
    assert [r.outcome for r in b] == ["stored", "held"]  # call a was encoding it
    assert b[1].num_embeddings == a[0].num_embeddings and b[1].nbytes == 0
    assert registry.get_sample_value("epd_encoder_items_encoded_total") == 2
    assert registry.get_sample_value("epd_encoder_items_deduplicated_total") == 1
    assert registry.get_sample_value("epd_encoder_batch_items_count") == 1  # one forward


async def test_two_encoders_racing_for_one_item_store_it_once(engines):
    (first, r1), (second, r2) = engines(), engines()
    item = EncodeItem("raced", MediaInput("image", image=noise_png(98, 70, seed=50)))
    results = await asyncio.gather(
        first.execute_mm_encoder([item]), second.execute_mm_encoder([item])
    )
    # Both asked before either published, so both encoded; SET NX stored it once, and the
    # loser reports HELD, not an error.
    assert sorted(r[0].outcome for r in results) == ["held", "stored"]
    assert [r.get_sample_value("epd_encoder_items_encoded_total") for r in (r1, r2)] == [1, 1]
    assert sum(r.get_sample_value("epd_encoder_items_held_total") for r in (r1, r2)) == 1
    for r in (r1, r2):
        for kind in ("invalid_argument", "unavailable", "internal"):
            assert r.get_sample_value("epd_encoder_errors_total", {"kind": kind}) == 0


async def test_redis_unreachable_fails_items_not_the_worker(checkpoint):
    config = ClusterConfig(model=ModelConfig(path=str(checkpoint)))
    tower, served = load_tower(config)
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    connector = AsyncECConnector(url, served.fingerprint, registry=None, retries=0, op_timeout=0.5)
    engine = MMEncoder(tower, connector, EncoderConfig(), EncoderMetrics(None))
    engine.start()
    try:
        item = EncodeItem("x", MediaInput("image", image=noise_png(64, 64, seed=60)))
        (result,) = await engine.execute_mm_encoder([item])
        assert (result.outcome, result.error_kind) == ("failed", "unavailable")
        assert "unreachable" in result.error and engine.inflight == {}
    finally:
        await engine.close()
        await connector.close()


@pytest.mark.cuda
async def test_cuda_tower_publishes_what_the_cpu_reference_computes(checkpoint, ref, redis_server):
    config = ClusterConfig(
        model=ModelConfig(path=str(checkpoint)),
        connector=ConnectorConfig(url=redis_server.url),
        encoder=EncoderConfig(device="cuda"),
    )
    tower, served = load_tower(config)
    assert tower.device.type == "cuda" and tower.dtype == torch.float32  # the checkpoint's
    connector = AsyncECConnector(redis_server.url, served.fingerprint, registry=None)
    engine = MMEncoder(tower, connector, config.encoder, EncoderMetrics(None))
    engine.start()
    items = [image_item(f"gpu-{i}", noise_png(64 + 28 * i, 90, seed=70 + i)) for i in range(3)]
    try:
        results = await engine.execute_mm_encoder(
            [EncodeItem(i.mm_hash, media_from_proto(i.media)) for i in items]
        )
        assert [r.outcome for r in results] == ["stored"] * 3
        found, _ = await connector.get_many([i.mm_hash for i in items])
    finally:
        await engine.close()
        await connector.close()
    for item, expected in zip(items, reference_embeddings(ref, items), strict=True):
        # Other kernels than the CPU's: close, not bit-equal.
        torch.testing.assert_close(found[item.mm_hash], expected, atol=1e-4, rtol=1e-4)


def test_media_to_proto_inverts_media_from_proto():
    from google.protobuf import struct_pb2

    from common.media import media_to_proto

    kwargs = struct_pb2.Struct()
    kwargs.update({"max_pixels": 3136 * 4})
    pcm = epd_pb2.AudioClip(data=b"pcm", format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=16000)
    for msg in (
        epd_pb2.MediaItem(image=b"png-bytes", uuid="u1", processor_kwargs=kwargs),
        epd_pb2.MediaItem(video=epd_pb2.VideoFrames(frames=[b"a", b"b"], fps=2.0)),
        epd_pb2.MediaItem(audio=pcm),
    ):
        item = media_from_proto(msg)
        assert media_from_proto(media_to_proto(item)) == item
