"""Tool calling's pieces without a cluster (proxy/tools.py): the checks on tools and
tool_choice, the conversation's rewriting, the calls parsed out of text whole and as it
streams, split anywhere. Through the cluster: tests/test_openai_api.py."""

from __future__ import annotations

import json

import pytest

from common.grammar import check
from proxy.prepare import BadInput
from proxy.tools import ToolCallStream, parse_calls, parse_tools, rewrite_messages

WEATHER = {
    "name": "weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER},
         {"type": "function", "function": {"name": "clock"}}]  # fmt: skip
TEXT = (
    'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ' and <tool_call>{"name": "clock", "arguments": {}}</tool_call> then '
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> done <tool_c'
)


def test_calls_are_parsed_out_of_the_text_and_unknown_ones_stay_text():
    content, calls = parse_calls(TEXT, {"weather", "clock"})
    assert [c["function"]["name"] for c in calls] == ["weather", "clock"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert content.startswith("Let me look.") and '"unknown"' in content
    assert "weather" not in content
    assert parse_calls("no calls here", {"weather"}) == ("no calls here", [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 11, len(TEXT)])
def test_streamed_text_gives_the_same_calls_and_content_split_anywhere(step):
    stream = ToolCallStream({"weather", "clock"})
    content, calls = "", []
    for at in range(0, len(TEXT), step):
        text, made = stream.push(TEXT[at : at + step])
        assert "weather" not in text and "clock" not in text  # a call never goes out as text
        content += text
        calls += made
    content += stream.finish()
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["name"] for c in calls] == ["weather", "clock"]
    whole, _ = parse_calls(TEXT, {"weather", "clock"})
    assert content.replace(" ", "") == whole.replace(" ", "")
    assert content.endswith("<tool_c")  # an unclosed start is text at the end


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tool_choice": "auto"}, "needs tools"),
        ({"tools": []}, "non-empty"),
        ({"tools": [{"type": "retrieval"}]}, "must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters"),
        ({"tools": TOOLS + TOOLS[:1]}, "second function"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "not among the tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused(body, says):
    with pytest.raises(BadInput, match=says):
        parse_tools(body)


def test_required_and_named_choices_compile_and_auto_and_none_constrain_nothing():
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        constraint = parse_tools({"tools": TOOLS, "tool_choice": choice}).constraint()
        assert constraint.kind == "lark" and '"const": "weather"' in constraint.text
        check(constraint)
    assert parse_tools({"tools": TOOLS}).constraint() is None  # auto
    assert not parse_tools({"tools": TOOLS, "tool_choice": "none"}).shown


def test_a_conversation_with_calls_and_responses_is_rewritten_as_blocks():
    tools = parse_tools({"tools": TOOLS})
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = rewrite_messages(messages, tools)
    assert out[0] == messages[0]
    assert out[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "weather", '
                      '"arguments": {"city": "Rome"}}\n</tool_call>'}  # fmt: skip
    assert out[2] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    with pytest.raises(BadInput, match="answers no earlier call"):
        rewrite_messages([messages[0], {**messages[2], "tool_call_id": "call_9"}], tools)
    unknown = {**call, "function": {"name": "nope", "arguments": "{}"}}
    with pytest.raises(BadInput, match="not among the tools"):
        rewrite_messages([{"role": "assistant", "tool_calls": [unknown]}], tools)


def test_a_vocabulary_with_a_tool_call_token_gets_it_whole():
    """Qwen's vocabularies have `<tool_call>` as one added token: a required call starts with
    that token alone (not the tag spelled in pieces), as the model was trained to write it."""
    from tokenizers import AddedToken, Tokenizer

    from common.grammar import GrammarCompiler
    from common.served_model import builtin_model

    tokenizer = Tokenizer.from_file(str(builtin_model() / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in ("<tool_call>", "</tool_call>")])  # fmt: skip
    compiler = GrammarCompiler(tokenizer.to_str(), 512, [tokenizer.token_to_id("<|im_end|>")])
    matcher = compiler.matcher(
        parse_tools({"tools": TOOLS, "tool_choice": "required"}).constraint()
    )
    assert matcher.allowed().nonzero()[0].tolist() == [tokenizer.token_to_id("<tool_call>")]
