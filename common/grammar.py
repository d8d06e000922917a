"""Structured outputs: a grammar a request's output must follow, with llguidance.

A `Constraint` is what the client asked for (a JSON schema, any JSON object, a regex, a Lark
grammar). The proxy checks it before any work (`check`: a clear error naming what the library
does not support); the LM worker compiles it against its tokenizer (`GrammarCompiler`: one
compiled matcher per constraint, kept, and a cheap copy of it per request) and each request's
`Matcher` says which tokens may come next (`allowed`) and takes the ones sampled (`accept`).
A request resumed elsewhere (a migration, the decode stage after a prefill) replays its output
so far into a fresh matcher.

Why llguidance and not xgrammar (measured on the built-in model's tokenizer and a 30k one,
2026-12-07): it has no dependencies (xgrammar pulls transformers into the worker and takes 4.8 s
to import), it refuses schema keywords it cannot enforce by name (xgrammar accepts
`uniqueItems` and `not` and then lets outputs break them), and a step's mask costs 30-110 us
against a decode step's milliseconds. A fresh matcher per request costs 0.3-1 ms; the copy of a
compiled one, 3-10 us.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

from models.sampling import Constraint
from proto import epd_pb2

KINDS = ("json_schema", "json_object", "regex", "lark")
# The proxy's bound on a constraint's text (a schema, a grammar): compiling costs with its size.
MAX_CONSTRAINT_CHARS = 64 * 1024
# Bounds on the work a grammar may make (llguidance's defaults are for trusted grammars): a
# request's grammar that passes them is refused, not left to stall its worker's steps.
LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,  # ~20 ms to build the lexer
    step_lexer_fuel=200_000,  # ~15 ms a mask
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=200_000,
    verbose_errors=False,  # errors reach clients: no parser state in them
)


class GrammarError(ValueError):
    """A constraint that cannot be used: invalid, unsupported, or over the limits."""


def grammar_of(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar. JSON is written without free whitespace (a
    model given the choice can emit spaces forever)."""
    kind, text = constraint.kind, constraint.text
    compact = {"whitespace_flexible": False}
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
    if kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=compact)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not a JSON object: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


def constraint_of(s: epd_pb2.SamplingParams) -> Constraint | None:
    """SamplingParams.structured as a Constraint (None: free text)."""
    kind = s.structured.WhichOneof("kind") if s.HasField("structured") else None
    if kind is None:
        return None
    return Constraint(kind, "" if kind == "json_object" else getattr(s.structured, kind))


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


@functools.lru_cache(maxsize=256)
def check(constraint: Constraint) -> None:
    """Raise GrammarError (the library's reason, e.g. `Unimplemented keys: ["uniqueItems"]`)
    unless the constraint compiles. Needs no tokenizer: the proxy's check before any work.
    A constraint that passed is remembered (clients send the same schema request after
    request); one that failed is checked again (an exception is not cached)."""
    if len(constraint.text) > MAX_CONSTRAINT_CHARS:
        raise GrammarError(
            f"the {constraint.kind} has {len(constraint.text)} characters, at most "
            f"{MAX_CONSTRAINT_CHARS}"
        )
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.text)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object")
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar_of(constraint), limits=limits()
    )
    if failed:
        raise GrammarError(f"the {constraint.kind} cannot be enforced: {messages[0]}")


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """The tokens that may come next: bool [vocab_size]. GrammarError if none can (the
        matcher failed: its limits, or a token it did not allow)."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(bool)
        if self._m.is_error() or not allowed.any():
            raise GrammarError(f"the grammar allows no next token: {self.error()}")
        return allowed

    def accept(self, token_id: int) -> bool:
        """Take a sampled token; False if the grammar did not allow it."""
        return self._m.consume_token(token_id) and not self._m.is_error()

    def replay(self, token_ids: Sequence[int]) -> None:
        """Take a resumed request's output so far (it was sampled under this grammar)."""
        if token_ids and not self._m.consume_tokens(list(token_ids)):
            raise GrammarError(f"the output so far does not follow the grammar: {self.error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of the output)."""
        return self._m.is_stopped()

    def error(self) -> str:
        return self._m.get_error() or "no token is allowed"


class GrammarCompiler:
    """Constraints compiled for one tokenizer: the compiled matcher of each of the last
    `cache_size` constraints is kept, and a request gets a copy. Thread-safe."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
    ):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.cache_size = cache_size
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (not found in the cache)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for the constraint; GrammarError if it does not compile."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
        if compiled is None:
            compiled = llguidance.LLMatcher(
                self.tokenizer, grammar_of(constraint), log_level=0, limits=limits()
            )
            compiled.compute_bitmask()  # the lexer's first states: a grammar over limits fails now
            if compiled.is_error():
                raise GrammarError(f"the {constraint.kind} cannot be enforced: "
                                   f"{compiled.get_error()}")  # fmt: skip
            with self._lock:
                self.compiled += 1
                self._compiled[constraint] = compiled
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return Matcher(compiled.deep_copy(), self.vocab_size)
