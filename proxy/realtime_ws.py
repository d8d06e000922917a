"""GET /v1/realtime: realtime transcription over a WebSocket, in the event protocol of vLLM's
realtime endpoint (so clients written for it work unchanged).

    server  session.created      {"id", "created"}                    on connect
    client  session.update       {"model", "temperature"}             before the audio
    client  input_audio_buffer.append  {"audio": base64 PCM16 mono at the model's rate}
    client  input_audio_buffer.commit  {"final": false}: start now;  {"final": true}: the end
    server  transcription.delta  {"delta", "token_ids", "audio_seconds"}
    server  transcription.done   {"text", "usage", "token_ids"}        then the socket closes
    server  error                {"error", "code"}

`token_ids` and `audio_seconds` are this server's additions. Generation starts with the first
audio (or a non-final commit). The session is the same as gRPC Realtime's (proxy/realtime.py):
an `error` event ends it, as do a final commit, an idle timeout and a closed socket.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
import uuid

import grpc
from aiohttp import WSMsgType, web

from proto import epd_pb2
from proxy.prepare import BadInput
from proxy.realtime import RealtimeService, RealtimeSession, SessionError, Settings, idle_error
from proxy.validate import check_json_shape

MAX_EVENT_DEPTH = 8  # the protocol's events nest 2 deep


async def realtime_websocket(request: web.Request, service: RealtimeService) -> web.StreamResponse:
    # `realtime` is selected when offered: a browser that offered subprotocols (its API key
    # rides on one, proxy/auth.py) fails a handshake that selects none.
    # A frame holds at most one chunk's audio (base64 of float32 samples, the widest format)
    # and the event around it: larger frames are refused before they are read whole.
    rate = service.sample_rate or 16000
    chunk_bytes = 4 * rate * service.config.proxy.realtime_max_chunk_seconds
    ws = web.WebSocketResponse(
        max_msg_size=int(chunk_bytes * 4 / 3) + 64 * 1024, protocols=("realtime",)
    )
    try:
        await ws.prepare(request)
    except ConnectionResetError:  # gone before the handshake's answer: nothing was opened
        return ws
    session_id = f"sess-{uuid.uuid4().hex}"
    try:
        pcm16 = epd_pb2.AUDIO_FORMAT_PCM_S16LE
        # Greedy unless session.update says otherwise (as vLLM's realtime endpoint).
        sampling = epd_pb2.SamplingParams(temperature=0.0)
        session = service.open(Settings(pcm16, rate, sampling, session_id=session_id))
    except SessionError as e:
        await _send_error(ws, e)
        await ws.close()
        return ws
    writer: asyncio.Task | None = None
    end = "disconnect"
    idle = service.config.proxy.realtime_idle_timeout_seconds
    # NOTE: from here on every way out closes the session (a client gone before this send
    # used to leak it: its slot counted against proxy.realtime_max_sessions for good).
    try:
        created = {"type": "session.created", "id": session_id, "created": int(time.time())}
        await ws.send_json(created)
        while True:
            try:
                msg = await ws.receive(timeout=idle)
            except TimeoutError:
                session.fail(idle_error(idle))
                end = "idle"
                break
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                break
            if msg.type != WSMsgType.TEXT:
                await _send_error(ws, _bad("events are JSON text messages"))
                continue
            try:
                started = _handle(session, service, _parse_event(msg.data))
            except (BadInput, ValueError, RecursionError, AttributeError, TypeError):
                # Not JSON, too deep, a number past Python's digit limit, not an object.
                await _send_error(ws, _bad("an event must be a JSON object with a `type`"))
                continue
            except SessionError as e:
                if e.code is grpc.StatusCode.INVALID_ARGUMENT:  # the event is refused, no more
                    await _send_error(ws, e)
                    continue
                session.fail(e)
                end = "error"
                break
            if started and writer is None:
                writer = asyncio.create_task(_write(ws, session))
            if session.committed:
                break
        if writer is not None:
            if writer.done() or session.committed or end != "disconnect":
                end = await writer or end
        elif end in ("idle", "error"):
            await _write(ws, session)  # sends the error
    finally:
        if writer is not None and not writer.done():
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        await session.close(end)
        if not ws.closed:
            with contextlib.suppress(ConnectionResetError):
                await ws.close()
    return ws


def _parse_event(data: str) -> dict:
    """A client event, refused (BadInput) before parsing when nested deeper than any event
    is, so a hostile nesting costs no recursion."""
    raw = data.encode()
    check_json_shape(raw, MAX_EVENT_DEPTH)
    return json.loads(raw)


def _handle(session: RealtimeSession, service: RealtimeService, event: dict) -> bool:
    """Apply one client event; True once the session runs."""
    kind = event.get("type")
    if kind == "session.update":
        model = event.get("model")
        if model and model != service.proxy.served.name:
            raise SessionError(grpc.StatusCode.NOT_FOUND, f"The model `{model}` does not exist.")
        if session.started:
            raise _bad("session.update comes before the audio")
        if event.get("temperature") is not None:
            try:
                session.settings.sampling.temperature = float(event["temperature"])
            except (TypeError, ValueError):
                raise _bad("temperature must be a number") from None
        return False
    if kind == "input_audio_buffer.append":
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise _bad("input_audio_buffer.append needs `audio`, base64 PCM16")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise _bad("`audio` is not valid base64") from None
        session.push(data)
        return session.started
    if kind == "input_audio_buffer.commit":
        if event.get("final"):
            session.commit()
        else:
            session.start()
        return True
    raise _bad(f"unknown event type {kind!r}")


async def _write(ws: web.WebSocketResponse, session: RealtimeSession) -> str | None:
    """The session's deltas as events, then the socket closed; the end's name, or None when
    the client left."""
    try:
        return await _events(ws, session)
    finally:
        if not ws.closed:
            with contextlib.suppress(ConnectionResetError):
                await ws.close()


async def _events(ws: web.WebSocketResponse, session: RealtimeSession) -> str | None:
    try:
        async for delta in session.deltas():
            if delta.finish_reason == epd_pb2.FINISH_REASON_UNSPECIFIED:
                await ws.send_json(
                    {
                        "type": "transcription.delta",
                        "delta": delta.text,
                        "token_ids": delta.token_ids,
                        "audio_seconds": round(delta.audio_seconds, 4),
                    }
                )
                continue
            if delta.token_ids or delta.text:
                await ws.send_json(
                    {
                        "type": "transcription.delta",
                        "delta": delta.text,
                        "token_ids": delta.token_ids,
                        "audio_seconds": round(delta.audio_seconds, 4),
                    }
                )
            usage = delta.usage or epd_pb2.Usage()
            await ws.send_json(
                {
                    "type": "transcription.done",
                    "text": "".join(session.text),
                    "token_ids": list(session.sent),
                    "usage": {
                        "prompt_tokens": usage.prompt_tokens,
                        "completion_tokens": usage.completion_tokens,
                        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                    },
                }
            )
            return "commit"
    except SessionError as e:
        await _send_error(ws, e)
        return "idle" if e.code is grpc.StatusCode.DEADLINE_EXCEEDED else "error"
    except ConnectionResetError:
        return None
    return None


async def _send_error(ws: web.WebSocketResponse, e: SessionError) -> None:
    if not ws.closed:
        with contextlib.suppress(ConnectionResetError):
            await ws.send_json({"type": "error", "error": e.message, "code": e.code.name.lower()})


def _bad(message: str) -> SessionError:
    return SessionError(grpc.StatusCode.INVALID_ARGUMENT, message)


__all__ = ["realtime_websocket"]
