"""The LM engine: one thread running the step loop over a continuous batch (`step`).

    schedule -> prepare inputs -> load remote KV -> gather multimodal embeddings -> forward
             (saving KV as it goes) -> sample -> postprocess -> stream out

Requests arrive from the servicer's thread (asyncio), checked once by `validate`. Each gets its
`RequestInputs` (lm_worker/inputs.py) on arrival, holding its embeddings fetched so far; the
rest follow through `add_embeddings` (media) and `append_realtime` (a realtime session's rows),
and the scheduler computes each request only as far as its inputs are in. Everything that
touches engine state runs on the engine thread, fed through an inbox; outputs go back through
the `emit` callback, once per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from prometheus_client import REGISTRY, CollectorRegistry

from common.tracing import wall_ns
from lm_worker.kv_connector import KVConnector
from lm_worker.metrics import EngineMetrics
from lm_worker.model_runner import InputBatch, ModelRunner
from lm_worker.request import Request
from lm_worker.sampler import SampledToken, Sampler
from lm_worker.scheduler import ScheduledBatch, Scheduler
from models import EmbeddingMismatch, IncrementalDetokenizer, LoadedEmbedding, Tokenizer
from models.sampling import Draws

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (sent to its sink)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # With "error": "request" when the rest of its batch ran (the request's own failure, not
    # to be retried elsewhere), "worker" otherwise; "stuck" from the servicer's watchdog.
    error_kind: str = "worker"
    # Set on the last output.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    rope_delta: int | None = None  # a handover's: the decode stage positions with it


Sink = Callable[[RequestOutput], None]
Emit = Callable[[list[tuple[Sink, RequestOutput]]], None]


class BadRequest(ValueError):
    """A request this engine cannot run as sent (INVALID_ARGUMENT); the message says why."""


class _Live:
    """Engine-side streaming state of one request: where its outputs go, its detokenizer,
    text held back while it could still be the start of a stop string."""

    def __init__(self, request: Request, sink: Sink, detokenizer: IncrementalDetokenizer | None):
        self.request = request
        self.sink = sink
        self.detokenizer = detokenizer
        self.held = ""  # decoded text not yet released
        self.hold_chars = max((len(s) for s in request.sampling.stop), default=1) - 1
        self.last_token_time: float | None = None


class LMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,  # built with `ready_tokens` and the KV connector
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_model_len: int,
        emit: Emit | None = None,
        registry: CollectorRegistry | None = REGISTRY,
        linear_kernel: str = "",
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.kv: KVConnector = scheduler.kv  # one connector: the scheduler asks, the step moves
        self.sampler = Sampler()
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.linear_kernel = linear_kernel  # the loader's choice: cpu_kernels.KERNELS or cuda
        self.emit = emit or deliver
        self.metrics = EngineMetrics(registry)
        self.live: dict[str, _Live] = {}
        self.sessions: dict[str, Request] = {}  # realtime session id -> its request
        self.tokens_generated = 0
        self.realtime_waiting_steps = 0  # steps realtime requests sat out for their audio
        self._inbox: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stopping = False
        # When the step now running began (None between steps): the servicer's watchdog
        # reads it to tell a stuck step from a slow one.
        self.busy_since: float | None = None
        self._thread: threading.Thread | None = None
        self._rate = _Rate()
        self._steps = _Rate()  # requests per step (GetLoad's batch_size)

    # -- the thread-safe surface (called from the servicer's thread) -------------------------

    def validate(self, request: Request) -> None:
        """BadRequest if the request can never run here: too long for the context or the KV
        cache, or a token id outside the vocabulary."""
        ids = request.prompt_token_ids
        if not ids:
            raise BadRequest("prompt_token_ids is empty")
        if len(ids) >= self.max_model_len:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; this worker's context is {self.max_model_len}"
            )
        vocab_size = self.vocab_size
        if max(ids) >= vocab_size or min(ids) < 0:
            bad = max(ids) if max(ids) >= vocab_size else min(ids)
            raise BadRequest(f"token id {bad} is outside the vocabulary ({vocab_size})")
        # Placeholders past the prompt are positions decode steps fill: realtime models only.
        end = request.embeds_end
        if end > request.num_prompt_tokens and not self.runner.is_realtime:
            raise BadRequest(
                f"media placeholders run to position {end}, outside the {len(ids)}-token prompt "
                "(only realtime models take embeddings on decode steps)"
            )
        if end > self.max_model_len:
            raise BadRequest(
                f"the audio fills {end} positions; this worker's context is {self.max_model_len}"
            )
        blocks = self.scheduler.blocks
        need = blocks.blocks_needed(max(request.num_prompt_tokens + 1, end))
        if need > blocks.num_usable:
            raise BadRequest(
                f"the prompt needs {need} KV blocks; this worker has {blocks.num_usable}"
            )

    @property
    def is_realtime(self) -> bool:
        """Decode steps take per-position embeddings (a realtime session's rows)."""
        return self.runner.is_realtime

    @property
    def realtime_capacity(self) -> int:
        """The most positions a realtime session can run to here (context and KV cache): a
        session's audio past it ends its request with "length"."""
        blocks = self.scheduler.blocks
        return min(self.max_model_len, blocks.num_usable * blocks.block_size)

    def load_embedding(
        self, mm_hash: str, tensor: torch.Tensor, num_embeds: int
    ) -> LoadedEmbedding:
        """A fetched embedding made ready for this engine (device, dtype, the family's check);
        models.EmbeddingMismatch when it cannot fill its placeholders."""
        return self.runner.load_embedding(mm_hash, tensor, num_embeds)

    def add_request(
        self,
        request: Request,
        sink: Sink,
        embeddings: Mapping[str, LoadedEmbedding | torch.Tensor] | None = None,
        more_to_come: bool = False,
    ) -> None:
        """Queue a request with its embeddings (by mm_hash) fetched so far. Without
        `more_to_come` they must be all of them (the request fails otherwise); with it, the
        rest come through `add_embeddings` and the request is prefilled up to its first item
        still lacking meanwhile (until it comes, or `fail`). A realtime request's rows come
        through `append_realtime`."""
        self._submit(lambda: self._add(request, sink, embeddings or {}, more_to_come))

    def add_embeddings(
        self, request_id: str, embeddings: Mapping[str, LoadedEmbedding | torch.Tensor]
    ) -> None:
        """More embeddings of a request added with `more_to_come` (ignored once it ended)."""
        self._submit(lambda: self._add_embeddings(request_id, embeddings))

    def append_realtime(self, session_id: str, rows: torch.Tensor, closed: bool = False) -> None:
        """More per-position embeddings of a realtime session (ignored once its request
        ended); `closed`: the audio ended."""
        self._submit(lambda: self._append_realtime(session_id, rows, closed))

    def fail(self, request_id: str, error: str) -> None:
        """End a request with its own error (its embeddings did not come, say): its blocks
        are freed and its sink gets the error."""
        self._submit(lambda: self._end(request_id, "error", error))

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._end(request_id, "abort"))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        if self.runner.ranks is not None:  # the other ranks of a tensor-parallel worker
            self.runner.ranks.close()

    def load(self) -> dict[str, float]:
        """A snapshot for GetLoad (read without locks: counters only)."""
        s = self.scheduler
        return {
            "running_requests": len(s.running),
            "waiting_requests": len(s.waiting),
            "running_tokens": sum(r.num_tokens for r in list(s.running)),
            "waiting_tokens": sum(r.num_tokens for r in list(s.waiting)),
            "kv_blocks_used": s.blocks.num_used,
            "kv_blocks_total": s.blocks.num_usable,
            "tokens_per_second": self._rate.per_second(),
            "batch_size": self._steps.mean(),
            "max_model_len": self.max_model_len,
        }

    def realtime_rows(self) -> int:
        """Rows held for the realtime sessions running here (GetLoad; read without locks)."""
        return sum(r.inputs.rows.count for r in list(self.sessions.values()))

    def run_to_completion(self, between_steps: Callable[[], None] | None = None) -> None:
        """Run steps in the calling thread until no request is left that can make progress
        (offline use: benchmarks, tests), calling `between_steps` before each. Not while the
        engine thread runs."""
        assert self._thread is None, "the engine thread is running"
        while True:
            self._run_inbox()
            if between_steps is not None:
                between_steps()
            if not self.step() and not self._inbox:
                return

    def _submit(self, op: Callable[[], None]) -> None:
        with self._cv:
            self._inbox.append(op)
            self._cv.notify()

    def _run_inbox(self) -> None:
        with self._cv:
            ops, self._inbox = self._inbox, []
        for op in ops:
            op()

    def _run(self) -> None:
        """The engine thread: the inbox's operations, then a step, while there is work."""
        idle = True
        while True:
            with self._cv:
                while (
                    not self._inbox
                    and not self._stopping
                    and (idle or not self.scheduler.has_work())
                ):
                    self._cv.wait()
                if self._stopping:
                    return
            self.busy_since = time.monotonic()
            try:
                self._run_inbox()
                idle = not self.step()
            finally:
                self.busy_since = None

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> bool:
        """One step of the loop. False: nothing ran.

        A step that raises is run again in halves, down to single requests, so one request
        that breaks the forward or the sampler (a value that got past `validate`, a bad
        embedding) fails alone and the rest of the batch goes on. A failed step has changed no
        request's progress (that happens in `postprocess`), so re-running it is safe."""
        batch = self.schedule()
        if not batch.requests:
            return False
        failed: list[tuple[Request, Exception]] = []
        self.execute_isolating(batch, failed)
        # Some of the batch ran: the failures are the requests' own. None did: the worker's.
        kind = "request" if len(failed) < len(batch) else "worker"
        for request, e in failed:
            self._finish(request, "error", error=f"LM worker step failed: {e}", error_kind=kind)
        return True

    def schedule(self) -> ScheduledBatch:
        """The scheduler's batch, with what it did besides counted; a scheduler that raises
        fails every request it holds (nothing can be trusted about the batch)."""
        try:
            batch = self.scheduler.schedule()
        except Exception as e:
            logger.exception("engine schedule failed")
            for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(request, "error", error=f"LM worker scheduling failed: {e}")
            return ScheduledBatch()
        waits = sum(1 for r in batch.stalled if r.realtime_session is not None)
        if waits:  # their next step waits for the audio (a preempted one's, for its rows)
            self.realtime_waiting_steps += waits
            self.metrics.realtime_waits.inc(waits)
        self.metrics.preemptions.inc(len(batch.preempted))
        for request in batch.preempted:
            # Media KV from the tier has no embeddings here to compute it again: the request
            # ends, to continue on another worker (never on wrong positions).
            if request.media_in_kv:
                error = "preempted, and its media embeddings were never fetched (KV from the tier)"
                self._finish(request, "error", error=error, error_kind="moved")
        return batch

    def execute_isolating(
        self, batch: ScheduledBatch, failed: list[tuple[Request, Exception]]
    ) -> None:
        """Run the batch, in halves if it raises, down to single requests (collected in
        `failed`)."""
        try:
            self.execute(batch)
            return
        except Exception as e:
            if len(batch) == 1:
                request = batch.requests[0]
                logger.exception("engine step failed for request %s", request.request_id)
                failed.append((request, e))
                self.metrics.isolated_failures.inc()
                return
            logger.warning("engine step of %d requests failed (%s): isolating", len(batch), e)
        for part in batch.halves():
            # Requests finished meanwhile (by the other half's outputs) are left out.
            part = part.running()
            if part.requests:
                self.execute_isolating(part, failed)

    def execute(self, batch: ScheduledBatch) -> None:
        """Run one scheduled batch: inputs, remote KV in, embeddings, forward (KV out as each
        layer is written), sample, outputs."""
        began = time.monotonic()
        inputs = self.runner.prepare_inputs(batch)
        cache = self.runner.connector_cache
        self.kv.load_kv(cache)  # blocks a remote holds, into the cache before they are read
        mm_embeds, is_mm_embed = self.runner.gather_mm_embeddings(inputs)
        # Blocks this step completes that go out layer by layer, as the forward writes them.
        layerwise = self.kv.start_save(batch.requests, batch.num_scheduled_tokens, cache)
        save_layer = self.kv.save_kv_layer if layerwise else None
        try:
            logits = self.runner.forward(inputs, mm_embeds, is_mm_embed, save_layer)
        except BaseException:
            self.kv.abort_save()
            raise
        self.kv.wait_for_save()
        sampled = self.sampler(logits, inputs.sampling_requests)
        outputs = self.postprocess(batch, inputs, sampled, began)
        self.stream_out(outputs)

    def postprocess(
        self,
        batch: ScheduledBatch,
        inputs: InputBatch,
        sampled: list[SampledToken],
        began: float | None = None,
    ) -> list[tuple[Sink, RequestOutput]]:
        now = time.monotonic()
        self.metrics.batch_size.observe(len(batch))
        self._steps.add(len(batch))
        self.metrics.batch_tokens.observe(batch.total_tokens)
        for request, n in zip(batch.requests, batch.num_scheduled_tokens, strict=True):
            if began is not None and request.num_computed_tokens < request.num_prompt_tokens:
                request.stages.add(  # a prefill chunk (common/tracing.py)
                    "prefill_chunk",
                    wall_ns(began),
                    wall_ns(now),
                    tokens=n,
                    batch_requests=len(batch),
                    batch_tokens=batch.total_tokens,
                )
            request.num_computed_tokens += n
            if request.first_scheduled is None:  # the step's start: its prefill ran from there
                request.first_scheduled = now if began is None else began
            self.scheduler.blocks.commit_full_blocks(request)
        # The step's new blocks out, before a finish frees them.
        self.kv.save_kv(batch.requests, self.runner.connector_cache)

        outputs = []
        for request, token in zip(inputs.sampling_requests, sampled, strict=True):
            live = self.live[request.request_id]
            request.output_token_ids.append(token.token_id)
            if request.grammar is not None and not request.grammar.accept(token.token_id):
                error = f"token {token.token_id} broke the grammar: {request.grammar.error()}"
                self._finish(request, "error", error=error, error_kind="request")
                continue
            if request.first_token is None:
                request.first_token = now
                self.metrics.ttft.observe(now - request.arrival)
            elif live.last_token_time is not None:
                self.metrics.itl.observe(now - live.last_token_time)
            live.last_token_time = now
            out = RequestOutput(request.request_id, [token.token_id])
            if request.sampling.logprobs is not None:
                out.logprobs.append(token)
            reason = self._stop_reason(request, token.token_id)
            text, stopped = self._detokenize(live, token.token_id, final=reason is not None)
            out.text = text
            if stopped:
                reason = "stop"
            if reason is not None:
                self._finish(request, reason, out, emit=False)
            outputs.append((live.sink, out))
        self.tokens_generated += len(sampled)
        self._rate.add(len(sampled))
        self.metrics.tokens.inc(len(sampled))
        self.metrics.kv_blocks_used.set(self.scheduler.blocks.num_used)
        return outputs

    def stream_out(self, outputs: list[tuple[Sink, RequestOutput]]) -> None:
        if outputs:
            self.emit(outputs)

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        p = request.sampling
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in p.stop_token_ids:
            return "stop"
        if request.grammar is not None and request.grammar.done:
            return "stop"  # the grammar is complete: only the end could come
        if request.num_tokens >= self.max_model_len or (
            p.max_tokens is not None and len(request.output_token_ids) >= p.max_tokens
        ):
            return "length"
        end = request.embeds_end
        if request.realtime_session is None and request.num_prompt_tokens < end <= (
            request.num_tokens
        ):
            return "stop"  # every audio position is consumed
        if request.realtime_session is not None:
            if request.num_tokens >= end:
                return "length"  # the session's positions (its longest audio) are used up
            if request.inputs.ended():
                return "stop"  # the audio ended and every position of it is consumed
        return None

    def _detokenize(self, live: _Live, token_id: int, final: bool) -> tuple[str, bool]:
        """The text to release now, and whether a stop string ended the request."""
        if live.detokenizer is None:
            return "", False
        live.held += live.detokenizer.push([token_id])
        if final:
            live.held += live.detokenizer.flush()
        for stop in live.request.sampling.stop:
            at = live.held.find(stop)
            if at != -1:
                text, live.held = live.held[:at], ""
                return text, True
        if final:
            text, live.held = live.held, ""
            return text, False
        # Hold back what could be the beginning of a stop string.
        cut = len(live.held) - live.hold_chars
        text, live.held = live.held[:cut], live.held[cut:]
        return text, False

    # -- state changes (engine thread) --------------------------------------------------------

    def _add(
        self,
        request: Request,
        sink: Sink,
        embeddings: Mapping[str, LoadedEmbedding | torch.Tensor],
        more_to_come: bool = False,
    ) -> None:
        detokenizer = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        live = self.live[request.request_id] = _Live(request, sink, detokenizer)
        if request.resumed_output_tokens and detokenizer is not None:
            # Resumed: the text of the output so far that the client has not received (held
            # back while it could begin a stop string) is still held here.
            done = detokenizer.push(request.prompt_token_ids[-request.resumed_output_tokens :])
            live.held = done[request.resumed_text_chars :]
        if request.sampling.seed is not None or not request.sampling.greedy:
            request.draws = Draws(request.sampling.seed, start=request.resumed_output_tokens)
        request.inputs = self.runner.make_inputs(request)
        if request.realtime_session is not None:
            self.sessions[request.realtime_session] = request
        try:
            missing = request.inputs.put(embeddings)
        except EmbeddingMismatch as e:
            self._finish(request, "error", error=str(e))
            return
        if missing and not more_to_come:
            self.metrics.embedding_misses.inc(len(missing))
            self._finish(request, "error", error=f"embeddings not provided: {missing}")
            return
        self.scheduler.add(request)

    def _add_embeddings(
        self, request_id: str, embeddings: Mapping[str, LoadedEmbedding | torch.Tensor]
    ) -> None:
        live = self.live.get(request_id)
        if live is None:  # ended meanwhile (aborted, failed)
            return
        try:
            live.request.inputs.put(embeddings)
        except EmbeddingMismatch as e:
            self._finish(live.request, "error", error=str(e), error_kind="request")

    def _append_realtime(self, session_id: str, rows: torch.Tensor, closed: bool) -> None:
        request = self.sessions.get(session_id)
        if request is None:
            return  # its request has ended (or never came): nothing will read the rows
        request.inputs.append_rows(rows, closed)
        # A request whose audio ended before its next position has nothing more to read.
        if request.inputs.ended():
            self._finish(request, "stop")

    def _end(self, request_id: str, reason: str, error: str | None = None) -> None:
        live = self.live.get(request_id)
        if live is not None:
            self._finish(live.request, reason, error=error, error_kind="request")

    def _finish(
        self,
        request: Request,
        reason: str,
        out: RequestOutput | None = None,
        emit: bool = True,
        error: str | None = None,
        error_kind: str = "worker",
    ) -> None:
        """End a request: free its blocks and inputs, complete its last output."""
        self.scheduler.finish(request, reason)
        if request.inputs is not None:
            request.inputs.release()
        self.kv.request_finished(request.request_id)
        if request.realtime_session is not None:
            self.sessions.pop(request.realtime_session, None)
        live = self.live.pop(request.request_id, None)
        self.metrics.requests.labels(reason).inc()
        if live is None:
            return
        out = out or RequestOutput(request.request_id)
        out.finish_reason = reason
        out.error = error
        out.error_kind = error_kind
        out.num_prompt_tokens = request.num_prompt_tokens
        out.num_output_tokens = len(request.output_token_ids)
        out.num_cached_tokens = request.num_cached_tokens
        out.timings = _timings(request)
        _end_stages(request)
        if emit:
            self.emit([(live.sink, out)])


def _end_stages(request: Request) -> None:
    """The request's queue wait and decode as stages (common/tracing.py), beside its prefill
    chunks: what `_timings` measures, on the time line its spans share."""
    if request.first_scheduled is not None:
        request.stages.add("queue_wait", wall_ns(request.arrival), wall_ns(request.first_scheduled))
    if request.first_token is not None:
        request.stages.add(
            "decode", wall_ns(request.first_token), tokens=len(request.output_token_ids)
        )


def _timings(request: Request) -> dict[str, float]:
    now = time.monotonic()
    t = {"total_seconds": now - request.arrival}
    if request.first_scheduled is not None:
        t["queue_seconds"] = request.first_scheduled - request.arrival
    if request.first_token is not None:
        t["time_to_first_token_seconds"] = request.first_token - request.arrival
        if request.first_scheduled is not None:
            t["prefill_seconds"] = request.first_token - request.first_scheduled
        t["decode_seconds"] = now - request.first_token
    return t


def deliver(outputs: list[tuple[Sink, RequestOutput]]) -> None:
    """Hand each output to its request's sink (the engine's default `emit`)."""
    for sink, out in outputs:
        sink(out)


class _Rate:
    """Tokens per second over the last few seconds."""

    def __init__(self, window: float = 5.0):
        self.window = window
        self.events: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        now = time.monotonic()
        self.events.append((now, n))
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()

    def per_second(self) -> float:
        events = list(self.events)
        if not events:
            return 0.0
        span = max(time.monotonic() - events[0][0], 1e-3)
        return sum(n for _, n in events) / span

    def mean(self) -> float:
        """Mean count per event within the window (0 when there was none)."""
        horizon = time.monotonic() - self.window
        recent = [n for t, n in list(self.events) if t >= horizon]
        return sum(recent) / len(recent) if recent else 0.0


__all__ = ["BadRequest", "Emit", "LMEngine", "RequestOutput", "Sink"]
