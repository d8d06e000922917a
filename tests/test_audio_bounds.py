"""An audio clip's cost is bounded by what it will cost, not by what its header claims: a
sample rate outside 8 kHz .. 192 kHz (a WAV header's or a raw PCM clip's) is refused, naming
the rate and the range, by the proxy's preparation before any encoder sees the clip, and by the
encoder's decode before anything is resampled; clips at ordinary rates pass and are counted as
before. (The same through a real cluster's HTTP and gRPC endpoints: test_voxtral_cluster.py.)"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from common.served_model import ServedModel
from models import AudioClip, FamilyOptions, MediaError, MediaInput, load_family
from models.testing import make_checkpoint
from models.voxtral_realtime import audio as audio_io
from proto import epd_pb2
from proxy.prepare import BadInput, RequestBuilder
from tests.voxtral_helpers import encode, speech_like

MAX_SECONDS = 4.0  # the encoder-side tests' limit; the builder serves the default 600 s
RANGE = "8000 to 192000 Hz"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vx-bounds") / "ckpt", "voxtral_realtime")


@pytest.fixture(scope="module")
def family(checkpoint):
    return load_family(checkpoint)  # encoder.max_audio_seconds' default: 600 s


@pytest.fixture(scope="module")
def served(checkpoint, family) -> ServedModel:
    return ServedModel(checkpoint, "tiny", torch.float32, family.fingerprint(torch.float32), family)


@pytest.fixture(scope="module")
def builder(served) -> RequestBuilder:
    """The proxy's preparation, as the HTTP transcription endpoint and gRPC Generate use it."""
    return RequestBuilder(served)


@pytest.fixture
def no_resampling(monkeypatch):
    """Fails the test if anything is resampled (the expensive step a bad rate would reach)."""

    def refuse(*args, **kwargs):
        raise AssertionError("resampled a clip that should have been refused")

    monkeypatch.setattr(audio_io.soxr, "resample", refuse)


def wav_at(header_rate: int, frames: int = 599) -> bytes:
    """A 16-bit mono WAV written at 16 kHz whose header then claims `header_rate` (both the
    sample rate and the byte rate fields, as a consistent forged header would)."""
    data = bytearray(encode(np.full(frames, 0.1, dtype=np.float32), 16000, "WAV", "PCM_16"))
    assert data[:4] == b"RIFF" and data[12:16] == b"fmt "
    data[24:28] = struct.pack("<I", header_rate)
    data[28:32] = struct.pack("<I", (header_rate * 2) & 0xFFFFFFFF)
    return bytes(data)


def transcribe(builder: RequestBuilder, clip: AudioClip):
    return builder.build("", [MediaInput("audio", audio=clip)], epd_pb2.SamplingParams())


def test_a_wav_header_claiming_1_hz_is_refused_before_any_encode(builder, family, no_resampling):
    data = wav_at(1)
    assert len(data) < 1300  # 1.2 KB that claim 599 s
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        assert (f.samplerate, f.frames) == (1, 599)
    with pytest.raises(BadInput, match=f"1 Hz.*{RANGE}"):
        transcribe(builder, AudioClip(data, "wav", 0))
    # The encoder's own checks refuse it too, before resampling.
    item = MediaInput("audio", audio=AudioClip(data, "wav", 0))
    with pytest.raises(MediaError, match=f"1 Hz.*{RANGE}"):
        family.processor().preprocess(item)
    with pytest.raises(MediaError, match=f"1 Hz.*{RANGE}"):
        audio_io.decode(item.audio, 16000, MAX_SECONDS)


def test_soundfile_written_at_1_hz_is_refused(builder):
    buf = io.BytesIO()
    soundfile.write(buf, speech_like(0.1)[:599], 1, format="WAV", subtype="PCM_16")
    with pytest.raises(BadInput, match=f"1 Hz.*{RANGE}"):
        transcribe(builder, AudioClip(buf.getvalue(), "wav", 0))


@pytest.mark.parametrize("fmt", ["pcm_s16le", "pcm_f32le"])
def test_raw_pcm_at_1_hz_is_refused(builder, family, fmt, no_resampling):
    samples = speech_like(0.05)[:599]  # 599 s at 1 Hz: under the 600 s bound
    pcm = (samples * 32767).astype("<i2") if fmt == "pcm_s16le" else samples.astype("<f4")
    clip = AudioClip(pcm.tobytes(), fmt, 1)
    with pytest.raises(BadInput, match=f"1 Hz.*{RANGE}"):
        transcribe(builder, clip)
    with pytest.raises(MediaError, match=f"1 Hz.*{RANGE}"):
        audio_io.decode(clip, 16000, MAX_SECONDS)


@pytest.mark.parametrize("rate", [7999, 192001, 2**31 - 1])
def test_rates_just_outside_the_range_are_refused(builder, rate):
    with pytest.raises(BadInput, match=f"{rate} Hz.*{RANGE}"):
        transcribe(builder, AudioClip(wav_at(rate), "wav", 0))
    pcm = (speech_like(0.05) * 32767).astype("<i2").tobytes()
    with pytest.raises(BadInput, match=f"{rate} Hz.*{RANGE}"):
        transcribe(builder, AudioClip(pcm, "pcm_s16le", rate))


@pytest.mark.parametrize("rate", [8000, 16000, 44100, 192000])
def test_clips_at_ordinary_rates_pass_and_count_as_their_length(builder, family, rate):
    seconds = 1.3
    data = encode(speech_like(seconds, rate=rate), rate, "WAV", "PCM_16")
    prepared = transcribe(builder, AudioClip(data, "wav", 0))
    grid = prepared.items[0].grid
    assert grid.seconds == pytest.approx(seconds, abs=1e-4)
    assert grid.num_tokens == audio_io.num_positions(round(seconds * 16000), family.streaming)
    processed = family.processor().preprocess(prepared.items[0].media)
    assert processed.grid == grid
    pcm = (speech_like(seconds, rate=rate) * 32767).astype("<i2").tobytes()
    prepared = transcribe(builder, AudioClip(pcm, "pcm_s16le", rate))
    assert prepared.items[0].grid == grid


def test_a_clip_over_the_limit_is_refused_before_resampling(checkpoint, no_resampling):
    """The count the work will be, at the model's rate, is checked before anything is
    decoded or resampled: the decoder refuses what the header check refuses."""
    family = load_family(checkpoint, FamilyOptions(max_audio_seconds=MAX_SECONDS))
    clip = AudioClip(encode(speech_like(MAX_SECONDS + 0.5, rate=8000), 8000), "wav", 0)
    with pytest.raises(MediaError, match="at most 4 s"):
        family.processor().grid(MediaInput("audio", audio=clip))
    with pytest.raises(MediaError, match="at most 4 s"):
        family.processor().preprocess(MediaInput("audio", audio=clip))
    with pytest.raises(MediaError, match="at most 4 s"):
        audio_io.decode(clip, 16000, MAX_SECONDS)


def test_a_transcription_is_held_to_the_item_token_bound(served, builder):
    clip = AudioClip(encode(speech_like(2.0)), "wav", 0)
    num_tokens = transcribe(builder, clip).items[0].grid.num_tokens
    with pytest.raises(BadInput, match=rf"{num_tokens} tokens.*\(proxy.max_item_tokens\)"):
        transcribe(RequestBuilder(served, max_item_tokens=num_tokens - 1), clip)
