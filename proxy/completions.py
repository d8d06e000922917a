"""POST /v1/completions: OpenAI's legacy text completions (what many benchmark and evaluation
tools still call), on the same request path as chat.

    prompt      text, token ids, or a list of either (one choice each, run concurrently)
    echo        the prompt's text before the completion's
    logprobs    N: each token's log-probability and the N most likely, in the legacy shape
                (tokens, token_logprobs, top_logprobs, text_offset)
    stream      server-sent events, `data: [DONE]` last; several prompts interleave by index
    and the sampling fields, limits and structured outputs of chat (proxy/validate.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from common import tracing
from proto import epd_pb2
from proxy.auth import ANONYMOUS
from proxy.core import Proxy
from proxy.prepare import PreparedRequest
from proxy.responses import FINISH, EventStream, usage_body
from proxy.validate import CompletionBody, check_token_prompt

# An exception -> the OpenAI error body (proxy/http.py's error_of).
ErrorBody = Callable[[Exception], Any]


async def completions(
    proxy: Proxy, request: web.Request, body: CompletionBody, error_of: ErrorBody
) -> web.StreamResponse:
    """The response to a parsed /v1/completions body."""
    proxy.check_model(body.model)
    for p in body.prompts:
        if isinstance(p, list):
            check_token_prompt(p, proxy.limits(), proxy.served.family.text.vocab_size)
    request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    tenant = request.get("principal", ANONYMOUS).tenant
    parent = tracing.tracer().extract(request.headers)
    prepared = []
    for i, prompt in enumerate(body.prompts):
        sampling = epd_pb2.SamplingParams()  # each request its own (the frontend may change it)
        sampling.CopyFrom(body.sampling)
        one = await proxy.prepare(
            proxy.builder.build, prompt, [], sampling, f"{request_id}-{i}", tenant=tenant
        )
        one.trace_parent = parent
        prepared.append(one)
    tokenizer = proxy.builder.tokenizer
    echoes = [
        (p if isinstance(p, str) else tokenizer.decode(p)) if body.echo else ""
        for p in body.prompts
    ]
    choices = [Choice(i, echoes[i], tokenizer) for i in range(len(prepared))]
    if body.stream:
        return await _stream(proxy, request, request_id, body, prepared, choices, error_of)
    usage = epd_pb2.Usage()

    async def one(p: PreparedRequest, choice: Choice) -> None:
        async for chunk in proxy.run(p, None):
            choice.add(chunk)
            add_usage(usage, chunk)

    tasks = [asyncio.create_task(one(p, c)) for p, c in zip(prepared, choices, strict=True)]
    try:
        await asyncio.gather(*tasks)
    finally:  # one prompt failed: the others' requests end too
        for task in tasks:
            task.cancel()
    return web.json_response(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": proxy.served.name,
            "choices": [c.whole(body.sampling.HasField("logprobs")) for c in choices],
            "usage": usage_body(usage),
        }
    )


class Choice:
    """One prompt's completion as it arrives: text, and the legacy logprobs' four lists."""

    def __init__(self, index: int, echo: str, tokenizer):
        self.index = index
        self.text = echo
        self.tokenizer = tokenizer
        self.finish: str | None = None
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, chunk) -> dict:
        """Take a chunk of the stream; its part of the legacy logprobs."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = len(self.text)
        for token_id, entry in zip(chunk.token_ids, chunk.logprobs, strict=False):
            token = self.tokenizer.decode([token_id])
            part["tokens"].append(token)
            part["token_logprobs"].append(entry.logprob)
            part["top_logprobs"].append(
                {self.tokenizer.decode([t.token_id]): t.logprob for t in entry.top}
            )
            part["text_offset"].append(offset)
            offset += len(token)
        for key, values in part.items():
            self.logprobs[key].extend(values)
        self.text += chunk.text
        if chunk.finish_reason:
            self.finish = FINISH.get(chunk.finish_reason, "stop")
        return part

    def whole(self, logprobs: bool) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": self.logprobs if logprobs else None,
            "finish_reason": self.finish,
        }


def add_usage(total: epd_pb2.Usage, chunk) -> None:
    """Count a prompt's usage (on its last chunk) into the request's total."""
    if chunk.finish_reason and chunk.usage is not None:
        total.prompt_tokens += chunk.usage.prompt_tokens
        total.completion_tokens += chunk.usage.completion_tokens
        total.cached_prompt_tokens += chunk.usage.cached_prompt_tokens


async def _stream(
    proxy: Proxy,
    request: web.Request,
    request_id: str,
    body: CompletionBody,
    prepared: list[PreparedRequest],
    choices: list[Choice],
    error_of: ErrorBody,
) -> web.StreamResponse:
    """Server-sent events: each prompt's chunks as they come, by choice index."""
    events = EventStream(request)  # headers once the first prompt is known to be valid
    created = int(time.time())
    usage = epd_pb2.Usage()
    logprobs = body.sampling.HasField("logprobs")

    def chunk_of(choices: list[dict], **extra) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": proxy.served.name, "choices": choices, **extra}  # fmt: skip

    async def event(choice: Choice, text: str, part: dict | None) -> None:
        one = {"index": choice.index, "text": text, "logprobs": part if logprobs else None,
               "finish_reason": choice.finish}  # fmt: skip
        await events.send(chunk_of([one]))

    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: PreparedRequest, choice: Choice) -> None:
        try:
            async for chunk in proxy.run(p, None):
                await merged.put((choice, chunk))
        except Exception as e:
            await merged.put((choice, e))
        await merged.put((choice, None))

    tasks = [asyncio.create_task(pump(p, c)) for p, c in zip(prepared, choices, strict=True)]
    try:
        async for choice, item in _until_all_end(merged, len(tasks)):
            if isinstance(item, Exception):
                if not events.started:
                    raise item
                await events.send(error_of(item).body())
                continue
            if not events.started:
                for c in choices:
                    if c.text:  # echo
                        await event(c, c.text, None)
            part = choice.add(item)
            add_usage(usage, item)
            if item.text or item.token_ids or choice.finish:
                await event(choice, item.text, part)
        if body.include_usage:
            await events.send(chunk_of([], usage=usage_body(usage)))
    finally:
        for task in tasks:
            task.cancel()
    return await events.done()


async def _until_all_end(queue: asyncio.Queue, count: int) -> AsyncIterator[tuple[Any, Any]]:
    """The queue's (choice, chunk or error) items until `count` producers have put their end
    (None)."""
    ended = 0
    while ended < count:
        choice, item = await queue.get()
        if item is None:
            ended += 1
            continue
        yield choice, item
