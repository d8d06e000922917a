"""Tool calling in the OpenAI chat API, in the Hermes manner (`<tool_call>` blocks).

The model sees the tools (the checkpoint's chat template renders them when it knows how; for a
template that does not, prepare.tools_section is added to the system message) and calls one by
writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallStream` turns such blocks of the output into `tool_calls` as the text streams, and
`parse_calls` in a whole text. `tool_choice`: "none" (the tools are not shown), "auto" (the model
decides; its calls are parsed), "required" or a named function (the output is constrained to
calls whose arguments follow the tools' parameter schemas: a Lark grammar with the schemas
embedded, `constraint`). A conversation goes on with the assistant's `tool_calls` and `tool`
messages, rendered as the same blocks and `<tool_response>` blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from models.sampling import Constraint
from proxy.prepare import BadInput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


@dataclass
class Tools:
    """A request's tools (OpenAI's `tools[i].function` objects) and its `tool_choice`."""

    functions: list[dict[str, Any]]
    choice: str  # "none", "auto", "required", or "function" (then `name`)
    name: str | None = None

    @property
    def shown(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def constraint(self) -> Constraint | None:
        """The grammar of the output for `required` (one or more calls of any tool) and a
        named function (one call of it); None for `auto` and `none`."""
        if self.choice not in ("required", "function"):
            return None
        functions = [
            f for f in self.functions if self.choice == "required" or f["name"] == self.name
        ]
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        # Compact JSON, as for response_format (a model given free whitespace can loop in it).
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        more = ' ("\\n" call)*' if self.choice == "required" else ""
        lark = f'start: call{more}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'
        return Constraint("lark", lark)


def parse_tools(body: dict) -> Tools | None:
    """`tools` and `tool_choice` of a chat body, checked; None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise BadInput("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise BadInput("tools must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise BadInput(f"{len(tools)} tools, at most {MAX_TOOLS}")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise BadInput(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise BadInput(f"tools[{i}].function.name must be 1-64 letters, digits, _ . -")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadInput(f"tools[{i}].function.parameters must be a JSON schema object")
        if any(f["name"] == name for f in functions):
            raise BadInput(f"tools[{i}]: a second function named {name!r}")
        functions.append(function)
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise BadInput('tool_choice must be "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}')  # fmt: skip
        if not any(f["name"] == name for f in functions):
            raise BadInput(f"tool_choice names {name!r}, which is not among the tools")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise BadInput(f'tool_choice must be "none", "auto", "required" or a function, '
                       f"got {choice!r}")  # fmt: skip
    return Tools(functions, choice, name)


def tool_functions(chat) -> list[dict[str, Any]]:
    """ChatPrompt.tools (JSON function objects), checked as a chat body's tools are."""
    if not chat.tools:
        return []
    try:
        functions = [json.loads(t) for t in chat.tools]
    except ValueError as e:
        raise BadInput(f"chat.tools: not JSON: {e}") from None
    return parse_tools(
        {"tools": [{"type": "function", "function": f} for f in functions]}
    ).functions


def rewrite_messages(messages: Any, tools: Tools | None) -> Any:
    """The conversation with the assistant's `tool_calls` written as the blocks the model
    writes, and `tool` messages as `<tool_response>` blocks in a user turn (as chat templates
    that know tools render them), so every template can take it. Checks that each call names
    a tool and each response answers an earlier call."""
    if not isinstance(messages, list):
        return messages  # parse_messages says what is wrong
    names = tools.names if tools else None
    calls: set[str] = set()  # the ids of the calls so far
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = _call_blocks(m["tool_calls"], f"messages[{i}]", names, calls)
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            out.append({"role": "assistant", "content": "\n".join(filter(None, [text, *blocks]))})
        elif m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and call_id not in calls:
                raise BadInput(f"messages[{i}]: tool_call_id {call_id!r} answers no earlier call")
            content = m.get("content")
            if isinstance(content, list):  # text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise BadInput(f"messages[{i}].content must be a string")
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append(m)
    return out


def _call_blocks(tool_calls: Any, where: str, names: set[str] | None, ids: set[str]) -> list[str]:
    """An assistant message's `tool_calls` as the blocks the model writes; their ids go into
    `ids`."""
    blocks = []
    for j, call in enumerate(tool_calls if isinstance(tool_calls, list) else ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadInput(f"{where}.tool_calls[{j}] needs function.name")
        if names is not None and function["name"] not in names:
            raise BadInput(f"{where}.tool_calls[{j}] calls {function['name']!r}, which is not "
                           "among the tools")  # fmt: skip
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise BadInput(f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
        if isinstance(call.get("id"), str):
            ids.add(call["id"])
        call_json = json.dumps({"name": function["name"], "arguments": arguments})
        blocks.append(f"{OPEN}\n{call_json}\n{CLOSE}")
    return blocks


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def parse_calls(text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """The text outside the tool-call blocks and the calls (a block that is not a JSON call of
    one of the tools stays text, as vLLM's Hermes parser leaves it): the stream's parse, over
    the whole text at once."""
    stream = ToolCallStream(names)
    content, calls = stream.push(text)
    content += stream.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls]  # a message's calls
    return (content.strip() if calls else text), calls


def _call(block: str, names: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    return new_call(value["name"], value.get("arguments", {}))


@dataclass
class ToolCallStream:
    """Streamed text -> content deltas and whole tool calls: text that could begin a call
    (a prefix of `<tool_call>`) is held until it is known; a call goes out once its block
    closes, as one `tool_calls` delta (id, name, arguments) the `openai` client assembles."""

    names: set[str]
    held: str = ""  # text not sent yet: a block still open (from its tag), or a tag's start
    calls: int = 0

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, calls completed now, each with its `index`)."""
        self.held += text
        content, calls = [], []
        while True:
            at = self.held.find(OPEN)  # 0 inside a block: `held` starts with its tag
            if at == -1:
                keep = _prefix_len(self.held, OPEN)
                content.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            content.append(self.held[:at])
            self.held = self.held[at:]
            end = self.held.find(CLOSE)
            if end == -1:
                break
            block, self.held = self.held[: end + len(CLOSE)], self.held[end + len(CLOSE) :]
            call = _call(block[len(OPEN) : -len(CLOSE)].strip(), self.names)
            if call is None:
                content.append(block)
                continue
            calls.append({"index": self.calls, **call})
            self.calls += 1
        return "".join(content), calls

    def finish(self) -> str:
        """What is left (an unclosed block is text)."""
        text, self.held = self.held, ""
        return text


def _prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
