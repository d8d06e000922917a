"""A request's inputs besides its token ids, in one place: `RequestInputs`.

Everything the model needs for a request other than its token ids lives in its
`RequestInputs`, made by the engine when the request arrives (`engine.add_request`):

- the media embeddings of its items, by mm_hash, as the servicer's fetch brings them (`put`);
  they sit in the worker's `EmbeddingCache`, shared by every request that names the same item;
- a realtime session's per-position rows as the encoder streams them (`append_rows`);
- what has arrived and what is missing, and so how many of its tokens can be computed now
  (`ready_tokens`: up to the first item still lacking; a realtime request, up to the position
  whose row has not come) and whether its audio has ended (`ended`);
- its position state (`request.rope`, the family's `ModelState.rope_state`), remade over the
  prompt up to its first lacking item each time embeddings arrive;
- the gather for a step's token window (`gather`), which `gather_mm_embeddings` runs over a
  step's requests as vLLM's model runner V2 does: an item contributes the rows of its
  placeholders inside the window, through its `is_embed` mask, and `is_mm_embed` is
  OR-accumulated (`|=`) so one item's mask never clears another's. Non-realtime models skip
  requests past their prompt and return early in a step of decodes alone; realtime models
  gather on decode steps too (their audio rides on every step).

Every method runs on the engine thread; sources on other threads reach it through the engine's
inbox (`add_embeddings`, `append_realtime`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lm_worker.request import Request
from models import LoadedEmbedding, MMFeature, ModelState


class RealtimeRows:
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


class EmbeddingCache:
    """Embeddings by mm_hash (vLLM's encoder cache): one copy of an item however many live
    requests name it, dropped when the last of them ends."""

    def __init__(self):
        self.embeds: dict[str, torch.Tensor] = {}  # mm_hash -> [num_embeds, width]
        # mm_hash -> what the model state's positions read from it (LoadedEmbedding.positions)
        self.positions: dict[str, Any] = {}
        self.refs: dict[str, int] = {}

    def hold(self, mm_hashes: Sequence[str]) -> None:
        for h in mm_hashes:
            self.refs[h] = self.refs.get(h, 0) + 1

    def release(self, mm_hashes: Sequence[str]) -> None:
        for h in mm_hashes:
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
                self.embeds.pop(h, None)
                self.positions.pop(h, None)

    def put(self, mm_hash: str, loaded: LoadedEmbedding) -> None:
        self.embeds[mm_hash] = loaded.embeds
        if loaded.positions is not None:
            self.positions[mm_hash] = loaded.positions


class RequestInputs:
    """One request's inputs besides its token ids (see the module docstring)."""

    def __init__(
        self,
        request: Request,
        cache: EmbeddingCache,
        model_state: ModelState,
        rows: RealtimeRows | None = None,  # a realtime request's session rows
    ):
        self.request = request
        self.cache = cache
        self.model_state = model_state
        # A request whose media KV came from the KV tier gathers nothing: its position state
        # past the media was set by the servicer.
        features = [] if request.media_in_kv else request.mm_features
        self.features = sorted(features, key=lambda f: f.offset)
        self.offsets = [f.offset for f in self.features]
        self.session = request.realtime_session
        self.rows = rows
        self.session_feature = next((f for f in self.features if f.mm_hash == self.session), None)
        # Items fetched from the connector (a realtime session's come as rows).
        self.media = [f.mm_hash for f in self.features if f.mm_hash != self.session]
        self.until: int | None = None  # the offset of the first item still lacking
        self.laid_out: set[str] = set()  # items whose run the model state has laid out
        cache.hold(self.media)

    # -- sources ------------------------------------------------------------------------------

    def put(self, embeddings: Mapping[str, LoadedEmbedding | torch.Tensor]) -> list[str]:
        """More of the request's embeddings (by mm_hash, made ready by the runner's
        `load_embedding`). Remakes its position state over the prompt up to its first item
        still lacking (all of it once none lacks: positions may depend on the embeddings, for
        pruned media) and returns the mm_hashes still lacking. Until they come, `ready_tokens`
        stops at that item: the text before it can be prefilled while it is encoded. Raises
        EmbeddingMismatch when the embeddings do not fit the prompt."""
        request = self.request
        if request.media_in_kv:
            return []
        for mm_hash, loaded in embeddings.items():
            if isinstance(loaded, torch.Tensor):
                loaded = LoadedEmbedding(loaded)
            self.cache.put(mm_hash, loaded)
        missing = self.missing
        positions = self.cache.positions
        self._lay_out(positions)
        # A prefix's positions depend on the prefix alone (a causal LM's position schemes do),
        # so the state made from the prompt before the first lacking item is exact there.
        end = min(
            (f.offset for f in self.features if f.mm_hash in missing),
            default=request.num_prompt_tokens,
        )
        if end > 0:
            request.rope = self.model_state.rope_state(
                end,
                [f for f in request.mm_features if f.offset < end],
                {h: positions[h] for h in self.media if h in positions},
                token_ids=request.model_prompt,
            )
        self.until = end if missing else None
        return missing

    def _lay_out(self, positions: Mapping[str, Any]) -> None:
        """Items in whose run the model state moves tokens once their embedding is in (a
        pruned video whose frames stand apart in the prompt: how many each kept): the
        request's input ids and the item's is_embed flags as it lays them out (its
        `relayout`)."""
        request = self.request
        for f in self.features:
            if f.mm_hash in self.laid_out or f.mm_hash not in positions:
                continue
            self.laid_out.add(f.mm_hash)
            laid = self.model_state.relayout(request.model_prompt, f, positions[f.mm_hash])
            if laid is None:
                continue
            run, is_embed = laid
            if request.input_token_ids is None:
                request.input_token_ids = list(request.prompt_token_ids)
            request.input_token_ids[f.offset : f.offset + f.length] = run
            f.is_embed[:] = is_embed

    def append_rows(self, rows: torch.Tensor, closed: bool = False) -> None:
        """More per-position rows of the request's realtime session; `closed`: the last."""
        if rows.numel():
            self.rows.append(rows)
        self.rows.closed = self.rows.closed or closed

    # -- what has arrived ---------------------------------------------------------------------

    @property
    def missing(self) -> list[str]:
        """The mm_hashes of media items not in yet (a realtime session's rows excluded)."""
        return [h for h in self.media if h not in self.cache.embeds]

    def ready_tokens(self) -> int:
        """How many of the request's tokens can be computed now (the scheduler's limit): up
        to its first item whose embedding has not arrived; for a realtime request, none past
        those computed until the rows of every position up to its next token are in."""
        request = self.request
        if self.rows is not None and not self._rows_reach_next_token():
            return request.num_computed_tokens
        return self.until if self.until is not None else request.num_tokens

    def ended(self) -> bool:
        """A realtime session's audio has ended and its last position is consumed: the last
        token sampled sits at the last position (as a whole clip's transcription ends)."""
        if self.rows is None or not self.rows.closed:
            return False
        offset = self.session_feature.offset if self.session_feature is not None else 0
        return self.request.num_tokens >= offset + self.rows.count

    def _rows_reach_next_token(self) -> bool:
        f = self.session_feature
        if f is None:
            return True
        needed = min(max(self.request.num_tokens - f.offset, 0), f.length)
        return self.rows.count >= needed

    # -- the gather ---------------------------------------------------------------------------

    def gather(
        self, start: int, end: int, at: int, is_mm_embed: torch.Tensor, out: list[torch.Tensor]
    ) -> None:
        """The rows of the request's placeholders in its window [start, end) onto `out`, in
        token order, and their flags in `is_mm_embed` from step index `at` (= `start`)."""
        # Items that can overlap [start, end): those starting before `end`, from the last one
        # starting at or before `start` (items do not overlap one another).
        lo = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        hi = bisect.bisect_left(self.offsets, end)
        for f in self.features[lo:hi]:
            first = max(start - f.offset, 0)  # item-relative placeholder range
            last = min(end - f.offset, f.length)
            if first >= last:
                continue
            rows_lo, rows_hi = f.embeds_in_range(first, last)
            if rows_lo == rows_hi:
                continue
            out.append(self._source(f)[rows_lo:rows_hi])
            i = at + f.offset + first - start  # step index of placeholder `first`
            if f.is_embed is None:
                is_mm_embed[i : i + last - first] = True
            else:
                is_mm_embed[i : i + last - first] |= torch.from_numpy(f.is_embed[first:last])

    def _source(self, f: MMFeature) -> torch.Tensor:
        if f.mm_hash == self.session:
            return self.rows.view()
        embeds = self.cache.embeds.get(f.mm_hash)
        if embeds is None:
            # NOTE: `ready_tokens` stops a request before its first lacking item; reaching
            # this is a bug.
            raise KeyError(f"embedding {f.mm_hash} is not in the cache")
        return embeds

    def release(self) -> None:
        """The request ended: its hold on the cache's embeddings ends (rows go with it)."""
        self.cache.release(self.media)
        self.media = []


def ready_tokens(request: Request) -> int:
    """The scheduler's limit for a request: its inputs' `ready_tokens`."""
    return request.inputs.ready_tokens()


def gather_mm_embeddings(
    requests: Sequence[Request],
    num_tokens: int,
    num_scheduled_tokens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    prefill_lens: np.ndarray,  # [num_reqs]
    num_computed_tokens: np.ndarray,  # [num_reqs], before this step
    is_realtime: bool,
    draft_lookahead: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """-> (embedding slices in token order, is_mm_embed [num_tokens]; None in a step of
    decodes alone of a non-realtime model, where no embedding can be wanted)."""
    if draft_lookahead:
        num_computed_tokens = num_computed_tokens + draft_lookahead
    exclude: list[bool] | None = None
    if not is_realtime:
        # Media only sits in prompts: requests past their prompt need nothing.
        is_decode = num_computed_tokens >= prefill_lens
        if is_decode.all():
            return [], None
        exclude = is_decode.tolist()
    is_mm_embed = torch.zeros(num_tokens, dtype=torch.bool)
    window_start = num_computed_tokens.tolist()
    window_end = (num_computed_tokens + num_scheduled_tokens).tolist()
    step_start = query_start_loc.tolist()
    mm_embeds: list[torch.Tensor] = []
    for i, request in enumerate(requests):
        if exclude is not None and exclude[i]:
            continue
        request.inputs.gather(window_start[i], window_end[i], step_start[i], is_mm_embed, mm_embeds)
    return mm_embeds, is_mm_embed


__all__ = [
    "EmbeddingCache",
    "RealtimeRows",
    "RequestInputs",
    "gather_mm_embeddings",
    "ready_tokens",
]
