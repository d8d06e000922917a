"""The Voxtral Realtime family against transformers' VoxtralRealtimeForConditionalGeneration:
features, prompt, encoder outputs, LM logits and greedy transcriptions equal the oracle's on
checkpoints transformers itself wrote (two shapes unlike make-model's), for clips shorter and
longer than one encoder window; make-model's checkpoint loads in transformers; audio files in
every container decode, and bad ones fail with MediaError naming the problem."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from models import AudioClip, FamilyOptions, MediaError, MediaInput, load_family
from models.testing import make_checkpoint
from models.testing.attention import ContiguousKVAttention
from models.testing.reference import transcribe as reference_transcribe
from models.voxtral_realtime import audio as audio_io
from tests.voxtral_helpers import (
    ORACLE_SHAPES,
    encode,
    hf_checkpoint,
    hf_model,
    hf_processor,
    speech_like,
)

CLIPS = {"short": 0.3, "long": 3.0}  # B's audio window is 4 s: the short clip fits in it


@pytest.fixture(scope="module", params=sorted(ORACLE_SHAPES))
def oracle(request, tmp_path_factory):
    """(our family, encoder, LM, transformers' model, its processor) for one oracle shape."""
    key = request.param
    path = hf_checkpoint(tmp_path_factory.mktemp(f"voxtral-{key}"), ORACLE_SHAPES[key])
    family = load_family(path)
    encoder = family.load_encoder(torch.float32, torch.device("cpu"))
    lm = family.load_language_model(
        ContiguousKVAttention(family.text.num_layers), torch.float32, torch.device("cpu")
    )
    return family, encoder, lm, hf_model(path), hf_processor(path)


def _prepare(family, encoder, processor, seconds: float):
    samples = speech_like(seconds, seed=int(seconds * 10))
    hf = processor(samples, return_tensors="pt", sampling_rate=16000)
    padded = audio_io.pad_for_transcription(samples, family.streaming)
    mel = encoder.log_mel(torch.from_numpy(padded))
    return hf, padded, mel


def test_registry_serves_the_family(oracle):
    family = oracle[0]
    assert type(family).__name__ == "VoxtralRealtimeFamily"
    assert family.modalities == ("audio",)


def test_log_mel_equals_the_feature_extractor(oracle):
    from transformers import VoxtralRealtimeFeatureExtractor

    family, encoder, *_ = oracle
    extractor = VoxtralRealtimeFeatureExtractor(
        feature_size=family.features.num_mel_bins, sampling_rate=16000
    )
    for seconds in (0.05, 1.0, 2.7):
        samples = audio_io.pad_for_transcription(speech_like(seconds), family.streaming)
        theirs = extractor(samples, sampling_rate=16000, return_tensors="pt")["input_features"]
        ours = encoder.log_mel(torch.from_numpy(samples))
        assert ours.shape == theirs[0].shape
        torch.testing.assert_close(ours, theirs[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_prompt_encoder_and_logits_equal_transformers(oracle, clip):
    family, encoder, lm, model, processor = oracle
    hf, padded, mel = _prepare(family, encoder, processor, CLIPS[clip])
    positions = padded.shape[0] // family.streaming.samples_per_token
    prompt, offset, length = family.transcription_prompt(positions)
    assert prompt == hf["input_ids"][0].tolist()
    assert family.num_delay_tokens == int(hf["num_delay_tokens"])
    assert (offset, length) == (0, positions)
    # The processor's features went through a 16-bit WAV round trip; ours did not.
    torch.testing.assert_close(mel, hf["input_features"][0], atol=2e-3, rtol=0)

    ours = encoder.model(hf["input_features"][0])
    with torch.no_grad():
        theirs = model.model.get_audio_features(input_features=hf["input_features"])
    assert ours.shape == (positions, family.text.hidden_size)
    torch.testing.assert_close(ours, theirs.pooler_output[0], atol=1e-4, rtol=1e-4)
    window = family.arch.audio.sliding_window
    frames = mel.shape[1] // 2
    assert (frames > window) == (clip == "long" or window < 100)

    ids = torch.tensor(prompt + [(7 * i + 100) % 1000 for i in range(positions - len(prompt))])
    with torch.no_grad():
        expected = model(
            input_ids=ids[None],
            input_features=hf["input_features"],
            num_delay_tokens=hf["num_delay_tokens"],
        ).logits[0]
    attention = ContiguousKVAttention(family.text.num_layers)
    for layer in lm.layers:
        layer.self_attn.backend = attention
    with torch.inference_mode():
        embeds = lm.embed_input_ids(ids, [ours], torch.ones(positions, dtype=torch.bool))
        hidden = lm(None, torch.arange(positions), embeds, attention.metadata([0], [positions]))
        logits = lm.compute_logits(hidden)
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_greedy_transcription_equals_generate(oracle, clip):
    family, encoder, lm, model, processor = oracle
    hf, _, _ = _prepare(family, encoder, processor, CLIPS[clip])
    with torch.no_grad():
        expected = model.generate(**hf)[0].tolist()
    embeds = encoder.model(hf["input_features"][0])
    prompt = hf["input_ids"][0].tolist()
    ours = reference_transcribe(lm, embeds, prompt, set(family.eos_token_ids))
    assert prompt + ours == expected
    assert len(expected) == embeds.shape[0] or expected[-1] in family.eos_token_ids


def test_make_model_checkpoint_loads_in_transformers(tmp_path):
    from transformers import VoxtralRealtimeForConditionalGeneration

    path = make_checkpoint(tmp_path / "vx", "voxtral_realtime", "tiny")
    model, info = VoxtralRealtimeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    processor = hf_processor(path)
    family = load_family(path)
    samples = speech_like(1.0)
    hf = processor(samples, return_tensors="pt", sampling_rate=16000)
    encoder = family.load_encoder(torch.float32, torch.device("cpu"))
    lm = family.load_language_model(
        ContiguousKVAttention(family.text.num_layers), torch.float32, torch.device("cpu")
    )
    with torch.no_grad():
        expected = model.eval().generate(**hf)[0].tolist()
    embeds = encoder.model(hf["input_features"][0])
    prompt = hf["input_ids"][0].tolist()
    assert prompt + reference_transcribe(lm, embeds, prompt, set(family.eos_token_ids)) == expected


def test_tokenizer_round_trip_and_detokenizer(oracle):
    family = oracle[0]
    tok = family.tokenizer()
    text = "hello world, the cat sat"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer()
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == text
    pad = tok.required_id("[STREAMING_PAD]")
    assert tok.decode([pad, *ids], skip_special_tokens=True) == text


# -- audio in -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_voxtral(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vx-tiny") / "ckpt", "voxtral_realtime")


FORMATS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "ogg": ("OGG", "VORBIS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_containers_decode_and_the_header_gives_the_count(tiny_voxtral, fmt):
    family = load_family(tiny_voxtral)
    processor = family.processor()
    samples = speech_like(1.5, rate=22050)
    data = encode(samples, 22050, *FORMATS[fmt])
    item = MediaInput("audio", audio=AudioClip(data, "wav", 0))
    grid = processor.grid(item)
    processed = processor.preprocess(item)
    assert processed.grid == grid
    per_tok = family.streaming.samples_per_token
    assert processed.pixel_values.shape[0] == grid.num_tokens * per_tok
    assert grid.num_tokens == audio_io.num_positions(24000, family.streaming)
    decoded = audio_io.decode(item.audio, 16000, 600.0)
    reference = audio_io.decode(AudioClip(encode(samples, 22050), "wav", 0), 16000, 600.0)
    assert abs(decoded.shape[0] - 24000) <= 1200  # codecs add priming / padding samples
    if fmt in ("wav", "flac"):  # lossless: the same samples as the WAV
        np.testing.assert_allclose(decoded, reference, atol=2 / 32768)  # 16-bit rounding
    embeds = family.load_encoder(torch.float32, torch.device("cpu")).embed([processed])[0]
    assert embeds.shape == (grid.num_tokens, family.text.hidden_size)


def test_raw_pcm_needs_a_rate(tiny_voxtral):
    processor = load_family(tiny_voxtral).processor()
    pcm = (speech_like(0.5) * 32767).astype("<i2").tobytes()
    item = MediaInput("audio", audio=AudioClip(pcm, "pcm_s16le", 16000))
    assert processor.grid(item).num_tokens == processor.preprocess(item).grid.num_tokens
    with pytest.raises(MediaError, match="sample_rate"):
        processor.grid(MediaInput("audio", audio=AudioClip(pcm, "pcm_s16le", 0)))


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("empty", "empty"),
        ("corrupt header", "not a readable audio file"),
        ("not audio", "not a readable audio file"),
        ("silence", "silent"),
        ("too long", "at most 2 s"),
        ("image", "takes audio, not image"),
    ],
)
def test_bad_audio_is_a_media_error(tiny_voxtral, case, match):
    processor = load_family(tiny_voxtral, FamilyOptions(max_audio_seconds=2.0)).processor()
    wav = encode(speech_like(0.5))
    data = {
        "empty": b"",
        "corrupt header": b"RIFF\xff\xff\xff\xffWAVEfmt " + b"\x00" * 40,
        "not audio": b"%PDF-1.7 this is a document, not a sound" * 10,
        "silence": encode(np.zeros(8000, dtype=np.float32)),
        "too long": encode(speech_like(3.0)),
    }.get(case, wav)
    if case == "image":
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format="PNG")
        item = MediaInput("image", image=buf.getvalue())
    else:
        item = MediaInput("audio", audio=AudioClip(data, "wav", 0))
    with pytest.raises(MediaError, match=match):
        processor.grid(item)
        processor.preprocess(item)
