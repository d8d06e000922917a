"""The OpenAI API beyond chat text, through the whole cluster with the official `openai` client
on the built-in model (which knows only pictures: every valid JSON answer, every call that fits
a tool's parameters, is the constraint's work): structured outputs (response_format, vLLM's
structured_outputs, the gRPC field), tool calling (tools, tool_choice, tool_calls, tool
messages, streamed calls), and POST /v1/completions (text or token-id prompts, several at
once, echo, logprobs, stop, streaming); and the 400s for each."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from common.served_model import builtin_model
from models import Tokenizer
from proto import epd_pb2, epd_pb2_grpc
from tests.test_structured import SCHEMAS

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def cluster(builtin_cluster):
    return builtin_cluster


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="-")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model())


# -- structured outputs ----------------------------------------------------------------------


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_client_gets_valid_json_for_every_schema(client, temperature):
    for name, schema in SCHEMAS.items():
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is in the picture?"}],
            temperature=temperature,
            seed=3,
            max_tokens=200,
            response_format=json_schema_format(schema),
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (name, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_structured_output_assembles_and_json_object(client):
    schema = SCHEMAS["nested objects and an array with bounds"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Which shapes are there?"}],
        temperature=0.0,
        max_tokens=200,
        stream=True,
        response_format=json_schema_format(schema),
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([c for c in chunks if c]) > 3
    jsonschema.validate(json.loads("".join(chunks)), schema)
    # Any JSON object: the built-in model's free answer is never one.
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "How many shapes are there?"}],
        temperature=0.0,
        max_tokens=300,
        response_format={"type": "json_object"},
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a string that runs to max_tokens: still the start of an object
        assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
         "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "schema must be a JSON schema object"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(a"}}, "unclosed group"),
        ({"structured_outputs": {"regex": "a", "grammar": "start: 'a'"}}, "exactly one"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)  # fmt: skip
def test_bad_constraints_get_a_400_naming_the_problem(client, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
    assert says in str(e.value)


def test_grpc_generate_carries_the_constraint(cluster):
    regex = r"(a red|a blue|a green) (circle|square)"
    request = epd_pb2.GenerateRequest(
        text="<|im_start|>user\nWhat is there?<|im_end|>\n<|im_start|>assistant\n",
        sampling=epd_pb2.SamplingParams(
            temperature=1.0, seed=5, max_tokens=40,
            structured=epd_pb2.StructuredOutput(regex=regex),
        ),
    )  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{cluster.proxy_grpc}") as channel:
        stub = epd_pb2_grpc.InferenceStub(channel)
        replies = list(stub.Generate(request, timeout=60))
        text = "".join(r.text for r in replies)
        assert replies[-1].finish_reason == epd_pb2.FINISH_REASON_STOP
        assert re.fullmatch(regex, text), text
        bad = epd_pb2.GenerateRequest(text="hi")
        bad.sampling.structured.lark = "start: ("
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- tool calling ------------------------------------------------------------------------------

COUNT = {
    "name": "count_shapes",
    "description": "How many shapes of a colour the picture has",
    "parameters": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "at_most": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["colour", "at_most"],
        "additionalProperties": False,
    },
}
DESCRIBE = {
    "name": "describe",
    "parameters": {
        "type": "object",
        "properties": {"detail": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                       "items": {"enum": ["shape", "colour"]}}},
        "required": ["detail", "tags"],
        "additionalProperties": False,
    },
}  # fmt: skip
TOOLS = [{"type": "function", "function": f} for f in (COUNT, DESCRIBE)]
ASK = [{"role": "user", "content": "How many red shapes are there?"}]


def check_call(call) -> dict:
    """The call names a tool and its arguments follow that tool's parameters."""
    function = {"count_shapes": COUNT, "describe": DESCRIBE}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, function["parameters"])
    assert call.type == "function" and call.id.startswith("call_")
    return arguments


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_tool_choices_give_calls_that_fit_the_parameters(client, temperature):
    for choice in ("required", {"type": "function", "function": {"name": "describe"}}):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
            temperature=temperature, seed=11, max_tokens=200,
        )  # fmt: skip
        (c,) = reply.choices
        assert c.message.tool_calls, c
        for call in c.message.tool_calls:
            check_call(call)
        if isinstance(choice, dict):  # one call, of bounded length: it ends
            assert [t.function.name for t in c.message.tool_calls] == ["describe"]
            assert c.finish_reason == "tool_calls", c
        else:  # `required` allows call after call: a model may make them until max_tokens
            assert c.finish_reason in ("tool_calls", "length"), c


def test_streamed_tool_calls_assemble_and_the_conversation_goes_on(client):
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0.0, max_tokens=200, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for event in stream:
        for c in event.choices:
            for t in c.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish in ("tool_calls", "length") and calls  # `required`: calls until it stops
    whole = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0.0, max_tokens=200,
    )  # fmt: skip
    want = [(t.function.name, json.loads(t.function.arguments))
            for t in whole.choices[0].message.tool_calls]  # fmt: skip
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want
    # The call made and answered: the model answers on (free text, tools still shown).
    first = whole.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
        {"role": "tool", "tool_call_id": first.id, "content": "3"},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0.0, max_tokens=24
    )
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens > whole.usage.prompt_tokens  # the call and answer in it


def test_tool_choice_none_hides_the_tools(client):
    shown = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=4
    )
    hidden = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0.0,
        max_tokens=4,
    )  # fmt: skip
    plain = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0.0, max_tokens=4
    )
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < shown.usage.prompt_tokens
    assert hidden.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "paint"}}},
         "not among the tools"),
        ({"tool_choice": "always"}, "tool_choice must be"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
            "type": "object", "properties": {"a": {"not": {}}}}}}], "tool_choice": "required"},
         '"not"'),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_a_400(client, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, **{"tools": TOOLS, **extra})
    assert says in str(e.value)


# -- /v1/completions --------------------------------------------------------------------------


def test_text_and_token_id_prompts_give_the_same_completion(client, tokenizer):
    prompt = CHAT.format("How many shapes are there?")
    by_text = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    by_ids = client.completions.create(
        model="tiny", prompt=tokenizer.encode(prompt), max_tokens=12, temperature=0
    )
    (a,), (b,) = by_text.choices, by_ids.choices
    assert a.text and a.text == b.text and a.finish_reason == b.finish_reason
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert by_text.usage.completion_tokens == len(tokenizer.encode(a.text)) + (
        a.finish_reason == "stop"  # the end token, not in the text
    )


def test_several_prompts_echo_and_the_default_max_tokens(client):
    prompts = [CHAT.format("What colour is the circle?"), CHAT.format("Which shape is red?")]
    reply = client.completions.create(model="tiny", prompt=prompts, temperature=0, echo=True)
    assert [c.index for c in sorted(reply.choices, key=lambda c: c.index)] == [0, 1]
    alone = [
        client.completions.create(model="tiny", prompt=p, temperature=0).choices[0].text
        for p in prompts
    ]
    for choice in reply.choices:
        prompt = prompts[choice.index]
        assert choice.text == prompt + alone[choice.index]  # echoed, then the same completion
    # 16 tokens unless it stops first (OpenAI's default for this endpoint).
    assert reply.usage.completion_tokens <= 32


def test_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(
        model="tiny", prompt=CHAT.format("What is red?"), max_tokens=6, temperature=0, logprobs=3
    )
    (choice,) = reply.choices
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n == reply.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens).startswith(choice.text)  # the end token's string may follow
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset == offsets
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely
        assert top.get(token, logprob) == logprob


def test_streaming_several_prompts_assembles_each_choice(client):
    prompts = [CHAT.format("How many shapes are there?"), CHAT.format("What is blue?")]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0)
    want = {c.index: c.text for c in whole.choices}
    got, finishes, usage = {0: "", 1: ""}, {}, None
    stream = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for event in stream:
        for c in event.choices:
            got[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = event.usage or usage
    assert got == want and set(finishes) == {0, 1}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_and_a_structured_output(client):
    prompt = CHAT.format("Tell me about the shapes")
    free = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].text == text[: text.index(stop)], (text, stop)
    assert cut.choices[0].finish_reason == "stop"
    shaped = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=1, seed=4,
        extra_body={"structured_outputs": {"regex": "(red|blue) (circle|square)"}},
    )  # fmt: skip
    assert shaped.choices[0].text in {f"{c} {s}" for c in ("red", "blue")
                                      for s in ("circle", "square")}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"prompt": "Hi", "echo": True, "logprobs": 1}, "prompt's log-probabilities"),
        ({"prompt": [10**6]}, "outside the vocabulary"),
        ({"prompt": []}, "prompt must be"),
        ({"prompt": [["a"]]}, "prompt must be"),
        ({"prompt": "Hi", "best_of": 2}, "best_of"),
        ({"prompt": "Hi", "suffix": "x"}, "suffix"),
        ({"prompt": ["Hi"] * 65}, "at most 64"),
        ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_completions_get_a_400(client, kwargs, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", **kwargs)
    assert says in str(e.value)
