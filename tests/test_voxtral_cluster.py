"""Voxtral Realtime through a cluster of real processes: gRPC Generate with an audio item and
POST /v1/audio/transcriptions (the official `openai` client) give transformers' generate
tokens; a held clip is not re-encoded; bad audio is INVALID_ARGUMENT / 400 naming the problem
and the cluster keeps serving."""

from __future__ import annotations

import io
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
import soundfile
import torch

from common.process import free_port
from models.testing import make_checkpoint
from proto import epd_pb2
from tests.cluster_helpers import Cluster
from tests.voxtral_helpers import encode, hf_model, hf_processor, speech_like

SECONDS = 1.3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("vx") / "ckpt", "voxtral_realtime")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoint):
    metrics_port = free_port()
    c = Cluster(
        tmp_path_factory.mktemp("cluster"),
        checkpoint,
        encoders=1,
        encoder={"max_audio_seconds": 4.0, "metrics_port": metrics_port},
        lm={"block_size": 8},
    )
    c.encoder_metrics_port = metrics_port
    yield c
    c.stop()


def expected_ids(checkpoint, wav: bytes) -> list[int]:
    """transformers' generate on the samples the WAV holds (prompt included)."""
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == 16000
    hf = hf_processor(checkpoint)(samples, return_tensors="pt", sampling_rate=16000)
    with torch.no_grad():
        return hf_model(checkpoint).generate(**hf)[0].tolist()


@pytest.fixture(scope="module")
def clip(checkpoint):
    wav = encode(speech_like(SECONDS, seed=5), 16000, "WAV", "FLOAT")
    return wav, expected_ids(checkpoint, wav)


def encoder_forwards(cluster) -> float:
    url = f"http://127.0.0.1:{cluster.encoder_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    m = re.search(r"^epd_encoder_items_encoded_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def grpc_transcribe(cluster, wav: bytes, **sampling):
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=wav))],
        sampling=epd_pb2.SamplingParams(temperature=0.0, **sampling),
        return_prompt_token_ids=True,
    )
    tokens, prompt, last = [], [], None
    for response in cluster.stub.Generate(request, timeout=60):
        tokens.extend(response.token_ids)
        prompt.extend(response.prompt_token_ids)
        last = response
    return prompt, tokens, last


def test_grpc_generate_with_audio_equals_transformers_and_holds_the_clip(cluster, clip):
    wav, expected = clip
    prompt, tokens, last = grpc_transcribe(cluster, wav)
    assert prompt + tokens == expected
    assert last.finish_reason == epd_pb2.FINISH_REASON_STOP
    assert last.usage.mm_items_encoded == 1

    held = cluster.metric("epd_mm_items_total", result="held")
    forwards = encoder_forwards(cluster)
    prompt2, tokens2, last2 = grpc_transcribe(cluster, wav)
    assert prompt2 + tokens2 == expected
    assert last2.usage.mm_items_held == 1 and last2.usage.mm_items_encoded == 0
    assert cluster.metric("epd_mm_items_total", result="held") == held + 1
    assert encoder_forwards(cluster) == forwards  # no new encoder forward


def test_openai_client_transcribes(cluster, clip, checkpoint, tmp_path):
    from openai import OpenAI

    wav, expected = clip
    path = tmp_path / "clip.wav"
    path.write_bytes(wav)
    client = OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    with open(path, "rb") as f:
        result = client.audio.transcriptions.create(
            model="tiny", file=f, extra_body={"return_token_ids": True}
        )
    body = result.model_dump()
    assert body["prompt_token_ids"] + body["token_ids"] == expected
    from models import load_family

    tok = load_family(checkpoint).tokenizer()
    assert result.text == tok.decode(body["token_ids"], skip_special_tokens=True)
    assert body["usage"]["output_tokens"] == len(body["token_ids"])

    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="tiny", file=f, response_format="text")
    assert text == result.text
    with open(path, "rb") as f:
        verbose = client.audio.transcriptions.create(
            model="tiny", file=f, response_format="verbose_json", language="en"
        )
    assert verbose.text == result.text and abs(verbose.duration - SECONDS) < 0.01
    with open(path, "rb") as f:
        events = list(client.audio.transcriptions.create(model="tiny", file=f, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert events[-1].type == "transcript.text.done"
    assert "".join(deltas) == events[-1].text == result.text


BAD = {
    "silence": (encode(np.zeros(16000, dtype=np.float32)), "silent"),
    "empty": (b"", "empty"),
    "corrupt header": (b"RIFF\xff\xff\xff\xffWAVEfmt " + b"\x00" * 64, "not a readable audio"),
    "not audio": (b"<html><body>hello</body></html>" * 20, "not a readable audio"),
    "too long": (encode(speech_like(5.0)), "at most 4 s"),
    # 50 bytes whose header says 1 Hz: 3 s of audio (under this cluster's 4 s) if trusted.
    "rate 1 Hz": (encode(speech_like(0.1)[:3], 1), "sample rate is 1 Hz"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_audio_is_rejected_and_the_cluster_keeps_serving(cluster, clip, case):
    from openai import BadRequestError, OpenAI

    data, match = BAD[case]
    with pytest.raises(grpc.RpcError) as info:
        grpc_transcribe(cluster, data)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details()
    client = OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    with pytest.raises(BadRequestError, match=match):
        client.audio.transcriptions.create(model="tiny", file=("x.wav", data))
    wav, expected = clip
    prompt, tokens, _ = grpc_transcribe(cluster, wav)
    assert prompt + tokens == expected


def test_raw_pcm_at_an_absurd_rate_is_refused_at_once(cluster, clip):
    pcm = (speech_like(0.1)[:3] * 32767).astype("<i2").tobytes()  # 3 s at 1 Hz
    audio = epd_pb2.AudioClip(data=pcm, format=epd_pb2.AUDIO_FORMAT_PCM_S16LE, sample_rate=1)
    request = epd_pb2.GenerateRequest(media=[epd_pb2.MediaItem(audio=audio)])
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sample rate is 1 Hz" in info.value.details()
    assert time.monotonic() - started < 5.0  # refused from the header: no decode, no encode
    wav, expected = clip
    prompt, tokens, _ = grpc_transcribe(cluster, wav)
    assert prompt + tokens == expected


def test_a_text_prompt_or_an_image_is_refused(cluster):
    request = epd_pb2.GenerateRequest(text="hello", sampling=epd_pb2.SamplingParams())
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes one audio item and no prompt" in info.value.details()
    request = epd_pb2.GenerateRequest(media=[epd_pb2.MediaItem(image=b"\x89PNG....")])
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image items are not supported" in info.value.details()


def test_a_chat_holding_only_the_audio_is_a_transcription(cluster, clip):
    wav, expected = clip
    request = epd_pb2.GenerateRequest(
        media=[epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=wav))],
        sampling=epd_pb2.SamplingParams(temperature=0.0),
    )
    request.chat.messages.add(role="user", content=[epd_pb2.ContentPart(media_index=0)])
    tokens = [t for r in cluster.stub.Generate(request, timeout=60) for t in r.token_ids]
    prompt_len = len(expected) - len(tokens)
    assert tokens == expected[prompt_len:] and prompt_len > 0
