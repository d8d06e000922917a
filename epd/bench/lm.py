"""`epd bench lm`: LM decode speed next to Hugging Face `generate` on the same checkpoint.

Both sides run in this process on the same threads, interleaved round by round:
- batch 1: decode tokens/s, measured as (N - 1) / (time for N tokens - time for 1 token), so
  prefill cancels out the same way on both sides;
- concurrency: our engine with S concurrent streams against `generate` at batch B (default 32
  vs 8), aggregate tokens/s including prefill, as a serving system would see it; and a few
  streams (default 4) against `generate` at the same batch, the load of a lightly used server;
- the roofline at batch 1: every decode step reads all LM weights once, so the fastest possible
  step takes weight bytes / memory *read* bandwidth. A batch-1 request on each side runs with
  a streaming read (a sum) of as many bytes as a step's weights just before each decode step,
  and each step's rate is taken over that read's (`PairedSteps`: a shared host's read rate
  jumps within seconds); ours and HF's are the medians of those fractions. The read probes of
  `read_bandwidth` (a sum and GEMVs, torch's and ours, best of 5; on 2 MiB pages as our
  weights are, and a sum on ordinary pages) are printed beside them. A copy reads and writes,
  so its rate is no limit;
- decode at batch B (`--decode-batches`, default 1, 8, 32 and 64 on CUDA, 1 and 8 on a CPU):
  our engine alone runs B sequences at once, and only its steady steps are timed, one by one
  (`DecodeSteps`: each of the B sequences one token, after all their prefills). Each such
  step reads the LM weights once and the KV of every sequence's context, so its roofline is
  B x read bandwidth / (weight bytes + KV bytes), at the rate of `read_bandwidth`'s sum;
- after the rounds, prefill (`--prefill-tokens`, default 1k, 4k and 16k tokens on CUDA, 512
  on a CPU): tokens/s against HF's forward, and MFU against the device's measured dense matmul
  peak.
`--size` picks the built-in random checkpoint: small (default), or Qwen2.5-VL-3B's or -7B's
shapes in bf16 (written on first use, drawn on the bench's device: on a GPU in seconds).
`--tp N` runs a second engine of ours of N tensor-parallel ranks (lm_worker/tensor_parallel.py):
its batch 1 and streams as ratios to TP 1; on a CPU each rank gets --threads / N.
`--eager` (CUDA) runs a second engine of ours without CUDA graphs: graphs over eager at batch 1.
`--batch-invariant` runs a second engine of ours with `lm.batch_invariant` on, in the same
rounds, and gives its figures as ratios to our default engine's (what batch invariance costs).
The CPU model and the linear kernel the LM worker chose at start-up are printed with the figures;
both sides' weights and compute run in the checkpoint's dtype, or `--dtype` (the rooflines count
its bytes).
The last line is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from common.config import LMConfig
from epd.bench import add_checkpoint_arguments, bench_checkpoint
from lm_worker import huge_pages
from lm_worker.attention import PagedAttention
from lm_worker.cpu_kernels import gemv, unavailable, weight_bytes
from lm_worker.engine import BadRequest, LMEngine
from lm_worker.loader import build_engine
from lm_worker.request import Request
from lm_worker.scheduler import Scheduler
from models import SamplingParams, load_family
from models.checkpoint import DTYPES

PROMPT_LEN = 64


def _prompt(i: int) -> list[int]:
    return [100 + (7 * i + j) % 5000 for j in range(PROMPT_LEN)]


def _long_prompt(tokens: int, seed: int, vocab: int) -> list[int]:
    """A prefill's prompt: `tokens` ids inside the vocabulary, its first token set by `seed`
    (a fresh prompt: no prefix-cache hit)."""
    span = max(min(5000, vocab - 100), 1)
    return [100 + (7 * seed + 3 * j) % span for j in range(tokens)]


class Ours:
    """Our engine on `model_dir`, in `dtype` (None: the checkpoint's), running up to
    `max_num_seqs` sequences at once (CUDA graphs for each of those batches), with a KV cache of
    1 GiB or, where more is needed, room for all of them holding `new_tokens` past the bench's
    prompt, and for one prompt of `longest_prompt` tokens (the context raised to hold it)."""

    def __init__(
        self,
        model_dir: Path,
        max_num_seqs: int,
        device: str,
        dtype: torch.dtype | None,
        fused_decode: str = "auto",
        huge_pages: bool = True,
        batch_invariant: bool = False,
        new_tokens: int = 0,
        cuda_graphs: str = "auto",
        prefill_attention: str = "torch",
        longest_prompt: int = 0,
        tensor_parallel_size: int = 1,
    ):
        family = load_family(model_dir)
        self.dtype = dtype or family.dtype
        text = family.text
        # What one token's K and V take across the layers (the cache holds them in `dtype`).
        self.kv_bytes_per_token = PagedAttention.bytes_per_block(
            text.num_layers, 1, text.num_kv_heads, text.head_dim, self.dtype
        )
        block = LMConfig.block_size
        blocks = max_num_seqs * -(-(PROMPT_LEN + new_tokens) // block)
        blocks = max(blocks, -(-(longest_prompt + 1) // block)) + 1  # + the null block
        context = LMConfig().context_length(text.max_position_embeddings)
        lm = LMConfig(
            max_model_len=longest_prompt + 1 if longest_prompt >= context else None,
            device=device,
            cpu_fused_decode=fused_decode,
            cpu_huge_pages=huge_pages,
            batch_invariant=batch_invariant,
            cuda_graphs=cuda_graphs,
            prefill_attention=prefill_attention,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_bytes=max(1 << 30, blocks * block * self.kv_bytes_per_token),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2048, max_num_seqs),
            max_graph_batch_size=max_num_seqs,
        )
        self.engine: LMEngine = build_engine(lm, family, self.dtype, registry=None)
        self.count = 0
        self.failed: list[str] = []  # errors the engine sent any request's sink

    def _add(self, request: Request) -> None:
        """As the LM worker's server adds one: validated first (a prompt longer than the
        context is refused, not run)."""
        try:
            self.engine.validate(request)
        except BadRequest as e:
            raise SystemExit(f"epd bench lm: {e}") from None
        self.engine.add_request(request, self._sink)

    def _sink(self, out) -> None:
        if out.finish_reason in ("error", "abort"):
            self.failed.append(f"{out.request_id}: {out.finish_reason} {out.error or ''}")

    def _check(self) -> None:
        """No figure from requests that failed: the first failure ends the bench."""
        if self.failed:
            raise SystemExit(f"epd bench lm: a request failed, {self.failed[0]}")

    def run(
        self, streams: int, new_tokens: int, between_steps: Callable[[], None] | None = None
    ) -> float:
        for i in range(streams):
            self.count += 1
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            self._add(Request(f"b{self.count}", _prompt(i), params))
        started = time.perf_counter()
        self.engine.run_to_completion(between_steps)
        _sync()
        elapsed = time.perf_counter() - started
        self._check()
        return elapsed

    def weight_bytes(self) -> int:
        return weight_bytes(self.engine.runner.model)

    def prefill(self, tokens: int) -> float:
        """Seconds to prefill one prompt of `tokens` tokens (a fresh one: no prefix hit),
        chunked as the engine chunks it, to its first token."""
        self.count += 1
        prompt = _long_prompt(tokens, self.count, self.engine.vocab_size)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self._add(Request(f"p{self.count}", prompt, params))
        started = time.perf_counter()
        self.engine.run_to_completion()
        _sync()
        elapsed = time.perf_counter() - started
        self._check()
        return elapsed

    def on_huge_pages(self) -> float:
        """The share of the parameters' bytes on 2 MiB pages (lm_worker/huge_pages.py)."""
        params = list(self.engine.runner.model.parameters())
        return huge_pages.huge_bytes(*params) / sum(p.nbytes for p in params)

    @property
    def fused_decode(self) -> bool:
        """Decode steps of a few sequences run every layer in one C call (cpu_decode.py)."""
        return self.engine.runner.fused is not None


class HuggingFace:
    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype):
        try:
            import transformers
        except ImportError as e:
            raise SystemExit(
                "epd bench lm compares against Hugging Face generate: install the test extra "
                "(pip install -e '.[test]')"
            ) from e
        architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
        cls = getattr(transformers, architecture)
        self.model = cls.from_pretrained(model_dir, dtype=dtype).eval().to(device)
        self.device = device

    @torch.inference_mode()
    def run(
        self, batch: int, new_tokens: int, between_steps: Callable[[], None] | None = None
    ) -> float:
        ids = torch.tensor([_prompt(i) for i in range(batch)], device=self.device)
        extra = {}
        if between_steps is not None:
            extra["stopping_criteria"] = _calling(between_steps)
        started = time.perf_counter()
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **extra,
        )
        _sync()
        return time.perf_counter() - started

    @torch.inference_mode()
    def prefill(self, tokens: int) -> float:
        """Seconds of one forward over a `tokens`-token prompt (the last position's logits)."""
        vocab = self.model.config.get_text_config().vocab_size
        ids = torch.tensor([_long_prompt(tokens, 0, vocab)], device=self.device)
        _sync()
        started = time.perf_counter()
        self.model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
        _sync()
        return time.perf_counter() - started


def prefill_flops(model: torch.nn.Module, tokens: int) -> float:
    """FLOPs of a prefill of `tokens` tokens: 2 per weight of every linear layer a token
    passes (the LM head once, for the last token; MoE experts at their `read_fraction`), and
    causal attention's two products (2 x tokens^2 x head_dim per layer and head)."""
    linear = 0.0
    for module in model.modules():
        if module is getattr(model, "lm_head", None):
            continue
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            linear += module.in_features * module.out_features
        elif hasattr(module, "read_fraction"):
            fraction = module.read_fraction
            linear += sum(p.numel() for p in module.parameters(recurse=False)) * fraction
    c = model.config
    attention = 2.0 * tokens * tokens * c.num_layers * c.num_heads * c.head_dim
    return 2.0 * linear * tokens + attention


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """The device's dense FLOP/s in `dtype`: the best of a few large square products."""
    n = 4096 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / best_seconds(lambda: a @ b, 6)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` runs of `fn`, the device's queue drained before and after
    each."""
    best = float("inf")
    for _ in range(repeats):
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - started)
    return best


def _calling(fn: Callable[[], None]):
    """A `generate` stopping criterion that calls `fn` after each token and never stops."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Between(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs):
            fn()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Between()])


def _best(run, *args, repeats: int = 3) -> float:
    """The fastest of a few runs: other work on the machine only ever adds time."""
    return min(run(*args) for _ in range(repeats))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def read_bandwidth(device: str, nbytes: int = 256 * 2**20) -> dict[str, float]:
    """Bytes per second *reading* memory (what a decode step does with its weights), best of 5:
    a streaming reduction over `nbytes` (at least 256 MiB), and a GEMV (one row) over an fp32
    matrix of that size, torch's and, on a CPU where it runs, ours (`gemv_ours`,
    lm_worker/cpu_decode.c). The bench passes the weight bytes of a step: a buffer that fits the
    last-level cache (300 MiB on some hosts) would be read from it, faster than a step's weights
    stream. (A tensor copy reads and writes: it is no read rate.) On a CPU the matrix is on 2
    MiB pages where the kernel grants them (as the LM worker's weights are,
    lm_worker/huge_pages.py: fewer TLB misses, a faster read), and `sum_4k_pages` reads a buffer
    as torch allocates it, on ordinary pages."""
    data = _probe_buffer(device, nbytes)
    rows = data.numel() // 4096
    matrix = data.view(rows, 4096)
    row = torch.ones(1, 4096, device=device)
    probes = {"sum": data.sum, "gemv": lambda: F.linear(row, matrix)}
    if device == "cpu":
        probes["sum_4k_pages"] = torch.ones(rows * 4096).sum
        if not unavailable("gemv"):
            probes["gemv_ours"] = lambda: gemv(matrix, row)
    best = dict.fromkeys(probes, float("inf"))
    with torch.inference_mode():
        for _ in range(5):
            for name, fn in probes.items():
                started = time.perf_counter()
                fn()
                _sync()
                best[name] = min(best[name], time.perf_counter() - started)
    return {name: data.nbytes / seconds for name, seconds in best.items()}


def _probe_buffer(device: str, nbytes: int) -> torch.Tensor:
    """fp32 ones, at least `nbytes` and 256 MiB, whole rows of 4096; on 2 MiB pages on a CPU."""
    rows = -(-max(nbytes, 256 * 2**20) // (4 * 4096))
    if device == "cpu":
        return huge_pages.empty(rows * 4096 * 4).view(torch.float32).fill_(1.0)
    return torch.ones(rows * 4096, device=device)


class PairedSteps:
    """Decode steps, each timed right after one read of a buffer of the step's weight bytes:
    the step's rate over that read's, pair by pair. A shared host's read rate jumps (here
    30-35 GB/s, with stretches of 50-60 lasting from milliseconds to seconds), so a decode
    and a probe timed a second apart can land on different rates and their ratio says more
    about the host than about the decode (rounds at 102% and at 43% of the roofline in one
    run); a step and the read just before it share the moment. The read also empties the
    caches, as the previous step's own weights would. `between()` runs between steps: before
    each of our engine's (`run_to_completion(between_steps=...)`: the first step timed is the
    prefill, `skip=1`) or after each token of generate's (a stopping criterion)."""

    def __init__(self, data: torch.Tensor, weight_bytes: int, skip: int):
        self.data = data  # `_probe_buffer`
        self.weight_bytes = weight_bytes
        self.skip = skip  # steps of each run not paired
        self.fractions: list[float] = []  # each step's rate over its read's
        self.reads: list[float] = []  # the reads' rates, bytes/s
        self._read_s = 0.0
        self._read_end: float | None = None
        self._steps = 0

    def start(self) -> Callable[[], None]:
        """`between` for a new run."""
        self._read_end, self._steps = None, 0
        return self.between

    def between(self) -> None:
        now = time.perf_counter()
        if self._read_end is not None:
            self._steps += 1
            if self._steps > self.skip:
                step_rate = self.weight_bytes / (now - self._read_end)
                self.reads.append(self.data.nbytes / self._read_s)
                self.fractions.append(step_rate / self.reads[-1])
        started = time.perf_counter()
        self.data.sum()
        _sync()
        self._read_end = time.perf_counter()
        self._read_s = self._read_end - started


class DecodeSteps:
    """Our engine's steady decode steps at a batch of `batch` sequences, timed one by one as
    `between` runs between them (`run_to_completion(between_steps=...)`): only the steps that
    run every sequence one token each, after all their prefills and before any has ended,
    each with the tokens its attention reads (the sequences' lengths, the new token's too)."""

    def __init__(self, scheduler: Scheduler, batch: int):
        self.scheduler = scheduler
        self.batch = batch
        self.seconds: list[float] = []  # each timed step's
        self.contexts: list[int] = []  # each timed step's tokens read from the KV cache
        self._started: float | None = None  # the step now running is timed from here
        self._context = 0

    def start(self) -> Callable[[], None]:
        """`between` for a new run."""
        self._started = None
        return self.between

    def between(self) -> None:
        _sync()
        if self._started is not None:
            self.seconds.append(time.perf_counter() - self._started)
            self.contexts.append(self._context)
        running = self.scheduler.running
        steady = (
            not self.scheduler.waiting
            and len(running) == self.batch
            and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        )
        self._context = sum(r.num_tokens for r in running)
        self._started = time.perf_counter() if steady else None

    def tokens_per_second(self, since: int = 0) -> float:
        """B x the timed steps from `since` on / their time."""
        return self.batch * len(self.seconds[since:]) / sum(self.seconds[since:])

    def summary(self, weight_bytes: int, kv_bytes_per_token: int, bandwidth: float) -> dict:
        """Tokens/s and the mean step against the roofline: a step reads `weight_bytes` and
        its KV, at `bandwidth` bytes/s."""
        if not self.seconds:
            raise SystemExit(
                f"--decode-batches {self.batch}: no step ran all {self.batch} sequences one "
                "token each (every prefill done): raise --tokens"
            )
        kv = kv_bytes_per_token * sum(self.contexts) // len(self.contexts)
        tps = self.tokens_per_second()
        roofline = self.batch * bandwidth / (weight_bytes + kv)
        return {
            "batch": self.batch,
            "tps": round(tps, 2),
            "step_ms": round(sum(self.seconds) / len(self.seconds) * 1e3, 3),
            "steps": len(self.seconds),
            "kv_bytes": kv,  # read by a step, the mean over the timed steps
            "step_bytes": weight_bytes + kv,
            "roofline_tps": round(roofline, 2),
            "vs_roofline": float(f"{tps / roofline:.3g}"),
        }


@contextlib.contextmanager
def _threads(n: int):
    """torch's threads set to `n` for a while (the TP engine's rank 0 shares the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if args.eager and device != "cuda":
        raise SystemExit("--eager compares CUDA graphs with eager steps: it needs CUDA")
    model_dir = bench_checkpoint(args, device)[0]
    if args.prefill_tokens is None:
        args.prefill_tokens = [1024, 4096, 16384] if device == "cuda" else [512]
    if args.decode_batches is None:
        args.decode_batches = [1, 8, 32, 64] if device == "cuda" else [1, 8]
    n = args.tokens
    ours = Ours(
        model_dir,
        max(args.streams, args.few_streams, 1, *args.decode_batches),
        device,
        DTYPES.get(args.dtype),
        args.fused_decode,
        args.huge_pages == "on",
        new_tokens=n,
        longest_prompt=max(args.prefill_tokens, default=0),
        prefill_attention=args.prefill_attention,
    )
    dtype = ours.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    hf = HuggingFace(model_dir, device, dtype)
    invariant = None
    if args.batch_invariant:
        invariant = Ours(
            model_dir,
            max(args.streams, args.few_streams, 1),
            device,
            dtype,
            huge_pages=args.huge_pages == "on",
            batch_invariant=True,
            new_tokens=n,
        )
        invariant.run(1, 4)
    tp = None
    if args.tp > 1:
        tp = Ours(
            model_dir,
            max(args.streams, 1),
            device,
            dtype,
            huge_pages=args.huge_pages == "on",
            new_tokens=n,
            tensor_parallel_size=args.tp,
        )
        torch.set_num_threads(args.threads)  # (TP=1's; the ranks' share while TP runs)
        with _threads(args.threads // args.tp if device == "cpu" else args.threads):
            tp.run(1, 4)
    eager = None
    if args.eager:
        eager = Ours(model_dir, 1, device, dtype, cuda_graphs="off", new_tokens=n)
        eager.run(1, 4)
    ours.run(1, 4)  # warm-up both
    hf.run(1, 4)
    for batch in args.decode_batches:
        ours.run(batch, 4)

    weights = ours.weight_bytes()
    probe = _probe_buffer(device, weights)
    ours_pairs, hf_pairs = PairedSteps(probe, weights, skip=1), PairedSteps(probe, weights, skip=0)
    decodes = [DecodeSteps(ours.engine.scheduler, batch) for batch in args.decode_batches]
    ours_b1, hf_b1, ours_many, hf_batch, reads_r = [], [], [], [], []
    ours_few, hf_few = [], []
    inv_b1, inv_many, inv_few = [], [], []  # --batch-invariant
    eager_b1 = []  # --eager
    tp_b1, tp_many = [], []  # --tp
    med = statistics.median
    for r in range(args.rounds):
        ours_b1.append((n - 1) / (_best(ours.run, 1, n) - _best(ours.run, 1, 1)))
        hf_b1.append((n - 1) / (_best(hf.run, 1, n) - _best(hf.run, 1, 1)))
        # Each decode step over the read rate of the moment just before it (`PairedSteps`).
        seen = len(ours_pairs.fractions), len(hf_pairs.fractions)
        ours.run(1, n, ours_pairs.start())
        hf.run(1, n, hf_pairs.start())
        reads_r.append(read_bandwidth(device, weights))
        ours_many.append(args.streams * n / ours.run(args.streams, n))
        hf_batch.append(args.hf_batch * n / hf.run(args.hf_batch, n))
        if args.few_streams:
            ours_few.append(args.few_streams * n / ours.run(args.few_streams, n))
            hf_few.append(args.few_streams * n / hf.run(args.few_streams, n))
        if tp is not None:
            with _threads(args.threads // args.tp if device == "cpu" else args.threads):
                tp_b1.append((n - 1) / (_best(tp.run, 1, n) - _best(tp.run, 1, 1)))
                tp_many.append(args.streams * n / tp.run(args.streams, n))
            print(
                f"round {r + 1}: TP {args.tp} batch 1 {tp_b1[-1]:.1f} tok/s, x{args.streams} "
                f"streams {tp_many[-1]:.1f}",
                flush=True,
            )
        if eager is not None:
            eager_b1.append((n - 1) / (_best(eager.run, 1, n) - _best(eager.run, 1, 1)))
            print(f"round {r + 1}: eager (no CUDA graphs) batch 1 {eager_b1[-1]:.1f} tok/s")
        if invariant is not None:
            inv_b1.append((n - 1) / (_best(invariant.run, 1, n) - _best(invariant.run, 1, 1)))
            inv_many.append(args.streams * n / invariant.run(args.streams, n))
            if args.few_streams:
                inv_few.append(args.few_streams * n / invariant.run(args.few_streams, n))
            print(
                f"round {r + 1}: batch-invariant batch 1 {inv_b1[-1]:.1f} tok/s, "
                f"x{args.streams} streams {inv_many[-1]:.1f}"
                + (f", x{args.few_streams} {inv_few[-1]:.1f}" if args.few_streams else ""),
                flush=True,
            )
        reads_now = ours_pairs.reads[seen[0] :] + hf_pairs.reads[seen[1] :]
        print(
            f"round {r + 1}: batch 1 ours {ours_b1[-1]:.1f} tok/s, HF {hf_b1[-1]:.1f}; step by "
            f"step ours {med(ours_pairs.fractions[seen[0] :]):.0%} and HF "
            f"{med(hf_pairs.fractions[seen[1] :]):.0%} of the roofline (read at "
            f"{min(reads_now) / 1e9:.0f}-{max(reads_now) / 1e9:.0f} GB/s); "
            f"ours x{args.streams} streams {ours_many[-1]:.1f} tok/s, HF batch {args.hf_batch} "
            f"{hf_batch[-1]:.1f}"
            + (
                f"; x{args.few_streams}: ours {ours_few[-1]:.1f}, HF {hf_few[-1]:.1f}"
                if args.few_streams
                else ""
            ),
            flush=True,
        )
        if decodes:
            timed = [len(d.seconds) for d in decodes]
            for d in decodes:
                ours.run(d.batch, n, d.start())
            print(
                f"round {r + 1}: steady decode, ours "
                + ", ".join(
                    f"batch {d.batch} {d.tokens_per_second(since):.1f} tok/s"
                    for d, since in zip(decodes, timed, strict=True)
                ),
                flush=True,
            )
    prefill_rows = []
    if args.prefill_tokens:
        peak = matmul_peak(device, dtype)
        model = ours.engine.runner.model
        for tokens in args.prefill_tokens:
            ours.prefill(min(tokens, 64))  # warm-up of the chunk shapes
            ours_s = min(ours.prefill(tokens) for _ in range(args.rounds))
            hf_s = min(hf.prefill(tokens) for _ in range(args.rounds))
            flops = prefill_flops(model, tokens)
            prefill_rows.append(
                {
                    "tokens": tokens,
                    "ours_tps": round(tokens / ours_s, 1),
                    "hf_tps": round(tokens / hf_s, 1),
                    "ours_vs_hf": round(hf_s / ours_s, 3),
                    "mfu": float(f"{flops / ours_s / peak:.3g}"),
                    "hf_mfu": float(f"{flops / hf_s / peak:.3g}"),
                }
            )
            row = prefill_rows[-1]
            print(
                f"prefill {tokens} tokens: ours {row['ours_tps']} tok/s ({row['mfu']:.0%} of "
                f"the {peak / 1e12:.2f} TFLOP/s a {dtype} matmul reaches here), HF "
                f"{row['hf_tps']} ({row['hf_mfu']:.0%}): {row['ours_vs_hf']}x",
                flush=True,
            )
    reads = {k: med(r[k] for r in reads_r) for k in reads_r[0]}
    bandwidth = med(ours_pairs.reads + hf_pairs.reads)
    roofline = bandwidth / weights
    decode_rows = [d.summary(weights, ours.kv_bytes_per_token, reads["sum"]) for d in decodes]
    for row in decode_rows:
        print(
            f"decode batch {row['batch']}: ours {row['tps']:.1f} tok/s ({row['step_ms']} ms a "
            f"step), {row['vs_roofline']:.0%} of the roofline {row['roofline_tps']:.1f} tok/s = "
            f"{weights / 1e6:.0f} MB of weights and {row['kv_bytes'] / 1e6:.2f} MB of KV a "
            f"step read at {reads['sum'] / 1e9:.1f} GB/s (the sum probe)",
            flush=True,
        )
    summary = {
        "bench": "lm",
        "model": str(model_dir.name),
        "device": device,
        "cpu": cpu_model() if device == "cpu" else torch.cuda.get_device_name(),
        "threads": args.threads,
        "dtype": dtype_name,
        "linear_kernel": ours.engine.linear_kernel,
        "prefill_attention": args.prefill_attention,
        "fused_decode": ours.fused_decode,
        "weights_on_huge_pages": round(ours.on_huge_pages(), 3),
        "new_tokens": n,
        "batch1_ours_tps": round(med(ours_b1), 2),
        "batch1_hf_tps": round(med(hf_b1), 2),
        "batch1_vs_hf": round(med(ours_b1) / med(hf_b1), 3),
        "weight_bytes": weights,
        "read_bandwidth_gbps": {k: round(v / 1e9, 2) for k, v in reads.items()},
        "roofline_tps": round(roofline, 2),
        # Three significant digits: a tiny model runs at a minute fraction of its roofline.
        "batch1_vs_roofline": float(f"{med(ours_pairs.fractions):.3g}"),
        "hf_batch1_vs_roofline": float(f"{med(hf_pairs.fractions):.3g}"),
        "paired_steps": len(ours_pairs.fractions),
        "streams": args.streams,
        "streams_ours_tps": round(med(ours_many), 2),
        "hf_batch": args.hf_batch,
        "hf_batch_tps": round(med(hf_batch), 2),
        "streams_vs_hf_batch": round(med(ours_many) / med(hf_batch), 3),
    }
    if decode_rows:
        summary["decode"] = decode_rows
        summary["decode_read_probe"] = "sum"  # read_bandwidth's: the decode rooflines' rate
        summary["kv_bytes_per_token"] = ours.kv_bytes_per_token
    if prefill_rows:
        summary["prefill"] = prefill_rows
        summary["matmul_peak_tflops"] = round(peak / 1e12, 3)
    if args.few_streams:
        summary |= {
            "few_streams": args.few_streams,
            "few_streams_ours_tps": round(med(ours_few), 2),
            "few_streams_hf_tps": round(med(hf_few), 2),
            "few_streams_vs_hf": round(med(ours_few) / med(hf_few), 3),
        }
    if tp is not None:
        summary["tensor_parallel"] = {
            "size": args.tp,
            "batch1_tps": round(med(tp_b1), 2),
            "batch1_vs_tp1": round(med(tp_b1) / med(ours_b1), 3),
            "streams_tps": round(med(tp_many), 2),
            "streams_vs_tp1": round(med(tp_many) / med(ours_many), 3),
        }
        t = summary["tensor_parallel"]
        print(
            f"TP {args.tp} against TP 1: batch 1 {t['batch1_vs_tp1']}x, {args.streams} streams "
            f"{t['streams_vs_tp1']}x",
            flush=True,
        )
        tp.engine.stop()
    if eager is not None:
        summary["eager_batch1_tps"] = round(med(eager_b1), 2)
        summary["graphs_vs_eager"] = round(med(ours_b1) / med(eager_b1), 3)
        print(f"batch 1: CUDA graphs {summary['graphs_vs_eager']}x eager steps", flush=True)
    if invariant is not None:
        inv = {
            "batch1_tps": round(med(inv_b1), 2),
            "batch1_vs_ours": round(med(inv_b1) / med(ours_b1), 3),
            "streams_tps": round(med(inv_many), 2),
            "streams_vs_ours": round(med(inv_many) / med(ours_many), 3),
        }
        if args.few_streams:
            inv |= {
                "few_streams_tps": round(med(inv_few), 2),
                "few_streams_vs_ours": round(med(inv_few) / med(ours_few), 3),
            }
        summary["batch_invariant"] = inv
        print(
            f"batch-invariant: batch 1 {inv['batch1_vs_ours']}x ours, {args.streams} streams "
            f"{inv['streams_vs_ours']}x ours"
            + (
                f", {args.few_streams} streams {inv['few_streams_vs_ours']}x"
                if args.few_streams
                else ""
            )
        )
    print(
        f"batch 1 ({summary['linear_kernel']} kernel"
        f"{', fused layers' if summary['fused_decode'] else ''}): "
        f"{summary['batch1_vs_hf']}x HF generate; "
        f"ours {summary['batch1_vs_roofline']:.0%} and HF {summary['hf_batch1_vs_roofline']:.0%} "
        f"of the roofline step by step (median {summary['roofline_tps']} tok/s = "
        f"{weights / 1e6:.0f} MB of weights read at {bandwidth / 1e9:.1f} GB/s); "
        f"{args.streams} streams: "
        f"{summary['streams_vs_hf_batch']}x HF at batch {args.hf_batch}"
        + (
            f"; {args.few_streams} streams: {summary['few_streams_vs_hf']}x HF at that batch"
            if args.few_streams
            else ""
        )
    )
    if args.profile:
        print(profile_batch1(ours, args.profile))
    print(json.dumps(summary))
    return 0


def profile_batch1(ours: Ours, tokens: int) -> str:
    """torch.profiler's per-op table (self CPU time, totals over the run) of one batch-1
    request of `tokens` new tokens: one prefill of the prompt, then `tokens - 1` decode steps.
    Where a step's time goes once the kernels are chosen."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = ours.run(1, tokens)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    note = ""
    if ours.fused_decode:
        note = (
            "\nthe decode steps' layers run in one C call (fused decode, no torch ops): their "
            "time is in the wall time above, not in the table"
        )
    elif ours.engine.linear_kernel.startswith("gemv"):
        note = (
            "\nthe one-row products run our gemv kernel (a C call, no torch op): their time is "
            "in the wall time above, not in the table"
        )
    return (
        f"profile: 1 request, {tokens} tokens (1 prefill + {tokens - 1} decode steps) in "
        f"{seconds * 1e3:.1f} ms under the profiler\n{table}{note}"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lm", help="LM decode vs Hugging Face generate on the same checkpoint")
    add_checkpoint_arguments(p)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--streams", type=int, default=32, help="our concurrent streams (default 32)")
    p.add_argument(
        "--fused-decode",
        default="auto",
        choices=["auto", "on", "off"],
        help="lm.cpu_fused_decode for our engine (default auto; off: the torch modules)",
    )
    p.add_argument(
        "--huge-pages",
        default="on",
        choices=["on", "off"],
        help="lm.cpu_huge_pages for our engine: weights and KV cache on 2 MiB pages (default on)",
    )
    p.add_argument(
        "--prefill-attention",
        default="torch",
        choices=["torch", "triton"],
        help="lm.prefill_attention for our engine (GPU: triton, the paged prefill kernel)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="also run an engine of ours with this many tensor-parallel ranks "
        "(lm.tensor_parallel_size; on a CPU each rank a share of --threads); ratios to TP 1",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="CUDA: also run an engine of ours without CUDA graphs; graphs over eager at batch 1",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run an engine with lm.batch_invariant on; its figures as ratios to ours",
    )
    p.add_argument(
        "--few-streams",
        type=int,
        default=4,
        help="a few concurrent streams, against generate at that batch (default 4; 0: not run)",
    )
    p.add_argument("--hf-batch", type=int, default=8, help="HF generate batch (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians reported")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="weights and compute, both sides (default: the checkpoint's, float32 for the small "
        "model, bfloat16 for 3b and 7b; bfloat16 reads half the bytes)",
    )
    p.add_argument(
        "--decode-batches",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="batches our engine decodes at, each timed over its steady decode steps against "
        "the roofline of weights and KV read per step (default 1,8,32,64 on CUDA, 1,8 on a "
        "CPU; '' for none)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="prompt lengths whose prefill is timed against HF's forward, with MFU against "
        "the device's measured matmul peak (default 1024,4096,16384 on CUDA, 512 on a CPU; "
        "'' for none)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also print torch.profiler's per-op table of one batch-1 request of TOKENS tokens",
    )
    p.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]
