"""Building an LM engine: the family's LM (never its encoders) on the chosen device, the KV cache
sized to its budget, the CPU's linear kernels chosen, CUDA graphs captured, one warm-up step."""

from __future__ import annotations

import dataclasses
import logging

import torch
from prometheus_client import REGISTRY, CollectorRegistry

from common.config import LMConfig, cache_dir
from common.device import resolve_device
from connector.kv import KVStore
from connector.kv_stream import KVInbox, KVSender
from lm_worker import huge_pages
from lm_worker.attention import PagedAttention
from lm_worker.block_manager import BlockManager
from lm_worker.cpu_decode import (
    FusedDecode,
    InvariantForward,
    choose_fused_decode,
    why_not_fused,
)
from lm_worker.cpu_kernels import choose_linear_kernel, linear_layers, use_kernel, why_not
from lm_worker.engine import Emit, LMEngine
from lm_worker.inputs import ready_tokens
from lm_worker.kv_connector import KVConnector, NoKVConnector, SharedKVConnector
from lm_worker.memory_plan import (
    MemoryPlan,
    PeakMeter,
    Usage,
    device_memory,
    module_bytes,
    plan_kv_cache,
)
from lm_worker.model_runner import ModelRunner
from lm_worker.scheduler import Scheduler
from lm_worker.tensor_parallel import WholeHeadsCache, start_ranks
from models import ModelFamily
from models.family import TextDims
from models.parallel import TensorParallel, local_kv_heads, tensor_parallel

logger = logging.getLogger(__name__)


def build_engine(
    lm: LMConfig,
    family: ModelFamily,
    dtype: torch.dtype,
    emit: Emit | None = None,
    registry: CollectorRegistry | None = REGISTRY,
    pad_decodes: bool = False,
    kv_store: KVStore | None = None,
    kv_direct: tuple[KVSender, KVInbox] | None = None,
) -> LMEngine:
    """Load the family's LM, plan its memory (the KV cache's size), capture graphs; with
    lm.tensor_parallel_size > 1, start the other ranks first (lm_worker/tensor_parallel.py).
    `pad_decodes` is for tests (graph-shaped inputs run eagerly on the CPU)."""
    ranks = None
    if lm.tensor_parallel_size > 1:
        ranks = start_ranks(lm, family, dtype)
    try:
        runner, plan, kernel = build_runner(
            lm, family, dtype, pad_decodes, ranks.tp if ranks else None
        )
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    runner.ranks = ranks
    text = family.text
    kv: KVConnector = NoKVConnector()
    if kv_store is not None:
        block_shape = (text.num_layers, 2, lm.block_size, text.num_kv_heads, text.head_dim)
        sender, inbox = kv_direct or (None, None)
        kv = SharedKVConnector(
            kv_store,
            lm.block_size,
            block_shape,
            dtype,
            registry,
            sender=sender,
            inbox=inbox,
            # Under tensor parallelism a block's heads are on every rank: it goes out whole,
            # after the step (lm_worker/tensor_parallel.py's WholeHeadsCache).
            layerwise=lm.kv_send_layerwise and ranks is None,
        )
        if ranks is not None:
            runner.whole_heads = WholeHeadsCache(
                runner.attention.kv_cache, ranks, text.num_kv_heads
            )
    blocks = BlockManager(plan.num_blocks, lm.block_size, lm.enable_prefix_caching)
    scheduler = Scheduler(
        blocks, lm.max_num_seqs, lm.max_num_batched_tokens, ready_tokens=ready_tokens, kv=kv
    )
    return LMEngine(
        runner,
        scheduler,
        family.tokenizer(),
        family.eos_token_ids,
        text.vocab_size,
        plan.max_model_len,
        emit=emit,
        registry=registry,
        linear_kernel=kernel,
    )


def build_runner(
    lm: LMConfig,
    family: ModelFamily,
    dtype: torch.dtype,
    pad_decodes: bool = False,
    tp: TensorParallel | None = None,
) -> tuple[ModelRunner, MemoryPlan, str]:
    """The model (this rank's shard under `tp`), its KV cache as planned, graphs captured, one
    warm-up step: what every rank of a worker runs, in the same order (their collectives
    meet). Returns the runner, the plan and the linear kernel's name."""
    device = resolve_device(lm.device, "lm.device")
    use_graphs = lm.cuda_graphs == "on" or (lm.cuda_graphs == "auto" and device.type == "cuda")
    if use_graphs and device.type != "cuda":
        raise RuntimeError("lm.cuda_graphs is on but the LM runs on the CPU: set it to auto or off")
    text = family.text
    max_model_len = lm.context_length(text.max_position_embeddings)
    if max_model_len > text.max_position_embeddings:
        raise RuntimeError(
            f"lm.max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{text.max_position_embeddings}"
        )
    if tp is not None and lm.batch_invariant:
        raise RuntimeError("lm.batch_invariant with lm.tensor_parallel_size > 1 is not supported")
    attention = PagedAttention(
        lm.block_size, text.head_dim, triton_prefill=lm.prefill_attention == "triton"
    )
    with tensor_parallel(tp):
        model = family.load_language_model(attention, dtype, device)
    kernel = "cuda"
    if lm.batch_invariant and device.type == "cuda":
        _use_triton_invariant_kernels(model, attention)
        kernel = "batch-invariant Triton kernels"
    elif lm.batch_invariant:
        kernel = "batch-invariant C layers"  # (the runner's InvariantForward, below)
    elif device.type == "cpu" and tp is not None and lm.cpu_linear == "auto":
        # The timed choice could differ between ranks' layers; torch's kernel on each.
        kernel = "linear"
    elif device.type == "cpu":
        kernel = _choose_cpu_kernel(lm, model)
    huge = device.type == "cpu" and lm.cpu_huge_pages
    if huge:  # after the kernel choice: the dense weights it dropped are not copied
        _weights_on_huge_pages(model)
    # The null block alone until the plan sizes the cache: the profiling steps read and write
    # only it.
    kv_heads = local_kv_heads(text.num_kv_heads, tp.size) if tp else text.num_kv_heads
    kv_shape = (kv_heads, text.head_dim, dtype, device, huge)
    attention.allocate(text.num_layers, 1, *kv_shape)
    runner = ModelRunner(
        model,
        attention,
        family.model_state,
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
    plan = _plan_memory(lm, runner, kv_heads, text, max_model_len, tp)
    attention.allocate(text.num_layers, plan.num_blocks, *kv_shape)
    free_before_graphs = device_memory(device).free if use_graphs else 0
    runner.capture_graphs()
    logger.info(
        "LM on %s (%s, %s linear), CUDA graphs %s%s; memory plan: %s",
        device,
        dtype,
        kernel,
        "on" if use_graphs else "off",
        f", tensor-parallel rank {tp.rank} of {tp.size}" if tp else "",
        plan.summary(),
    )
    if use_graphs:
        left = device_memory(device).free
        logger.info(
            "after graph capture: %.2f GiB free on %s (the graphs took %.2f GiB, planned %.2f)",
            left / 2**30,
            device,
            (free_before_graphs - left) / 2**30,
            plan.usage.graphs / 2**30,
        )
    runner.dummy_run(1)  # warm-up: kernels and allocator settle before the first request
    if lm.batch_invariant and device.type == "cpu":
        why = why_not_fused(model, attention)
        extra = getattr(model, "prefill_beyond_decoder", None)
        if extra and not why:
            why = f"the model adds {extra} at prefill, which its C layers do not"
        if why:
            raise RuntimeError(f"lm.batch_invariant cannot run here: {why}")
        runner.invariant = InvariantForward(model, attention)
    elif device.type == "cpu":
        _choose_fused_decode(lm, runner, timed=tp is None)
    return runner, plan, kernel


def _use_triton_invariant_kernels(model: torch.nn.Module, attention: PagedAttention) -> None:
    """lm.batch_invariant on a GPU: the products, norms and attention in Triton kernels whose
    sums do not depend on the batch (lm_worker/triton_invariant.py)."""
    try:
        from lm_worker.triton_invariant import use_invariant_kernels
    except ImportError as e:
        raise RuntimeError(f"lm.batch_invariant on a GPU needs Triton: {e}") from e
    switched = use_invariant_kernels(model, attention)
    logger.info("batch-invariant kernels: %d linear and norm layers, and attention", switched)


def _weights_on_huge_pages(model: torch.nn.Module) -> None:
    """The weights copied onto 2 MiB pages (lm_worker/huge_pages.py), before anything keeps
    pointers into them (the fused decode; the packed kernels hold copies of their own); the
    log says how much the kernel granted, and why not where it did not."""
    weights = huge_pages.move_parameters(model)
    if weights is None:
        return
    mode, held = huge_pages.thp_mode(), huge_pages.huge_bytes(weights)
    why = ""
    if held < weights.nbytes // 2 and weights.nbytes >= huge_pages.HUGE_PAGE:
        why = {
            "": ": this kernel has no transparent huge pages",
            "never": ": transparent huge pages are off here ('never' in "
            f"{huge_pages.THP_MODE}; 'madvise' turns them on)",
        }.get(mode, ": the kernel had no free 2 MiB frames for the rest")
    logger.info(
        "LM weights on 2 MiB pages: %.0f of %.0f MB%s", held / 1e6, weights.nbytes / 1e6, why
    )


def _choose_cpu_kernel(lm: LMConfig, model: torch.nn.Module) -> str:
    """`lm.cpu_linear`, or (auto) the kernel measured fastest here for this model."""
    if lm.cpu_linear != "auto":
        if use_kernel(model, lm.cpu_linear) == 0 and linear_layers(model):
            raise RuntimeError(
                f"lm.cpu_linear: {lm.cpu_linear} cannot run here: {why_not(model, lm.cpu_linear)}"
            )
        return lm.cpu_linear
    kernel, timings = choose_linear_kernel(model, min(lm.max_num_seqs, 32), cache_dir())
    logger.info("CPU linear kernel: %s (ms per pass over the layers: %s)", kernel, timings)
    return kernel


def _choose_fused_decode(lm: LMConfig, runner: ModelRunner, timed: bool = True) -> None:
    """`lm.cpu_fused_decode`: the runner's decode steps of a few sequences in C
    (lm_worker/cpu_decode.py) where it runs (on: up to 8 sequences) or for the sequence counts
    where it is measured faster (auto). Not `timed` (the ranks of a tensor-parallel worker:
    a timed choice could differ between them), auto takes it wherever it runs."""
    model, attention = runner.model, runner.attention
    if lm.cpu_fused_decode == "off":
        return
    why = why_not_fused(model, attention)
    if lm.cpu_fused_decode == "on":
        if why:
            raise RuntimeError(f"lm.cpu_fused_decode is on but cannot run here: {why}")
        runner.fused = FusedDecode(model, attention)
        return
    if why:
        logger.info("CPU decode steps run the torch modules (no fused decode: %s)", why)
        return
    if not timed:
        runner.fused = FusedDecode(model, attention)
        return
    runner.fused, measured = choose_fused_decode(
        model, attention, runner.dummy_decode, lm.max_num_seqs, cache_dir=cache_dir()
    )
    kept = runner.fused.max_seqs if runner.fused is not None else 0
    logger.info(
        "CPU decode steps of %s: fused C layers (a step's time at S sequences: %s)",
        f"1 .. {kept} sequences" if kept else "no sequence count",
        measured,
    )


def _plan_memory(
    lm: LMConfig,
    runner: ModelRunner,
    kv_heads: int,
    text: TextDims,
    max_model_len: int,
    tp: TensorParallel | None,
) -> MemoryPlan:
    """Profile the largest steps, then size the KV cache (lm_worker/memory_plan.py): a prefill
    chunk of max_num_batched_tokens at the end of a max_model_len sequence (the most keys a
    chunk attends to), and the largest decode batch the graphs capture. On a CPU the chunk
    runs without the prefix: its attention tiles the scores, so a prefix adds only its mask
    (16 MiB at 2048 x 8192), and reading 8k keys took 5 s of a 2-core host's start-up. The
    ranks of a tensor-parallel worker each plan on their device and all take the smallest
    plan (their block tables are rank 0's)."""
    device = runner.device
    chunk = min(lm.max_num_batched_tokens, max_model_len)
    with PeakMeter(device) as prefill:
        runner.profile_run(chunk, max_model_len if device.type == "cuda" else chunk)
    graphs = 0
    if runner.use_graphs:
        with PeakMeter(device) as decode:
            runner.dummy_run(max(runner.graph_sizes))
        graphs = decode.bytes
    plan = plan_kv_cache(
        device.type,
        device_memory(device),
        Usage(module_bytes(runner.model), prefill.bytes, graphs),
        utilization=lm.gpu_memory_utilization,
        reserved=lm.gpu_memory_reserved if device.type == "cuda" else 0.0,
        kv_cache_bytes=int(lm.kv_cache_bytes),
        block_bytes=PagedAttention.bytes_per_block(
            text.num_layers, lm.block_size, kv_heads, text.head_dim, runner.dtype
        ),
        block_size=lm.block_size,
        max_model_len=max_model_len,
        explicit_len=lm.max_model_len is not None,
    )
    if tp is None:
        return plan
    least = tp.all_reduce_min([plan.num_blocks, plan.max_model_len])
    return dataclasses.replace(plan, num_blocks=least[0], max_model_len=least[1])
