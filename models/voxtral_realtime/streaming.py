"""The audio encoder run on a stream: one session's state, fed as the audio arrives.

The whole-clip path (`SpeechEncoder.embed`) sees a clip padded with silence on both sides and
computes everything at once. A stream computes the same function incrementally, keeping per
session only what the next samples need:

- log-mel: the samples not yet covered by a whole STFT window (a window is `n_fft` samples
  centred on its frame; frame i is computed once samples up to i * hop + n_fft / 2 are in);
- conv stem: the last two log-mel frames (the k3 causal conv's padding cache) and the odd
  conv-1 output the stride-2 conv has not consumed;
- transformer: per layer, the keys and values of the last `sliding_window - 1` frames (the
  sliding-window KV cache), with absolute rotary positions;
- projector: the tower frames short of a whole group of `downsample_factor`.

The session starts with the left padding's silence and ends (`finish`) with the right
padding's, so its embeddings are, in order, the whole clip's.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from models.layers import apply_rotary
from models.media import MediaError
from models.voxtral_realtime.audio import LogMel
from models.voxtral_realtime.config import StreamingConfig
from models.voxtral_realtime.encoder import AudioEncoder, EncoderLayer


class AudioStream:
    """One session's streaming encoder state. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        model: AudioEncoder,
        log_mel: LogMel,
        streaming: StreamingConfig,
        device: torch.device,
    ):
        f = log_mel.config
        if f.global_log_mel_max is None:
            raise MediaError(
                "this checkpoint's features scale by each clip's own maximum "
                "(preprocessor_config.json has no global_log_mel_max): it cannot stream"
            )
        self.model = model
        self.log_mel = log_mel
        self.streaming = streaming
        self.device = device
        self.dtype = model.dtype
        self.hop = f.hop_length
        self.half = f.n_fft // 2
        self.rate = f.sampling_rate
        c = model.config.audio
        self.window = c.sliding_window
        self.downsample = model.config.downsample_factor
        # Padded samples not yet behind every window, from padded index `pending_start` (the
        # centred STFT's edge is `half` samples of silence before index 0).
        self.pending = torch.zeros(self.half, dtype=torch.float32, device=device)
        self.pending_start = -self.half
        self.num_frames = 0  # log-mel frames computed
        self.num_padded = 0  # padded samples in (left silence + audio + right silence)
        self.num_audio = 0  # the client's samples in
        self.target_frames: int | None = None  # set by finish(): the clip's whole length
        dtype = self.dtype
        self.mel_tail = torch.zeros(c.num_mel_bins, 2, dtype=dtype, device=device)
        self.conv_tail = torch.zeros(c.hidden_size, 1, dtype=dtype, device=device)
        self.position = 0  # tower frames out so far (their rotary position)
        empty = torch.zeros(0, c.num_heads, c.head_dim, dtype=dtype, device=device)
        self.keys = [empty] * c.num_layers
        self.values = [empty] * c.num_layers
        self.group = torch.zeros(0, c.hidden_size, dtype=dtype, device=device)
        self.num_embeddings = 0
        self.finished = False
        self._silence(streaming.n_left_pad_tokens * streaming.samples_per_token)

    @property
    def audio_seconds(self) -> float:
        return self.num_audio / self.rate

    @torch.inference_mode()
    def push(self, samples: np.ndarray) -> torch.Tensor:
        """The client's next samples (mono float32 at the model's rate) -> the embeddings they
        complete, [n, hidden] (often none: one comes per `samples_per_token`)."""
        if self.finished:
            raise ValueError("the stream is finished")
        if samples.size:
            self.num_audio += samples.shape[0]
            self._append(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)))
        return self._advance()

    @torch.inference_mode()
    def finish(self) -> torch.Tensor:
        """No more audio: the right padding's silence, and every embedding still owed."""
        if self.finished:
            raise ValueError("the stream is finished")
        self.finished = True
        per_tok = self.streaming.samples_per_token
        right = (per_tok - self.num_audio % per_tok) % per_tok
        right += per_tok * self.streaming.n_right_pad_tokens
        self._silence(right)
        self.target_frames = self.num_padded // self.hop
        # The last frames' windows run past the end into the centred transform's edge.
        self._append(torch.zeros(self.half, dtype=torch.float32), padded=False)
        return self._advance()

    # -- stages -------------------------------------------------------------------------------

    def _silence(self, n: int) -> None:
        self._append(torch.zeros(n, dtype=torch.float32))

    def _append(self, samples: torch.Tensor, padded: bool = True) -> None:
        self.pending = torch.cat((self.pending, samples.to(self.device)))
        if padded:
            self.num_padded += samples.shape[0]

    def _advance(self) -> torch.Tensor:
        mel = self._mel()
        x = self._stem(mel)
        x = self._transformer(x)
        return self._project(x)

    def _mel(self) -> torch.Tensor:
        end = self.pending_start + self.pending.shape[0]
        ready = (end - self.half) // self.hop + 1 if end >= self.half else 0
        if self.target_frames is not None:
            ready = min(ready, self.target_frames)
        if ready <= self.num_frames:
            return torch.zeros(self.log_mel.filters.shape[1], 0, device=self.device)
        first, last = self.num_frames, ready  # frames [first, last)
        lo = first * self.hop - self.half - self.pending_start
        hi = (last - 1) * self.hop + self.half - self.pending_start
        mel = self.log_mel.frames(self.pending[lo:hi])
        assert mel.shape[1] == last - first, (mel.shape, first, last)
        keep = last * self.hop - self.half - self.pending_start
        self.pending = self.pending[keep:]
        self.pending_start += keep
        self.num_frames = last
        return mel

    def _stem(self, mel: torch.Tensor) -> torch.Tensor:
        """Causal conv (k3) -> GELU -> causal conv (k3, stride 2) -> GELU, over cached edges."""
        embedder = self.model.tower.embedder
        if mel.shape[1] == 0:
            return torch.zeros(0, self.conv_tail.shape[0], dtype=self.dtype, device=self.device)
        x = torch.cat((self.mel_tail, mel.to(self.dtype)), dim=1)
        self.mel_tail = x[:, -2:]
        c1 = F.gelu(F.conv1d(x[None], embedder.conv1.weight, embedder.conv1.bias))[0]
        x = torch.cat((self.conv_tail, c1), dim=1)
        n = (x.shape[1] - 3) // 2 + 1 if x.shape[1] >= 3 else 0
        self.conv_tail = x[:, 2 * n :]
        if n == 0:
            return torch.zeros(0, x.shape[0], dtype=self.dtype, device=self.device)
        c2 = F.conv1d(x[:, : 2 * n + 1][None], embedder.conv2.weight, embedder.conv2.bias, stride=2)
        return F.gelu(c2)[0].T  # [n, width]

    def _transformer(self, x: torch.Tensor) -> torch.Tensor:
        tower = self.model.tower
        n = x.shape[0]
        if n == 0:
            return x
        positions = torch.arange(
            self.position, self.position + n, device=self.device, dtype=torch.float32
        )
        freqs = positions[:, None] * tower.inv_freq.to(self.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(tower.layers):
            x = self._layer(i, layer, x, cos, sin)
        self.position += n
        return tower.norm(x)

    def _layer(
        self, i: int, layer: EncoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        a = layer.self_attn
        n = x.shape[0]
        h = layer.self_attn_layer_norm(x)
        q = apply_rotary(a.q_proj(h).view(n, a.num_heads, a.head_dim), cos, sin)
        k = apply_rotary(a.k_proj(h).view(n, a.num_heads, a.head_dim), cos, sin)
        v = a.v_proj(h).view(n, a.num_heads, a.head_dim)
        cached = self.keys[i].shape[0]
        keys = torch.cat((self.keys[i], k))
        values = torch.cat((self.values[i], v))
        qi = torch.arange(cached, cached + n, device=self.device)[:, None]
        kj = torch.arange(cached + n, device=self.device)[None, :]
        mask = (kj <= qi) & (qi - kj < self.window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=a.head_dim**-0.5,
        )
        drop = max(0, keys.shape[0] - (self.window - 1))  # keep the last window - 1
        self.keys[i], self.values[i] = keys[drop:], values[drop:]
        x = x + a.o_proj(out.transpose(0, 1).reshape(n, -1))
        return x + layer.mlp(layer.final_layer_norm(x))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        frames = torch.cat((self.group, x)) if x.shape[0] else self.group
        d = self.downsample
        usable = frames.shape[0] - frames.shape[0] % d
        self.group = frames[usable:]
        hidden = self.model.config.text.hidden_size
        if usable == 0:
            return torch.zeros(0, hidden, dtype=self.dtype, device=self.device)
        out = self.model.projector(frames[:usable].reshape(usable // d, -1))
        self.num_embeddings += out.shape[0]
        return out


__all__ = ["AudioStream"]
