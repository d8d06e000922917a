"""`epd bench structured`: what a structured output costs, next to the same engine's free text.

One engine of ours (as `epd bench lm` builds it) runs S streams of greedy requests, each time
twice in a row, interleaved round by round: free (the baseline) and constrained by the schema
(`--schema FILE`; by default an object with one string, which a random model fills to
max_tokens). Both run to `--tokens` unless the grammar ends first; tokens/s counts the tokens
each really gave. Also timed, outside the engine: compiling the schema against the model's
vocabulary, cold (a new compiler) and from the cache (what every later request with it pays),
and one step's mask for S requests (`mask_grammar`) against the step it rides on.
The last line is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common.grammar import GrammarCompiler, check
from common.served_model import ensure_bench_model
from epd.bench.lm import Ours, _prompt, cpu_model
from lm_worker.engine import LMEngine
from lm_worker.request import Request
from lm_worker.sampler import mask_grammar
from models import SamplingParams, Tokenizer
from models.checkpoint import DTYPES
from models.sampling import Constraint

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


class Streams:
    """S greedy requests at once on our engine, free or under a constraint."""

    def __init__(self, engine: LMEngine, compiler: GrammarCompiler):
        self.engine = engine
        self.compiler = compiler
        self.count = 0

    def run(self, streams: int, tokens: int, constraint: Constraint | None) -> tuple[float, int]:
        """(seconds, tokens given)."""
        engine = self.engine
        given = [0]

        def sink(out) -> None:
            given[0] += len(out.token_ids)

        for i in range(streams):
            self.count += 1
            params = SamplingParams(max_tokens=tokens, temperature=0.0, structured=constraint)
            request = Request(f"s{self.count}", _prompt(i), params)
            if constraint is not None:
                request.grammar = self.compiler.matcher(constraint)
            engine.add_request(request, sink)
        started = time.perf_counter()
        engine.run_to_completion()
        return time.perf_counter() - started, given[0]


def compile_times(tokenizer_json: str, vocab: int, eos: list[int], constraint: Constraint):
    """A new compiler for the vocabulary, and seconds: its making, the constraint's first
    compile on it, and a request's matcher from the cache (best of 20)."""
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer_json, vocab, eos)
    vocabulary = time.perf_counter() - started
    started = time.perf_counter()
    compiler.matcher(constraint)
    cold = time.perf_counter() - started
    cached = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        compiler.matcher(constraint)
        cached = min(cached, time.perf_counter() - started)
    return compiler, vocabulary, cold, cached


def mask_seconds(compiler: GrammarCompiler, constraint: Constraint, rows: int) -> float:
    """One step's mask for `rows` constrained requests over the vocabulary (best of 20)."""
    grammars = [compiler.matcher(constraint) for _ in range(rows)]
    logits = torch.randn(rows, compiler.vocab_size)
    best = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        mask_grammar(logits, grammars)
        best = min(best, time.perf_counter() - started)
    return best


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_bench_model()
    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    constraint = Constraint("json_schema", json.dumps(schema))
    check(constraint)
    streams = [int(s) for s in args.streams.split(",")]
    ours = Ours(model_dir, max(streams), "cpu", DTYPES[args.dtype])
    engine = ours.engine
    tokenizer_json = Tokenizer.from_dir(model_dir).to_json()
    eos = sorted(engine.eos_token_ids)
    compiler, vocabulary_s, cold_s, cached_s = compile_times(
        tokenizer_json, engine.vocab_size, eos, constraint
    )
    bench = Streams(engine, compiler)
    bench.run(1, 4, None)  # warm-up both
    bench.run(1, 4, constraint)
    med = statistics.median
    rows = []
    for s in streams:
        free, constrained = [], []
        for r in range(args.rounds):
            seconds, given = bench.run(s, args.tokens, None)
            free.append(given / seconds)
            seconds, given = bench.run(s, args.tokens, constraint)
            constrained.append(given / seconds)
            print(
                f"{s} streams, round {r + 1}: free {free[-1]:.1f} tok/s, "
                f"constrained {constrained[-1]:.1f} ({given} tokens)",
                flush=True,
            )
        mask = mask_seconds(compiler, constraint, s)
        rows.append(
            {
                "streams": s,
                "free_tps": round(med(free), 2),
                "constrained_tps": round(med(constrained), 2),
                "constrained_vs_free": round(med(constrained) / med(free), 3),
                "mask_ms_per_step": round(mask * 1e3, 3),
                "constrained_tokens_per_stream": given // s,
            }
        )
    summary = {
        "bench": "structured",
        "model": model_dir.name,
        "cpu": cpu_model(),
        "threads": args.threads,
        "vocab_size": engine.vocab_size,
        "schema_chars": len(constraint.text),
        "vocabulary_ms": round(vocabulary_s * 1e3, 2),
        "compile_cold_ms": round(cold_s * 1e3, 3),
        "compile_cached_ms": round(cached_s * 1e3, 4),
        "results": rows,
    }
    for row in rows:
        print(
            f"{row['streams']} streams: constrained {row['constrained_vs_free']}x free "
            f"({row['constrained_tps']} against {row['free_tps']} tok/s); the mask "
            f"{row['mask_ms_per_step']} ms a step"
        )
    print(
        f"compile: {summary['compile_cold_ms']} ms cold, {summary['compile_cached_ms']} ms "
        f"cached (the vocabulary once: {summary['vocabulary_ms']} ms)"
    )
    print(json.dumps(summary))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "structured", help="structured outputs: tokens/s constrained vs free, compile, mask"
    )
    p.add_argument("--model", help="checkpoint directory (default: the random small model)")
    p.add_argument("--schema", help="a JSON schema file (default: an object with one string)")
    p.add_argument("--streams", default="1,8,32", help="concurrent streams, comma-separated")
    p.add_argument("--tokens", type=int, default=64, help="max tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.set_defaults(func=run)
