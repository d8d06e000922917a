"""The LM worker's front end: what happens to a request between the servicer and the engine.

    admit       checks (the engine's `validate`, realtime session, duplicate id), reserves a
                realtime session slot
    KV prefetch the blocks the KV tier holds for it, off the engine thread (a decode stage may
                find all its media's KV there: then it fetches no embedding)
    attach      its inputs' sources: the embedding fetch from the EC connector (notified,
                bounded; misses reported so the proxy re-encodes) and, for a realtime session,
                the reader of the session's stream. Each puts into the request's inputs
                through the engine's inbox (`add_embeddings`, `append_realtime`)
    engine      the request enters the engine at once and is prefilled up to its first item
                still lacking (`lm.overlap_encode_prefill`), or once every embedding is in
    relay       the engine's outputs (and missing-hash reports) back, in order, until the last,
                which carries the handover's rope delta and the stage timings

`LMFrontend.generate` is that flow as an async iterator of `RequestOutput`s and `Missing`
reports; failures are raised as exceptions (the servicer maps each to a status in one place).
No gRPC here: protobuf stops at the servicer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from common import tracing
from common.grammar import GrammarCompiler, GrammarError, Matcher
from common.tracing import wall_ns
from connector import AsyncECConnector, ConnectorError
from connector.streams import SessionStreams
from lm_worker.engine import BadRequest, LMEngine, RequestOutput
from lm_worker.realtime import RealtimeFeeder
from lm_worker.request import Request
from models import EmbeddingMismatch, LoadedEmbedding

logger = logging.getLogger(__name__)

# How long a request's grammar may take to compile before it is refused (the proxy compiled it
# already, without the vocabulary; this bounds what only the vocabulary costs).
GRAMMAR_SECONDS = 10.0


class AlreadyRunning(ValueError):
    """A request with this id is running here already (ALREADY_EXISTS)."""


class NotRealtime(ValueError):
    """A realtime session sent to a model whose decode steps take no audio
    (FAILED_PRECONDITION)."""


class RequestFailed(RuntimeError):
    """The request failed here: the engine ended it with an error, its realtime stream broke,
    the step is stuck, its fetch broke unexpectedly. `kind` as RequestOutput.error_kind."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Handover:
    """The prefill / decode split's part of a call: a prefill stage hands its KV over
    (`kv_handover`, to `kv_target` on the direct path); a decode stage gets the prefill's rope
    delta."""

    kv_handover: bool = False
    kv_target: str = ""
    rope_delta: int | None = None


@dataclass
class Missing:
    """Embeddings found missing in the connector (the proxy re-encodes them)."""

    mm_hashes: list[str]


class EmbeddingFetcher:
    """Waits for a request's embeddings in the connector and brings them to the device."""

    def __init__(self, connector: AsyncECConnector, engine: LMEngine, timeout: float):
        self.connector = connector
        self.engine = engine
        self.timeout = timeout
        self.waiting = 0  # requests waiting for embeddings (GetLoad)

    async def fetch(self, request: Request, report, deliver=None) -> dict[str, LoadedEmbedding]:
        """{mm_hash: tensor on the engine's device}. `report(hashes)` is called with each set
        of hashes newly found missing; `deliver(found)`, when given, with each set as it is
        fetched. Raises TimeoutError after `timeout` seconds."""
        # A realtime session's rows come through its stream (lm_worker/realtime.py).
        needed = {
            f.mm_hash: f.num_embeds
            for f in request.mm_features
            if f.mm_hash != request.realtime_session
        }
        found: dict[str, LoadedEmbedding] = {}
        reported: set[str] = set()
        deadline = time.monotonic() + self.timeout
        self.waiting += 1
        try:
            while True:
                pending = [h for h in needed if h not in found]
                began = tracing.now_ns()
                fetched, misses = await self.connector.get_many(pending)
                loaded = {}
                for h, tensor in fetched.items():
                    loaded[h] = await asyncio.to_thread(
                        self.engine.load_embedding, h, tensor, needed[h]
                    )
                if fetched:  # the read and the copy to the engine's device, inside the wait
                    request.stages.add("fetch", began, items=len(fetched), missing=len(misses))
                found.update(loaded)
                if deliver is not None and loaded:
                    deliver(loaded)
                if not misses:
                    return found
                new = [h for h in misses if h not in reported]
                if new:
                    self.engine.metrics.embedding_misses.inc(len(new))
                    reported.update(new)
                    report(new)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or await self.connector.wait_for(misses, remaining):
                    raise TimeoutError(
                        f"embeddings {sorted(set(misses))} did not arrive within "
                        f"{self.timeout:.0f}s"
                    )
                # Everything arrived: an item missing on the next read was evicted again, a
                # new miss, reported again (else it would wait out the whole timeout).
                reported.clear()
        finally:
            self.waiting -= 1


@dataclass
class _Fetched:
    """Every embedding of a request that waits for them all before the engine has it."""

    embeddings: dict[str, LoadedEmbedding]


class _Call:
    """A request in flight here: its event queue (outputs, reports, a failed fetch), its
    embedding fetch, whether it is aborted and whether the engine has it."""

    def __init__(self, request: Request):
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.fetch: asyncio.Task | None = None
        self.aborted = False
        self.in_engine = False
        self.started = time.monotonic()
        self.embedding_wait: float | None = None  # seconds until every embedding was in


class LMFrontend:
    def __init__(
        self,
        engine: LMEngine,
        connector: AsyncECConnector,
        streams: SessionStreams,
        *,
        embedding_timeout: float,
        max_realtime_sessions: int,
        overlap_encode_prefill: bool,
    ):
        self.engine = engine
        self.kv = engine.kv
        self.fetcher = EmbeddingFetcher(connector, engine, embedding_timeout)
        self.streams = streams
        self.feeder = RealtimeFeeder(streams, engine, max_realtime_sessions)
        self.overlap = overlap_encode_prefill
        self.calls: dict[str, _Call] = {}
        self._grammars: GrammarCompiler | None = None  # made by the first constrained request
        self._grammars_lock = threading.Lock()

    async def generate(
        self, request: Request, handover: Handover
    ) -> AsyncIterator[RequestOutput | Missing]:
        """The request's outputs (the last has its finish_reason) and missing-embedding
        reports, in order. Raises BadRequest, NotRealtime, AlreadyRunning, TooManySessions
        before anything runs; TimeoutError, EmbeddingMismatch or ConnectorError when its
        embeddings cannot be had; RequestFailed when the engine ends it with an error. Closing
        the iterator early (the client went away) aborts the request."""
        if request.sampling.structured is not None:
            request.grammar = await self._grammar(request)
        call = self._admit(request)
        session = request.realtime_session
        finished = False  # the engine has ended the request (its last output came)
        try:
            media = await self._prefetch_kv(request, handover)
            if not call.aborted:
                overlap = media and self.overlap
                if not media or overlap:
                    self._enter_engine(call, {}, more_to_come=overlap)
                if media:
                    call.fetch = asyncio.create_task(self._fetch(call, overlap))
            while True:
                event = await call.queue.get()
                if isinstance(event, Missing):
                    yield event
                    continue
                if isinstance(event, BaseException):  # a failed fetch or stream, a stuck step
                    raise event
                if isinstance(event, _Fetched):
                    if not call.aborted:
                        self._enter_engine(call, event.embeddings, more_to_come=False)
                    continue
                finished = event.finish_reason is not None
                if event.finish_reason == "error":
                    raise RequestFailed(event.error or "engine error", event.error_kind)
                if finished:
                    await self._complete(call, event, handover)
                yield event
                if finished:
                    return
        finally:
            self.calls.pop(request.request_id, None)
            self.kv.pending_saves(request.request_id)  # not waited for: dropped
            if not call.in_engine:  # what its prefetch kept, the engine never took
                self.kv.request_finished(request.request_id)
            if call.fetch is not None:
                call.fetch.cancel()
            if not finished and call.in_engine:  # the client went away, a failure here
                self.engine.abort(request.request_id)
            if session is not None:
                self.feeder.stop(session)

    async def _grammar(self, request: Request) -> Matcher:
        """The request's grammar matcher, off the event loop (a new schema compiles in
        milliseconds to seconds), with a resumed request's output so far replayed into it.
        BadRequest when it cannot be had within GRAMMAR_SECONDS."""
        if request.sampling.ignore_eos:
            raise BadRequest("ignore_eos cannot be combined with a structured output")
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self._compile, request), GRAMMAR_SECONDS
            )
        except TimeoutError:
            raise BadRequest(
                f"the grammar did not compile within {GRAMMAR_SECONDS:.0f} s"
            ) from None
        except GrammarError as e:
            raise BadRequest(str(e)) from None

    def _compile(self, request: Request) -> Matcher:
        with self._grammars_lock:
            if self._grammars is None:
                engine = self.engine
                vocabulary = engine.tokenizer.to_json() if engine.tokenizer is not None else None
                if vocabulary is None:
                    raise GrammarError("this model's tokenizer cannot constrain its output")
                eos = sorted(engine.eos_token_ids)
                self._grammars = GrammarCompiler(vocabulary, engine.vocab_size, eos)
        matcher = self._grammars.matcher(request.sampling.structured)
        if request.resumed_output_tokens:
            matcher.replay(request.prompt_token_ids[-request.resumed_output_tokens :])
        return matcher

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state: waiting for its embeddings (the wait is cancelled
        and it ends with "abort") or in the engine. False: no such request running here."""
        call = self.calls.get(request_id)
        if call is None or call.aborted:
            return False
        call.aborted = True
        if call.fetch is not None:
            call.fetch.cancel()
        if call.in_engine:
            self.engine.abort(request_id)
        else:  # it ends here, before the engine had it
            out = RequestOutput(
                request_id, finish_reason="abort", num_prompt_tokens=call.request.num_prompt_tokens
            )
            call.queue.put_nowait(out)
        return True

    def fail_all(self, error: str, kind: str) -> int:
        """End every request here with an error of `kind` (the watchdog: a stuck step)."""
        for call in list(self.calls.values()):
            call.queue.put_nowait(RequestFailed(error, kind))
        return len(self.calls)

    # -- the flow -----------------------------------------------------------------------------

    def _admit(self, request: Request) -> _Call:
        engine = self.engine
        session = request.realtime_session
        if session is not None:
            if not engine.is_realtime:
                raise NotRealtime(
                    "this model takes no realtime sessions (its decode steps take no audio)"
                )
            self.streams.key(session)  # a usable id (ValueError: INVALID_ARGUMENT)
            if session not in request.mm_hashes:
                raise BadRequest(
                    f"realtime session {session}: no mm_feature names it (its positions, from "
                    "where its audio starts)"
                )
            capacity = engine.realtime_capacity
            request.mm_features = [
                dataclasses.replace(f, length=min(f.length, capacity))
                if f.mm_hash == session
                else f
                for f in request.mm_features
            ]
        engine.validate(request)
        if request.request_id in self.calls:
            raise AlreadyRunning(f"request {request.request_id} is already running")
        if session is not None:
            self.feeder.reserve(session)
        call = self.calls[request.request_id] = _Call(request)
        return call

    async def _prefetch_kv(self, request: Request, handover: Handover) -> bool:
        """The blocks the KV tier holds for the request, off the engine thread. True: it has
        media embeddings to fetch from the connector (a realtime session's rows come through
        its stream; a decode stage whose media KV is all in the tier fetches none)."""
        session = request.realtime_session
        media = any(f.mm_hash != session for f in request.mm_features)
        began = tracing.now_ns()
        covered = await self.kv.prefetch_async(request, handover.kv_handover, handover.kv_target)
        if covered:
            request.stages.add("kv_prefetch", began, tokens=covered)
        if media and session is None and covered >= request.embeds_end:
            media = not self._media_from_kv(request, handover.rope_delta)
        return media

    def _media_from_kv(self, request: Request, delta: int | None) -> bool:
        """Every token of the request that takes a media embedding has its KV from the tier:
        position the rest with the prefill worker's rope delta and fetch no embedding (True).
        Without a delta the family can use, False: the embeddings are fetched as usual."""
        try:
            request.rope = self.engine.runner.model_state.rope_past_media(
                request.num_prompt_tokens, delta
            )
        except ValueError:
            return False
        request.media_in_kv = True
        return True

    def _enter_engine(
        self, call: _Call, embeddings: dict[str, LoadedEmbedding], more_to_come: bool
    ) -> None:
        request = call.request
        request.arrival = time.monotonic()
        self.engine.add_request(request, call.queue.put_nowait, embeddings, more_to_come)
        call.in_engine = True
        if request.realtime_session is not None:

            def stream_failed(error: str) -> None:
                call.queue.put_nowait(RequestFailed(error, "worker"))

            self.feeder.start(request.realtime_session, stream_failed)

    async def _fetch(self, call: _Call, overlap: bool) -> None:
        """The request's embeddings from the connector: fed to the engine as they come
        (`overlap`), or all of them as one event. A fetch that fails ends the request with the
        fetch's error (in the engine too, its blocks freed)."""
        request = call.request
        feed = partial(self.engine.add_embeddings, request.request_id) if overlap else None

        def report(hashes: list[str]) -> None:
            call.queue.put_nowait(Missing(hashes))

        try:
            embeddings = await self.fetcher.fetch(request, report, feed)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if overlap:
                self.engine.fail(request.request_id, str(e))
            if not isinstance(e, TimeoutError | EmbeddingMismatch | ConnectorError):
                logger.error("embedding fetch for %s failed", request.request_id, exc_info=e)
                e = RequestFailed(str(e), "worker")
            call.queue.put_nowait(e)
            return
        call.embedding_wait = time.monotonic() - call.started
        request.stages.add(
            "embedding_wait", wall_ns(call.started), items=len(embeddings), overlap=overlap
        )
        if not overlap:
            call.queue.put_nowait(_Fetched(embeddings))

    async def _complete(self, call: _Call, out: RequestOutput, handover: Handover) -> None:
        """The last output: a handover's blocks all stored first; its rope delta for the
        decode stage; the timings of the whole call."""
        request = call.request
        if handover.kv_handover:  # the decode stage reads what this one writes
            with request.stages.time("kv_send"):
                await wait_saves(self.kv, request.request_id)
        else:
            await wait_saves(self.kv, request.request_id)
        if handover.kv_handover and request.rope is not None:  # the decode stage's positions
            out.rope_delta = self.engine.runner.model_state.rope_delta(request.rope)
        if call.embedding_wait is not None:
            out.timings["embedding_wait_seconds"] = call.embedding_wait
        if "time_to_first_token_seconds" in out.timings:
            admitted = request.arrival - call.started  # before the engine had it
            out.timings["time_to_first_token_seconds"] += admitted
        out.timings["total_seconds"] = time.monotonic() - call.started


async def wait_saves(kv, request_id: str) -> None:
    """Until the request's KV writes are done. A failed write is logged, not raised: the
    blocks it held are recomputed by whoever looks for them."""
    for future in kv.pending_saves(request_id):
        try:
            await asyncio.wrap_future(future)
        except Exception as e:
            logger.warning("%s: KV save failed (%s): readers recompute", request_id, e)


__all__ = [
    "AlreadyRunning",
    "EmbeddingFetcher",
    "Handover",
    "LMFrontend",
    "Missing",
    "NotRealtime",
    "RequestFailed",
    "wait_saves",
]
