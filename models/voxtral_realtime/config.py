"""Parse a Voxtral Realtime checkpoint's JSON files into frozen, typed configs.

config.json is the layout transformers' `VoxtralRealtimeForConditionalGeneration.save_pretrained`
writes: `audio_config` (the causal Whisper-style encoder), `text_config` (the Mistral LM with
sliding-window attention and the time-conditioned norm) and the projector's `downsample_factor`
on top. The audio front end comes from two places that must agree: preprocessor_config.json
(the log-mel settings) and the `audio` section of tekken.json (sampling rate, frame rate,
streaming delay and padding), which decides the prompt and the padding around the clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.checkpoint import CheckpointError, parse_dtype, read_json

ARCHITECTURE = "VoxtralRealtimeForConditionalGeneration"

# Right padding past the delay: room for the last word (mistral-common's offline buffer).
OFFLINE_BUFFER_TOKENS = 10


@dataclass(frozen=True)
class AudioEncoderConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_mel_bins: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    hidden_act: str


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str


@dataclass(frozen=True)
class FeatureConfig:
    """The log-mel front end (preprocessor_config.json)."""

    num_mel_bins: int
    sampling_rate: int
    hop_length: int
    n_fft: int
    win_length: int
    global_log_mel_max: float | None


@dataclass(frozen=True)
class StreamingConfig:
    """tekken.json's `audio` section: how a clip is padded and how long the delay is."""

    sampling_rate: int
    frame_rate: float
    transcription_delay_ms: float
    n_left_pad_tokens: int

    @property
    def samples_per_token(self) -> int:
        return int(self.sampling_rate // self.frame_rate)

    @property
    def num_delay_tokens(self) -> int:
        return delay_tokens(self.transcription_delay_ms, self.sampling_rate, self.samples_per_token)

    @property
    def n_right_pad_tokens(self) -> int:
        return self.num_delay_tokens + 1 + OFFLINE_BUFFER_TOKENS


@dataclass(frozen=True)
class VoxtralConfig:
    architecture: str
    dtype: torch.dtype
    audio: AudioEncoderConfig
    text: TextConfig
    downsample_factor: int
    audio_length_per_tok: int  # mel frames per LM position
    default_num_delay_tokens: int
    projector_hidden_act: str
    bos_token_id: int
    eos_token_ids: tuple[int, ...]


def delay_tokens(delay_ms: float, sampling_rate: int, samples_per_token: int) -> int:
    samples = int(delay_ms / 1000.0 * sampling_rate)
    return -(-samples // samples_per_token)


def _rope_theta(section: dict[str, Any], default: float) -> float:
    rope = section.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"rope_type {rope.get('rope_type')!r} is not supported")
    return float(rope.get("rope_theta", section.get("rope_theta", default)))


def load_config(checkpoint_dir: str | Path) -> VoxtralConfig:
    root = Path(checkpoint_dir)
    path = root / "config.json"
    cfg = read_json(path)
    a, t = cfg.get("audio_config") or {}, cfg.get("text_config") or {}
    if not a or not t:
        raise CheckpointError(f"{path}: audio_config and text_config are required")
    try:
        audio = AudioEncoderConfig(
            hidden_size=int(a["hidden_size"]),
            intermediate_size=int(a["intermediate_size"]),
            num_layers=int(a["num_hidden_layers"]),
            num_heads=int(a["num_attention_heads"]),
            head_dim=int(a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]),
            num_mel_bins=int(a.get("num_mel_bins", 128)),
            rms_norm_eps=float(a.get("rms_norm_eps", 1e-5)),
            rope_theta=_rope_theta(a, 10000.0),
            sliding_window=int(a.get("sliding_window", 750)),
            hidden_act=str(a.get("hidden_act", "silu")),
        )
        tie = bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))
        text = TextConfig(
            vocab_size=int(t["vocab_size"]),
            hidden_size=int(t["hidden_size"]),
            intermediate_size=int(t["intermediate_size"]),
            num_layers=int(t["num_hidden_layers"]),
            num_heads=int(t["num_attention_heads"]),
            num_kv_heads=int(t.get("num_key_value_heads") or t["num_attention_heads"]),
            head_dim=int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
            rope_theta=_rope_theta(t, 1e6),
            sliding_window=int(t["sliding_window"]) if t.get("sliding_window") else None,
            tie_word_embeddings=tie,
            max_position_embeddings=int(t.get("max_position_embeddings", 131072)),
            hidden_act=str(t.get("hidden_act", "silu")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad or missing field: {e}") from e
    for name, act in (("audio", audio.hidden_act), ("text", text.hidden_act)):
        if act != "silu":
            raise CheckpointError(f"{path}: {name} hidden_act {act!r}: only silu is supported")
    if cfg.get("projector_hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{path}: projector_hidden_act must be gelu")
    generation = (
        read_json(root / "generation_config.json")
        if (root / "generation_config.json").exists()
        else {}
    )
    eos = generation.get("eos_token_id", t.get("eos_token_id", 2))
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    downsample = int(cfg.get("downsample_factor", 4))
    per_tok = int(cfg.get("audio_length_per_tok", 8))
    if per_tok != 2 * downsample:
        # The conv stem halves the mel frames; the projector stacks `downsample` of them.
        raise CheckpointError(
            f"{path}: audio_length_per_tok {per_tok} is not 2 x downsample_factor {downsample}"
        )
    return VoxtralConfig(
        architecture=ARCHITECTURE,
        dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype"), path),
        audio=audio,
        text=text,
        downsample_factor=downsample,
        audio_length_per_tok=per_tok,
        default_num_delay_tokens=int(cfg.get("default_num_delay_tokens", 6)),
        projector_hidden_act="gelu",
        bos_token_id=int(generation.get("bos_token_id", t.get("bos_token_id", 1))),
        eos_token_ids=eos_ids,
    )


def load_feature_config(checkpoint_dir: str | Path) -> FeatureConfig:
    path = Path(checkpoint_dir) / "preprocessor_config.json"
    if not path.exists():
        raise CheckpointError(f"{path.parent}: no preprocessor_config.json")
    p = read_json(path)
    return FeatureConfig(
        num_mel_bins=int(p.get("feature_size", 128)),
        sampling_rate=int(p.get("sampling_rate", 16000)),
        hop_length=int(p.get("hop_length", 160)),
        n_fft=int(p.get("n_fft", 400)),
        win_length=int(p.get("win_length", 400)),
        global_log_mel_max=(
            float(p["global_log_mel_max"]) if p.get("global_log_mel_max") is not None else None
        ),
    )


def load_streaming_config(checkpoint_dir: str | Path, features: FeatureConfig) -> StreamingConfig:
    path = Path(checkpoint_dir) / "tekken.json"
    if not path.exists():
        raise CheckpointError(f"{path.parent}: no tekken.json")
    audio = read_json(path).get("audio")
    if not audio:
        raise CheckpointError(f"{path}: no audio section")
    enc = audio.get("audio_encoding_config") or {}
    if str(audio.get("transcription_format", "")).lower() != "streaming":
        raise CheckpointError(f"{path}: transcription_format must be streaming")
    s = StreamingConfig(
        sampling_rate=int(audio["sampling_rate"]),
        frame_rate=float(audio["frame_rate"]),
        transcription_delay_ms=float(audio["transcription_delay_ms"]),
        n_left_pad_tokens=int(audio["streaming_n_left_pad_tokens"]),
    )
    checks = {
        "sampling_rate": (s.sampling_rate, features.sampling_rate),
        "num_mel_bins": (enc.get("num_mel_bins"), features.num_mel_bins),
        "hop_length": (enc.get("hop_length"), features.hop_length),
        "window_size": (enc.get("window_size"), features.win_length),
    }
    for name, (tekken, pre) in checks.items():
        if tekken != pre:
            raise CheckpointError(
                f"{path}: audio {name} {tekken} disagrees with preprocessor_config.json's {pre}"
            )
    return s
