"""Sampling settings and the distribution they define: one definition for the LM engine and
the reference path, so both draw from the same probabilities."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

# Temperatures below this sample as greedy: dividing logits by a denormal overflows them to
# inf, and the softmax of inf is NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow (structured outputs; common/grammar.py compiles it)."""

    kind: str  # "json_schema", "json_object", "regex" or "lark"
    text: str = ""  # the schema's JSON, the regex or the grammar; "" for json_object


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: until a stop, or the context is full
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: the sampled token's and the N most likely
    structured: Constraint | None = None  # None: free text

    def __post_init__(self):
        for key in ("temperature", "top_p"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{key} must be finite, got {value}")
        for key in ("max_tokens", "top_k", "seed", "logprobs"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key} must be an integer, got {value!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
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
        return self.temperature < MIN_TEMPERATURE


class Draws:
    """The randomness of one request's sampled tokens: output token i draws from a CPU generator
    seeded by (seed, i). A token's draw depends on its index alone, not on how many tokens this
    process drew before it, so a request resumed elsewhere after n tokens (`start=n`) goes on
    exactly as it would have in one piece. Without a seed, the seed is random."""

    def __init__(self, seed: int | None, start: int = 0):
        self.seed = seed if seed is not None else random.getrandbits(64)
        self.index = start
        self._generator = torch.Generator()

    def next(self) -> torch.Generator:
        """The generator for the next token's draw."""
        self._generator.manual_seed(_mix(self.seed, self.index))
        self.index += 1
        return self._generator


def _mix(seed: int, index: int) -> int:
    """A 63-bit seed from (seed, index): splitmix64's finaliser over their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


_MASK64 = (1 << 64) - 1


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token drawn from logits [vocab] at params' temperature, top-k and top-p.

    NOTE: on the CPU, where the generator lives, so a seed gives the same tokens on every
    device."""
    row = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < row.shape[0]:
        kth = row.topk(params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
