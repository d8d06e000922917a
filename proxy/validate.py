"""Every value a client sends, checked at the edge before any work is done for it.

    HTTP JSON body      size (before it is read), JSON depth, valid Unicode, strict types per
                        field, sampling values finite and in range      -> parse_chat_body
    gRPC messages       bytes that do not parse (tolerant deserializers), sampling values, ids,
                        item counts                                    -> check_generate
    both, once the prompt is known and before any encode is dispatched: the context length
    (prompt + max_tokens), placeholder tokens per item                   -> check_prepared

Every problem raises BadInput naming the field (HTTP 400 / INVALID_ARGUMENT). Nothing here
touches a worker.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from common import grammar
from models import AudioClip, MediaInput
from proto import epd_pb2
from proxy.prepare import BadInput, ChatMessage, Part, PreparedRequest
from proxy.tools import Tools, parse_tools, rewrite_messages

# JSON nesting deeper than this is refused before parsing (the chat body needs about 6 levels;
# Python's parser would otherwise recurse until RecursionError).
MAX_JSON_DEPTH = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256
MAX_LOGPROBS = 20
# A structured output that compiles slower than this (without the vocabulary) is refused.
GRAMMAR_CHECK_SECONDS = 5.0
UINT32 = 2**32 - 1
# A token is at most this many characters in any tokenizer we serve: a text longer than the
# context times this is over the context without being tokenized.
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int
    max_media_items: int
    max_item_tokens: int
    context: int  # tokens: prompt + output
    max_messages: int = 2048
    max_content_parts: int = 4096

    @property
    def max_json_containers(self) -> int:
        """Objects and arrays a chat body within the limits can hold: the body and its
        messages array, each message and its content list, each part and its url object,
        and room for the small ones (stop, stream_options, logit_bias)."""
        return 2 + 2 * self.max_messages + 2 * self.max_content_parts + 64


# -- JSON --------------------------------------------------------------------------------------


def parse_json_body(raw: bytes, max_containers: int | None = None) -> dict:
    """The body as a JSON object; BadInput for anything else (invalid UTF-8 or JSON, nesting
    deeper than MAX_JSON_DEPTH, more than `max_containers` objects and arrays, lone
    surrogates, another top-level type). Depth and containers are counted before parsing, at
    memory speed: a body built to cost (a million empty messages) is refused unparsed."""
    check_json_shape(raw, MAX_JSON_DEPTH, max_containers)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, an int past the digit limit
        raise BadInput("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadInput("the body must be a JSON object")
    # "\ud800" parses to a lone surrogate that no later encode survives; only a body that
    # writes a surrogate's escape can hold one.
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadInput("the body holds a lone UTF-16 surrogate (invalid Unicode)") from None
    return body


def check_json_shape(raw: bytes, max_depth: int, max_containers: int | None = None) -> None:
    """BadInput when a JSON text nests deeper than `max_depth` or holds more than
    `max_containers` objects and arrays. Counting every bracket first (an upper bound, at
    memcpy speed) spares the exact count for texts with few of them."""
    brackets = raw.count(b"{") + raw.count(b"[")
    if brackets <= max_depth and (max_containers is None or brackets <= max_containers):
        return
    depth, containers = json_shape(raw)
    if depth > max_depth:
        raise BadInput(f"the JSON is nested deeper than {max_depth} levels")
    if max_containers is not None and containers > max_containers:
        raise BadInput(
            f"the JSON holds {containers} objects and arrays, more than a request within "
            "proxy.max_messages and proxy.max_content_parts can"
        )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SPECIAL = np.zeros(256, dtype=bool)  # what a JSON text's shape depends on
_SPECIAL[[0x22, 0x5C, 0x5B, 0x5D, 0x7B, 0x7D]] = True
_STEP = np.zeros(256, dtype=np.int8)  # an opening bracket +1, a closing one -1
_STEP[[0x5B, 0x7B]] = 1
_STEP[[0x5D, 0x7D]] = -1


# Bytes json_shape scans at once: its arrays take some 40 bytes a bracket or quote, so a text
# scanned whole cost the proxy 18-21 times its size (+608 MiB for a 29 MB body of a million
# empty messages); a window of 1 MiB bounds that at a few tens of MB, whatever the body.
SHAPE_WINDOW = 1 << 20


def json_shape(raw: bytes) -> tuple[int, int]:
    """(how deep brackets nest, how many objects and arrays) in a JSON text, brackets inside
    strings not counted. Vectorized over the quotes, backslashes and brackets alone (numpy
    releases the GIL: a thread can run it off an event loop), SHAPE_WINDOW bytes at a time.
    Exact for valid JSON."""
    deepest = depth = count = 0
    in_string = False
    start, n = 0, len(raw)
    while start < n:
        end = min(start + SHAPE_WINDOW, n)
        while end < n and raw[end - 1] == 0x5C:  # never cut after a backslash: it escapes
            end += 1
        top, last, opened, in_string = _window_shape(raw[start:end], in_string)
        deepest = max(deepest, depth + top)
        depth += last
        count += opened
        start = end
    return deepest, count


def _window_shape(raw: bytes, in_string: bool) -> tuple[int, int, int, bool]:
    """A window of a JSON text that starts `in_string` or not: (the deepest nesting in it and
    the nesting at its end, both relative to its start; the objects and arrays it opens;
    whether it ends inside a string)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    at = np.flatnonzero(_SPECIAL[b])
    if at.size == 0:
        return 0, 0, 0, in_string
    c = b[at]
    k = np.arange(at.size)
    # Runs of backslashes next to each other in the text, each from its first.
    bs = c == 0x5C
    follows = np.zeros(at.size, dtype=bool)  # right after a backslash in the text
    follows[1:] = bs[:-1] & (at[1:] == at[:-1] + 1)
    start = np.maximum.accumulate(np.where(bs & follows, 0, k))
    # A quote is escaped when an odd run of backslashes ends right before it.
    run = np.zeros(at.size, dtype=np.int64)
    run[1:] = np.where(follows[1:], k[:-1] - start[:-1] + 1, 0)
    quote = (c == 0x22) & (run % 2 == 0)
    quotes = np.cumsum(quote) + in_string
    outside = (quotes % 2 == 0) & ~quote  # not in a string, not its quotes
    steps = np.where(outside, _STEP[c], 0)
    depth = np.cumsum(steps, dtype=np.int64)
    top = max(int(depth.max()), 0)
    return top, int(depth[-1]), int(np.count_nonzero(steps == 1)), bool(quotes[-1] % 2)


def _opt(body: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """body[key] if present and not null, checked to be of `kind` (bool is never a number)."""
    value = body.get(key)
    if value is None:
        return None
    number = kind in (int, float) or kind == (int, float)
    if (number and isinstance(value, bool)) or not isinstance(value, kind):
        raise BadInput(f"{key} must be {what}, got {json.dumps(value)[:40]}")
    return value


def _number(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = _opt(body, key, (int, float), "a number")
    if value is None:
        return None
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise BadInput(f"{key} must be a finite number in {bracket}{lo}, {hi}], got {value}")
    return float(value)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    value = _opt(body, key, int, "an integer")
    if value is not None and not lo <= value <= hi:
        raise BadInput(f"{key} must be an integer in [{lo}, {hi}], got {value}")
    return value


def _flag(body: dict, key: str) -> bool:
    return bool(_opt(body, key, bool, "true or false"))


def parse_sampling(body: dict, completion: bool = False) -> epd_pb2.SamplingParams:
    """OpenAI / vLLM sampling fields -> SamplingParams, each checked for type and range.
    `completion`: /v1/completions' `logprobs` (how many top tokens) in place of chat's flag
    and `top_logprobs`."""
    s = epd_pb2.SamplingParams(ignore_eos=_flag(body, "ignore_eos"))
    for key in ("max_completion_tokens", "max_tokens"):
        max_tokens = _integer(body, key, 1, UINT32)
        if max_tokens is not None:
            s.max_tokens = max_tokens
            break
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        s.temperature = temperature
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    if top_p is not None:
        s.top_p = top_p
    top_k = _integer(body, "top_k", -1, UINT32)
    if top_k is not None:
        s.top_k = max(top_k, 0)  # vLLM: -1 means off
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    if seed is not None:
        s.seed = seed % 2**64
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadInput("stop must be a string or a list of strings")
        s.stop.extend(stops)
    check_stop(list(s.stop))
    if completion:
        top = _integer(body, "logprobs", 0, MAX_LOGPROBS)
        if top is not None:
            s.logprobs = top
    elif _flag(body, "logprobs"):
        s.logprobs = _integer(body, "top_logprobs", 0, MAX_LOGPROBS) or 0
    n = _integer(body, "n", 1, UINT32)
    if n not in (None, 1):
        raise BadInput("only n=1 is supported")
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key, -2.0, 2.0):
            raise BadInput(f"{key} is not supported")
    parse_structured(body, s.structured)
    return s


def parse_structured(body: dict, out: epd_pb2.StructuredOutput) -> None:
    """OpenAI's `response_format` (json_object, json_schema) and vLLM's `structured_outputs`
    (json, regex, grammar: one of them) into `out`; checked for shape here, for what the
    grammar library supports by `check_structured`."""
    fmt = _opt(body, "response_format", dict, "an object")
    extra = _opt(body, "structured_outputs", dict, "an object")
    if fmt is not None and extra is not None:
        raise BadInput("give response_format or structured_outputs, not both")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            out.json_object = True
        elif kind == "json_schema":
            spec = _opt(fmt, "json_schema", dict, "an object")
            if spec is None or not isinstance(spec.get("schema"), dict):
                raise BadInput("response_format.json_schema.schema must be a JSON schema object")
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise BadInput("response_format.json_schema.name must be a string")
            out.json_schema = json.dumps(spec["schema"])
        elif kind != "text":
            raise BadInput(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}"
            )
    if extra is not None:
        given = [k for k in ("json", "regex", "grammar") if extra.get(k) is not None]
        unknown = sorted(set(extra) - {"json", "regex", "grammar"})
        if unknown or len(given) != 1:
            raise BadInput("structured_outputs takes exactly one of json, regex, grammar")
        value = extra[given[0]]
        if given[0] == "json":
            if not isinstance(value, dict | str):
                raise BadInput("structured_outputs.json must be a JSON schema")
            out.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif not isinstance(value, str):
            raise BadInput(f"structured_outputs.{given[0]} must be a string")
        elif given[0] == "regex":
            out.regex = value
        else:
            out.lark = value


async def check_structured(s: epd_pb2.SamplingParams) -> None:
    """A request's structured output, compiled without the vocabulary off the event loop:
    BadInput naming what the grammar library refused, or that it took longer than
    GRAMMAR_CHECK_SECONDS. Nothing when there is none."""
    constraint = grammar.constraint_of(s)
    if constraint is None:
        return
    if s.ignore_eos:
        raise BadInput("ignore_eos cannot be combined with a structured output")
    try:
        await asyncio.wait_for(asyncio.to_thread(grammar.check, constraint), GRAMMAR_CHECK_SECONDS)
    except TimeoutError:
        raise BadInput(
            f"the {constraint.kind} did not compile within {GRAMMAR_CHECK_SECONDS:.0f} s"
        ) from None
    except grammar.GrammarError as e:
        raise BadInput(str(e)) from None


def check_stop(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise BadInput(f"stop has {len(stops)} strings, at most {MAX_STOP_STRINGS}")
    for x in stops:
        if not x or len(x) > MAX_STOP_CHARS:
            raise BadInput(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")


@dataclass
class ChatBody:
    model: str
    chat: list[ChatMessage]
    media: list[MediaInput]
    sampling: epd_pb2.SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tools: Tools | None = None  # shown to the model (None: no tools, or tool_choice "none")


def parse_chat_body(body: dict, limits: Limits) -> ChatBody:
    """A /v1/chat/completions body, every field checked."""
    model = _opt(body, "model", str, "a string") or ""
    tools = parse_tools(body)
    chat, media = parse_messages(rewrite_messages(body.get("messages"), tools), limits)
    sampling = parse_sampling(body)
    constraint = tools.constraint() if tools is not None else None
    if constraint is not None:  # tool_choice "required" or a named function
        if sampling.HasField("structured"):
            raise BadInput("a required or named tool_choice cannot be combined with "
                           "response_format or structured_outputs")  # fmt: skip
        sampling.structured.lark = constraint.text
    if tools is not None and not tools.shown:  # tool_choice "none": as if there were none
        tools = None
    stream = _flag(body, "stream")
    options = _opt(body, "stream_options", dict, "an object") or {}
    include_usage = _flag(options, "include_usage")
    return ChatBody(
        model, chat, media, sampling, stream, include_usage, _flag(body, "return_token_ids"),
        tools,
    )  # fmt: skip


@dataclass
class CompletionBody:
    model: str
    prompts: list[str | list[int]]  # one choice each
    sampling: epd_pb2.SamplingParams
    stream: bool
    include_usage: bool
    echo: bool


# Prompts in one /v1/completions request (each is a request to the cluster).
MAX_PROMPTS = 64
# /v1/completions' default max_tokens, as OpenAI's and vLLM's.
COMPLETION_MAX_TOKENS = 16


def parse_completion_body(body: dict, limits: Limits) -> CompletionBody:
    """A /v1/completions body: `prompt` as text, token ids, or a list of either (a choice
    each), every field checked."""
    model = _opt(body, "model", str, "a string") or ""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p)
                                                     for p in prompt):  # fmt: skip
        prompts = list(prompt)
    else:
        raise BadInput(
            "prompt must be a string, a list of token ids, or a non-empty list of either"
        )
    if len(prompts) > MAX_PROMPTS:
        raise BadInput(f"{len(prompts)} prompts, at most {MAX_PROMPTS}")
    for p in prompts:  # token ids are checked against the vocabulary by the handler
        if isinstance(p, str):
            check_text_chars(len(p), limits)
    for key, allowed in (("suffix", None), ("best_of", 1)):
        if body.get(key) not in (None, allowed):
            raise BadInput(f"{key} is not supported")
    sampling = parse_sampling(body, completion=True)
    if not sampling.HasField("max_tokens"):
        sampling.max_tokens = COMPLETION_MAX_TOKENS
    echo = _flag(body, "echo")
    if echo and sampling.HasField("logprobs"):
        raise BadInput("echo with logprobs needs the prompt's log-probabilities: not supported")
    options = _opt(body, "stream_options", dict, "an object") or {}
    return CompletionBody(
        model, prompts, sampling, _flag(body, "stream"), _flag(options, "include_usage"), echo
    )


def _is_ids(p: Any) -> bool:
    """A non-empty list of token ids."""
    return (
        isinstance(p, list)
        and bool(p)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < UINT32 for t in p)
    )


def _data_url(url: str, what: str) -> bytes:
    if not url.startswith("data:"):
        raise BadInput(f"{what}: only data: URLs are supported (the proxy fetches nothing)")
    header, _, payload = url.partition(",")
    try:
        if header.endswith(";base64"):
            return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise BadInput(f"{what}: the data URL's base64 payload is invalid") from None
    raise BadInput(f"{what}: data URLs must be base64-encoded")


def parse_messages(messages: Any, limits: Limits) -> tuple[list[ChatMessage], list[MediaInput]]:
    """OpenAI chat messages -> our chat form and the media items they carry, in order."""
    if not isinstance(messages, list) or not messages:
        raise BadInput("messages must be a non-empty list")
    check_chat_size(
        len(messages),
        sum(len(m["content"]) for m in messages if isinstance(m, dict) and _is_list(m, "content")),
        limits,
    )
    chat, media = [], []
    chars = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadInput(f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            chars += len(content)
            chat.append(ChatMessage(m["role"], (Part(text=content),)))
            continue
        if not isinstance(content, list):
            raise BadInput(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadInput(f"{where}: text must be a string")
                chars += len(text)
                parts.append(Part(text=text))
                continue
            if kind not in ("image_url", "video_url", "input_audio"):
                raise BadInput(f"{where}: unsupported content part type {kind!r}")
            if len(media) >= limits.max_media_items:
                raise BadInput(
                    f"more than {limits.max_media_items} media items (proxy.max_media_items)"
                )
            if kind in ("image_url", "video_url"):
                # An image file, or a video container file (MP4, WebM, MKV, MOV).
                holder = part.get(kind)
                url = holder.get("url") if isinstance(holder, dict) else holder
                if not isinstance(url, str):
                    raise BadInput(f"{where}: {kind} needs a url")
                uuid_ = part.get("uuid")
                if uuid_ is not None and not isinstance(uuid_, str):
                    raise BadInput(f"{where}: uuid must be a string")
                check_id(uuid_ or "", f"{where}.uuid")
                data = _data_url(url, where)
                if kind == "image_url":
                    media.append(MediaInput("image", image=data, uuid=uuid_ or ""))
                else:
                    media.append(MediaInput("video", video=data, uuid=uuid_ or ""))
            else:
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise BadInput(f"{where}: input_audio must be an object with string data")
                try:
                    data = base64.b64decode(audio["data"], validate=True)
                except binascii.Error:
                    raise BadInput(f"{where}: input_audio.data is not valid base64") from None
                if audio.get("format", "wav") != "wav":
                    raise BadInput(f"{where}: input_audio format must be wav")
                media.append(MediaInput("audio", audio=AudioClip(data, "wav", 0)))
            parts.append(Part(media_index=len(media) - 1))
        chat.append(ChatMessage(m["role"], tuple(parts)))
    check_text_chars(chars, limits)
    return chat, media


def _is_list(m: dict, key: str) -> bool:
    return isinstance(m.get(key), list)


def check_chat_size(messages: int, parts: int, limits: Limits) -> None:
    """Refuse a chat over proxy.max_messages or proxy.max_content_parts before any work on
    its messages (templating and tokenizing a million empty ones took the proxy 40 s)."""
    if messages > limits.max_messages:
        raise BadInput(f"{messages} messages, more than {limits.max_messages} (proxy.max_messages)")
    if parts > limits.max_content_parts:
        raise BadInput(
            f"{parts} content parts, more than {limits.max_content_parts} (proxy.max_content_parts)"
        )


def check_text_chars(chars: int, limits: Limits) -> None:
    """Refuse text that cannot fit the context before tokenizing it (tokenizing megabytes
    holds a CPU for seconds)."""
    if chars > limits.context * MAX_CHARS_PER_TOKEN:
        raise BadInput(
            f"the prompt has {chars} characters: more than a {limits.context}-token context "
            "can hold"
        )


def check_id(value: str, what: str) -> None:
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise BadInput(f"{what} has {len(value)} characters, at most {MAX_REQUEST_ID_CHARS}")
    if not value.isprintable():
        raise BadInput(f"{what} must be printable characters")


# -- gRPC --------------------------------------------------------------------------------------


def check_sampling(s: epd_pb2.SamplingParams) -> None:
    """The proto's sampling values (the HTTP path builds them checked; gRPC sends them)."""
    if s.HasField("max_tokens") and s.max_tokens < 1:
        raise BadInput(f"max_tokens must be >= 1, got {s.max_tokens}")
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise BadInput(f"temperature must be a finite number >= 0, got {s.temperature}")
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        raise BadInput(f"top_p must be a finite number in (0, 1], got {s.top_p}")
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise BadInput(f"logprobs must be in 0..{MAX_LOGPROBS}, got {s.logprobs}")
    check_stop(list(s.stop))


def check_generate(request: epd_pb2.GenerateRequest, limits: Limits, vocab_size: int) -> None:
    check_id(request.request_id, "request_id")
    if len(request.media) > limits.max_media_items:
        raise BadInput(
            f"{len(request.media)} media items, more than {limits.max_media_items} "
            "(proxy.max_media_items)"
        )
    for i, item in enumerate(request.media):
        check_id(item.uuid, f"media[{i}].uuid")
        for key, value in item.processor_kwargs.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise BadInput(f"media[{i}].processor_kwargs.{key} must be finite, got {value}")
    check_sampling(request.sampling)
    kind = request.WhichOneof("prompt")
    if kind == "text":
        check_text_chars(len(request.text), limits)
    elif kind == "chat":
        messages = request.chat.messages
        check_chat_size(
            len(messages), sum(len(m.content) for m in messages[: limits.max_messages]), limits
        )
        chars = 0
        for m in messages:
            for p in m.content:
                chars += len(p.text)
        check_text_chars(chars, limits)
    elif kind == "token_ids":
        check_token_prompt(request.token_ids.ids, limits, vocab_size)


def check_token_prompt(ids: Sequence[int], limits: Limits, vocab_size: int) -> None:
    """A prompt given as token ids: shorter than the context, every id in the vocabulary."""
    if len(ids) >= limits.context:
        raise BadInput(f"the prompt has {len(ids)} tokens; the context is {limits.context}")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise BadInput(f"token id {bad} is outside the vocabulary ({vocab_size})")


class Malformed:
    """What a tolerant deserializer returns for bytes that are not the expected message."""

    def __init__(self, error: Exception):
        self.message = f"the request bytes are not a valid message of this method: {error}"


def tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that hands the servicer a Malformed instead of failing the call
    with gRPC's own INTERNAL "Exception deserializing request!"."""

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError, and whatever else bad bytes raise
            return Malformed(e)

    return parse


def tolerant_add(add: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """A generated add_XServicer_to_server whose methods get tolerant deserializers (each
    servicer method starts with `refuse_malformed`)."""

    class Capture:
        def __init__(self):
            self.name, self.handlers = "", {}

        def add_generic_rpc_handlers(self, _handlers) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            self.name, self.handlers = name, handlers

    def add_to(servicer, server) -> None:
        capture = Capture()
        add(servicer, capture)
        handlers = {
            method: h._replace(request_deserializer=tolerant(h.request_deserializer))
            for method, h in capture.handlers.items()
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(capture.name, handlers),)
        )
        server.add_registered_method_handlers(capture.name, handlers)

    return add_to


async def refuse_malformed(request: Any, context) -> None:
    """INVALID_ARGUMENT for a request whose bytes did not parse (no-op otherwise)."""
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


# -- both, once the prompt is known ------------------------------------------------------------


def check_prepared(prepared: PreparedRequest, limits: Limits) -> None:
    """The expanded prompt against the context, before any encode is dispatched (the
    per-item token limit is the builder's, before the prompt is expanded)."""
    prompt = len(prepared.prompt_token_ids)
    if prompt >= limits.context:
        raise BadInput(
            f"the prompt is {prompt} tokens (media placeholders included); the context is "
            f"{limits.context} tokens"
        )
    s = prepared.sampling
    if s.HasField("max_tokens") and prompt + s.max_tokens > limits.context:
        raise BadInput(
            f"the prompt ({prompt} tokens) plus max_tokens ({s.max_tokens}) exceeds the "
            f"context of {limits.context} tokens"
        )
