"""Structured outputs (common/grammar.py): a request's grammar masks the tokens it does not
allow in the sampler, in the same steps as free requests, and a resumed request goes on alike;
what cannot be enforced is refused by name. Through the whole cluster: tests/test_openai_api.py
(and a constrained stream through P + D and a migration: tests/test_pd_cluster.py)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from common.grammar import MAX_CONSTRAINT_CHARS, Constraint, GrammarCompiler, GrammarError, check
from common.served_model import builtin_model
from models import Tokenizer
from tests.lm_helpers import case, make_engine, run

SCHEMAS = {
    "enums and bounded integers": {
        "type": "object",
        "properties": {
            "shape": {"enum": ["circle", "square", "triangle"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
            "filled": {"type": "boolean"},
        },
        "required": ["shape", "count", "filled"],
        "additionalProperties": False,
    },
    "nested objects and an array with bounds": {
        "type": "object",
        "properties": {
            "scene": {
                "type": "object",
                "properties": {
                    "shapes": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 3,
                        "items": {
                            "type": "object",
                            "properties": {
                                "colour": {"enum": ["red", "green", "blue"]},
                                "size": {"type": "integer", "minimum": 1, "maximum": 5},
                            },
                            "required": ["colour", "size"],
                            "additionalProperties": False,
                        },
                    }
                },
                "required": ["shapes"],
                "additionalProperties": False,
            }
        },
        "required": ["scene"],
        "additionalProperties": False,
    },
    "patterns and numbers": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"},
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
        },
        "required": ["code", "x"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def builtin_grammars() -> tuple[GrammarCompiler, Tokenizer]:
    tokenizer = Tokenizer.from_dir(builtin_model())
    return GrammarCompiler(tokenizer.to_json(), 512, [tokenizer.eos_token_id]), tokenizer


def sample_under(compiler: GrammarCompiler, constraint: Constraint, seed: int) -> list[int]:
    """Tokens drawn from random logits under the constraint's mask, to its end."""
    g = torch.Generator().manual_seed(seed)
    matcher, out = compiler.matcher(constraint), []
    while not matcher.done and len(out) < 400:
        logits = torch.randn(compiler.vocab_size, generator=g) * 3
        logits[~torch.from_numpy(matcher.allowed())] = float("-inf")
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        assert matcher.accept(token)
        out.append(token)
        if token in compiler.tokenizer.eos_tokens:
            break
    return out


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_logits_under_a_schema_always_give_valid_json(builtin_grammars, name):
    compiler, tokenizer = builtin_grammars
    schema = SCHEMAS[name]
    for seed in range(12):
        tokens = sample_under(compiler, Constraint("json_schema", json.dumps(schema)), seed)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_regex_constraints(builtin_grammars):
    compiler, tokenizer = builtin_grammars
    for seed in range(6):
        text = tokenizer.decode(
            sample_under(compiler, Constraint("regex", r"(yes|no), [0-9]{3}"), seed),
            skip_special_tokens=True,
        )
        assert re.fullmatch(r"(yes|no), [0-9]{3}", text), text
    # Any JSON object: its mask allows "{" first and nothing else that could start text.
    matcher = compiler.matcher(Constraint("json_object"))
    allowed = [tokenizer.decode([t]) for t in matcher.allowed().nonzero()[0]]
    assert allowed and all(a.lstrip().startswith("{") for a in allowed), allowed


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (Constraint("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (Constraint("json_schema", '{"properties": {"a": {"not": {}}}}'), '"not"'),
        (Constraint("json_schema", '{"type": "colour"}'), "colour"),
        (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
        (Constraint("json_schema", "{nope"), "not valid JSON"),
        (Constraint("regex", "(a"), "unclosed group"),
        (Constraint("lark", "start: foo"), "foo"),
        (Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1)), "at most"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(constraint, named):
    with pytest.raises(GrammarError) as e:
        check(constraint)
    assert named in str(e.value)


def test_a_compiled_grammar_is_kept_and_each_request_gets_its_own_copy(builtin_grammars):
    compiler, tokenizer = builtin_grammars
    schema = {**SCHEMAS["enums and bounded integers"], "title": "only this test's"}
    constraint = Constraint("json_schema", json.dumps(schema))
    before = compiler.compiled
    first, second = compiler.matcher(constraint), compiler.matcher(constraint)
    assert compiler.compiled - before == 1  # the second came from the cache
    for token in tokenizer.encode('{"shape":"sq'):  # compact JSON: no free whitespace
        assert first.accept(token)
    # The second is still at the start: only "{" may begin it.
    assert (first.allowed() != second.allowed()).any()
    assert not second.accept(tokenizer.encode('"')[0])


# -- in the engine ------------------------------------------------------------------------------

ENGINE_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_grammars(tiny_checkpoint) -> tuple[GrammarCompiler, Tokenizer]:
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    engine = make_engine(tiny_checkpoint)
    compiler = GrammarCompiler(tokenizer.to_json(), engine.vocab_size, sorted(engine.eos_token_ids))
    return compiler, tokenizer


def constrained(c, compiler: GrammarCompiler, **sampling):
    """The case's request under ENGINE_SCHEMA, its matcher set as the LM frontend sets it."""
    request = c.request(ignore_eos=False, max_tokens=80, **sampling)
    constraint = Constraint("json_schema", json.dumps(ENGINE_SCHEMA))
    request.sampling = replace(request.sampling, structured=constraint)
    request.grammar = compiler.matcher(constraint)
    return request


def test_constrained_and_free_requests_share_steps(tiny_checkpoint, tiny_ref, tiny_grammars):
    """A constrained request in the same steps as free ones: the free ones' tokens are the
    reference's (the mask touched their rows not at all), the constrained one's are valid."""
    compiler, tokenizer = tiny_grammars
    free = [case(tiny_ref, f"free{i}", f"Say something about {i}") for i in range(2)]
    json_case = case(tiny_ref, "json", "Describe the colour", max_tokens=4)
    engine = make_engine(tiny_checkpoint)
    batches = []
    sample = engine.sampler.__call__

    def watched(logits, requests):
        batches.append({r.request_id for r in requests})
        return sample(logits, requests)

    engine.sampler = watched
    out = run(engine, *free, (constrained(json_case, compiler), json_case.embeddings))
    for c in free:
        assert out[c.request_id].token_ids == c.expected, c.request_id
    got = out["json"]
    assert got.last.finish_reason == "stop", got.last
    jsonschema.validate(json.loads(tokenizer.decode(got.token_ids, skip_special_tokens=True)),
                        ENGINE_SCHEMA)  # fmt: skip
    assert any({"json", "free0", "free1"} <= b for b in batches)


def test_a_resumed_constrained_request_replays_its_output_and_goes_on_alike(
    tiny_checkpoint, tiny_ref, tiny_grammars
):
    """A migration or the decode stage after a prefill: a new worker gets the output so far as
    the end of its prompt, replays it into a fresh matcher, and gives the same tokens the
    unbroken request gave (greedy), the whole still valid."""
    compiler, tokenizer = tiny_grammars
    c = case(tiny_ref, "whole", "Describe the colour", max_tokens=4)
    whole = run(make_engine(tiny_checkpoint), (constrained(c, compiler), c.embeddings))
    tokens = whole["whole"].token_ids
    assert len(tokens) > 6
    k = 5
    resumed = constrained(replace(c, request_id="rest"), compiler)
    resumed.prompt_token_ids = resumed.prompt_token_ids + tokens[:k]
    resumed.resumed_output_tokens = k
    resumed.sampling = replace(resumed.sampling, max_tokens=80 - k)
    resumed.grammar.replay(tokens[:k])
    rest = run(make_engine(tiny_checkpoint), (resumed, c.embeddings))
    assert tokens[:k] + rest["rest"].token_ids == tokens
    jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)),
                        ENGINE_SCHEMA)  # fmt: skip


def test_bench_structured(tiny_checkpoint, tmp_path):
    """`epd bench structured` runs end to end (its figures are measured, never asserted)."""
    from tests.test_benches import bench

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(ENGINE_SCHEMA))
    summary = bench(
        "structured", "--model", str(tiny_checkpoint), "--schema", str(schema),
        "--streams", "1,2", "--tokens", "8", "--rounds", "1",
    )  # fmt: skip
    assert summary["bench"] == "structured" and summary["compile_cold_ms"] > 0
    assert [r["streams"] for r in summary["results"]] == [1, 2]
    for row in summary["results"]:
        assert row["constrained_vs_free"] > 0 and row["mask_ms_per_step"] > 0
        assert 0 < row["constrained_tokens_per_stream"] <= 8


def test_a_constraint_that_compiles_too_long_is_refused_with_the_limit(monkeypatch):
    """The proxy's check runs on a thread under GRAMMAR_CHECK_SECONDS; past it, a 400 that
    says so (the limit set to nothing here: any compile takes longer)."""
    import asyncio

    from proto import epd_pb2
    from proxy import validate
    from proxy.prepare import BadInput

    monkeypatch.setattr(validate, "GRAMMAR_CHECK_SECONDS", 0.0)
    sampling = epd_pb2.SamplingParams()
    sampling.structured.json_schema = json.dumps(SCHEMAS["patterns and numbers"])
    with pytest.raises(BadInput, match="did not compile within"):
        asyncio.run(validate.check_structured(sampling))
