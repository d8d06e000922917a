"""The LM worker's internal request type. Protobuf stops at the servicer; this goes inside."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from common.tracing import Stages
from models.media import MMFeature
from models.sampling import Draws, SamplingParams


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
    # The family's per-request position state (ModelState.rope_state; None: plain positions).
    rope: Any = None
    # The prompt as the model takes it where that differs from `prompt_token_ids` (which the
    # prefix and KV hashes keep reading): a pruned video's run laid out as its frames kept
    # their tokens (ModelState.relayout). None: the prompt itself.
    input_token_ids: list[int] | None = None
    # Every token that takes a media embedding has its KV from the KV tier (a decode stage):
    # `rope` is the family's state past the media, and no embedding is fetched or gathered.
    media_in_kv: bool = False
    # Everything the model needs besides token ids (lm_worker/inputs.py's RequestInputs),
    # made by the engine when the request arrives.
    inputs: Any = None
    draws: Draws | None = None  # set when the request samples (or has a seed)
    # Its place in its grammar (common/grammar.py Matcher) when sampling.structured is set:
    # the sampler masks what it does not allow, and each sampled token advances it.
    grammar: Any = None
    # A resumed request: its last `resumed_output_tokens` prompt tokens are output it gave
    # before (elsewhere), of which the client has received `resumed_text_chars` characters.
    resumed_output_tokens: int = 0
    resumed_text_chars: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    num_preemptions: int = 0
    # Its stages here (common/tracing.py): the engine thread's prefill chunks, queue wait and
    # decode, the frontend's waits; exported when it ends.
    stages: Stages = field(default_factory=Stages)

    @property
    def model_prompt(self) -> list[int]:
        """The prompt as the model takes it (`input_token_ids` where set)."""
        return self.prompt_token_ids if self.input_token_ids is None else self.input_token_ids

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
    def embeds_end(self) -> int:
        """One past the last position that takes a media embedding (0 without media). Past
        the prompt (realtime models), decode steps add those positions' embeddings and the
        request ends once they are all consumed."""
        return max((f.offset + f.length for f in self.mm_features), default=0)

    @property
    def mm_hashes(self) -> list[str]:
        return [f.mm_hash for f in self.mm_features]
