"""What the OpenAI endpoints write, in one place: finish reasons by name, usage, and the
server-sent event stream (chat, completions and transcription streams alike)."""

from __future__ import annotations

import json

from aiohttp import web

from proto import epd_pb2

# A chunk's finish reason as the OpenAI API names it.
FINISH = {
    epd_pb2.FINISH_REASON_STOP: "stop",
    epd_pb2.FINISH_REASON_LENGTH: "length",
    epd_pb2.FINISH_REASON_ABORT: "abort",
}


def usage_body(usage: epd_pb2.Usage | None) -> dict:
    if usage is None:
        return {}
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


class EventStream:
    """`data: {json}` events, then `data: [DONE]`. The headers go out with the first event,
    so a request that fails before it gets an ordinary error response (`started`)."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.started = False

    async def send(self, payload: dict) -> None:
        if not self.started:
            await self.response.prepare(self.request)
            self.started = True
        await self.response.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
