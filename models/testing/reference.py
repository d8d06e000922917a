"""The reference generation path: our whole model, end to end, with no engine around it.

preprocess media -> vision tower -> merge embeddings into the prompt -> LM with M-RoPE ->
greedy or sampled tokens, with the contiguous KV cache of `ContiguousKVAttention`. Tests hold
it token for token against transformers; the LM worker's tests use it for expected outputs.

    model = ReferenceModel("path/to/checkpoint")
    ids = model.generate(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        media=[ImageItem(png_bytes)],
        max_tokens=32,
    )
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.media import ProcessedMedia
from models.qwen2_vl.rope import (
    MediaSpan,
    frame_spans,
    mrope_decode_positions,
    mrope_positions,
    num_placeholder_tokens,
)
from models.registry import load_family
from models.sampling import Draws, SamplingParams, sample_row
from models.testing.attention import ContiguousKVAttention
from models.tokenizer import expand_media

# A prompt: chat messages (rendered with the checkpoint's template), raw text, or token ids.
# Each media item appears as one <|image_pad|> / <|video_pad|> token.
Prompt = Sequence[dict[str, Any]] | str | Sequence[int]


@dataclass(frozen=True)
class ImageItem:
    data: bytes  # an encoded image (PNG, JPEG, ...)
    kwargs: dict[str, Any] | None = None  # min_pixels / max_pixels for this item


@dataclass(frozen=True)
class VideoItem:
    frames: tuple[bytes, ...] = ()  # encoded frames, all the same size
    fps: float = 0.0
    kwargs: dict[str, Any] | None = None
    container: bytes = b""  # or a whole video file (MP4, WebM, ...), sampled by the processor


MediaItem = ImageItem | VideoItem


@dataclass
class PreparedPrompt:
    """A prompt with its placeholders expanded and its media preprocessed."""

    token_ids: list[int]  # expanded
    media: list[ProcessedMedia]
    # One per media item in order (one per frame for a video whose run has text between
    # its frames).
    spans: list[MediaSpan] = field(default_factory=list)


class ReferenceModel:
    """One checkpoint's tokenizer, processor, vision tower and LM, loaded once."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        family = load_family(checkpoint_dir)  # Qwen2-VL, Qwen2.5-VL or Qwen3-VL
        self.arch = family.arch
        self.tokenizer = family.tokenizer()
        self.processor = family.processor()
        self.tower = family.load_tower(dtype, device)
        self.attention = ContiguousKVAttention(self.arch.text.num_layers)
        self.lm = family.language_model(self.attention, dtype, device)
        self.device = torch.device(device)
        self._next_seq_id = 0

    # -- prompt preparation --------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids with one placeholder per media item (not yet expanded)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt))
        return [int(t) for t in prompt]

    def prepare(self, prompt: Prompt, media: Sequence[MediaItem] = ()) -> PreparedPrompt:
        ids = self.prompt_ids(prompt)
        tokens = self.arch.tokens
        placeholders = [t for t in ids if t in (tokens.image_token_id, tokens.video_token_id)]
        if len(placeholders) != len(media):
            raise ValueError(f"the prompt has {len(placeholders)} placeholders, {len(media)} items")
        processed = []
        for token, item in zip(placeholders, media, strict=True):
            if isinstance(item, ImageItem):
                if token != tokens.image_token_id:
                    raise ValueError("an image item sits at a video placeholder")
                processed.append(self.processor.process_image(item.data, item.kwargs))
            else:
                if token != tokens.video_token_id:
                    raise ValueError("a video item sits at an image placeholder")
                if item.container:
                    processed.append(self.processor.process_video_file(item.container, item.kwargs))
                else:
                    processed.append(
                        self.processor.process_video(item.frames, item.fps, item.kwargs)
                    )
        expanded, runs = expand_media(
            ids,
            (tokens.image_token_id, tokens.video_token_id),
            [m.grid.expansion for m in processed],
        )
        merge = self.arch.vision.spatial_merge_size
        spans = []
        for (offset, _, is_embed), m in zip(runs, processed, strict=True):
            if is_embed is not None:  # text between its frames (Qwen3-VL video)
                spans += frame_spans(offset, m.grid.grid_thw, is_embed, merge)
            else:
                spans.append(
                    MediaSpan(offset, m.grid.grid_thw, m.grid.modality, m.grid.second_per_grid_t)
                )
        return PreparedPrompt(expanded, processed, spans)

    # -- running -------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed_media(self, media: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """All items through the tower in one forward."""
        if not media:
            return []
        pixels = torch.cat([m.pixel_values for m in media])
        return self.tower.embed_multimodal(pixels, [m.grid.grid_thw for m in media])

    def positions(self, prepared: PreparedPrompt) -> tuple[torch.Tensor, int]:
        vision = self.arch.vision
        return mrope_positions(
            len(prepared.token_ids),
            prepared.spans,
            vision.spatial_merge_size,
            vision.tokens_per_second,
        )

    @torch.inference_mode()
    def prefill_logits(self, prepared: PreparedPrompt) -> torch.Tensor:
        """Logits [L, vocab] of every prompt position (no cache is kept)."""
        seq_id = self._new_seq_id()
        try:
            hidden, _ = self._prefill([prepared], [seq_id])
            return self.lm.compute_logits(hidden).float()
        finally:
            self.attention.free(seq_id)

    def generate(
        self,
        prompt: Prompt,
        media: Sequence[MediaItem] = (),
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> list[int]:
        """Generated token ids (the prompt excluded) for one prompt. Keyword sampling settings
        are SamplingParams' fields; NOTE: unlike the API, the reference defaults to greedy."""
        params = params or SamplingParams(**{"temperature": 0.0, **sampling})
        return self.generate_many([self.prepare(prompt, media)], params)[0]

    @torch.inference_mode()
    def generate_many(
        self, prompts: Sequence[PreparedPrompt], params: SamplingParams
    ) -> list[list[int]]:
        """Prefill all prompts packed in one forward, then decode them together, one token per
        sequence per step, until each stops (eos, a stop token or max_tokens)."""
        if params.max_tokens is None:
            raise ValueError("the reference path needs max_tokens")
        seqs = [
            _Sequence(self._new_seq_id(), len(p.token_ids), Draws(params.seed)) for p in prompts
        ]
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.arch.tokens.eos_token_ids)
        try:
            hidden, deltas = self._prefill(prompts, [s.seq_id for s in seqs])
            for seq, delta in zip(seqs, deltas, strict=True):
                seq.delta = delta
            last_rows = torch.tensor([s.length for s in seqs]).cumsum(0) - 1
            logits = self.lm.compute_logits(hidden[last_rows.to(self.device)])
            live = seqs
            while True:
                draws = [s.draws for s in live]
                for seq, token in zip(live, sample(logits, params, draws).tolist(), strict=True):
                    seq.output.append(token)
                    seq.done = token in stops or len(seq.output) >= params.max_tokens
                live = [s for s in live if not s.done]
                if not live:
                    break
                # Feed each live sequence its newest token, at index length + outputs - 1.
                ids = torch.tensor([s.output[-1] for s in live], device=self.device)
                positions = torch.cat(
                    [
                        mrope_decode_positions(s.length + len(s.output) - 1, 1, s.delta)
                        for s in live
                    ],
                    dim=1,
                ).to(self.device)
                metadata = self.attention.metadata([s.seq_id for s in live], [1] * len(live))
                logits = self.lm.compute_logits(self.lm(ids, positions, attn_metadata=metadata))
            return [s.output for s in seqs]
        finally:
            for seq in seqs:
                self.attention.free(seq.seq_id)

    def _prefill(
        self, prompts: Sequence[PreparedPrompt], seq_ids: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states [sum of lengths, hidden] of all prompts, and their M-RoPE deltas."""
        mm_embeds = self.embed_media([m for p in prompts for m in p.media])
        ids = torch.tensor([t for p in prompts for t in p.token_ids], device=self.device)
        merge = self.arch.vision.spatial_merge_size
        is_mm = torch.zeros(len(ids), dtype=torch.bool)  # [T]
        positions, deltas = [], []
        start = 0
        for p in prompts:
            for span in p.spans:
                length = num_placeholder_tokens(span.grid_thw, merge)
                is_mm[start + span.offset : start + span.offset + length] = True
            prompt_positions, delta = self.positions(p)
            positions.append(prompt_positions)
            deltas.append(delta)
            start += len(p.token_ids)
        embeds = self.lm.embed_input_ids(ids, mm_embeds, is_mm.to(self.device))
        metadata = self.attention.metadata(seq_ids, [len(p.token_ids) for p in prompts])
        positions_t = torch.cat(positions, dim=1).to(self.device)  # [3, T]
        hidden = self.lm(None, positions_t, inputs_embeds=embeds, attn_metadata=metadata)
        return hidden, deltas

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id


@dataclass
class _Sequence:
    """One sequence of a generate_many call."""

    seq_id: int
    length: int  # prompt tokens
    draws: Draws
    delta: int = 0  # M-RoPE decode delta
    output: list[int] = field(default_factory=list)
    done: bool = False


def sample(logits: torch.Tensor, params: SamplingParams, draws: list[Draws]) -> torch.Tensor:
    """Next token per row of logits [B, vocab]: argmax at temperature 0, else row i drawn with
    draws[i] (models.sampling, as the engine draws)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    tokens = [sample_row(row, params, d.next()) for row, d in zip(logits, draws, strict=True)]
    return torch.tensor(tokens, device=logits.device)


def generate(
    checkpoint_dir: str | Path,
    prompt: Prompt,
    media: Sequence[MediaItem] = (),
    dtype: torch.dtype = torch.float32,
    **sampling: Any,
) -> list[int]:
    """Load a checkpoint and generate for one prompt: `ReferenceModel(...).generate(...)`."""
    return ReferenceModel(checkpoint_dir, dtype).generate(prompt, media, **sampling)


@torch.inference_mode()
def transcribe(lm, audio_embeds: torch.Tensor, prompt: list[int], eos: set[int]):
    """Greedy transcription with our LM on a contiguous KV cache: the prompt takes the first
    audio embeddings at prefill, every decode step adds its position's; it stops when the
    audio's positions are consumed or at EOS."""
    attention = ContiguousKVAttention(lm.config.num_layers)
    for layer in lm.layers:
        layer.self_attn.backend = attention
    total = audio_embeds.shape[0]
    ids = list(prompt)
    n = len(ids)
    x = lm.embed_tokens(torch.tensor(ids)) + audio_embeds[:n]
    hidden = lm(None, torch.arange(n), x, attention.metadata([0], [n]))
    out = []
    while True:
        token = int(lm.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        ids.append(token)
        if token in eos or len(ids) >= total:
            return out
        pos = len(ids) - 1
        x = lm.embed_tokens(torch.tensor([token])) + audio_embeds[pos : pos + 1]
        hidden = lm(None, torch.tensor([pos]), x, attention.metadata([0], [1]))
