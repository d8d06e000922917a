"""GPU checks for the LM worker (skipped without CUDA): decode in CUDA graphs gives the same
tokens as eager decode and as the reference path, and is at least 1.3x eager at batch 1 (the
speed-ups are printed with `-s`)."""

from __future__ import annotations

import time

import pytest
import torch

from common.config import LMConfig
from lm_worker.loader import build_engine
from lm_worker.request import Request
from models import SamplingParams, load_family
from models.testing import ReferenceModel, make_checkpoint
from tests.lm_helpers import Collected, decode_case

pytestmark = pytest.mark.cuda


def engine(checkpoint, graphs: str, dtype=torch.float32, **settings):
    """`settings`: more LMConfig fields (tensor_parallel_size, say)."""
    lm = LMConfig(
        device="cuda",
        cuda_graphs=graphs,
        kv_cache_bytes=256 << 20,
        max_num_seqs=32,
        max_model_len=1024,
        **settings,
    )
    return build_engine(lm, load_family(checkpoint), dtype, registry=None)


def generate(e, prompts, max_tokens):
    sinks = {}
    for i, p in enumerate(prompts):
        sinks[i] = Collected()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        e.add_request(Request(f"r{time.monotonic_ns()}-{i}", p, params), sinks[i])
    started = time.perf_counter()
    e.run_to_completion()
    torch.cuda.synchronize()
    return [sinks[i].token_ids for i in range(len(prompts))], time.perf_counter() - started


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen2_5_vl", "tiny", seed=1)


@pytest.mark.parametrize("batch", [1, 3, 8, 17])
def test_graph_decode_matches_eager_and_reference(checkpoint, batch):
    prompts = [[100 + i + j for j in range(20 + i)] for i in range(batch)]
    eager = engine(checkpoint, "off")
    graphed = engine(checkpoint, "on")
    assert graphed.runner.graphs is not None and graphed.runner.graph_sizes[-1] >= batch
    want, _ = generate(eager, prompts, 24)
    got, _ = generate(graphed, prompts, 24)
    assert got == want
    ref = ReferenceModel(checkpoint, device="cuda")
    assert got[0] == ref.generate(prompts[0], max_tokens=24, ignore_eos=True)


# Decode in CUDA graphs must pay for itself where it matters most: batch 1, launch-bound.
MIN_SPEEDUP_AT_BATCH_1 = 1.3


def test_graph_speedup(tmp_path_factory):
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("small"), "qwen2_5_vl", "small")
    prompts = [[100 + i + j for j in range(64)] for i in range(32)]
    for batch in (1, 8, 32):
        times = {}
        for graphs in ("off", "on"):
            e = engine(checkpoint, graphs, torch.bfloat16)
            generate(e, prompts[:batch], 8)  # warm-up
            _, short = generate(e, prompts[:batch], 1)
            _, long = generate(e, prompts[:batch], 129)
            times[graphs] = 128 * batch / (long - short)
        print(
            f"\nbatch {batch}: eager {times['off']:.0f} tok/s, graphs {times['on']:.0f} tok/s, "
            f"speed-up {times['on'] / times['off']:.2f}x"
        )
        if batch == 1:
            assert times["on"] >= MIN_SPEEDUP_AT_BATCH_1 * times["off"], times


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_triton_paged_decode_matches_the_torch_path(dtype, window, head_dim):
    att, q, meta = decode_case(dtype, [1, 16, 17, 100, 250], head_dim)
    assert att.decode_kernel is not None, "the Triton decode kernel is not in use on CUDA"
    layer_kv = att.kv_cache[0]
    got = att._decode(q, layer_kv, meta, window, 0)
    att.decode_kernel = None  # the torch path: gathers every table's full width
    want = att._decode(q, layer_kv, meta, window, 0)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_triton_paged_decode_in_a_graph_follows_the_lengths_written_later():
    att, q, meta = decode_case(torch.bfloat16, [5, 40, 130], 64, width=64)
    layer_kv = att.kv_cache[0]
    att._decode(q, layer_kv, meta, None, 0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = att._decode(q, layer_kv, meta, None, 0)
    meta.decode_seq_lens.copy_(torch.tensor([70, 3, 200], device="cuda"))
    graph.replay()
    kernel = att.decode_kernel
    att.decode_kernel = None
    want = att._decode(q, layer_kv, meta, None, 0)
    att.decode_kernel = kernel
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_triton_paged_decode_speed_at_long_context():
    # What graphs gain from reading only the used blocks: 8 sequences, tables 8192 tokens
    # wide (the torch path gathers all of them), half of them used. Printed with -s.
    # The outputs must agree there too (many splits a sequence, half of them past its end).
    att, q, meta = decode_case(torch.bfloat16, [4096] * 8, 128, kv_heads=4, heads=32, width=512)
    layer_kv = att.kv_cache[0]
    times, outs = {}, {}
    for name, kernel in (("triton", att.decode_kernel), ("torch", None)):
        att.decode_kernel = kernel
        for _ in range(3):
            outs[name] = att._decode(q, layer_kv, meta, None, 0)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            att._decode(q, layer_kv, meta, None, 0)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - started) / 20
    kv_bytes = 8 * 4096 * 4 * 128 * 2 * 2  # keys and values read, bf16
    print(
        f"\ndecode attention, 8 x 4096 tokens in 8192-token tables: triton "
        f"{times['triton'] * 1e6:.0f} us ({kv_bytes / times['triton'] / 1e9:.0f} GB/s of the "
        f"used cache), torch {times['torch'] * 1e6:.0f} us "
        f"(triton {times['torch'] / times['triton']:.1f}x faster)"
    )
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-2, rtol=2e-2)


def test_triton_paged_prefill_matches_the_torch_path():
    """lm_worker/triton_prefill.py on the GPU: the interpreter test's cases (lengths, cached
    prefixes, windows, GQA ratios, head sizes 64 / 80 / 128, fp32 and bf16)."""
    from tests.test_triton_interpreter import _prefill_cases

    for case in _prefill_cases("cuda"):
        assert case["finite"] and case["close"], case


def test_triton_prefill_engine_tokens_and_speed(checkpoint):
    """An engine on `lm.prefill_attention: triton` gives the torch path's greedy tokens
    (prompts that chunk and share prefixes); then the attention of one 4k-token prefill,
    timed both ways (printed with -s)."""
    prompts = [[100 + (i * 7 + j) % 300 for j in range(300 + 40 * i)] for i in range(4)]
    prompts.append([*prompts[0][:200], 5, 6, 7])  # a prefix-cache hit
    lm = dict(device="cuda", kv_cache_bytes=256 << 20, max_num_seqs=8, max_model_len=1024,
              max_num_batched_tokens=256)  # fmt: skip
    family = load_family(checkpoint)
    torch_engine = build_engine(LMConfig(**lm), family, torch.float32, registry=None)
    triton_engine = build_engine(
        LMConfig(**lm, prefill_attention="triton"), family, torch.float32, registry=None
    )
    assert triton_engine.runner.attention.prefill_kernel is not None
    want, _ = generate(torch_engine, prompts, 16)
    got, _ = generate(triton_engine, prompts, 16)
    assert got == want

    from lm_worker.attention import PagedAttention, PagedAttentionMetadata

    n, heads, kv_heads, head_dim, block = 4096, 28, 4, 128, 16
    att = PagedAttention(block, head_dim, triton_prefill=True)
    att.allocate(1, n // block + 2, kv_heads, head_dim, torch.bfloat16, torch.device("cuda"))
    q = torch.randn(n, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(1, n // block + 1, device="cuda")
    times, outs = {}, {}
    for name in ("triton", "torch"):
        kernel = att.prefill_kernel if name == "triton" else None
        for _ in range(4):
            meta = PagedAttentionMetadata(
                slot_mapping=torch.arange(block, n + block, device="cuda"), num_decodes=0,
                decode_block_tables=table[None], decode_seq_lens=torch.ones(1, device="cuda"),
                prefill_query_lens=[n], prefill_seq_lens=[n], prefill_block_tables=[table],
            )  # fmt: skip
            saved, att.prefill_kernel = att.prefill_kernel, kernel
            torch.cuda.synchronize()
            started = time.perf_counter()
            outs[name] = att(0, q, k, k, meta)
            torch.cuda.synchronize()
            times[name] = time.perf_counter() - started
            att.prefill_kernel = saved
    flops = 4 * n * n / 2 * heads * head_dim
    print(
        f"\nprefill attention, 4096 tokens, 28 / 4 heads of 128, bf16: triton "
        f"{times['triton'] * 1e3:.2f} ms ({flops / times['triton'] / 1e12:.0f} TFLOP/s), torch "
        f"{times['torch'] * 1e3:.2f} ms"
    )
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graphs", ["off", "on"])
def test_batch_invariant_streams_together_get_what_each_gets_alone(checkpoint, graphs, dtype):
    """lm.batch_invariant on a GPU (lm_worker/triton_invariant.py): 24 streams, greedy and
    seeded, prompts chunked among the others', give each exactly the tokens and log-
    probabilities it gets alone; the batch's time is printed beside the default kernels'."""

    def invariant_engine(**lm):
        config = LMConfig(
            device="cuda",
            cuda_graphs=graphs,
            kv_cache_bytes=256 << 20,
            max_model_len=1024,
            batch_invariant=True,
            **lm,
        )
        return build_engine(config, load_family(checkpoint), dtype, registry=None)

    def requests():
        for i in range(24):
            sampling = {"max_tokens": 64, "ignore_eos": True, "logprobs": 0, "temperature": 0.0}
            if i % 2:
                sampling |= {"temperature": 0.9, "top_p": 0.95, "seed": i}
            prompt = [100 + (7 * i + j) % 400 for j in range(20 + 9 * i)]
            yield Request(f"s{i}", prompt, SamplingParams(**sampling))

    def run(e, batch):
        sinks = {r.request_id: Collected() for r in batch}
        for r in batch:
            e.add_request(r, sinks[r.request_id])
        started = time.perf_counter()
        e.run_to_completion()
        torch.cuda.synchronize()
        got = {
            k: [(t.token_id, t.logprob) for o in s.outputs for t in o.logprobs]
            for k, s in sinks.items()
        }
        return got, time.perf_counter() - started

    single = invariant_engine(max_num_seqs=32)
    alone = {}
    for r in requests():
        alone |= run(single, [r])[0]
    crowd = invariant_engine(max_num_seqs=32, max_num_batched_tokens=96)
    together, seconds = run(crowd, list(requests()))
    differing = [k for k in alone if together[k] != alone[k]]
    default = engine(checkpoint, graphs, dtype)
    _, default_seconds = run(default, list(requests()))
    print(
        f"batch-invariant {dtype} graphs {graphs}: 24 streams x 64 tokens in {seconds:.2f} s, "
        f"default kernels {default_seconds:.2f} s ({default_seconds / seconds:.2f}x)"
    )
    assert differing == [], differing


def test_memory_plan_on_the_gpu(checkpoint, caplog):
    """lm.kv_cache_bytes auto: the plan (weights, profiled activations and graphs) leaves the
    device at most lm.gpu_memory_utilization in use, the KV cache takes nearly all of the share
    (the tiny model's weights and steps are small), and a full batch of long prompts runs."""
    import logging

    utilization = 0.5  # half the device: room for whatever else the test machine holds
    lm = LMConfig(
        device="cuda", gpu_memory_utilization=utilization, max_num_seqs=32, max_model_len=4096
    )
    with caplog.at_level(logging.INFO, logger="lm_worker.loader"):
        e = build_engine(lm, load_family(checkpoint), torch.float32, registry=None)
    plan_line = next(r.getMessage() for r in caplog.records if "memory plan" in r.getMessage())
    print(plan_line)
    total = torch.cuda.mem_get_info()[1]
    kv = e.runner.attention.kv_cache.nbytes
    assert kv > 0.4 * total * utilization or "set by free" in plan_line, plan_line
    prompts = [[100 + (i * 7 + j) % 500 for j in range(2000)] for i in range(32)]
    tokens, _ = generate(e, prompts, 8)
    assert all(len(t) == 8 for t in tokens)
    used = (total - torch.cuda.mem_get_info()[0]) / total
    print(f"device in use at steady state: {used:.3f} (utilization {utilization})")
