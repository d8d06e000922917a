"""Realtime audio sessions in the proxy, shared by gRPC `Inference.Realtime` (server.py) and
`GET /v1/realtime` (realtime_ws.py).

A session is pinned to one encoder worker and one LM worker (a `both` LM worker while one is
up: a session is not split into prefill and decode, proxy/pd.py `realtime_pick`):

    client audio -> proxy (keeps all of it) -> Encoder.EncodeStream (the session's streaming
    encoder state) -> the session's Redis Stream -> the LM worker's blocking reader -> its
    realtime request (LanguageModel.Generate with realtime_session_id) -> text deltas back

The proxy keeps the session's audio: when its encoder fails mid-session, another encoder gets
the whole audio again from the start (the encoder is causal and deterministic: the same rows
come out; the LM keeps each row once) and the session goes on. When its LM worker fails,
another one runs the prompt plus the tokens already sent (its prefill reads the rows from the
stream) and continues: no delta is repeated or skipped.

A session ends on commit (the audio ended: the LM consumes the last positions), on cancel,
on an idle timeout, or when the client goes away; at the end its encoder call is closed (its
last rows flushed), its LM call cancelled, and its stream's key deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from common import tracing
from common.tracing import Stages, wall_ns
from connector.streams import SessionStreams, StreamError
from models import MediaError
from proto import epd_pb2
from proxy.pd import realtime_pick
from proxy.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

SAMPLE_FORMATS = {
    epd_pb2.AUDIO_FORMAT_PCM_S16LE: (np.dtype("<i2"), 1.0 / 32768.0),
    epd_pb2.AUDIO_FORMAT_PCM_F32LE: (np.dtype("<f4"), 1.0),
}
# Failures of a worker (not of the session's input): the session moves to another worker.
WORKER_FAILURES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
# How long closing a session waits for its encoder to flush its last rows.
CLOSE_WAIT_SECONDS = 5.0
# How long a session waits for a usable worker (not tried yet) to come up before it fails.
WORKER_WAIT = 5.0


def _wait(last: SessionError | None) -> float:
    """How long a session waits for an untried worker to come up: not at all once every worker
    it tried was full (the client hears RESOURCE_EXHAUSTED at once and backs off, as from
    the proxy's own load shedding; a new worker takes longer to start than WORKER_WAIT)."""
    full = last is not None and last.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return 0.0 if full else WORKER_WAIT


class SessionError(Exception):
    """A session that cannot go on; `code` is the gRPC status (the WebSocket `error` event
    carries its name)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Settings:
    """What a session opens with."""

    audio_format: int = epd_pb2.AUDIO_FORMAT_PCM_S16LE
    sample_rate: int = 16000
    sampling: epd_pb2.SamplingParams = field(default_factory=epd_pb2.SamplingParams)
    session_id: str = ""


@dataclass
class Delta:
    """Text out: the tokens of one step (or the last message, with the finish and usage)."""

    token_ids: list[int]
    text: str
    audio_seconds: float  # the client's audio the tokens so far have consumed
    finish_reason: int = epd_pb2.FINISH_REASON_UNSPECIFIED
    usage: epd_pb2.Usage | None = None


class RealtimeService:
    """The proxy's realtime sessions: limits, the model's session shape, the stream store."""

    def __init__(self, proxy):  # proxy.core.Proxy
        self.proxy = proxy
        self.config = proxy.config
        self.family = proxy.served.family
        self.metrics = proxy.metrics
        options = self.config.connector.connector_options()
        options.pop("local_tier_bytes")
        self.streams = SessionStreams(**options)
        self.sessions: dict[str, RealtimeSession] = {}
        self.audio_seconds = 0.0  # audio received by every session so far
        try:
            self.sample_rate = self.family.realtime_sample_rate
            self.prompt = self.family.realtime_prompt()
        except MediaError as e:
            self.sample_rate, self.prompt, self.unsupported = 0, [], str(e)
        else:
            self.unsupported = ""

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.close("cancel")
        await self.streams.close()

    def open(self, settings: Settings) -> RealtimeSession:
        """A new session (not started); SessionError when it cannot be."""
        p = self.config.proxy
        if self.unsupported:
            raise SessionError(grpc.StatusCode.FAILED_PRECONDITION, self.unsupported)
        if settings.audio_format not in SAMPLE_FORMATS:
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT, "realtime audio is PCM_S16LE or PCM_F32LE"
            )
        if settings.sample_rate != self.sample_rate:
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the audio is at {settings.sample_rate} Hz; this model takes "
                f"{self.sample_rate} Hz",
            )
        session_id = settings.session_id or f"rt-{uuid.uuid4().hex}"
        try:
            self.streams.key(session_id)
        except ValueError as e:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if session_id in self.sessions:
            raise SessionError(
                grpc.StatusCode.ALREADY_EXISTS, f"session {session_id} is already open"
            )
        if len(self.sessions) >= p.realtime_max_sessions:
            self.metrics.realtime_sessions_total.labels("refused").inc()
            raise SessionError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.sessions)} realtime sessions are open "
                "(proxy.realtime_max_sessions); retry later",
            )
        session = RealtimeSession(self, session_id, settings)
        self.sessions[session_id] = session
        self.metrics.realtime_sessions.set(len(self.sessions))
        return session

    def _closed(self, session: RealtimeSession) -> None:
        self.sessions.pop(session.id, None)
        self.metrics.realtime_sessions.set(len(self.sessions))


class RealtimeSession:
    """One session: audio in (`push`, `commit`), deltas out (`deltas`), `close` at the end."""

    def __init__(self, service: RealtimeService, session_id: str, settings: Settings):
        self.service = service
        self.id = session_id
        self.settings = settings
        self.dtype, self.scale = SAMPLE_FORMATS[settings.audio_format]
        p = service.config.proxy
        family = service.family
        # The longest audio: the configured limit, or what the largest context holds.
        context = service.proxy.limits().context
        seconds = p.realtime_max_session_seconds
        while seconds > 0.08 and family.realtime_positions(seconds) > context:
            seconds *= 0.9
        self.max_seconds = seconds
        self.positions = min(family.realtime_positions(seconds), context)
        self.chunks: list[bytes] = []  # float32 at the model's rate: what an encoder gets
        self.num_samples = 0
        self.committed = False
        self.more = asyncio.Event()  # set on every push and on commit
        self.out: asyncio.Queue[Delta | SessionError] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.encoder: Worker | None = None
        self.lm: Worker | None = None
        self.sent: list[int] = []
        self.text: list[str] = []
        self.pending_chunks: deque[tuple[float, float]] = deque()  # (audio end s, received)
        self.started = False
        self.closed = False
        self.end: str | None = None
        # Its trace (common/tracing.py): one span for the session, a stage per audio chunk
        # (received -> the first delta covering its end); the encoder's and LM's calls its
        # children.
        self.stages = Stages()
        self.span = tracing.tracer().start("proxy.realtime_session", None, session_id=session_id)

    @property
    def audio_seconds(self) -> float:
        return self.num_samples / self.service.sample_rate

    # -- audio in -----------------------------------------------------------------------------

    def start(self) -> None:
        """Pin the workers and start encoding and generating (idempotent)."""
        if self.started:
            return
        self.started = True
        self.tasks = [
            asyncio.create_task(self._encode(), name=f"{self.id}-encode"),
            asyncio.create_task(self._generate(), name=f"{self.id}-generate"),
        ]

    def push(self, data: bytes) -> None:
        """The client's next chunk, in the session's format; SessionError for bad audio or a
        session over its length."""
        if self.committed:
            raise SessionError(grpc.StatusCode.FAILED_PRECONDITION, "the audio was committed")
        if len(data) % self.dtype.itemsize:
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an audio chunk of {len(data)} bytes is not a whole number of "
                f"{self.dtype.itemsize}-byte samples",
            )
        # Bounds from the length alone, before any work on the samples.
        seconds = len(data) // self.dtype.itemsize / self.service.sample_rate
        if self.audio_seconds + seconds > self.max_seconds + 1e-9:
            raise SessionError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the session's audio would run past {self.max_seconds:.1f} s "
                "(proxy.realtime_max_session_seconds, or the context)",
            )
        max_chunk = self.service.config.proxy.realtime_max_chunk_seconds
        if seconds > max_chunk:
            raise SessionError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an audio chunk of {seconds:.1f} s; at most {max_chunk:g} s a chunk "
                "(proxy.realtime_max_chunk_seconds): send the audio as it is captured",
            )
        samples = np.frombuffer(data, dtype=self.dtype).astype(np.float32)
        if self.scale != 1.0:
            samples *= self.scale
        if not np.all(np.isfinite(samples)):
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, "the audio holds NaN or inf")
        if not samples.size:
            return
        self.start()
        self.chunks.append(samples.tobytes())
        self.num_samples += samples.shape[0]
        self.pending_chunks.append((self.audio_seconds, time.monotonic()))
        self.service.metrics.realtime_audio_seconds.inc(seconds)
        self.service.audio_seconds += seconds
        self.more.set()

    def commit(self) -> None:
        """No more audio: the transcript finishes over what was sent."""
        self.start()
        self.committed = True
        self.more.set()

    def fail(self, error: SessionError) -> None:
        """End the session's output with `error` (bad input, idle timeout)."""
        self.out.put_nowait(error)

    # -- text out -----------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[Delta]:
        """The session's deltas until its last (finish_reason set); SessionError when it
        fails."""
        while True:
            item = await self.out.get()
            if isinstance(item, SessionError):
                raise item
            self._observe_chunks(item.audio_seconds)
            yield item
            if item.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
                return

    def _observe_chunks(self, covered: float) -> None:
        now = time.monotonic()
        metrics = self.service.metrics
        while self.pending_chunks and self.pending_chunks[0][0] <= covered + 1e-9:
            end, received = self.pending_chunks.popleft()
            metrics.realtime_chunk_latency.observe(now - received)
            self.stages.add("realtime_chunk", wall_ns(received), audio_end_seconds=round(end, 3))
            metrics.chunk_window.add(now - received)

    async def close(self, end: str) -> None:
        """End the session (`end`: commit, cancel, idle, disconnect, error): its calls ended,
        its stream deleted. Idempotent. The session's slot is freed even when the caller is
        cancelled meanwhile (a client gone mid-close: the web server cancels its handler);
        the ending itself goes on."""
        if self.closed:
            return
        self.closed = True
        self.end = end
        try:
            await asyncio.shield(self._end_calls())
        finally:
            self.service.metrics.realtime_sessions_total.labels(end).inc()
            self.service.metrics.stages.observe(self.stages)
            tracing.tracer().end(
                self.span,
                self.stages,
                end=end,
                audio_seconds=round(self.audio_seconds, 3),
                output_tokens=len(self.sent),
            )
            self.service._closed(self)

    async def _end_calls(self) -> None:
        encode = self.tasks[0] if self.tasks else None
        for task in self.tasks[1:]:
            task.cancel()
        if encode is not None and not encode.done():
            # The encoder flushes and writes the stream's last entry, so nothing is appended
            # after the key is deleted below.
            self.committed = True
            self.more.set()
            try:
                await asyncio.wait_for(asyncio.shield(encode), CLOSE_WAIT_SECONDS)
            except (TimeoutError, asyncio.CancelledError, Exception):
                encode.cancel()
        for task in self.tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            await self.service.streams.delete(self.id)
        except StreamError as e:
            logger.warning("session %s: its stream stays until its TTL: %s", self.id, e)

    # -- the encoder side ---------------------------------------------------------------------

    async def _requests(
        self, accepted: asyncio.Event
    ) -> AsyncIterator[epd_pb2.EncodeStreamRequest]:
        """One EncodeStream call's messages: start; once the encoder accepts the session,
        the whole audio so far, then each chunk as it comes, then input_done once committed."""
        yield epd_pb2.EncodeStreamRequest(
            start=epd_pb2.EncodeStreamStart(
                session_id=self.id,
                format=epd_pb2.AUDIO_FORMAT_PCM_F32LE,
                sample_rate=self.service.sample_rate,
            )
        )
        await accepted.wait()
        i = 0
        while True:
            while i < len(self.chunks):
                yield epd_pb2.EncodeStreamRequest(audio=self.chunks[i])
                i += 1
            if self.committed:
                yield epd_pb2.EncodeStreamRequest(input_done=epd_pb2.RealtimeInputDone())
                return
            self.more.clear()
            await self.more.wait()

    async def _encode(self) -> None:
        pool = self.service.proxy.encoders
        tried: set[str] = set()
        last: SessionError | None = None
        while True:
            worker = await pool.wait_for(lambda: pool.pick(exclude=tried), _wait(last))
            if worker is None:
                self.fail(
                    last or SessionError(grpc.StatusCode.UNAVAILABLE, "no encoder worker is up")
                )
                return
            if self.encoder is not None:
                self.service.metrics.realtime_failovers.labels("encoder").inc()
                logger.warning(
                    "session %s: encoder %s failed; replaying %.2f s of audio to %s",
                    self.id,
                    self.encoder.address,
                    self.audio_seconds,
                    worker.address,
                )
            self.encoder = worker
            accepted = asyncio.Event()
            try:
                trace = tracing.tracer().metadata(self.span)
                async for response in worker.stub.EncodeStream(
                    self._requests(accepted), metadata=trace
                ):
                    accepted.set()
                    if response.done:
                        pool.succeeded(worker)
                        return
                return  # ended without `done`: the session is closing
            except grpc.aio.AioRpcError as e:
                last = self._worker_failed(e, pool, worker, tried, "encoder")
                if last is None:
                    return
            finally:
                accepted.set()  # a refused call's writer ends (its next write sees the end)

    def _worker_failed(
        self, e: grpc.aio.AioRpcError, pool: WorkerPool, worker: Worker, tried: set[str], what: str
    ) -> SessionError | None:
        """A worker's stream failed. Not the worker's fault: the session fails with it (None).
        Else the worker is set aside (and marked failed, unless it was only full) and the error
        is returned, to report if no other worker takes over."""
        if e.code() not in WORKER_FAILURES:
            self.fail(SessionError(e.code(), f"{what}: {e.details()}"))
            return None
        if e.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:  # full is not broken
            pool.failed(worker, e.details() or e.code().name)
        tried.add(worker.address)
        return SessionError(e.code(), f"{what} {worker.address}: {e.details()}")

    # -- the LM side --------------------------------------------------------------------------

    def _lm_request(self, attempt: int) -> epd_pb2.LMGenerateRequest:
        s = self.settings.sampling
        msg = epd_pb2.LMGenerateRequest(
            request_id=f"{self.id}-{attempt}",
            prompt_token_ids=self.service.prompt + self.sent,
            sampling=s,
            realtime_session_id=self.id,
        )
        msg.mm_features.add(
            mm_hash=self.id, modality=epd_pb2.MODALITY_AUDIO, offset=0, length=self.positions
        )
        if self.sent:  # a failover: the new worker continues the draws and the held-back text
            msg.resumed_output_tokens = len(self.sent)
            msg.resumed_text_chars = sum(len(t) for t in self.text)
        if s.HasField("max_tokens"):
            msg.sampling.max_tokens = max(1, s.max_tokens - len(self.sent))
        return msg

    async def _generate(self) -> None:
        pool = self.service.proxy.lms
        family = self.service.family
        prompt = len(self.service.prompt)
        tried: set[str] = set()
        last: SessionError | None = None
        attempt = 0
        while True:
            worker = await pool.wait_for(lambda: realtime_pick(pool, tried), _wait(last))
            if worker is None:
                self.fail(last or SessionError(grpc.StatusCode.UNAVAILABLE, "no LM worker is up"))
                return
            if self.lm is not None:
                self.service.metrics.realtime_failovers.labels("lm").inc()
                logger.warning(
                    "session %s: LM worker %s failed after %d tokens; continuing on %s",
                    self.id,
                    self.lm.address,
                    len(self.sent),
                    worker.address,
                )
            self.lm = worker
            attempt += 1
            try:
                trace = tracing.tracer().metadata(self.span)
                async for r in worker.stub.Generate(self._lm_request(attempt), metadata=trace):
                    if r.missing_mm_hashes:
                        continue
                    self.sent.extend(r.token_ids)
                    self.text.append(r.text)
                    positions = prompt + len(self.sent) - 1
                    covered = min(self.audio_seconds, family.realtime_audio_seconds(positions))
                    delta = Delta(list(r.token_ids), r.text, covered)
                    if r.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
                        delta.finish_reason = r.finish_reason
                        delta.usage = epd_pb2.Usage(
                            prompt_tokens=prompt, completion_tokens=len(self.sent)
                        )
                        delta.audio_seconds = self.audio_seconds if self.committed else covered
                    self.out.put_nowait(delta)
                    if delta.finish_reason != epd_pb2.FINISH_REASON_UNSPECIFIED:
                        pool.succeeded(worker)
                        return
                self.fail(SessionError(grpc.StatusCode.INTERNAL, "the LM stream ended early"))
                return
            except grpc.aio.AioRpcError as e:
                last = self._worker_failed(e, pool, worker, tried, "LM worker")
                if last is None:
                    return


__all__ = ["Delta", "RealtimeService", "RealtimeSession", "SessionError", "Settings"]


# -- gRPC Inference.Realtime ------------------------------------------------------------------


async def grpc_session(
    service: RealtimeService, requests, context
) -> AsyncIterator[epd_pb2.RealtimeResponse]:
    """One Realtime call: `config`, audio chunks and `input_done` in; deltas out, the last
    with finish_reason and usage. Errors end the call with their status code."""
    messages = aiter(requests)
    first = await anext(messages, None)
    if first is None or first.WhichOneof("event") != "config":
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the first Realtime message must be `config`"
        )
    cfg = first.config
    if cfg.model and cfg.model != service.proxy.served.name:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"The model `{cfg.model}` does not exist.")
    try:
        session = service.open(Settings(cfg.format, cfg.sample_rate, cfg.sampling, cfg.session_id))
    except SessionError as e:
        await context.abort(e.code, e.message)
    idle = service.config.proxy.realtime_idle_timeout_seconds
    pump = asyncio.create_task(_pump_grpc(session, messages, idle))
    end = "cancel"  # the client cancelled the call, or went away
    try:
        async for delta in session.deltas():
            msg = epd_pb2.RealtimeResponse(
                session_id=session.id,
                token_ids=delta.token_ids,
                text=delta.text,
                finish_reason=delta.finish_reason,
                audio_seconds=delta.audio_seconds,
            )
            if delta.usage is not None:
                msg.usage.CopyFrom(delta.usage)
            yield msg
        end = "commit"
    except SessionError as e:
        end = "idle" if e.code is grpc.StatusCode.DEADLINE_EXCEEDED else "error"
        await context.abort(e.code, e.message)
    finally:
        pump.cancel()
        await session.close(end)


async def _pump_grpc(session: RealtimeSession, messages, idle: float) -> None:
    try:
        while True:
            msg = await asyncio.wait_for(anext(messages, None), idle)
            if msg is None:  # the client half-closed: the audio is complete
                session.commit()
                return
            kind = msg.WhichOneof("event")
            if kind == "audio":
                session.push(msg.audio)
            elif kind == "input_done":
                session.commit()
                return
            else:
                raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, "`config` comes once, first")
    except TimeoutError:
        session.fail(idle_error(idle))
    except SessionError as e:
        session.fail(e)
    except grpc.aio.AioRpcError:
        pass  # the call is ending; its handler closes the session


def idle_error(idle: float) -> SessionError:
    return SessionError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"no audio or commit for {idle:g} s (proxy.realtime_idle_timeout_seconds)",
    )
