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


def test_the_triton_kernel_in_the_interpreter_matches_the_torch_path():
    pytest.importorskip("triton", reason="Triton is in the test extra on Linux x86-64 only")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
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


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_run_cases()))
