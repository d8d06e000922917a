"""The LM worker's internal request types. Protobuf stops at the servicer; these go inside."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int  # already capped by the context length
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: the sampled token's and the N most likely

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in 0..20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class MMFeature:
    """Where one media item's embeddings go in the prompt (vLLM's PlaceholderRange + hash)."""

    mm_hash: str
    offset: int  # first placeholder token
    length: int  # placeholder tokens
    # One flag per placeholder token; None: every placeholder token takes an embedding.
    is_embed: np.ndarray | None = None  # [length] bool
    modality: str = "image"
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_t: float | None = None

    def __post_init__(self):
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(
                f"{self.mm_hash}: is_embed has {len(self.is_embed)} flags for {self.length} tokens"
            )

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    def embeds_in_range(self, start: int, end: int) -> tuple[int, int]:
        """Embedding rows [lo, hi) that placeholder tokens [start, end) (item-relative) take."""
        if self.is_embed is None:
            return start, end
        lo = int(self.is_embed[:start].sum())
        return lo, lo + int(self.is_embed[start:end].sum())


class Status(enum.Enum):
    WAITING = "waiting"  # ready to be scheduled (new, or preempted for recompute)
    RUNNING = "running"  # holds KV blocks
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_features: list[MMFeature] = field(default_factory=list)
    # Realtime: the session whose per-position embeddings this request's decode steps add.
    realtime_session: str | None = None
    arrival: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain, full blocks
    num_committed_blocks: int = 0  # leading block_ids registered in the prefix cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # M-RoPE: prompt positions [3, prompt_len] and the decode delta (None: plain 1-D positions).
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    generator: torch.Generator | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def mm_hashes(self) -> list[str]:
        return [f.mm_hash for f in self.mm_features]
