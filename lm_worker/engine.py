"""The LM engine: one thread running the step loop over a continuous batch.

    schedule -> prepare inputs -> gather multimodal embeddings -> forward -> sample
             -> postprocess -> stream out

Requests arrive from the gRPC servicer (another thread, asyncio) with their embeddings already
fetched; everything that touches engine state runs on the engine thread, fed through an inbox.
Outputs go back through the `emit` callback, once per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from lm_worker.cpu_gemv import pack_linear_layers
from lm_worker.mm import RealtimeStream
from lm_worker.model_runner import InputBatch, ModelRunner
from lm_worker.request import Request, Status
from lm_worker.sampler import SampledToken, Sampler, new_generator
from lm_worker.scheduler import ScheduledBatch, Scheduler
from models import IncrementalDetokenizer, Tokenizer

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
    # Set on the last output.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


Sink = Callable[[RequestOutput], None]


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


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY):
        kw = {"registry": registry}
        self.ttft = Histogram(
            "epd_lm_time_to_first_token_seconds",
            "LM worker: arrival to first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            **kw,
        )
        self.itl = Histogram(
            "epd_lm_inter_token_latency_seconds",
            "LM worker: time between tokens",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
            **kw,
        )
        self.batch_size = Histogram(
            "epd_lm_batch_size",
            "Requests per step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            **kw,
        )
        self.batch_tokens = Histogram(
            "epd_lm_batch_tokens",
            "Tokens per step",
            buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192),
            **kw,
        )
        self.kv_blocks_used = Gauge("epd_lm_kv_blocks_used", "KV cache blocks in use", **kw)
        self.preemptions = Counter("epd_lm_preemptions_total", "Requests preempted", **kw)
        self.requests = Counter(
            "epd_lm_requests_total", "Finished requests by reason", ["finish_reason"], **kw
        )
        self.tokens = Counter("epd_lm_generated_tokens_total", "Tokens generated", **kw)
        self.embedding_misses = Counter(
            "epd_lm_embedding_misses_total",
            "Embeddings a request needed that the cache did not hold",
            **kw,
        )


class LMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        emit: Callable[[list[tuple[Sink, RequestOutput]]], None] | None = None,
        registry: CollectorRegistry | None = REGISTRY,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.scheduler.is_ready = self.is_ready
        self.sampler = Sampler()
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.emit = emit or deliver
        self.metrics = EngineMetrics(registry)
        self.live: dict[str, _Live] = {}
        self.tokens_generated = 0
        self._inbox: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rate = _Rate()
        self._steps = _Rate()  # requests per step (GetLoad's batch_size)

    # -- the thread-safe surface (called from the servicer's thread) -------------------------

    def add_request(
        self, request: Request, sink: Sink, embeddings: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Queue a request whose embeddings (by mm_hash) are already fetched."""
        self._submit(lambda: self._add(request, sink, embeddings or {}))

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    def append_realtime(self, session_id: str, rows: torch.Tensor, closed: bool = False) -> None:
        """More per-position embeddings of a realtime session (wakes requests waiting on it)."""
        self._submit(lambda: self._append_realtime(session_id, rows, closed))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

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
        }

    def run_to_completion(self) -> None:
        """Run steps in the calling thread until no request is left that can make progress
        (offline use: benchmarks, tests). Not while the engine thread runs."""
        assert self._thread is None, "the engine thread is running"
        while True:
            with self._cv:
                ops, self._inbox = self._inbox, []
            for op in ops:
                op()
            if not self.run_step() and not self._inbox:
                return

    def _submit(self, op: Callable[[], None]) -> None:
        with self._cv:
            self._inbox.append(op)
            self._cv.notify()

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
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
                ops, self._inbox = self._inbox, []
            for op in ops:
                op()
            idle = not self.run_step()

    def run_step(self) -> bool:
        """One step, failing its requests (not the engine) if it raises. False: nothing ran."""
        try:
            return self.step()
        except Exception as e:  # a bug or a device error: the batch fails, the engine lives on
            logger.exception("engine step failed")
            for request in list(self.scheduler.running):
                self._finish(request, "error", error=f"LM worker step failed: {e}")
            return False

    def step(self) -> bool:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return False
        inputs = self.runner.prepare_inputs(batch)
        mm_embeds, is_mm_embed = self.runner.gather_mm_embeddings(inputs)
        logits = self.runner.forward(inputs, mm_embeds, is_mm_embed)
        sampled = self.sampler(logits, inputs.sampling_requests)
        outputs = self.postprocess(batch, inputs, sampled)
        self.stream_out(outputs)
        return True

    # -- postprocess --------------------------------------------------------------------------

    def postprocess(
        self, batch: ScheduledBatch, inputs: InputBatch, sampled: list[SampledToken]
    ) -> list[tuple[Sink, RequestOutput]]:
        now = time.monotonic()
        self.metrics.batch_size.observe(len(batch))
        self._steps.add(len(batch))
        self.metrics.batch_tokens.observe(batch.total_tokens)
        self.metrics.preemptions.inc(len(batch.preempted))
        for request, n in zip(batch.requests, batch.num_scheduled_tokens, strict=True):
            request.num_computed_tokens += n
            if request.first_scheduled is None:
                request.first_scheduled = now
            self.scheduler.blocks.commit_full_blocks(request)

        outputs = []
        for request, token in zip(inputs.sampling_requests, sampled, strict=True):
            live = self.live[request.request_id]
            request.output_token_ids.append(token.token_id)
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
        if (
            len(request.output_token_ids) >= p.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return "length"
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

    def _add(self, request: Request, sink: Sink, embeddings: dict[str, torch.Tensor]) -> None:
        need = self.scheduler.blocks.blocks_needed(request.num_prompt_tokens + 1)
        if need > self.scheduler.blocks.num_usable:
            self._reject(
                request,
                sink,
                f"the prompt needs {need} KV blocks; this worker has "
                f"{self.scheduler.blocks.num_usable}",
            )
            return
        detokenizer = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        self.live[request.request_id] = _Live(request, sink, detokenizer)
        if request.sampling.seed is not None or not request.sampling.greedy:
            request.generator = new_generator(request.sampling.seed)
        self.runner.model_state.init_request(request)
        self.runner.mm.add_request(request.request_id, request.mm_features)
        for mm_hash, embeds in embeddings.items():
            self.runner.mm.put(mm_hash, embeds)
        if request.realtime_session is not None:
            self._stream(request.realtime_session)  # its rows arrive as the audio does
        missing = self.runner.mm.missing(request.request_id)
        missing = [h for h in missing if h != request.realtime_session]
        if missing:
            self.metrics.embedding_misses.inc(len(missing))
            self._finish(request, "error", error=f"embeddings not provided: {missing}")
            return
        self.scheduler.add(request)

    def _reject(self, request: Request, sink: Sink, error: str) -> None:
        out = RequestOutput(request.request_id, finish_reason="error", error=error)
        self.emit([(sink, out)])

    def _abort(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is not None:
            self._finish(live.request, "abort")

    def _stream(self, session_id: str) -> RealtimeStream:
        stream = self.runner.realtime.get(session_id)
        if stream is None:
            stream = self.runner.realtime[session_id] = RealtimeStream(
                self.runner.model_state.hidden_size, self.runner.dtype, self.runner.device
            )
        return stream

    def _append_realtime(self, session_id: str, rows: torch.Tensor, closed: bool) -> None:
        stream = self._stream(session_id)
        if rows.numel():
            stream.append(rows)
        stream.closed = stream.closed or closed
        # A request whose audio ended before its next position has nothing more to read.
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if (
                request.realtime_session == session_id
                and stream.closed
                and not self.is_ready(request)
            ):
                self._finish(request, "stop")

    def is_ready(self, request: Request) -> bool:
        """Realtime: the embeddings up to the request's next token have arrived."""
        if request.realtime_session is None:
            return True
        stream = self.runner.realtime.get(request.realtime_session)
        if stream is None:
            return False
        for f in request.mm_features:
            if f.mm_hash == request.realtime_session:
                needed = min(max(request.num_tokens - f.offset, 0), f.length)
                return stream.count >= needed
        return True

    def _finish(
        self,
        request: Request,
        reason: str,
        out: RequestOutput | None = None,
        emit: bool = True,
        error: str | None = None,
    ) -> None:
        """End a request: free its blocks and embeddings, complete its last output."""
        self.scheduler.finish(request, reason)
        self.runner.mm.remove_request(request.request_id)
        live = self.live.pop(request.request_id, None)
        self.metrics.requests.labels(reason).inc()
        if live is None:
            return
        out = out or RequestOutput(request.request_id)
        out.finish_reason = reason
        out.error = error
        out.num_prompt_tokens = request.num_prompt_tokens
        out.num_output_tokens = len(request.output_token_ids)
        out.num_cached_tokens = request.num_cached_tokens
        out.timings = _timings(request)
        if emit:
            self.emit([(live.sink, out)])


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


__all__ = ["LMEngine", "RequestOutput", "Status"]


# Under CUDA graphs the decode attention reads max_model_len keys per sequence (static shapes):
# without an explicit lm.max_model_len the context is capped here.
DEFAULT_MAX_MODEL_LEN = 8192
CPU_KV_CACHE_BYTES = 1 << 30


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("lm.device is cuda but torch finds no CUDA device: set lm.device: auto")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def build_engine(
    config,
    model_dir: str,
    dtype: torch.dtype,
    emit=None,
    registry: CollectorRegistry | None = REGISTRY,
    model_cls: type | None = None,
    pad_decodes: bool = False,
) -> LMEngine:
    """Load the checkpoint's LM (never its vision tower), size the KV cache, capture graphs.
    `model_cls` and `pad_decodes` are for tests (a synthetic realtime model; graph-shaped
    inputs run eagerly)."""
    from lm_worker.attention import PagedAttention
    from lm_worker.block_manager import BlockManager
    from lm_worker.model_state import ModelState, RopeSpec
    from models import Qwen2LanguageModel, load_arch_config

    lm = config.lm
    device = resolve_device(lm.device)
    use_graphs = lm.cuda_graphs == "on" or (lm.cuda_graphs == "auto" and device.type == "cuda")
    if use_graphs and device.type != "cuda":
        raise RuntimeError("lm.cuda_graphs is on but the LM runs on the CPU: set it to auto or off")
    arch = load_arch_config(model_dir)
    text = arch.text
    max_model_len = lm.max_model_len or min(text.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > text.max_position_embeddings:
        raise RuntimeError(
            f"lm.max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{text.max_position_embeddings}"
        )
    attention = PagedAttention(lm.block_size, text.head_dim)
    model_cls = model_cls or Qwen2LanguageModel
    model = model_cls.from_checkpoint(model_dir, attention, dtype, device)
    if device.type == "cpu":
        pack_linear_layers(model)
    per_block = PagedAttention.bytes_per_block(
        text.num_layers, lm.block_size, text.num_kv_heads, text.head_dim, dtype
    )
    budget = int(lm.kv_cache_bytes)
    if budget == 0:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.9)
        else:
            budget = CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise RuntimeError(f"lm.kv_cache_bytes {budget} holds no KV block ({per_block} bytes each)")
    logger.info(
        "LM on %s (%s): %d KV blocks of %d tokens (%.2f GiB), context %d, CUDA graphs %s",
        device,
        dtype,
        num_blocks,
        lm.block_size,
        num_blocks * per_block / 2**30,
        max_model_len,
        "on" if use_graphs else "off",
    )
    runner = ModelRunner(
        model,
        attention,
        ModelState,
        RopeSpec(arch.vision.spatial_merge_size, arch.vision.tokens_per_second),
        num_blocks=num_blocks,
        block_size=lm.block_size,
        max_num_seqs=lm.max_num_seqs,
        max_num_batched_tokens=lm.max_num_batched_tokens,
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        use_graphs=use_graphs,
        max_graph_batch_size=lm.max_graph_batch_size,
        pad_decodes=pad_decodes,
    )
    blocks = BlockManager(num_blocks, lm.block_size, lm.enable_prefix_caching)
    scheduler = Scheduler(blocks, lm.max_num_seqs, lm.max_num_batched_tokens)
    return LMEngine(
        runner,
        scheduler,
        Tokenizer.from_dir(model_dir),
        arch.tokens.eos_token_ids,
        max_model_len,
        emit=emit,
        registry=registry,
    )
