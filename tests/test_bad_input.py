"""Malformed input over HTTP and gRPC, against one real cluster: each case is refused with a 4xx
/ INVALID_ARGUMENT (NOT_FOUND for a model) naming the problem, in bounded time, and the cluster
serves on afterwards. Then hypothesis fuzzes the HTTP schema, the gRPC messages and the EC wire
format: nothing a client sends is answered 500 / UNKNOWN / INTERNAL, and wire.decode raises
nothing but WireError."""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import os
import threading
import time
import urllib.request
from pathlib import Path
from unittest import mock

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from common.process import free_port
from connector import wire
from proto import epd_pb2, epd_pb2_grpc
from proxy import validate
from proxy.validate import json_shape
from tests.cluster_helpers import Cluster, image_bytes
from tests.helpers import worker_channel

CONTEXT = 512
MAX_ITEMS = 4
MAX_ITEM_TOKENS = 256
MAX_BODY = 1 << 20
# Every refusal comes back within this (the slowest legitimate refusal is a header read).
BOUND_S = 10.0
LM_METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_checkpoint):
    c = Cluster(
        tmp_path_factory.mktemp("bad-input"),
        tiny_checkpoint,
        encoders=1,
        proxy={
            "max_body_bytes": MAX_BODY,
            "max_media_items": MAX_ITEMS,
            "max_item_tokens": MAX_ITEM_TOKENS,
        },
        lm={"max_model_len": CONTEXT, "metrics_port": LM_METRICS_PORT},
    )
    yield c
    c.stop()


def solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


PNG = image_bytes(96, 64, 5)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def post(cluster: Cluster, body, headers: dict | None = None, chunked: bool = False):
    """(status, parsed JSON or None, seconds) of a raw POST to /v1/chat/completions."""
    if isinstance(body, dict | list | str | int | float) or body is None:
        data = json.dumps(body).encode()
    else:
        data = body
    conn = http.client.HTTPConnection("127.0.0.1", cluster.proxy_http, timeout=60)
    started = time.monotonic()
    try:
        h = {"Content-Type": "application/json", **(headers or {})}
        if chunked:
            pieces = (data[i : i + 65536] for i in range(0, len(data), 65536))
            conn.request("POST", "/v1/chat/completions", pieces, h, encode_chunked=True)
        else:
            conn.request("POST", "/v1/chat/completions", data, h)
        reply = conn.getresponse()
        raw = reply.read()
        status = reply.status
    except (BrokenPipeError, ConnectionResetError):
        # The server refused before reading everything; its answer may still be readable.
        reply = conn.getresponse()
        raw, status = reply.read(), reply.status
    finally:
        conn.close()
    seconds = time.monotonic() - started
    try:
        return status, json.loads(raw), seconds
    except ValueError:
        return status, None, seconds


def user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


def with_(**fields) -> dict:
    return {**user("Hello"), **fields}


def image_part(url=DATA_URL, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


LONG = " ".join(["word"] * (CONTEXT + 50))
EMPTY = {"role": "user", "content": ""}
MANY_MESSAGES = json.dumps({"messages": [EMPTY] * 30_000}).encode()
DEEP = b"[" * 100_000 + b"]" * 100_000

# (name, body (dict: JSON; bytes: raw), expected status, words the error message holds)
HTTP_CASES = [
    ("not json", b"{", 400, "not valid JSON"),
    ("invalid utf-8", b"\xff\xfe{}", 400, "not valid JSON"),
    ("top-level array", b"[1, 2]", 400, "JSON object"),
    ("top-level string", b'"hi"', 400, "JSON object"),
    ("empty body", b"", 400, "not valid JSON"),
    ("deeply nested", DEEP, 400, "nested deeper"),
    ("nested messages", b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}", 400, "nested deeper"),
    (
        "lone surrogate",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "surrogate",
    ),
    ("no messages", {"max_tokens": 4}, 400, "messages must be a non-empty list"),
    ("empty messages", {"messages": []}, 400, "messages must be a non-empty list"),
    ("messages a string", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("message not an object", {"messages": [1]}, 400, "must be an object with a string role"),
    ("no role", {"messages": [{"content": "hi"}]}, 400, "string role"),
    ("role a number", {"messages": [{"role": 5, "content": "hi"}]}, 400, "string role"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "unknown chat role"),
    ("content a number", user(5), 400, "content must be a string or a list"),
    ("content an object", user({"text": "hi"}), 400, "content must be a string or a list"),
    ("part not an object", user([1]), 400, "unsupported content part type"),
    ("unknown part type", user([{"type": "file_url"}]), 400, "unsupported content part"),
    ("video without url", user([{"type": "video_url"}]), 400, "video_url needs a url"),
    ("text not a string", user([{"type": "text", "text": 5}]), 400, "text must be a string"),
    ("image without url", user([{"type": "image_url"}]), 400, "image_url needs a url"),
    ("remote image", user([image_part("http://example.com/x.png")]), 400, "fetches nothing"),
    ("bad base64", user([image_part("data:image/png;base64,@@@")]), 400, "base64"),
    ("url-encoded data", user([image_part("data:image/png,abc")]), 400, "base64-encoded"),
    ("not an image", user([image_part("data:image/png;base64," + b64(b"hello"))]), 400, "media"),
    ("truncated png", user([image_part("data:image/png;base64," + b64(PNG[:40]))]), 400, "media"),
    ("uuid a number", user([image_part(uuid=5)]), 400, "uuid must be a string"),
    ("uuid too long", user([image_part(uuid="u" * 300)]), 400, "at most 256"),
    ("uuid not printable", user([image_part(uuid="a\nb")]), 400, "printable"),
    ("audio not an object", user([{"type": "input_audio", "input_audio": 5}]), 400, "string data"),
    (
        "audio bad base64",
        user([{"type": "input_audio", "input_audio": {"data": "@@"}}]),
        400,
        "not valid base64",
    ),
    (
        "audio to a vision model",
        user([{"type": "input_audio", "input_audio": {"data": b64(b"RIFF")}}]),
        400,
        "not supported by this model",
    ),
    ("too many images", user([image_part()] * (MAX_ITEMS + 1)), 400, "max_media_items"),
    (
        "extreme aspect ratio",
        user([image_part("data:image/png;base64," + b64(solid_png(4000, 10)))]),
        400,
        "aspect ratio",
    ),
    ("max_tokens a string", with_(max_tokens="abc"), 400, "max_tokens must be an integer"),
    ("max_tokens zero", with_(max_tokens=0), 400, "max_tokens must be an integer in [1"),
    ("max_tokens negative", with_(max_tokens=-1), 400, "max_tokens must be an integer in [1"),
    ("max_tokens a float", with_(max_tokens=1e9), 400, "max_tokens must be an integer"),
    ("max_tokens huge", with_(max_tokens=2**40), 400, "max_tokens must be an integer in"),
    ("max_tokens a bool", with_(max_tokens=True), 400, "max_tokens must be an integer"),
    ("max_completion_tokens a string", with_(max_completion_tokens="x"), 400, "max_completion"),
    (
        "temperature NaN",
        b'{"messages":[{"role":"user","content":"a"}],"temperature":NaN}',
        400,
        "temperature must be a finite number",
    ),
    (
        "temperature Infinity",
        b'{"messages":[{"role":"user","content":"a"}],"temperature":Infinity}',
        400,
        "temperature must be a finite number",
    ),
    ("temperature negative", with_(temperature=-1), 400, "temperature must be a finite number"),
    ("temperature above 2", with_(temperature=3), 400, "temperature must be a finite number"),
    ("temperature a string", with_(temperature="0.5"), 400, "temperature must be a number"),
    ("top_p zero", with_(top_p=0), 400, "top_p must be a finite number in (0"),
    ("top_p above 1", with_(top_p=1.5), 400, "top_p must be"),
    ("top_p NaN", b'{"messages":[{"role":"user","content":"a"}],"top_p":NaN}', 400, "top_p"),
    ("top_k below -1", with_(top_k=-2), 400, "top_k must be an integer in [-1"),
    ("top_k a float", with_(top_k=1.5), 400, "top_k must be an integer"),
    ("seed a string", with_(seed="x"), 400, "seed must be an integer"),
    ("seed too large", with_(seed=2**70), 400, "seed must be an integer in"),
    ("n a string", with_(n="abc"), 400, "n must be an integer"),
    ("n two", with_(n=2), 400, "only n=1"),
    ("stream a string", with_(stream="yes"), 400, "stream must be true or false"),
    ("stream_options a string", with_(stream_options="yes"), 400, "stream_options must be"),
    ("include_usage a string", with_(stream_options={"include_usage": "y"}), 400, "include_usage"),
    ("stop a number", with_(stop=5), 400, "stop must be a string or a list of strings"),
    ("stop numbers", with_(stop=[1, 2]), 400, "stop must be a string or a list of strings"),
    ("too many stops", with_(stop=["x"] * 17), 400, "at most 16"),
    ("empty stop", with_(stop=[""]), 400, "each stop string"),
    ("logprobs a string", with_(logprobs="yes"), 400, "logprobs must be true or false"),
    ("top_logprobs 50", with_(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("model a number", with_(model=5), 400, "model must be a string"),
    ("unknown model", with_(model="nope"), 404, "does not exist"),
    ("ignore_eos a string", with_(ignore_eos="true"), 400, "ignore_eos must be true or false"),
    ("return_token_ids 1", with_(return_token_ids=1), 400, "return_token_ids"),
    ("frequency_penalty", with_(frequency_penalty=1.0), 400, "not supported"),
    (
        "presence_penalty NaN",
        b'{"messages":[{"role":"user","content":"a"}],"presence_penalty":NaN}',
        400,
        "presence_penalty",
    ),
    ("prompt over the context", user(LONG), 400, "context"),
    ("max_tokens over the context", with_(max_tokens=CONTEXT), 400, "exceeds the context"),
    ("text far over the context", user("x" * (CONTEXT * 64 + 1)), 400, "characters"),
    ("too many messages", {"messages": [EMPTY] * 2049}, 400, "proxy.max_messages"),
    ("too many parts", user([{"type": "text", "text": ""}] * 4097), 400, "proxy.max_content_parts"),
    # 30,000 empty messages (under the body limit): refused by their count before the body is
    # parsed, so the invalid JSON after them is never seen.
    ("messages by the thousand", MANY_MESSAGES + b" not JSON", 400, "objects and arrays"),
]


@pytest.mark.parametrize(("name", "body", "status", "words"), HTTP_CASES, ids=lambda x: x)
def test_http_refuses(cluster, name, body, status, words):
    got, reply, seconds = post(cluster, body)
    assert got == status, (name, reply)
    assert words in reply["error"]["message"], (name, reply)
    assert seconds < BOUND_S


def test_http_body_over_the_limit_is_refused_before_reading(cluster):
    body = json.dumps(user("y" * (MAX_BODY + 10))).encode()
    status, reply, _ = post(cluster, body)
    assert status == 413 and "proxy.max_body_bytes" in reply["error"]["message"]
    status, reply, _ = post(cluster, body, chunked=True)  # no Content-Length: counted as read
    assert status == 413 and "proxy.max_body_bytes" in reply["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [with_(temperature=1e-40), with_(n=None, stream=None, stop=None), with_(top_k=-1)],
    ids=["denormal temperature", "nulls", "top_k -1"],
)
def test_http_accepts_edge_values(cluster, body):
    status, reply, _ = post(cluster, body)
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")


def test_over_context_with_an_image_is_refused_before_it_is_encoded(cluster):
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    image = "data:image/png;base64," + b64(image_bytes(64, 56, 77))
    status, reply, _ = post(cluster, user([image_part(image), {"type": "text", "text": LONG}]))
    assert status == 400 and "context" in reply["error"]["message"]
    assert cluster.metric("epd_mm_items_total", result="encoded") == encoded


# -- gRPC --------------------------------------------------------------------------------------


def chat(*parts, **fields) -> epd_pb2.GenerateRequest:
    request = epd_pb2.GenerateRequest(sampling=epd_pb2.SamplingParams(max_tokens=4), **fields)
    request.chat.messages.add(role="user", content=list(parts) or [epd_pb2.ContentPart(text="a")])
    return request


def text_part(text: str = "hello") -> epd_pb2.ContentPart:
    return epd_pb2.ContentPart(text=text)


def media_part(i: int = 0) -> epd_pb2.ContentPart:
    return epd_pb2.ContentPart(media_index=i)


def image_item(data: bytes = PNG, **kwargs) -> epd_pb2.MediaItem:
    item = epd_pb2.MediaItem(image=data)
    if kwargs:
        item.processor_kwargs.update(kwargs)
    return item


def sampled(**values) -> epd_pb2.GenerateRequest:
    request = chat()
    for key, value in values.items():
        if key == "stop":
            request.sampling.stop.extend(value)
        else:
            setattr(request.sampling, key, value)
    return request


INVALID = grpc.StatusCode.INVALID_ARGUMENT
GRPC_CASES = [
    ("no prompt", epd_pb2.GenerateRequest(), INVALID, "set one of text, chat or token_ids"),
    ("empty text", epd_pb2.GenerateRequest(text=""), INVALID, "the prompt is empty"),
    (
        "token outside vocab",
        epd_pb2.GenerateRequest(token_ids=epd_pb2.TokenIds(ids=[10**6])),
        INVALID,
        "outside the vocabulary",
    ),
    (
        "too many tokens",
        epd_pb2.GenerateRequest(token_ids=epd_pb2.TokenIds(ids=[1] * CONTEXT)),
        INVALID,
        "the context is",
    ),
    ("temperature NaN", sampled(temperature=math.nan), INVALID, "temperature must be a finite"),
    ("temperature inf", sampled(temperature=math.inf), INVALID, "temperature must be a finite"),
    ("temperature negative", sampled(temperature=-1), INVALID, "temperature must be a finite"),
    ("top_p zero", sampled(top_p=0.0), INVALID, "top_p must be"),
    ("top_p two", sampled(top_p=2.0), INVALID, "top_p must be"),
    ("top_p NaN", sampled(top_p=math.nan), INVALID, "top_p must be"),
    ("max_tokens zero", sampled(max_tokens=0), INVALID, "max_tokens must be >= 1"),
    ("max_tokens over context", sampled(max_tokens=CONTEXT), INVALID, "exceeds the context"),
    ("logprobs 50", sampled(logprobs=50), INVALID, "logprobs must be in 0..20"),
    ("too many stops", sampled(stop=["s"] * 17), INVALID, "at most 16"),
    ("empty stop", sampled(stop=[""]), INVALID, "each stop string"),
    ("request_id too long", chat(request_id="r" * 300), INVALID, "request_id has 300"),
    ("request_id not printable", chat(request_id="a\x00b"), INVALID, "printable"),
    (
        "item without payload",
        chat(media_part(), media=[epd_pb2.MediaItem()]),
        INVALID,
        "no payload",
    ),
    (
        "media index out of range",
        chat(media_part(3), media=[image_item()]),
        INVALID,
        "out of range",
    ),
    (
        "media referenced twice",
        chat(media_part(), media_part(), media=[image_item()]),
        INVALID,
        "referenced twice",
    ),
    ("media unreferenced", chat(text_part(), media=[image_item()]), INVALID, "not referenced"),
    ("garbage image", chat(media_part(), media=[image_item(b"garbage")]), INVALID, "media item"),
    (
        "min_pixels 3 MP",
        chat(media_part(), media=[image_item(min_pixels=3e6, max_pixels=4e6)]),
        INVALID,
        "proxy.max_item_tokens",
    ),
    (
        "min_pixels 1e300",
        chat(media_part(), media=[image_item(min_pixels=1e300, max_pixels=1e300)]),
        INVALID,
        "proxy.max_item_tokens",
    ),
    (
        "min_pixels NaN",
        chat(media_part(), media=[image_item(min_pixels=math.nan)]),
        INVALID,
        "must be finite",
    ),
    (
        "min_pixels a string",
        chat(media_part(), media=[image_item(min_pixels="abc")]),
        INVALID,
        "media item 0",
    ),
    ("unknown kwarg", chat(media_part(), media=[image_item(colour=1)]), INVALID, "unknown image"),
    (
        "min over max pixels",
        chat(media_part(), media=[image_item(min_pixels=3e6)]),
        INVALID,
        "min_pixels <= max_pixels",
    ),
    (
        "too many items",
        chat(*[media_part(i) for i in range(5)], media=[image_item()] * 5),
        INVALID,
        "proxy.max_media_items",
    ),
    (
        "uuid too long",
        chat(media_part(), media=[epd_pb2.MediaItem(image=PNG, uuid="u" * 300)]),
        INVALID,
        "uuid has 300",
    ),
    (
        "unknown role",
        epd_pb2.GenerateRequest(
            chat=epd_pb2.ChatPrompt(
                messages=[epd_pb2.ChatMessage(role="robot", content=[text_part()])]
            )
        ),
        INVALID,
        "unknown chat role",
    ),
    (
        "video without frames",
        chat(media_part(), media=[epd_pb2.MediaItem(video=epd_pb2.VideoFrames(fps=2))]),
        INVALID,
        "media item 0",
    ),
    (
        "audio to a vision model",
        chat(
            media_part(),
            media=[
                epd_pb2.MediaItem(
                    audio=epd_pb2.AudioClip(data=b"RIFF", format=epd_pb2.AUDIO_FORMAT_WAV)
                )
            ],
        ),
        INVALID,
        "not supported by this model",
    ),
    ("unknown model", chat(model="nope"), grpc.StatusCode.NOT_FOUND, "does not exist"),
    ("prompt over the context", chat(text_part(LONG)), INVALID, "context"),
    (
        "too many messages",
        epd_pb2.GenerateRequest(
            chat=epd_pb2.ChatPrompt(
                messages=[epd_pb2.ChatMessage(role="user", content=[text_part("")])] * 2049
            )
        ),
        INVALID,
        "proxy.max_messages",
    ),
]


@pytest.mark.parametrize(("name", "request_", "code", "words"), GRPC_CASES, ids=lambda x: x)
def test_grpc_refuses(cluster, name, request_, code, words):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub.Generate(request_, timeout=30))
    assert info.value.code() == code, (name, info.value.details())
    assert words in info.value.details(), (name, info.value.details())
    assert time.monotonic() - started < BOUND_S


def _reference_shape(value) -> tuple[int, int]:
    """(depth, objects and arrays) of a parsed JSON value, by recursion over it."""
    if isinstance(value, dict | list):
        children = [
            _reference_shape(v) for v in (value.values() if isinstance(value, dict) else value)
        ]
        return 1 + max((d for d, _ in children), default=0), 1 + sum(n for _, n in children)
    return 0, 0


# Strings full of what the shape counts: brackets, quotes, backslashes (escaped or not).
TRICKY = st.text(alphabet='{}[]"\\ab', max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.booleans(), st.integers(1, 12))
def test_json_shape_counts_what_the_parser_builds(value, ascii_only, window):
    """The pre-parse shape check (proxy/validate.json_shape) counts depth and containers
    exactly, whatever the strings hold, and however its windows cut the text (here a few
    bytes each: cuts inside strings, escapes and runs of backslashes)."""
    text = json.dumps({"v": value}, ensure_ascii=ascii_only, indent=None if ascii_only else 1)
    want = _reference_shape({"v": value})
    assert json_shape(text.encode()) == want
    with mock.patch.object(validate, "SHAPE_WINDOW", window):
        assert json_shape(text.encode()) == want


def test_json_shape_needs_memory_for_a_window_not_for_the_body():
    """A million empty messages (29 MB): scanned whole, the check's arrays took the proxy
    +524 MiB; a window at a time, a few tens."""
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 1_000_000}).encode()

    def kib(key: str) -> int:
        lines = Path("/proc/self/status").read_text().splitlines()
        return next(int(line.split()[1]) for line in lines if line.startswith(key))

    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    before = kib("VmRSS")
    assert json_shape(body) == (3, 1_000_002)
    assert kib("VmHWM") - before < 100 * 1024


RAW_METHODS = ["Generate", "Abort", "ListModels"]


@pytest.mark.parametrize("method", RAW_METHODS)
def test_grpc_random_bytes_are_invalid_argument(cluster, method):
    # \x0a\xff: field 1, length 255, then too few bytes: no message parses from it.
    raw = b"\x0a\xff\x01abc"
    path = f"/epd.v1.Inference/{method}"
    if method == "Generate":
        call = cluster.channel.unary_stream(path)
        run = lambda: list(call(raw, timeout=10))  # noqa: E731
    else:
        call = cluster.channel.unary_unary(path)
        run = lambda: call(raw, timeout=10)  # noqa: E731
    with pytest.raises(grpc.RpcError) as info:
        run()
    assert info.value.code() == INVALID, info.value.details()
    assert "not a valid message" in info.value.details()


def test_colliding_request_ids_all_run_and_all_abort(cluster):
    """Two clients sending the same request_id: the second used to be refused by the LM
    (ALREADY_EXISTS), and once one ended the other could no longer be aborted."""
    request = chat(text_part("Count slowly"), request_id="same-id")
    request.sampling.max_tokens = CONTEXT - 64
    request.sampling.ignore_eos = True
    request.sampling.temperature = 0.0
    streams = [cluster.stub.Generate(request, timeout=60) for _ in range(2)]
    for s in streams:
        next(s)  # both are running
    assert cluster.stub.Abort(epd_pb2.AbortRequest(request_id="same-id")).aborted
    for s in streams:
        last = list(s)[-1]
        assert last.finish_reason == epd_pb2.FINISH_REASON_ABORT


def test_an_abandoned_non_streaming_http_request_is_aborted(cluster):
    """A client that goes away before its (non-streaming) answer: the request is aborted on
    the LM worker, instead of generating on for nobody."""
    aborted, ran_out = lm_finished("abort"), lm_finished("length")
    conn = http.client.HTTPConnection("127.0.0.1", cluster.proxy_http, timeout=60)
    body = with_(max_tokens=CONTEXT - 64, ignore_eos=True, temperature=0.0)
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    with worker_channel(cluster.lm_address) as channel:
        stub = epd_pb2_grpc.LanguageModelStub(channel)

        def running() -> int:
            return stub.GetLoad(epd_pb2.GetLoadRequest()).running_requests

        deadline = time.monotonic() + 20
        while running() == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        conn.sock.shutdown(2)  # the client goes away
        conn.close()
        deadline = time.monotonic() + 30
        while running():
            assert time.monotonic() < deadline, "the abandoned request ran on"
            time.sleep(0.05)
    # It ended aborted, not by running to its max_tokens for nobody.
    assert lm_finished("abort") == aborted + 1
    assert lm_finished("length") == ran_out


def lm_finished(reason: str) -> float:
    """The LM worker's count of requests that finished for `reason`."""
    url = f"http://127.0.0.1:{LM_METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(f'epd_lm_requests_total{{finish_reason="{reason}"}} '):
            return float(line.split()[-1])
    return 0.0


# -- fuzzing -----------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=int(os.environ.get("EPD_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_any = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
part = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.one_of(st.text(max_size=30), json_any)}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.one_of(
                st.fixed_dictionaries({"url": st.sampled_from([DATA_URL, "data:,x", "http://x"])}),
                json_any,
            ),
        }
    ),
    json_any,
)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_any)},
    optional={"content": st.one_of(st.text(max_size=40), st.lists(part, max_size=3), json_any)},
)
sampling_value = st.one_of(
    json_leaf, st.integers(min_value=-2, max_value=8), st.floats(min_value=-1, max_value=3)
)
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), json_any)},
    optional={
        key: sampling_value
        for key in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "n",
            "stream",
            "stop",
            "logprobs",
            "top_logprobs",
            "ignore_eos",
            "model",
            "stream_options",
        )
    },
)


def _capped(body: dict) -> dict:
    # Bodies that happen to be valid generate at most a few tokens (keeps the fuzz fast).
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    else:
        body.setdefault("max_tokens", 4)
    return body


@FUZZ
@given(body=chat_body)
def test_fuzz_http_schema_never_answers_5xx(cluster, body):
    status, reply, seconds = post(cluster, _capped(body))
    assert status in (200, 400, 404), (status, body, reply)
    if status != 200:
        assert reply["error"]["message"], reply
    assert seconds < BOUND_S


@FUZZ
@given(raw=st.binary(max_size=200))
def test_fuzz_http_raw_bytes_never_answers_5xx(cluster, raw):
    status, reply, _ = post(cluster, raw)
    assert status in (200, 400, 404), (status, raw, reply)


floats = st.floats(width=32)
grpc_request = st.builds(
    lambda text, ids, kind, temp, top_p, top_k, max_tokens, logprobs, stop, images, kwargs: _grpc(
        text, ids, kind, temp, top_p, top_k, max_tokens, logprobs, stop, images, kwargs
    ),
    st.text(max_size=40),
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=8),
    st.sampled_from(["text", "chat", "token_ids", "none"]),
    st.one_of(st.none(), floats),
    st.one_of(st.none(), floats),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1)),
    st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1)),
    st.lists(st.text(max_size=4), max_size=3),
    st.lists(st.sampled_from([PNG, b"", b"\x89PNG\r\n", solid_png(30, 20)]), max_size=2),
    st.dictionaries(
        st.sampled_from(["min_pixels", "max_pixels", "size", "other"]),
        st.one_of(
            st.floats(), st.integers(min_value=-(2**60), max_value=2**60), st.text(max_size=3)
        ),
        max_size=2,
    ),
)


def _grpc(text, ids, kind, temp, top_p, top_k, max_tokens, logprobs, stop, images, kwargs):
    request = epd_pb2.GenerateRequest()
    if kind == "text":
        request.text = text
    elif kind == "token_ids":
        request.token_ids.ids.extend(ids)
    elif kind == "chat":
        parts = [media_part(i) for i in range(len(images))] + [text_part(text)]
        request.chat.messages.add(role="user", content=parts)
    for data in images:
        item = request.media.add(image=data)
        if kwargs:
            item.processor_kwargs.update(kwargs)
    s = request.sampling
    if temp is not None:
        s.temperature = temp
    if top_p is not None:
        s.top_p = top_p
    s.top_k = top_k
    s.max_tokens = min(max_tokens, 4) if max_tokens is not None else 4
    if logprobs is not None:
        s.logprobs = logprobs
    s.stop.extend(stop)
    return request


@FUZZ
@given(request=grpc_request)
def test_fuzz_grpc_messages_never_unknown_or_internal(cluster, request):
    try:
        list(cluster.stub.Generate(request, timeout=30))
    except grpc.RpcError as e:
        assert e.code() in (INVALID, grpc.StatusCode.NOT_FOUND), (e.code(), e.details(), request)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_fuzz_grpc_raw_bytes(cluster, raw):
    try:
        list(cluster.channel.unary_stream("/epd.v1.Inference/Generate")(raw, timeout=30))
    except grpc.RpcError as e:
        assert e.code() in (INVALID, grpc.StatusCode.NOT_FOUND), (e.code(), e.details())


VALID_ENTRY = wire.encode(torch.arange(12, dtype=torch.float32).view(3, 4))


@settings(max_examples=400, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.tuples(st.integers(0, len(VALID_ENTRY) - 1), st.integers(0, 255)).map(
            lambda p: VALID_ENTRY[: p[0]] + bytes([p[1]]) + VALID_ENTRY[p[0] + 1 :]
        ),
        st.integers(0, len(VALID_ENTRY)).map(lambda n: VALID_ENTRY[:n]),
        st.binary(min_size=1, max_size=64).map(lambda tail: VALID_ENTRY + tail),
        st.binary(min_size=56, max_size=56).map(lambda h: wire.MAGIC + b"\x01\x01\x02" + h[:57]),
    )
)
def test_fuzz_wire_decode_raises_only_wire_error(data):
    try:
        tensor = wire.decode(data)
    except wire.WireError:
        return
    # What decodes is exactly what its header says.
    assert tensor.dtype in wire.CODE_DTYPES.values()
    assert tensor.numel() * tensor.element_size() == len(data) - wire.HEADER_BYTES


# -- afterwards --------------------------------------------------------------------------------


def test_the_cluster_still_serves_after_all_of_it(cluster):
    """Last in the module: every role alive, and a request with an image and one without
    are answered."""
    for role in cluster.roles.values():
        assert role.child.proc.poll() is None, role.name
    tokens, last = cluster.generate("Still there?", [PNG], max_tokens=6)
    assert len(tokens) == 6 and last.finish_reason == epd_pb2.FINISH_REASON_LENGTH
    status, reply, _ = post(cluster, with_(max_tokens=3, temperature=0, ignore_eos=True))
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    results: list = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                post(cluster, with_(max_tokens=3, temperature=0, ignore_eos=True))[0]
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 4
