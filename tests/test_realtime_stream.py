"""The streaming audio encoder (models/voxtral_realtime/streaming.py): a session fed chunk by
chunk gives, in order, the whole clip's embeddings, whatever the chunk sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import load_family
from models.media import MediaError
from models.testing import make_checkpoint
from models.voxtral_realtime import audio as audio_io
from tests.voxtral_helpers import speech_like


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("vx-stream") / "ckpt", "voxtral_realtime")
    family = load_family(path)
    return family, family.load_encoder(torch.float32, torch.device("cpu"))


def whole_clip(family, encoder, samples: np.ndarray) -> torch.Tensor:
    padded = audio_io.pad_for_transcription(samples, family.streaming)
    return encoder.model(encoder.log_mel(torch.from_numpy(padded)))


def streamed(encoder, samples: np.ndarray, sizes) -> tuple[torch.Tensor, list[int]]:
    stream = encoder.open_stream()
    out, counts, at, i = [], [], 0, 0
    while at < samples.shape[0]:
        n = sizes[i % len(sizes)]
        rows = stream.push(samples[at : at + n])
        out.append(rows)
        counts.append(rows.shape[0])
        at += n
        i += 1
    out.append(stream.finish())
    assert stream.num_embeddings == sum(r.shape[0] for r in out)
    return torch.cat(out), counts


@pytest.mark.parametrize(
    ("seconds", "sizes"),
    [
        (0.7, [1280]),  # 80 ms chunks, one LM position each
        (2.3, [1280]),  # longer than the encoder's sliding window (20 frames)
        (2.3, [37, 5000, 160, 999, 1]),  # chunks that cut frames and windows anywhere
        (1.1, [100_000]),  # all at once
    ],
)
def test_stream_equals_whole_clip(voxtral, seconds, sizes):
    family, encoder = voxtral
    samples = speech_like(seconds, seed=int(seconds * 10))
    expected = whole_clip(family, encoder, samples)
    got, _ = streamed(encoder, samples, sizes)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_embeddings_come_while_the_audio_arrives(voxtral):
    family, encoder = voxtral
    samples = speech_like(2.0, seed=3)
    per_tok = family.streaming.samples_per_token
    _, counts = streamed(encoder, samples, [per_tok])
    # After the left padding, each 80 ms chunk completes one position (the stem's edge
    # delays it by a few samples, so the first chunk completes the padding's last one).
    left = family.streaming.n_left_pad_tokens
    assert sum(counts[:1]) == left
    assert counts[1:] == [1] * (len(counts) - 1)


def test_a_finished_stream_takes_no_more_audio(voxtral):
    _, encoder = voxtral
    stream = encoder.open_stream()
    stream.push(np.zeros(1000, dtype=np.float32))
    stream.finish()
    with pytest.raises(ValueError, match="finished"):
        stream.push(np.zeros(10, dtype=np.float32))


def test_per_clip_scaling_cannot_stream(voxtral, tmp_path):
    family, _ = voxtral
    import json
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(family.path, copy)
    config = json.loads((copy / "preprocessor_config.json").read_text())
    config["global_log_mel_max"] = None
    (copy / "preprocessor_config.json").write_text(json.dumps(config))
    encoder = load_family(copy).load_encoder(torch.float32, torch.device("cpu"))
    with pytest.raises(MediaError, match="global_log_mel_max"):
        encoder.open_stream()
