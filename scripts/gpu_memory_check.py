"""The memory plan on a GPU at real size (run by scripts/gpu_checks.sh): an LM engine on a
checkpoint with the KV cache sized automatically (lm_worker/memory_plan.py), then the heaviest
load it admits (max_num_seqs sequences at once, prompts in max_num_batched_tokens chunks), and
how much of the device is in use at steady state against lm.gpu_memory_utilization. Prints the
plan's log line and one JSON line.

    python3 scripts/gpu_memory_check.py /tmp/epd-7b --max-model-len 16384
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from common.config import LMConfig
from lm_worker.loader import build_engine
from lm_worker.memory_plan import device_memory
from lm_worker.request import Request
from models import SamplingParams, load_family


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--device", default="cuda", help="cuda (cpu: the script's logic, on host memory)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    family = load_family(args.model)
    lm = LMConfig(
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    started = time.perf_counter()
    engine = build_engine(lm, family, family.dtype, registry=None)
    built_s = time.perf_counter() - started
    device = engine.runner.device
    cuda = device.type == "cuda"
    free, total = device_memory(device).free, device_memory(device).total
    kv = engine.runner.attention.kv_cache.nbytes
    vocab = family.text.vocab_size
    outputs = []
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.max_num_seqs):
        prompt = [100 + (13 * i + 7 * j) % (vocab - 200) for j in range(args.prompt_tokens)]
        engine.add_request(Request(f"r{i}", prompt, params), outputs.append, {})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    engine.run_to_completion()
    ran_s = time.perf_counter() - started
    steady_free = device_memory(device).free
    used = (total - steady_free) / total
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "total_gib": round(total / 2**30, 2),
                "kv_cache_gib": round(kv / 2**30, 2),
                "free_after_start_gib": round(free / 2**30, 2),
                "free_at_steady_state_gib": round(steady_free / 2**30, 2),
                "used_fraction": round(used, 4),
                "gpu_memory_utilization": lm.gpu_memory_utilization,
                "used_vs_utilization": round(used / lm.gpu_memory_utilization, 4),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                if cuda
                else None,
                "requests": args.max_num_seqs,
                "prompt_tokens": args.prompt_tokens,
                "generated_tokens": sum(len(o.token_ids) for o in outputs),
                "start_s": round(built_s, 1),
                "run_s": round(ran_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
