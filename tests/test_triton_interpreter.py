"""The Triton paged decode kernel's logic on the CPU, in Triton's interpreter.

The kernel (lm_worker/triton_decode.py) runs only on CUDA in serving; tests/test_lm_cuda.py
holds it there against the torch path. Triton's interpreter (TRITON_INTERPRET=1) executes the
same kernel source on CPU tensors, so every CI run checks what it computes: the same outputs as
the torch path over scattered blocks, sliding windows, head sizes that are not a power of two
and a grouped KV head; and that it reads only the blocks a sequence uses (every other block of
the cache, and the unused tail of each sequence's last block, is NaN here, which the torch path
would not survive). Speed and CUDA graphs stay with the GPU tests.

The interpreter is chosen by the environment when Triton is first imported, and torch imports
Triton (where installed) as soon as modules are built: the cases run in a child process of
their own, started with TRITON_INTERPRET=1.

The batch-invariant kernels (lm_worker/triton_invariant.py, lm.batch_invariant on a GPU) are
held here the same way: a row's product, norm and attention are the same bits whatever else
the call holds (a decode and the same token inside a prefill tile, one row and seventy), close
to torch's; and an engine on them gives 3 streams together exactly what each gets alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # dtype, window, head_dim, sequence lengths (tokens incl. the new one)
    ("float32", None, 64, [1, 16, 17, 100, 250]),
    ("float32", 37, 80, [1, 16, 17, 100, 250]),
    ("bfloat16", None, 80, [3, 33, 64]),
    ("bfloat16", 20, 64, [5, 48, 130]),
]


def interpreted(*args: str) -> list[dict]:
    """This file's cases (`args` name which) in a child process under Triton's interpreter."""
    pytest.importorskip("triton", reason="Triton is in the test extra on Linux x86-64 only")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_triton_kernel_in_the_interpreter_matches_the_torch_path():
    results = interpreted()
    assert len(results) == len(CASES)
    for case in results:
        assert case["finite"], case  # a NaN block or tail was read
        assert case["close"], case


def _run_cases() -> list[dict]:
    import torch

    from lm_worker.triton_decode import paged_decode
    from tests.lm_helpers import decode_case

    results = []
    for dtype_name, window, head_dim, seq_lens in CASES:
        dtype = getattr(torch, dtype_name)
        att, q, meta = decode_case(dtype, seq_lens, head_dim, device="cpu")
        layer_kv, tables, block = att.kv_cache[0], meta.decode_block_tables, att.block_size
        want = att._decode(q, layer_kv, meta, window, 0)  # the torch path, on the clean cache

        # Poison everything no sequence may read: unused blocks (the null block included) and
        # the slots past each sequence's last token.
        poisoned = torch.full_like(layer_kv, float("nan"))
        for i, n in enumerate(seq_lens):
            for b in range(-(-n // block)):
                used = min(block, n - b * block)
                poisoned[:, tables[i, b], :used] = layer_kv[:, tables[i, b], :used]
        got = paged_decode(
            q, poisoned[0], poisoned[1], tables, meta.decode_seq_lens, att.scale, window
        )
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # as tests/test_lm_cuda.py
        results.append(
            {
                "dtype": dtype_name,
                "window": window,
                "head_dim": head_dim,
                "finite": bool(torch.isfinite(got).all()),
                "close": torch.allclose(got.float(), want.float(), atol=tol, rtol=tol),
                "max_error": (got.float() - want.float()).abs().max().item(),
            }
        )
    return results


# dtype, window, head_dim, query heads, KV heads, chunks as (query tokens, sequence length):
# fresh prompts, chunked prefill and prefix-cache hits (a cached prefix of seq_len - query).
PREFILL_CASES = [
    ("float32", None, 64, 8, 2, [(17, 17), (5, 40), (33, 100)]),
    ("float32", 24, 80, 4, 4, [(30, 30), (16, 70)]),
    ("bfloat16", None, 128, 8, 1, [(20, 20), (9, 57)]),
    ("bfloat16", 16, 64, 6, 2, [(40, 40), (7, 90), (1, 33)]),
]


def test_the_triton_prefill_kernel_in_the_interpreter_matches_the_torch_path():
    """lm_worker/triton_prefill.py: every chunk of a step in one launch over the paged cache
    (lengths, cached prefixes, sliding windows, GQA ratios, head sizes 64 / 80 / 128, fp32 and
    bf16) against the torch path chunk by chunk; reading only the keys a chunk may see."""
    results = interpreted("prefill")
    assert len(results) == len(PREFILL_CASES)
    for case in results:
        assert case["finite"], case  # a NaN block or tail was read
        assert case["close"], case


def _prefill_cases(device: str = "cpu") -> list[dict]:
    """PREFILL_CASES, each as a dict of what the kernel gave against the torch path (on
    `device`: the interpreter's CPU here, a GPU in tests/test_lm_cuda.py)."""
    import torch

    from lm_worker.attention import PagedAttention
    from lm_worker.triton_prefill import paged_prefill, prefill_plan

    results = []
    for dtype_name, window, head_dim, heads, kv_heads, chunks in PREFILL_CASES:
        torch.manual_seed(len(results))
        dtype, block = getattr(torch, dtype_name), 16
        need = [-(-seq_len // block) for _, seq_len in chunks]
        att = PagedAttention(block, head_dim)
        att.allocate(1, sum(need) + 4, kv_heads, head_dim, dtype, torch.device(device))
        cache = att.kv_cache[0]  # [2, blocks, block, kv_heads, head_dim]
        cache.normal_()
        order = (torch.randperm(cache.shape[1] - 1) + 1).tolist()  # scattered, not the null one
        tables = [torch.tensor([order.pop() for _ in range(n)], device=device) for n in need]
        q = torch.randn(sum(n for n, _ in chunks), heads, head_dim, dtype=dtype, device=device)
        want, at = [], 0
        for (n, seq_len), table in zip(chunks, tables, strict=True):
            # The chunk's own keys and values sit in its last n slots (written before attention).
            slots = (table[:, None] * block + torch.arange(block)).reshape(-1)[
                seq_len - n : seq_len
            ]
            k = cache[0].view(-1, kv_heads, head_dim)[slots]
            v = cache[1].view(-1, kv_heads, head_dim)[slots]
            want.append(
                att._prefill(q[at : at + n], k, v, cache[0], cache[1], seq_len, table, window)
            )
            at += n
        want = torch.cat(want)
        poisoned = torch.full_like(cache, float("nan"))  # all but what a chunk may read
        for (_, seq_len), table in zip(chunks, tables, strict=True):
            for b, block_id in enumerate(table.tolist()):
                used = min(block, seq_len - b * block)
                poisoned[:, block_id, :used] = cache[:, block_id, :used]
        plan = prefill_plan(
            [n for n, _ in chunks], [s for _, s in chunks], tables, heads // kv_heads, q.device
        )
        got = paged_prefill(q, poisoned[0], poisoned[1], plan, att.scale, window)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        results.append(
            {
                "dtype": dtype_name,
                "window": window,
                "head_dim": head_dim,
                "group": heads // kv_heads,
                "finite": bool(torch.isfinite(got).all()),
                "close": torch.allclose(got.float(), want.float(), atol=tol, rtol=tol),
                "max_error": (got.float() - want.float()).abs().max().item(),
            }
        )
    return results


def test_the_batch_invariant_kernels_give_a_row_the_same_bits_whatever_comes_with_it():
    results = interpreted("invariant-kernels")
    assert {r["case"] for r in results} >= {"matmul", "rms_norm", "attention"}
    for case in results:
        assert case["same"], case  # bit for bit, alone and in company
        assert case["close"], case  # and what torch computes, to rounding


def test_an_engine_on_the_batch_invariant_kernels_gives_each_stream_its_tokens_alone(tmp_path):
    (result,) = interpreted("invariant-engine", str(tmp_path / "ckpt"))
    assert result["chunked"], result
    assert result["reference_tokens"], result  # greedy text stream = the reference's tokens
    assert result["differing_streams"] == [], result


def _invariant_kernel_cases() -> list[dict]:
    import torch
    import torch.nn.functional as F

    from lm_worker.attention import PagedAttention, PagedAttentionMetadata
    from lm_worker.triton_invariant import attention, matmul, rms_norm

    torch.manual_seed(0)
    results = []
    x, w, b = torch.randn(70, 80), torch.randn(96, 80), torch.randn(96)
    together = matmul(x, w, b)
    alone = torch.cat([matmul(x[i : i + 1], w, b) for i in range(0, 70, 9)])
    results.append(
        {
            "case": "matmul",
            "same": torch.equal(together[::9], alone),
            "close": torch.allclose(together, F.linear(x, w, b), atol=1e-4),
        }
    )
    norm_w = torch.randn(80)
    together = rms_norm(x, norm_w, 1e-6)
    alone = torch.cat([rms_norm(x[i : i + 1], norm_w, 1e-6) for i in range(70)])
    want = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm_w
    results.append(
        {
            "case": "rms_norm",
            "same": torch.equal(together, alone),
            "close": torch.allclose(together, want, atol=1e-5),
        }
    )

    # One sequence of 100 tokens: its last 20 as one prefill chunk (2 query tiles), against
    # each of those tokens as a decode of its own; a sliding window too; grouped KV heads.
    block, heads, kv_heads, head_dim, n, chunk = 16, 4, 2, 64, 100, 20
    att = PagedAttention(block, head_dim)
    att.allocate(1, 12, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    att.kv_cache.normal_()
    table = torch.randperm(11)[: -(-n // block)] + 1
    q = torch.randn(chunk, heads, head_dim)
    k_cache, v_cache = att.kv_cache[0, 0], att.kv_cache[0, 1]
    for window in (None, 37):
        prefill = PagedAttentionMetadata(
            slot_mapping=torch.zeros(chunk, dtype=torch.long),
            num_decodes=0,
            decode_block_tables=torch.zeros(0, table.numel(), dtype=torch.long),
            decode_seq_lens=torch.zeros(0, dtype=torch.long),
            prefill_query_lens=[chunk],
            prefill_seq_lens=[n],
            prefill_block_tables=[table],
        )
        together = attention(q, k_cache, v_cache, prefill, att.scale, window)
        decodes = PagedAttentionMetadata(
            slot_mapping=torch.zeros(chunk, dtype=torch.long),
            num_decodes=chunk,
            decode_block_tables=table.expand(chunk, -1).contiguous(),
            decode_seq_lens=torch.arange(n - chunk + 1, n + 1),
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_block_tables=[],
        )
        alone = attention(q, k_cache, v_cache, decodes, att.scale, window)
        want = att._prefill(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, n, table, window)
        results.append(
            {
                "case": "attention",
                "window": window,
                "same": torch.equal(together, alone),
                "close": torch.allclose(together, want, atol=1e-4),
                "max_error": (together - want).abs().max().item(),
            }
        )
    return results


def _invariant_engine_case() -> dict:
    import torch

    from lm_worker.request import Request
    from lm_worker.triton_invariant import use_invariant_kernels
    from models import SamplingParams
    from models.testing import ReferenceModel, make_checkpoint
    from tests.lm_helpers import make_engine, run, three_cases

    checkpoint = make_checkpoint(Path(sys.argv[2]), "qwen2_5_vl", "tiny", seed=7)
    cases = list(three_cases(ReferenceModel(checkpoint)).values())

    def engine(**lm):
        e = make_engine(checkpoint, cpu_linear="linear", cpu_fused_decode="off", **lm)
        use_invariant_kernels(e.runner.model, e.runner.attention)
        return e

    def streams():
        for i in range(3):
            case = cases[i % 3]
            sampling = {"max_tokens": 3, "ignore_eos": True, "logprobs": 0, "temperature": 0.0}
            if i % 2:
                sampling |= {"temperature": 0.9, "seed": i}
            request = Request(
                f"s{i}", list(case.token_ids), SamplingParams(**sampling), list(case.features)
            )
            yield request, case.embeddings

    def logprobs(collected):
        return [(t.token_id, t.logprob) for o in collected.outputs for t in o.logprobs]

    alone_engine, alone = engine(), {}
    for request, embeddings in streams():
        alone |= run(alone_engine, (request, embeddings))
    crowd = engine(max_num_seqs=3, max_num_batched_tokens=24)
    together = run(crowd, *streams())
    text = cases[0]
    return {
        "chunked": all(len(c.token_ids) > 24 for c in cases),
        "reference_tokens": alone["s0"].token_ids == text.expected[:3],
        "differing_streams": [
            r.request_id
            for r, _ in streams()
            if logprobs(together[r.request_id]) != logprobs(alone[r.request_id])
        ],
        "dtype": str(torch.get_default_dtype()),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    which = sys.argv[1] if len(sys.argv) > 1 else "decode"
    if which == "invariant-kernels":
        print(json.dumps(_invariant_kernel_cases()))
    elif which == "invariant-engine":
        print(json.dumps([_invariant_engine_case()]))
    elif which == "prefill":
        print(json.dumps(_prefill_cases()))
    else:
        print(json.dumps(_run_cases()))
