"""Multimodal embeddings on the LM side: the store of fetched embeddings, and the per-step
gather that picks the slices falling inside each request's token window.

The gather follows vLLM's EncoderRunner.gather_mm_embeddings (model runner V2):
- each request's window this step is [num_computed_tokens, + num_scheduled_tokens), shifted by
  `draft_lookahead`; an item contributes the embedding rows of its placeholder tokens inside
  that window, mapped through its `is_embed` mask (placeholders may hold non-embedding tokens);
- `is_mm_embed` marks which of the step's tokens take an embedding, OR-accumulated (`|=`) over
  the items of a request, so one item's mask never clears another's;
- non-realtime models skip requests in decode and return early when every request decodes;
  realtime models gather on decode steps too (their audio embedding rides on every step).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from models import MMFeature


class RealtimeStream:
    """A realtime session's per-position embeddings, growing as the encoder publishes them."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device):
        self.rows = torch.empty(256, hidden, dtype=dtype, device=device)
        self.count = 0
        self.closed = False  # no more rows will come (the audio ended)

    def append(self, rows: torch.Tensor) -> None:
        needed = self.count + rows.shape[0]
        if needed > self.rows.shape[0]:
            grown = torch.empty(
                max(needed, 2 * self.rows.shape[0]),
                self.rows.shape[1],
                dtype=self.rows.dtype,
                device=self.rows.device,
            )
            grown[: self.count] = self.rows[: self.count]
            self.rows = grown
        self.rows[self.count : needed] = rows.to(self.rows.device, self.rows.dtype)
        self.count = needed

    def view(self) -> torch.Tensor:
        return self.rows[: self.count]


class MMEmbeddings:
    """Embeddings by mm_hash (vLLM's encoder cache), each held while a request needs it, and
    the features (placeholder ranges) of every live request."""

    def __init__(self, is_realtime: bool):
        self.is_realtime = is_realtime
        self.outputs: dict[str, torch.Tensor] = {}  # mm_hash -> [num_embeds, width]
        # mm_hash -> what the model state's positions read from it (LoadedEmbedding.positions)
        self.positions: dict[str, Any] = {}
        self.refs: dict[str, int] = {}
        self.features: dict[str, list[MMFeature]] = {}  # request id -> by offset
        self._offsets: dict[str, list[int]] = {}

    # -- lifetime -----------------------------------------------------------------------------

    def add_request(self, request_id: str, features: Sequence[MMFeature]) -> None:
        ordered = sorted(features, key=lambda f: f.offset)
        self.features[request_id] = ordered
        self._offsets[request_id] = [f.offset for f in ordered]
        for f in ordered:
            self.refs[f.mm_hash] = self.refs.get(f.mm_hash, 0) + 1

    def remove_request(self, request_id: str) -> None:
        for f in self.features.pop(request_id, ()):
            self.refs[f.mm_hash] -= 1
            if self.refs[f.mm_hash] == 0:
                del self.refs[f.mm_hash]
                self.outputs.pop(f.mm_hash, None)
                self.positions.pop(f.mm_hash, None)
        self._offsets.pop(request_id, None)

    def put(self, mm_hash: str, embeds: torch.Tensor, positions: Any = None) -> None:
        self.outputs[mm_hash] = embeds
        if positions is not None:
            self.positions[mm_hash] = positions

    def positions_of(self, request_id: str) -> dict[str, Any]:
        """The stored positions of a request's items that carry some, by mm_hash."""
        return {
            f.mm_hash: self.positions[f.mm_hash]
            for f in self.features.get(request_id, ())
            if f.mm_hash in self.positions
        }

    def missing(self, request_id: str) -> list[str]:
        return [
            f.mm_hash for f in self.features.get(request_id, ()) if f.mm_hash not in self.outputs
        ]

    # -- the per-step gather ------------------------------------------------------------------

    def gather_mm_embeddings(
        self,
        req_ids: Sequence[str],
        total_num_scheduled_tokens: int,
        num_scheduled_tokens: np.ndarray,  # [num_reqs]
        query_start_loc: np.ndarray,  # [num_reqs + 1]
        prefill_lens: np.ndarray,  # [num_reqs]
        num_computed_tokens: np.ndarray,  # [num_reqs]
        draft_lookahead: int = 0,
        realtime: dict[str, RealtimeStream] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """-> (embedding slices in token order, is_mm_embed [total_num_scheduled_tokens]; None
        in a step of decodes alone, where no embedding can be wanted)."""
        if draft_lookahead:
            num_computed_tokens = num_computed_tokens + draft_lookahead
        exclude: list[bool] | None = None
        if not self.is_realtime:
            # Media only sits in prompts: requests past their prompt need nothing.
            is_decode = num_computed_tokens >= prefill_lens
            if is_decode.all():
                return [], None
            exclude = is_decode.tolist()
        is_mm_embed = torch.zeros(total_num_scheduled_tokens, dtype=torch.bool)

        window_start = num_computed_tokens.tolist()
        window_end = (num_computed_tokens + num_scheduled_tokens).tolist()
        step_start = query_start_loc.tolist()
        mm_embeds: list[torch.Tensor] = []
        for i, req_id in enumerate(req_ids):
            if exclude is not None and exclude[i]:
                continue
            start, end = window_start[i], window_end[i]
            features = self.features.get(req_id, ())
            offsets = self._offsets.get(req_id, [])
            # Items that can overlap [start, end): those starting before `end`, from the last
            # one starting at or before `start` (items do not overlap one another).
            lo = max(bisect.bisect_right(offsets, start) - 1, 0)
            hi = bisect.bisect_left(offsets, end)
            for f in features[lo:hi]:
                first = max(start - f.offset, 0)  # item-relative placeholder range
                last = min(end - f.offset, f.length)
                if first >= last:
                    continue
                rows_lo, rows_hi = f.embeds_in_range(first, last)
                if rows_lo == rows_hi:
                    continue
                source = self._source(f.mm_hash, realtime)
                mm_embeds.append(source[rows_lo:rows_hi])
                at = step_start[i] + f.offset + first - start  # step index of placeholder `first`
                if f.is_embed is None:
                    is_mm_embed[at : at + last - first] = True
                else:
                    is_mm_embed[at : at + last - first] |= torch.from_numpy(f.is_embed[first:last])
        return mm_embeds, is_mm_embed

    def _source(self, mm_hash: str, realtime: dict[str, RealtimeStream] | None) -> torch.Tensor:
        if realtime is not None and mm_hash in realtime:
            return realtime[mm_hash].view()
        embeds = self.outputs.get(mm_hash)
        if embeds is None:
            # NOTE: the engine checks `missing()` before a request's step; reaching this is a bug.
            raise KeyError(f"embedding {mm_hash} is not in the store")
        return embeds
