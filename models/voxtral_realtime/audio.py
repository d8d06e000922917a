"""Audio in: decoding and resampling (soundfile + soxr), the streaming padding, log-mel
features, and the placeholder count from the header alone.

A clip's cost is what it becomes at the model's rate, so its length is counted in one place,
`num_samples`, from the header's frames over a sample rate held to
[MIN_SAMPLE_RATE, MAX_SAMPLE_RATE] (a WAV header's rate and a raw PCM clip's are both client
input: soxr resamples any ratio, and 1.2 KB that claim 1 Hz are 599 s of audio); `decode`
checks the same count before it reads or resamples anything.

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
RAW_SUBTYPES = {"pcm_s16le": "PCM_16", "pcm_f32le": "FLOAT"}
# Sample rates a clip may have: telephone speech (8 kHz) to studio masters (192 kHz), every
# rate recorders and codecs write. Below, a few bytes claim minutes of model work; above, a
# second of model work costs more than 12 seconds' worth of decoding and resampling.
MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 192_000


def _check_rate(rate: int) -> None:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise MediaError(
            f"the audio's sample rate is {rate} Hz; this server takes {MIN_SAMPLE_RATE} to "
            f"{MAX_SAMPLE_RATE} Hz"
        )


def _open(clip: AudioClip) -> soundfile.SoundFile:
    """The clip's reader, its sample rate checked (a raw clip's before anything is read)."""
    if not clip.data:
        raise MediaError("the audio file is empty (0 bytes)")
    subtype = RAW_SUBTYPES.get(clip.format)
    if subtype is not None:
        if clip.sample_rate <= 0:
            raise MediaError(f"{clip.format} audio needs a sample_rate")
        _check_rate(clip.sample_rate)
    try:
        if subtype is not None:
            return soundfile.SoundFile(
                io.BytesIO(clip.data),
                format="RAW",
                subtype=subtype,
                samplerate=clip.sample_rate,
                channels=1,
                endian="LITTLE",
            )
        f = soundfile.SoundFile(io.BytesIO(clip.data))
    except Exception as e:  # libsndfile says "Format not recognised", "unknown format", ...
        raise MediaError(f"not a readable audio file (WAV, FLAC, OGG or MP3): {e}") from e
    try:
        if f.format not in CONTAINERS:
            raise MediaError(f"audio container {f.format} is not one of {', '.join(CONTAINERS)}")
        _check_rate(f.samplerate)
    except MediaError:
        f.close()
        raise
    return f


def _frames(f: soundfile.SoundFile, max_seconds: float) -> int:
    """The header's frame count, held to `max_seconds` at the (checked) rate."""
    if f.frames <= 0:
        raise MediaError("the audio file holds no samples")
    seconds = f.frames / f.samplerate
    if seconds > max_seconds:
        raise MediaError(
            f"the clip is {seconds:.1f} s long; this server takes at most {max_seconds:g} s "
            "(encoder.max_audio_seconds)"
        )
    return f.frames


def num_samples(clip: AudioClip, sampling_rate: int, max_seconds: float) -> int:
    """Samples the clip becomes at `sampling_rate`, from its header alone (no decoding): what
    every count of its positions and work comes from. MediaError for a sample rate outside
    [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE], no samples, or more than `max_seconds`."""
    with _open(clip) as f:
        seconds = _frames(f, max_seconds) / f.samplerate
    return max(1, round(seconds * sampling_rate))


def decode(clip: AudioClip, sampling_rate: int, max_seconds: float) -> np.ndarray:
    """The clip as mono float32 samples at `sampling_rate`: at most the header's frames, held
    to `max_seconds` (as `num_samples` counts them) before anything is read or resampled."""
    with _open(clip) as f:
        frames = _frames(f, max_seconds)
        try:
            samples = f.read(frames, dtype="float32", always_2d=True)
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
