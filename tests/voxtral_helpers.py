"""Helpers for the Voxtral Realtime tests: checkpoints written by transformers itself, its
processor (feature extractor + mistral-common tokenizer) as the oracle, and clips as bytes.
The reference generation loop over our modules is models.testing.reference.transcribe."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import soundfile
import torch

from models.testing.make_voxtral import (
    VOXTRAL_SHAPES,
    VoxtralShape,
    _write_json,
    preprocessor_config,
    tekken,
    voxtral_config,
)

TORCH_THREADS = 2

# Two shapes unlike anything make-model writes: other head counts, windows, downsample
# factors and delays. A: downsample 2 (40 ms per position), short windows; B: downsample 5
# (100 ms per position), an audio window of 200 frames (4 s).
ORACLE_SHAPES = {
    "A": replace(
        VOXTRAL_SHAPES["tiny"],
        num_heads=2,
        num_kv_heads=1,
        head_dim=24,
        hidden_size=48,
        sliding_window=12,
        audio_heads=2,
        audio_head_dim=16,
        audio_sliding_window=8,
        num_mel_bins=16,
        downsample_factor=2,
        transcription_delay_ms=160.0,
        n_left_pad_tokens=3,
    ),
    "B": replace(
        VOXTRAL_SHAPES["tiny"],
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        sliding_window=64,
        audio_heads=8,
        audio_head_dim=4,
        audio_sliding_window=200,
        num_mel_bins=24,
        downsample_factor=5,
        transcription_delay_ms=300.0,
        n_left_pad_tokens=2,
    ),
}


def hf_checkpoint(out: Path, shape: VoxtralShape, seed: int = 0) -> Path:
    """A random VoxtralRealtimeForConditionalGeneration saved by transformers, plus the
    tekken.json and preprocessor_config.json of the same shape."""
    from transformers import VoxtralRealtimeConfig, VoxtralRealtimeForConditionalGeneration

    torch.manual_seed(seed)
    c = voxtral_config(shape)
    config = VoxtralRealtimeConfig(
        audio_config=c["audio_config"],
        text_config=c["text_config"],
        downsample_factor=c["downsample_factor"],
        audio_length_per_tok=c["audio_length_per_tok"],
        default_num_delay_tokens=c["default_num_delay_tokens"],
    )
    model = VoxtralRealtimeForConditionalGeneration(config)
    with torch.no_grad():  # larger weights: clear greedy logit gaps
        for name, p in model.named_parameters():
            if "norm" not in name or "ada_rms_norm" in name:
                p.mul_(3.0)
    model.save_pretrained(out)
    _write_json(out / "preprocessor_config.json", preprocessor_config(shape.num_mel_bins))
    _write_json(out / "tekken.json", tekken(shape))
    return out


def hf_model(checkpoint: Path):
    from transformers import VoxtralRealtimeForConditionalGeneration

    torch.set_num_threads(TORCH_THREADS)
    return VoxtralRealtimeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()


def hf_processor(checkpoint: Path):
    from transformers import VoxtralRealtimeFeatureExtractor, VoxtralRealtimeProcessor
    from transformers.tokenization_mistral_common import MistralCommonBackend

    return VoxtralRealtimeProcessor(
        VoxtralRealtimeFeatureExtractor.from_pretrained(checkpoint),
        MistralCommonBackend(tokenizer_path=str(checkpoint / "tekken.json")),
    )


def speech_like(seconds: float, seed: int = 0, rate: int = 16000) -> np.ndarray:
    """A deterministic clip with some structure (tones that move, noise bursts)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f = 200 + 150 * np.sin(2 * np.pi * 1.3 * t)
    wave = 0.3 * np.sin(2 * np.pi * np.cumsum(f) / rate) + 0.05 * rng.standard_normal(t.shape)
    return (wave * (0.5 + 0.5 * np.sin(2 * np.pi * 2.1 * t) ** 2)).astype(np.float32)


def encode(samples: np.ndarray, rate: int = 16000, fmt: str = "WAV", subtype: str | None = None):
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()
