"""The proxy end to end: real processes (embedded Redis, two encoders, an LM worker, the
proxy) on the tiny model; expected tokens from the models' reference path."""

from __future__ import annotations

import signal
import socket
import threading
import time

import grpc
import openai
import pytest
import redis
import yaml

from common.config import load_config
from common.process import Child, epd_command, free_port
from common.served_model import resolve_model
from models import MediaInput
from models.testing import ImageItem, ReferenceModel, VideoItem
from proto import epd_pb2, epd_pb2_grpc
from proxy.prepare import mm_hash
from tests.cluster_helpers import Cluster, http_json, image_bytes
from tests.encoder_helpers import image_item
from tests.helpers import RoleProcess, wait_until, worker_channel
from tests.model_helpers import make_audio_only, make_video

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def ref(tiny_checkpoint):
    return ReferenceModel(tiny_checkpoint)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(tmp_path_factory.mktemp("cluster"), tiny_checkpoint)
    yield c
    c.stop()


def expected(ref: ReferenceModel, text: str, images=()) -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return ref.generate(
        [{"role": "user", "content": content}],
        [ImageItem(b) for b in images],
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    )


IMAGES = {"one": [image_bytes(96, 64, 1)], "two": [image_bytes(64, 64, 2), image_bytes(56, 84, 3)]}


@pytest.mark.parametrize("kind", ["text", "one", "two"])
def test_grpc_greedy_output_equals_reference(cluster, ref, kind):
    images = IMAGES.get(kind, [])
    tokens, last = cluster.generate(f"Describe {kind}", images, max_tokens=MAX_TOKENS)
    assert tokens == expected(ref, f"Describe {kind}", images)
    assert last.finish_reason == epd_pb2.FINISH_REASON_LENGTH
    assert last.usage.mm_items == len(images)
    assert last.usage.completion_tokens == MAX_TOKENS
    assert last.timings.time_to_first_token_seconds > 0


def openai_content(text: str, images) -> list[dict]:
    import base64

    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [*parts, {"type": "text", "text": text}]


@pytest.mark.parametrize("kind", ["text", "one", "two"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_unchanged_streaming_and_not(cluster, ref, kind, stream):
    images = IMAGES.get(kind, [])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    text = f"Explain {kind} please"
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": openai_content(text, images)}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    want = expected(ref, text, images)
    if stream:
        pieces, token_ids, finish = [], [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0]
            pieces.append(delta.delta.content or "")
            token_ids += (delta.model_extra or {}).get("token_ids") or []
            finish = delta.finish_reason or finish
        assert token_ids == want
        assert "".join(pieces) == ref.tokenizer.decode(want, skip_special_tokens=True)
        assert finish == "length"
    else:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert choice.message.content == ref.tokenizer.decode(want, skip_special_tokens=True)
        assert choice.finish_reason == "length"
        assert reply.usage.completion_tokens == MAX_TOKENS
        assert reply.model_extra["prompt_token_ids"][-3:]  # the expanded prompt


def test_models_health_and_unknown_model(cluster):
    status, models = cluster.http("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    status, health = cluster.http("/health")
    assert status == 200 and health["status"] == "healthy"
    assert {w["status"] for w in health["roles"]["encoder"]["workers"]} == {"SERVING"}
    status, body = cluster.http(
        "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 404 and "The model `nope` does not exist." in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub.Generate(epd_pb2.GenerateRequest(model="nope", text="hi")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_same_image_twice_encodes_once(cluster):
    image = image_bytes(80, 80, 10)
    held_before = cluster.metric("epd_mm_items_total", result="held")
    _, first = cluster.generate("First look", [image], max_tokens=2)
    _, second = cluster.generate("Second look", [image], max_tokens=2)
    assert first.usage.mm_items_encoded == 1 and first.usage.mm_items_held == 0
    assert second.usage.mm_items_held == 1 and second.usage.mm_items_encoded == 0
    assert second.timings.encode_seconds == 0
    assert cluster.metric("epd_mm_items_total", result="held") == held_before + 1


def test_ten_concurrent_requests_with_one_new_image_encode_it_once(cluster):
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
    assert sum(u.mm_items_encoded for u in results) == 1
    assert sum(u.mm_items_deduplicated + u.mm_items_held for u in results) == 9
    assert cluster.metric("epd_mm_items_total", result="encoded") == encoded_before + 1


def test_redis_flushed_between_requests(cluster, ref):
    image = image_bytes(64, 96, 12)
    cluster.generate("Before the flush", [image], max_tokens=2)
    redis.Redis.from_url(cluster.redis.url).flushall()
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    tokens, last = cluster.generate("After the flush", [image], max_tokens=MAX_TOKENS)
    assert tokens == expected(ref, "After the flush", [image])
    assert last.usage.mm_items_held == 0
    # The cache forgot it: encoded again. (Counted on the metric: the LM worker still holds the
    # item in its local tier, so the request may finish before the encoder's reply comes back,
    # and then its usage cannot include that encode.)
    cluster.wait_metric("epd_mm_items_total", encoded + 1, result="encoded")


def test_redis_flushed_between_encode_and_gather(cluster, ref):
    """The proxy sees the item held, the LM worker finds it gone: the LM reports it, the proxy
    re-encodes it, and the request completes."""
    image = image_bytes(88, 64, 13)
    # Published by an encoder directly, so no LM worker holds it in its local tier.
    fingerprint = resolve_model(load_config(cluster.config_path)).fingerprint
    item = image_item(mm_hash(fingerprint, MediaInput("image", image=image)), image)
    with worker_channel(cluster.encoder_addresses[0]) as channel:
        reply = epd_pb2_grpc.EncoderStub(channel).Encode(epd_pb2.EncodeRequest(items=[item]))
    assert reply.results[0].outcome == epd_pb2.ENCODE_OUTCOME_STORED
    reencodes = cluster.metric("epd_reencodes_total")
    held = cluster.metric("epd_mm_items_total", result="held")
    lm = cluster.roles["lm-0"].child
    lm.signal(signal.SIGSTOP)  # the request will sit in the LM's socket while we flush
    try:
        done: list = []
        caller = threading.Thread(
            target=lambda: done.append(cluster.generate("Flushed", [image], max_tokens=MAX_TOKENS))
        )
        caller.start()
        # The proxy found the item held (and sends the LM request, which waits in the stopped
        # LM's socket): flush now, before the LM worker fetches it.
        cluster.wait_metric("epd_mm_items_total", held + 1, result="held")
        redis.Redis.from_url(cluster.redis.url).flushall()
    finally:
        lm.signal(signal.SIGCONT)
    caller.join(60)
    tokens, last = done[0]
    assert last.usage.mm_items_held == 1
    assert tokens == expected(ref, "Flushed", [image])
    assert cluster.metric("epd_reencodes_total") == reencodes + 1


def test_corrupt_image_is_invalid_argument_and_the_next_request_succeeds(cluster):
    good = image_bytes(64, 64, 14)
    truncated = good[: len(good) // 2]  # a valid header, broken pixels: caught by the encoder
    for bad, words in [(b"not an image at all", "not a recognised image"), (truncated, "")]:
        with pytest.raises(grpc.RpcError) as info:
            cluster.generate("Bad", [bad], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details()
    status, body = cluster.http(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"},
                        },
                        {"type": "text", "text": "hi"},
                    ],
                }
            ],
        },
    )
    assert status == 400 and "media item 0" in body["error"]["message"]
    tokens, _ = cluster.generate("Fine again", [good], max_tokens=2)
    assert len(tokens) == 2


def test_audio_to_an_image_model_is_invalid_argument(cluster):
    """A wrong-modality item (audio for an image-only model) and a transcription request to a
    model that does not transcribe: INVALID_ARGUMENT / 400 naming the problem."""
    wav = b"RIFF" + b"\x00" * 60
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=wav))],
        sampling=epd_pb2.SamplingParams(max_tokens=2),
    )
    request.chat.messages.add(role="user", content=[epd_pb2.ContentPart(media_index=0)])
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "audio items are not supported by this model" in info.value.details()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="x")
    with pytest.raises(openai.BadRequestError, match="does not transcribe audio"):
        client.audio.transcriptions.create(model="tiny", file=("a.wav", wav))
    tokens, _ = cluster.generate("Still fine", max_tokens=2)
    assert len(tokens) == 2


def test_client_cancel_and_abort_reach_the_lm_worker(cluster):
    request = epd_pb2.GenerateRequest(
        request_id="to-abort",
        text="Go on",
        # Past EOS: the random model's sampled stream could otherwise stop before the abort.
        sampling=epd_pb2.SamplingParams(max_tokens=5000, ignore_eos=True),
    )
    stream = cluster.stub.Generate(request, timeout=60)
    next(stream)
    assert cluster.stub.Abort(epd_pb2.AbortRequest(request_id="to-abort")).aborted
    last = list(stream)[-1]
    assert last.finish_reason == epd_pb2.FINISH_REASON_ABORT

    stream = cluster.stub.Generate(
        epd_pb2.GenerateRequest(
            text="Go on", sampling=epd_pb2.SamplingParams(max_tokens=5000, ignore_eos=True)
        ),
        timeout=60,
    )
    next(stream)
    stream.cancel()
    lm = worker_channel(cluster.lm_address)
    load_stub = epd_pb2_grpc.LanguageModelStub(lm)
    deadline = time.monotonic() + 10
    while (
        load_stub.GetLoad(epd_pb2.GetLoadRequest()).running_requests and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert load_stub.GetLoad(epd_pb2.GetLoadRequest()).running_requests == 0
    lm.close()


def test_a_full_proxy_sheds_load_and_deadlines_reach_the_lm(cluster, tmp_path):
    # A second proxy over the same workers, with room for one request at a time.
    config = yaml.safe_load(cluster.config_path.read_text())
    grpc_port, http_port = free_port(), free_port()
    config["proxy"].update(grpc_port=grpc_port, http_port=http_port, max_pending_requests=1)
    path = tmp_path / "small-proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = epd_command("proxy", "--config", str(path), "--name", "proxy-b")
    proxy = RoleProcess("proxy-b", "proxy", f"127.0.0.1:{grpc_port}", Child("proxy-b", argv))
    try:
        proxy.wait_status("SERVING", timeout=60)
        wait_until_lm_is_seen(http_port)
        lm_process = cluster.roles["lm-0"].child
        with grpc.insecure_channel(proxy.address) as channel:
            stub = epd_pb2_grpc.InferenceStub(channel)
            lm_process.signal(signal.SIGSTOP)  # requests now sit at the LM worker
            try:
                first = threading.Thread(
                    target=lambda: list(
                        stub.Generate(epd_pb2.GenerateRequest(text="Go"), timeout=60)
                    )
                )
                first.start()  # takes the only slot and waits there
                wait_until(
                    lambda: (
                        http_json(http_port, "/dashboard/state")[1]["proxy"]["pending_requests"]
                        == 1
                    ),
                    "the first request to take proxy-b's only slot",
                )
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(epd_pb2.GenerateRequest(text="Me too"), timeout=30))
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_pending_requests" in info.value.details()
                status, body = http_json(
                    http_port,
                    "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                )
                assert status == 429 and body["error"]["type"] == "RateLimitError"
            finally:
                lm_process.signal(signal.SIGCONT)
            first.join(60)

            # A client deadline travels to the LM worker, which drops the request.
            lm_process.signal(signal.SIGSTOP)
            try:
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(epd_pb2.GenerateRequest(text="Slow"), timeout=1.0))
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                lm_process.signal(signal.SIGCONT)
        with worker_channel(cluster.lm_address) as channel:
            lm = epd_pb2_grpc.LanguageModelStub(channel)
            # Just resumed, the worker may not have read the cancelled call yet (it may even
            # admit it before it reads the cancel): idle for a whole second means it dropped it.
            deadline = time.monotonic() + 10
            idle_since = None
            while idle_since is None or time.monotonic() - idle_since < 1.0:
                assert time.monotonic() < deadline, "the LM worker still runs the request"
                if lm.GetLoad(epd_pb2.GetLoadRequest()).running_requests:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                time.sleep(0.05)
    finally:
        proxy.child.stop(20)


def wait_until_lm_is_seen(http_port: int) -> None:
    """Until the proxy's health watch has seen its LM worker SERVING (before a test stops it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, health = http_json(http_port, "/health")
        if status == 200 and health["roles"]["lm"]["status"] == "healthy":
            return
        time.sleep(0.05)
    raise AssertionError("the proxy never saw its LM worker SERVING")


def test_an_encoder_killed_under_load_fails_no_request(cluster):
    # Last in the module: it kills encoder-1 and brings a registered encoder-2 in.
    results, errors = [], []

    def call(i):
        try:
            results.append(
                cluster.generate(
                    f"Load {i}", [image_bytes(64, 64, 100 + i)], max_tokens=4, timeout=90
                )
            )
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads[:6]:
        t.start()
    cluster.kill("encoder-1")
    for t in threads[6:]:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 12
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = {
            w["address"]: w for w in cluster.http("/health")[1]["roles"]["encoder"]["workers"]
        }
        if workers[cluster.encoder_addresses[1]]["status"] != "SERVING":
            break
        time.sleep(0.1)
    assert workers[cluster.encoder_addresses[1]]["status"] == "UNREACHABLE"
    assert cluster.metric("epd_worker_up", role="encoder", worker=cluster.encoder_addresses[1]) == 0

    # A new encoder that registers through Redis is used without restarting the proxy.
    address = f"127.0.0.1:{free_port()}"
    cluster.start("encoder", "encoder-2", address).wait_status("SERVING", timeout=60)
    cluster.kill("encoder-0")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = {
            w["address"]: w for w in cluster.http("/health")[1]["roles"]["encoder"]["workers"]
        }
        if workers.get(address, {}).get("status") == "SERVING":
            break
        time.sleep(0.1)
    assert workers[address]["source"] == "registry"
    tokens, last = cluster.generate("New encoder", [image_bytes(64, 64, 999)], max_tokens=2)
    assert len(tokens) == 2 and last.usage.mm_items_encoded == 1


# -- video files -----------------------------------------------------------------------------------


def video_part(data: bytes, mime: str = "video/mp4") -> dict:
    import base64

    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def test_openai_video_url_equals_reference_and_is_held_the_second_time(cluster, ref):
    video = make_video("mp4", 16, 4, 112, 112, seed=21)
    text = "What happens in the clip?"
    want = ref.generate(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}],
        [VideoItem(container=video)],
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [video_part(video), {"type": "text", "text": text}]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert reply.choices[0].model_extra["token_ids"] == want
    # The same file over gRPC as container bytes: the same item, held, not encoded again.
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(video_file=video)],
        sampling=epd_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    request.chat.messages.add(
        role="user",
        content=[epd_pb2.ContentPart(media_index=0), epd_pb2.ContentPart(text=text)],
    )
    responses = list(cluster.stub.Generate(request, timeout=60))
    assert [t for r in responses for t in r.token_ids] == want
    usage = responses[-1].usage
    assert usage.mm_items_held == 1 and usage.mm_items_encoded == 0
    assert usage.prompt_tokens == reply.usage.prompt_tokens


def test_bad_videos_are_invalid_argument_naming_the_problem(cluster):
    cases = [
        (b"\x00\x00\x00\x18ftypmp42 but nothing else", "not a readable video container"),
        (make_audio_only(), "no video stream"),
        (make_video("mkv", 40, 4, seed=22)[:1500], "no decodable frames"),
        (make_video("mkv", 40, 4, seed=22)[:12000], "is truncated: its header says 40 frames"),
    ]
    for data, words in cases:
        request = epd_pb2.GenerateRequest(
            media=[epd_pb2.MediaItem(video_file=data)],
            sampling=epd_pb2.SamplingParams(max_tokens=2),
        )
        request.chat.messages.add(role="user", content=[epd_pb2.ContentPart(media_index=0)])
        with pytest.raises(grpc.RpcError) as info:
            list(cluster.stub.Generate(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details(), info.value.details()
    status, body = cluster.http(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [video_part(make_audio_only(), "video/mp4")]}],
        },
    )
    assert status == 400 and "no video stream" in body["error"]["message"]


# Failed dials after which gRPC's default reconnect backoff (1 s, x1.6 a failure, +-20%) waits
# 16.8 s (at least 13.4 s) before the next: past the worker's start plus the proxy's 2 s wait
# for a worker. The proxy's channels (0.1 s to 0.5 s) get there in about 2 s.
DIALS = 7


def count_dials(address: str, dials: int, timeout: float = 60) -> None:
    """Listen on the dead worker's port and refuse the proxy's channel `dials` times: each
    connection is accepted and closed at once (a failed connect, as a refused one is)."""
    host, _, port = address.rpartition(":")
    with socket.create_server((host, int(port))) as server:  # SO_REUSEADDR: past TIME_WAIT
        deadline = time.monotonic() + timeout
        for done in range(dials):
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                connection, _ = server.accept()
            except TimeoutError:
                raise AssertionError(
                    f"the proxy redialled {address} {done} times in {timeout} s, not {dials}"
                ) from None
            connection.close()


def test_an_lm_worker_back_after_an_outage_serves_the_first_request(cluster):
    # Last in the module: it kills the only LM worker until the proxy's channel has failed to
    # redial it DIALS times, enough that gRPC's default reconnect backoff would leave the
    # proxy blind to it for seconds after it is back. The client sends as soon as the
    # worker's own health says SERVING.
    cluster.kill("lm-0")
    deadline = time.monotonic() + 10
    while cluster.http("/health")[0] != 503:
        assert time.monotonic() < deadline, "the proxy still sees the killed LM worker"
        time.sleep(0.1)
    count_dials(cluster.lm_address, DIALS)
    cluster.start("lm", "lm-0", cluster.lm_address).wait_status("SERVING", timeout=120)
    tokens, last = cluster.generate("Back up", max_tokens=3)
    assert len(tokens) == 3 and last.usage.completion_tokens == 3
