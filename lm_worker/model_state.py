"""What differs between model families, behind one small interface (vLLM's ModelState), so the
runner never asks `if model == ...`.

- positions: Qwen2-VL / Qwen2.5-VL use M-RoPE: [3, T] positions from the prompt's media grids,
  and `index + delta` on all three axes past the prompt (the per-request rope state);
- `process_mm_embeds`: the multimodal-pruning hook (EVS, seed 001). Pruned video embeddings
  carry extra trailing channels with their M-RoPE positions; a model that supports pruning
  strips them here (and recomputes positions). Models without pruning get the embeddings as they
  are, and an embedding wider than the hidden size is refused with a clear error;
- `dummy_inputs_embeds`: what capture and warm-up runs feed the model instead of running an
  encoder (seed 000): a slice of the runner's preallocated buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lm_worker.request import Request
from models import MediaSpan, mrope_positions


class EmbeddingMismatch(ValueError):
    """An embedding that cannot fill its placeholders (wrong width or row count)."""


@dataclass(frozen=True)
class RopeSpec:
    spatial_merge_size: int = 2
    tokens_per_second: float | None = None  # Qwen2.5-VL video time scale


class ModelState:
    def __init__(self, model: torch.nn.Module, rope: RopeSpec, inputs_embeds: torch.Tensor):
        self.model = model
        self.rope = rope
        self.hidden_size = inputs_embeds.shape[1]
        self.inputs_embeds = inputs_embeds  # the runner's persistent [max_tokens, hidden]

    def init_request(self, request: Request) -> None:
        """The request's rope state: prompt positions [3, P] and the decode delta."""
        spans = [
            MediaSpan(f.offset, f.grid_thw, f.modality, f.second_per_grid_t)
            for f in request.mm_features
            if f.grid_thw is not None and f.modality in ("image", "video")
        ]
        positions, delta = mrope_positions(
            request.num_prompt_tokens,
            spans,
            self.rope.spatial_merge_size,
            self.rope.tokens_per_second,
        )
        request.mrope_positions = positions.numpy()
        request.mrope_delta = delta

    def positions(self, request: Request, start: int, end: int) -> np.ndarray:  # [3, end - start]
        prompt_len = request.num_prompt_tokens
        if start >= prompt_len:  # decode (or recompute of outputs): index + delta on all axes
            return np.broadcast_to(np.arange(start, end) + request.mrope_delta, (3, end - start))
        if end <= prompt_len:
            return request.mrope_positions[:, start:end]
        tail = np.arange(prompt_len, end) + request.mrope_delta
        return np.concatenate(
            [request.mrope_positions[:, start:], np.broadcast_to(tail, (3, end - prompt_len))],
            axis=1,
        )

    def process_mm_embeds(
        self, mm_hash: str, embeds: torch.Tensor, num_embeds: int
    ) -> torch.Tensor:
        """Check (and for pruning models, reshape) one fetched embedding before it is stored."""
        if embeds.dim() != 2:
            raise EmbeddingMismatch(f"embedding {mm_hash} has shape {tuple(embeds.shape)}, not 2-D")
        width = embeds.shape[1]
        if width != self.hidden_size:
            if width > self.hidden_size and not self.model.supports_multimodal_pruning:
                raise EmbeddingMismatch(
                    f"embedding {mm_hash} is {width} wide, the model's hidden size is "
                    f"{self.hidden_size}: pruned (EVS) embeddings need a model with multimodal "
                    "pruning"
                )
            raise EmbeddingMismatch(
                f"embedding {mm_hash} is {width} wide; the hidden size is {self.hidden_size}"
            )
        if embeds.shape[0] != num_embeds:
            raise EmbeddingMismatch(
                f"embedding {mm_hash} has {embeds.shape[0]} rows for {num_embeds} placeholder "
                "embeddings in the prompt"
            )
        return embeds

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor:
        return self.inputs_embeds[:num_tokens]
