"""Audio in: decoding and resampling (soundfile + soxr), the streaming padding, log-mel
features, and the placeholder count from the header alone.

A clip becomes LM positions this way: it is resampled to the model's rate, padded with
`n_left_pad_tokens` tokens' worth of silence on the left and, on the right, up to a whole
token plus the delay, one more token and a buffer for the last word. The log-mel spectrogram of
that (a centred STFT whose last frame is dropped) has `audio_length_per_tok` frames per LM
position; position p of the transcription request takes the audio embedding of token p.
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile
import soxr
import torch

from models.media import AudioClip, MediaError
from models.voxtral_realtime.config import FeatureConfig, StreamingConfig

# Containers soundfile reads from bytes (libsndfile): WAV, FLAC, OGG (Vorbis, Opus), MP3.
CONTAINERS = ("WAV", "FLAC", "OGG", "MP3")


def _open(clip: AudioClip) -> soundfile.SoundFile:
    if not clip.data:
        raise MediaError("the audio file is empty (0 bytes)")
    try:
        if clip.format == "pcm_s16le" or clip.format == "pcm_f32le":
            if clip.sample_rate <= 0:
                raise MediaError(f"{clip.format} audio needs a sample_rate")
            subtype = "PCM_16" if clip.format == "pcm_s16le" else "FLOAT"
            return soundfile.SoundFile(
                io.BytesIO(clip.data),
                format="RAW",
                subtype=subtype,
                samplerate=clip.sample_rate,
                channels=1,
                endian="LITTLE",
            )
        f = soundfile.SoundFile(io.BytesIO(clip.data))
    except MediaError:
        raise
    except Exception as e:  # libsndfile says "Format not recognised", "unknown format", ...
        raise MediaError(f"not a readable audio file (WAV, FLAC, OGG or MP3): {e}") from e
    if f.format not in CONTAINERS:
        f.close()
        raise MediaError(f"audio container {f.format} is not one of {', '.join(CONTAINERS)}")
    return f


def duration_seconds(clip: AudioClip) -> float:
    """The clip's length from its header (no decoding)."""
    with _open(clip) as f:
        if f.frames <= 0 or f.samplerate <= 0:
            raise MediaError("the audio file holds no samples")
        return f.frames / f.samplerate


def decode(clip: AudioClip, sampling_rate: int) -> np.ndarray:
    """The clip as mono float32 samples at `sampling_rate`."""
    with _open(clip) as f:
        try:
            samples = f.read(dtype="float32", always_2d=True)
        except Exception as e:
            raise MediaError(f"the audio data is corrupt: {e}") from e
        rate = f.samplerate
    if samples.shape[0] == 0:
        raise MediaError("the audio file holds no samples")
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if rate != sampling_rate:
        mono = soxr.resample(mono, rate, sampling_rate)
    return np.ascontiguousarray(mono, dtype=np.float32)


def pad_for_transcription(samples: np.ndarray, s: StreamingConfig) -> np.ndarray:
    """Left silence, then the clip, then right silence (mistral-common's offline padding)."""
    per_tok = s.samples_per_token
    right = (per_tok - samples.shape[0] % per_tok) % per_tok + per_tok * s.n_right_pad_tokens
    left = per_tok * s.n_left_pad_tokens
    return np.pad(samples, (left, right))


def num_positions(num_samples: int, s: StreamingConfig) -> int:
    """LM positions (audio tokens) a clip of `num_samples` at the model's rate fills."""
    per_tok = s.samples_per_token
    return s.n_left_pad_tokens + math.ceil(num_samples / per_tok) + s.n_right_pad_tokens


def mel_filter_bank(f: FeatureConfig) -> np.ndarray:
    """[n_fft // 2 + 1, num_mel_bins] triangular filters on the Slaney mel scale, Slaney area
    normalisation, 0 Hz to 8 kHz (float64)."""

    def hz_to_mel(hz: np.ndarray) -> np.ndarray:
        hz = np.asarray(hz, dtype=np.float64)
        mel = 3.0 * hz / 200.0
        log_region = hz >= 1000.0
        logstep = 27.0 / np.log(6.4)
        return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * logstep, mel)

    def mel_to_hz(mel: np.ndarray) -> np.ndarray:
        hz = 200.0 * mel / 3.0
        logstep = np.log(6.4) / 27.0
        return np.where(mel >= 15.0, 1000.0 * np.exp(logstep * (mel - 15.0)), hz)

    num_bins = 1 + f.n_fft // 2
    fft_freqs = np.linspace(0, f.sampling_rate // 2, num_bins)
    mels = np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), f.num_mel_bins + 2)
    edges = mel_to_hz(mels)
    diff = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    enorm = 2.0 / (edges[2 : f.num_mel_bins + 2] - edges[: f.num_mel_bins])
    return filters * enorm[None, :]


class LogMel:
    """Log-mel features on any device: [num_mel_bins, num_samples // hop_length] per clip."""

    def __init__(self, f: FeatureConfig):
        self.config = f
        self.filters = torch.from_numpy(mel_filter_bank(f)).to(torch.float32)  # [bins, mels]

    def __call__(self, samples: torch.Tensor) -> torch.Tensor:
        f = self.config
        device = samples.device
        window = torch.hann_window(f.n_fft, device=device)
        stft = torch.stft(
            samples.to(torch.float32),
            f.n_fft,
            f.hop_length,
            window=window,
            center=True,
            return_complex=True,
        )
        power = stft[..., :-1].abs() ** 2  # the last (partial) frame is dropped
        return self.scale(power)

    def frames(self, segment: torch.Tensor) -> torch.Tensor:
        """The frames whose whole windows lie in `segment` (no centring padding): frame j
        covers samples [j * hop, j * hop + n_fft). A stream computes its frames this way, a
        window at a time as the audio arrives; where the clip is padded with silence they
        equal the centred transform's."""
        f = self.config
        window = torch.hann_window(f.n_fft, device=segment.device)
        stft = torch.stft(
            segment.to(torch.float32),
            f.n_fft,
            f.hop_length,
            window=window,
            center=False,
            return_complex=True,
        )
        return self.scale(stft.abs() ** 2)

    def scale(self, power: torch.Tensor) -> torch.Tensor:
        """Power spectrum [bins, frames] -> the model's log-mel features [mels, frames]."""
        f = self.config
        device = power.device
        mel = self.filters.to(device).T @ power
        log = torch.clamp(mel, min=1e-10).log10()
        top = (
            torch.tensor(f.global_log_mel_max, device=device)
            if f.global_log_mel_max is not None
            else log.max()
        )
        log = torch.maximum(log, top - 8.0)
        return (log + 4.0) / 4.0
