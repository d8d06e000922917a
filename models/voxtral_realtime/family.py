"""The Voxtral Realtime family: speech in, its transcription out, one LM position per 80 ms
of audio. What the roles see of it is models.family.ModelFamily.

A transcription is a realtime request whose audio feature starts at position 0 and runs past
the prompt: the prompt (BOS + streaming pads) takes the first positions' embeddings at
prefill, every decode step adds the embedding of its own position, and the request ends when
the audio's positions are consumed (`MMFeature.offset + length` tokens in all).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import asdict
from functools import cached_property

import numpy as np
import soundfile
import torch

from models.attention import AttentionBackend
from models.checkpoint import CheckpointError, weights_fingerprint
from models.family import ModelFamily, TextDims
from models.media import AudioClip, MediaError, MediaGrid, MediaInput, Modality, ProcessedMedia
from models.voxtral_realtime import audio
from models.voxtral_realtime.config import (
    ARCHITECTURE,
    FeatureConfig,
    StreamingConfig,
    VoxtralConfig,
    load_config,
    load_feature_config,
    load_streaming_config,
)
from models.voxtral_realtime.encoder import AudioEncoder, encoder_tensor
from models.voxtral_realtime.language_model import VoxtralLanguageModel
from models.voxtral_realtime.streaming import AudioStream
from models.voxtral_realtime.tokenizer import TekkenTokenizer

# Bump when our preprocessing or encoder numerics change, so cached embeddings stop matching.
EMBEDDING_CODE_VERSION = 1
DEFAULT_MAX_AUDIO_SECONDS = 600.0


class AudioProcessor:
    """models.family.MediaProcessor for audio clips (thread-safe: no state after init)."""

    def __init__(
        self,
        features: FeatureConfig,
        streaming: StreamingConfig,
        max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    ):
        self.features = features
        self.streaming = streaming
        self.max_audio_seconds = max_audio_seconds

    def _check(self, item: MediaInput) -> AudioClip:
        if item.modality != "audio" or item.audio is None:
            raise MediaError(f"this model takes audio, not {item.modality}")
        return item.audio

    def num_samples(self, item: MediaInput) -> int:
        """Samples at the model's rate, from the header alone."""
        clip = self._check(item)
        return audio.num_samples(clip, self.features.sampling_rate, self.max_audio_seconds)

    def grid(self, item: MediaInput) -> MediaGrid:
        n = self.num_samples(item)
        positions = audio.num_positions(n, self.streaming)
        seconds = n / self.features.sampling_rate
        return MediaGrid("audio", (positions, 1, 1), positions, seconds=seconds)

    def preprocess(self, item: MediaInput) -> ProcessedMedia:
        grid = self.grid(item)
        n = round(grid.seconds * self.features.sampling_rate)
        samples = audio.decode(item.audio, self.features.sampling_rate, self.max_audio_seconds)
        if not np.any(samples):
            raise MediaError("the clip is silent (every sample is zero)")
        # The header's length decides the placeholder count: the decoded clip is held to it.
        samples = np.pad(samples[:n], (0, max(0, n - samples.shape[0])))
        padded = audio.pad_for_transcription(samples, self.streaming)
        assert padded.shape[0] == grid.num_tokens * self.streaming.samples_per_token
        return ProcessedMedia(grid, torch.from_numpy(padded))

    def warmup_item(self) -> MediaInput:
        rate = self.features.sampling_rate
        t = np.arange(rate // 2) / rate
        wave = (0.1 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
        buf = io.BytesIO()
        soundfile.write(buf, wave, rate, format="WAV", subtype="PCM_16")
        return MediaInput("audio", audio=AudioClip(buf.getvalue(), "wav", 0))


class SpeechEncoder:
    """models.family.MediaEncoder: log-mel on the device, then the tower and projector."""

    def __init__(
        self,
        model: AudioEncoder,
        features: FeatureConfig,
        device: torch.device,
        streaming: StreamingConfig | None = None,
    ):
        self.model = model
        self.device = device
        self.streaming = streaming
        self.dtype = model.dtype
        self.width = model.config.text.hidden_size
        self.log_mel = audio.LogMel(features)

    def embed(self, batch: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        out = []
        for m in batch:
            mel = self.log_mel(m.pixel_values.to(self.device))
            embeds = self.model(mel)
            if embeds.shape[0] != m.grid.num_tokens:
                raise MediaError(
                    f"the clip gave {embeds.shape[0]} audio embeddings for {m.grid.num_tokens} "
                    "positions"
                )
            out.append(embeds)
        return out

    def open_stream(self) -> AudioStream:
        """A realtime session's encoder state: audio in as it arrives, embeddings out in
        order, equal to the whole clip's (models/voxtral_realtime/streaming.py)."""
        if self.streaming is None:
            raise MediaError("this encoder was loaded without the streaming settings")
        return AudioStream(self.model, self.log_mel, self.streaming, self.device)


class VoxtralRealtimeFamily(ModelFamily):
    architectures = (ARCHITECTURE,)
    prompt_from_media = True

    @cached_property
    def arch(self) -> VoxtralConfig:
        return load_config(self.path)

    @cached_property
    def features(self) -> FeatureConfig:
        return load_feature_config(self.path)

    @cached_property
    def streaming(self) -> StreamingConfig:
        s = load_streaming_config(self.path, self.features)
        per_tok = self.features.hop_length * self.arch.audio_length_per_tok
        if s.samples_per_token != per_tok:
            raise CheckpointError(
                f"{self.path}: tekken.json's frame rate gives {s.samples_per_token} samples per "
                f"token; config.json and the features give {per_tok}"
            )
        return s

    @property
    def architecture(self) -> str:
        return self.arch.architecture

    @property
    def dtype(self) -> torch.dtype:
        return self.arch.dtype

    @property
    def modalities(self) -> tuple[Modality, ...]:
        return ("audio",)

    @cached_property
    def text(self) -> TextDims:
        return TextDims.of(self.arch.text)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_ids

    @property
    def placeholder_token_ids(self) -> dict[Modality, int]:
        return {"audio": self.tokenizer().required_id("[STREAMING_PAD]")}

    @property
    def num_delay_tokens(self) -> int:
        return self.streaming.num_delay_tokens

    def tokenizer(self) -> TekkenTokenizer:
        return TekkenTokenizer.from_dir(self.path)

    def processor(self, max_image_pixels: int | None = None) -> AudioProcessor:
        limit = self.options.max_audio_seconds or DEFAULT_MAX_AUDIO_SECONDS
        return AudioProcessor(self.features, self.streaming, limit)

    def media_prompt(self, grid: MediaGrid) -> tuple[list[int], int, int]:
        return self.transcription_prompt(grid.num_tokens)

    def transcription_prompt(self, num_positions: int) -> tuple[list[int], int, int]:
        """(prompt ids, offset, length) of a transcription whose clip fills `num_positions`:
        the audio feature starts at position 0 and covers every position of the request."""
        prompt = self.tokenizer().transcription_prompt(
            self.streaming.n_left_pad_tokens, self.num_delay_tokens
        )
        if num_positions <= len(prompt):
            raise MediaError(
                f"the clip fills {num_positions} positions; a transcription needs more than "
                f"the {len(prompt)}-token prompt"
            )
        return prompt, 0, num_positions

    @property
    def realtime_sample_rate(self) -> int:
        return self.features.sampling_rate

    def realtime_prompt(self) -> list[int]:
        """The prompt of a realtime session: the transcription prompt, whose positions take
        the first embeddings of the session's stream (left silence, then the audio)."""
        return self.tokenizer().transcription_prompt(
            self.streaming.n_left_pad_tokens, self.num_delay_tokens
        )

    def realtime_positions(self, seconds: float) -> int:
        return audio.num_positions(round(seconds * self.features.sampling_rate), self.streaming)

    def realtime_audio_seconds(self, num_positions: int) -> float:
        s = self.streaming
        covered = max(0, num_positions - s.n_left_pad_tokens) * s.samples_per_token
        return covered / self.features.sampling_rate

    def fingerprint(self, dtype: torch.dtype) -> str:
        settings = {
            "code": EMBEDDING_CODE_VERSION,
            "dtype": str(dtype).removeprefix("torch."),
            "audio": asdict(self.arch.audio),
            "downsample": self.arch.downsample_factor,
            "features": asdict(self.features),
            "streaming": asdict(self.streaming),
        }
        return weights_fingerprint(self.path, encoder_tensor, settings)

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> SpeechEncoder:
        model = AudioEncoder.from_checkpoint(self.path, self.arch, dtype, device)
        return SpeechEncoder(model, self.features, torch.device(device), self.streaming)

    def load_language_model(
        self, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> VoxtralLanguageModel:
        return VoxtralLanguageModel.from_checkpoint(
            self.path, self.arch.text, self.num_delay_tokens, attn_backend, dtype, device
        )


__all__ = ["AudioProcessor", "SpeechEncoder", "VoxtralRealtimeFamily"]
