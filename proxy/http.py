"""The proxy's HTTP API (aiohttp): the OpenAI chat completions API, /health, /metrics.

    POST /v1/chat/completions   streaming (SSE) or not; content parts text, image_url and
                                video_url (data: URLs; the proxy fetches nothing; a video is
                                a container file, MP4 / WebM / MKV / MOV), input_audio;
                                vLLM's extensions top_k, ignore_eos, return_token_ids
    POST /v1/completions        text completions: prompt as text or token ids (or a list of
                                them), echo, logprobs, stream (proxy/completions.py)
    POST /v1/audio/transcriptions   multipart `file` (WAV, FLAC, OGG, MP3), model, language,
                                temperature, response_format json | text | verbose_json,
                                stream (SSE: transcript.text.delta / .done events, as OpenAI's);
                                vLLM's return_token_ids. Only for models that transcribe audio;
                                `language` is echoed in verbose_json (the prompt is the
                                family's and carries no language)
    GET  /v1/models             the served model
    GET  /health                per role: healthy / degraded / unavailable (503 when nothing
                                can serve); with keys on, a caller without one gets only
                                {"status": ...}
    GET  /metrics               Prometheus
    GET  /dashboard             the health dashboard; GET /dashboard/state, its data as JSON
                                (proxy/dashboard.py)

The official `openai` client works against it unchanged. Errors come in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
import prometheus_client
from aiohttp import web

from common import tracing
from common.server import RoleServer
from models import AudioClip, MediaError, MediaInput
from proto import epd_pb2
from proxy.auth import ANONYMOUS
from proxy.completions import completions
from proxy.core import ModelNotFound, Overloaded, Proxy
from proxy.dashboard import add_dashboard
from proxy.encode import Unavailable
from proxy.prepare import BadInput
from proxy.realtime_ws import realtime_websocket
from proxy.responses import FINISH, EventStream, usage_body
from proxy.tools import ToolCallStream, parse_calls
from proxy.validate import check_sampling, parse_chat_body, parse_completion_body, parse_json_body
from proxy.workers import overall_status

logger = logging.getLogger(__name__)

# A body larger than this is parsed on a worker thread (its shape check is numpy's, which
# releases the GIL; its parse holds it for the few containers the limits let through).
LARGE_BODY_BYTES = 1 << 20


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def error_of(e: Exception) -> HttpError:
    """The HTTP error for an exception raised while serving a request."""
    if isinstance(e, HttpError):
        return e
    if isinstance(e, BadInput | MediaError):
        return HttpError(400, str(e), "BadRequestError")
    if isinstance(e, ModelNotFound):
        return HttpError(404, str(e), "NotFoundError", "model")
    if isinstance(e, Overloaded):
        return HttpError(429, str(e), "RateLimitError")
    if isinstance(e, Unavailable):
        return HttpError(503, str(e), "ServiceUnavailableError")
    if isinstance(e, grpc.aio.AioRpcError):
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return HttpError(504, f"LM worker: {e.details()}", "TimeoutError")
        return HttpError(502, f"LM worker: {e.code().name}: {e.details()}", "APIError")
    logger.exception("unexpected error", exc_info=e)
    return HttpError(500, f"internal error: {e}", "InternalServerError")


class HttpApi:
    def __init__(self, role: RoleServer, middlewares: Sequence = ()):
        self.proxy: Proxy | None = None  # set by attach() once loaded
        self.role = role
        self.serving = False
        self.app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=list(middlewares))
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/v1/models", self.models),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.post("/v1/audio/transcriptions", self.transcriptions),
                web.get("/v1/realtime", self.realtime),
            ]
        )
        self.dashboard = add_dashboard(self.app, lambda: self.serving)
        self.runner: web.AppRunner | None = None

    def attach(self, proxy: Proxy) -> None:
        """The loaded proxy: from now on the API and the dashboard serve from it."""
        self.proxy = proxy
        self.dashboard.proxy = proxy

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        # A client that goes away cancels its handler: the LM call is cancelled with it, and
        # the LM worker aborts the request (no work nobody waits for).
        self.runner = web.AppRunner(
            self.app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=tls)
        try:
            await site.start()
        except OSError as e:
            raise OSError(f"proxy cannot listen for HTTP on {host}:{port}: {e.strerror}") from e
        logger.info("HTTP%s API on %s:%d", "S" if tls else "", host, port)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- routes -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        # principal None: keys are on and none (or a wrong one) came: healthy or not, no more.
        detailed = request.get("principal", ANONYMOUS) is not None
        if not self.serving:
            body = {"status": "unavailable", "proxy": "not serving"}
            return web.json_response(body if detailed else {"status": "unavailable"}, status=503)
        roles = {}
        for pool in (self.proxy.encoders, self.proxy.lms):
            roles[pool.role] = {
                "status": pool.summary(),
                "workers": [
                    {
                        "address": w.address,
                        "status": w.status,
                        "circuit": w.breaker.state.value,
                        "source": w.source,
                        "last_error": w.last_error,
                    }
                    for w in pool.workers.values()
                ],
            }
        overall = overall_status(self.proxy.lms, self.proxy.encoders)
        body = {"status": overall, "proxy": "serving", "roles": roles}
        if not detailed:
            body = {"status": overall}
        return web.json_response(body, status=503 if overall == "unavailable" else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=prometheus_client.generate_latest(),
            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
        )

    async def models(self, request: web.Request) -> web.Response:
        if self.proxy is None:
            return web.json_response(HttpError(503, "starting", "ServiceUnavailableError").body(),
                                     status=503)  # fmt: skip
        card = self.proxy.card
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": card.id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "epd",
                        "max_model_len": card.max_model_len,
                    }
                ],
            }
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(self._chat, request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await self._body(request, parse_completion_body)
            return await completions(self.proxy, request, body, error_of)

        return await self._serve(handle, request)

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(self._transcribe, request)

    async def realtime(self, request: web.Request) -> web.StreamResponse:
        """Realtime transcription over a WebSocket (proxy/realtime_ws.py)."""
        if not self.serving or self.proxy is None:
            raise web.HTTPServiceUnavailable(reason="the proxy is not serving")
        async with self.role.track():
            return await realtime_websocket(request, self.proxy.realtime)

    async def _serve(self, handler, request: web.Request) -> web.StreamResponse:
        """What every generating route shares: 503 unless serving, counted for the drain,
        errors in the OpenAI shape, one request metric by status."""
        if not self.serving:
            e = HttpError(503, "the proxy is not serving (starting or draining)",
                          "ServiceUnavailableError")  # fmt: skip
            return web.json_response(e.body(), status=e.status)
        status = 200
        async with self.role.track():
            try:
                return await handler(request)
            except Exception as e:
                error = error_of(e)
                status = error.status
                return web.json_response(error.body(), status=error.status)
            finally:
                self.proxy.metrics.requests.labels("http", str(status)).inc()

    async def _transcribe(self, request: web.Request) -> web.StreamResponse:
        proxy = self.proxy
        family = proxy.served.family
        if not family.prompt_from_media or "audio" not in family.modalities:
            raise BadInput(
                f"the model `{proxy.served.name}` does not transcribe audio (it takes "
                f"{', '.join(family.modalities)})"
            )
        try:
            form = await request.post()
        except Exception as e:  # not multipart, or a malformed body
            raise BadInput(f"the body must be multipart/form-data: {e}") from None
        upload = form.get("file")
        if upload is None or not hasattr(upload, "file"):
            raise BadInput("`file` (the audio file, multipart) is required")
        data = upload.file.read()
        proxy.check_model(str(form.get("model") or ""))
        fmt = str(form.get("response_format") or "json")
        if fmt not in ("json", "text", "verbose_json"):
            raise BadInput(f"response_format {fmt!r}: json, text or verbose_json")
        sampling = epd_pb2.SamplingParams()
        try:
            sampling.temperature = float(form.get("temperature") or 0.0)
            if form.get("max_tokens"):
                sampling.max_tokens = int(form["max_tokens"])
        except ValueError as e:
            raise BadInput(f"bad sampling parameter: {e}") from None
        check_sampling(sampling)
        return_ids = str(form.get("return_token_ids", "")).lower() in ("1", "true")
        media = [MediaInput("audio", audio=AudioClip(data, "wav", 0))]
        request_id = f"trsc-{uuid.uuid4().hex[:24]}"
        prepared = await proxy.prepare(
            proxy.builder.build, "", media, sampling, request_id, False, return_ids
        )
        prepared.trace_parent = tracing.tracer().extract(request.headers)
        chunks = proxy.run(prepared, None)
        if str(form.get("stream", "")).lower() in ("1", "true"):
            return await self._transcript_events(request, prepared, chunks)
        text, token_ids, last = [], [], None
        async for chunk in chunks:
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            last = chunk
        transcript = "".join(text)
        if fmt == "text":
            return web.Response(text=transcript, content_type="text/plain")
        usage = last.usage if last is not None else None
        body: dict[str, Any] = {"text": transcript}
        if fmt == "verbose_json":
            seconds = prepared.items[0].grid.seconds or 0.0
            body = {
                "task": "transcribe",
                "language": str(form.get("language") or ""),
                "duration": seconds,
                "text": transcript,
            }
        if usage is not None:
            body["usage"] = {
                "type": "tokens",
                "input_tokens": usage.prompt_tokens,
                "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            }
        if return_ids:
            body["token_ids"] = token_ids
            body["prompt_token_ids"] = prepared.prompt_token_ids
        return web.json_response(body)

    async def _transcript_events(self, request, prepared, chunks) -> web.StreamResponse:
        """OpenAI's transcription stream: `transcript.text.delta` events, one
        `transcript.text.done` with the whole text, then `data: [DONE]`."""
        events = EventStream(request)  # headers once the request is known to be valid
        return_ids = prepared.return_prompt_token_ids
        text: list[str] = []
        try:
            last = None
            async for chunk in chunks:
                last = chunk
                if chunk.text or (return_ids and chunk.token_ids):
                    text.append(chunk.text)
                    event = {"type": "transcript.text.delta", "delta": chunk.text}
                    if return_ids:
                        event["token_ids"] = list(chunk.token_ids)
                    await events.send(event)
            done: dict[str, Any] = {"type": "transcript.text.done", "text": "".join(text)}
            if last is not None and last.usage is not None:
                u = last.usage
                done["usage"] = {
                    "type": "tokens",
                    "input_tokens": u.prompt_tokens,
                    "output_tokens": u.completion_tokens,
                    "total_tokens": u.prompt_tokens + u.completion_tokens,
                }
            if return_ids:
                done["prompt_token_ids"] = prepared.prompt_token_ids
            await events.send(done)
        except Exception as e:
            if not events.started:
                raise
            await events.send(error_of(e).body())
        return await events.done()

    async def _body(self, request: web.Request, parse):
        """The request's JSON body read within the limits and `parse`d (chat's or
        completions'): a large one off the event loop (every other client waits on it)."""
        limits = self.proxy.limits()
        raw = await read_body(request, limits.max_body_bytes)
        if len(raw) > LARGE_BODY_BYTES:
            body = await asyncio.to_thread(parse_json_body, raw, limits.max_json_containers)
            return await asyncio.to_thread(parse, body, limits)
        return parse(parse_json_body(raw, limits.max_json_containers), limits)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        proxy = self.proxy
        parsed = await self._body(request, parse_chat_body)
        proxy.check_model(parsed.model)
        sampling, return_ids = parsed.sampling, parsed.return_token_ids
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tenant = request.get("principal", ANONYMOUS).tenant
        prepared = await proxy.prepare(
            proxy.builder.build,
            parsed.chat,
            parsed.media,
            sampling,
            request_id,
            False,
            return_ids,
            tenant=tenant,
            tools=parsed.tools.functions if parsed.tools else (),
        )
        prepared.trace_parent = tracing.tracer().extract(request.headers)
        chunks = proxy.run(prepared, None)
        tools = parsed.tools
        if parsed.stream:
            calls = ToolCallStream(tools.names) if tools is not None else None
            return await self._stream(request, prepared, chunks, parsed.include_usage, calls)
        text, token_ids, logprobs, last = [], [], [], None
        async for chunk in chunks:
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            last = chunk
        message = {"role": "assistant", "content": "".join(text)}
        finish = FINISH.get(last.finish_reason, "stop")
        if tools is not None:  # the model's <tool_call> blocks become tool_calls
            content, tool_calls = parse_calls(message["content"], tools.names)
            if tool_calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": tool_calls}  # fmt: skip
                finish = "tool_calls" if finish == "stop" else finish
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(token_ids, logprobs)
            if sampling.HasField("logprobs")
            else None,
            "finish_reason": finish,
        }
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": proxy.served.name,
            "choices": [choice],
            "usage": usage_body(last.usage),
        }
        if return_ids:
            choice["token_ids"] = token_ids
            response["prompt_token_ids"] = prepared.prompt_token_ids
        return web.json_response(response)

    async def _stream(
        self, request, prepared, chunks, include_usage: bool, calls: ToolCallStream | None = None
    ) -> web.StreamResponse:
        """Server-sent events in the OpenAI chunk format, then `data: [DONE]`. With tools
        shown (`calls`), the model's tool calls go out as `tool_calls` deltas, each whole once
        its block closes, and the text around them as content."""
        events = EventStream(request)  # headers once the request is known to be valid
        name = self.proxy.served.name
        created = int(time.time())
        return_ids = prepared.return_prompt_token_ids

        def chunk_of(choices: list[dict], **extra) -> dict:
            return {"id": prepared.request_id, "object": "chat.completion.chunk",
                    "created": created, "model": name, "choices": choices, **extra}  # fmt: skip

        async def event(delta: dict, finish: str | None = None, **extra) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
            await events.send(chunk_of([choice]))

        try:
            last = None
            async for chunk in chunks:
                if not events.started:
                    first = {"role": "assistant", "content": ""}
                    extra = {"prompt_token_ids": prepared.prompt_token_ids} if return_ids else {}
                    await event(first, **extra)
                last = chunk
                finish = FINISH.get(chunk.finish_reason)
                extra = {"token_ids": chunk.token_ids} if return_ids else {}
                text = chunk.text
                if calls is not None:
                    text, made = calls.push(text)
                    for call in made:
                        await event({"tool_calls": [call]})
                    if finish:
                        text += calls.finish()
                        if calls.calls and finish == "stop":
                            finish = "tool_calls"
                if text or chunk.token_ids or finish:
                    await event({"content": text}, finish, **extra)
            if include_usage and last is not None:
                await events.send(chunk_of([], usage=usage_body(last.usage)))
        except Exception as e:
            if not events.started:
                raise
            await events.send(error_of(e).body())
        return await events.done()

    def _logprobs(self, token_ids: list[int], entries: list) -> dict:
        tokenizer = self.proxy.builder.tokenizer

        def token(t: int) -> dict:
            text = tokenizer.decode([t])
            return {"token": text, "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **token(t),
                    "logprob": e.logprob,
                    "top_logprobs": [{**token(x.token_id), "logprob": x.logprob} for x in e.top],
                }
                for t, e in zip(token_ids, entries, strict=False)
            ]
        }


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes: by its Content-Length before
    anything is read, else as soon as the bytes read pass it."""
    too_large = HttpError(
        413, f"the body is larger than {limit} bytes (proxy.max_body_bytes)", "BadRequestError"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
