"""A tensor-parallel LM worker's rank 1 .. N-1 (`python -m lm_worker.tp_rank`, started by rank
0: lm_worker/tensor_parallel.py): its spec, then every step's inputs, come over stdin."""

from __future__ import annotations

import logging
import os
import sys
from typing import IO

import torch
import torch.distributed as dist

from common.device import resolve_device
from lm_worker.loader import build_runner
from lm_worker.model_runner import StepArrays
from lm_worker.tensor_parallel import (
    GROUP_TIMEOUT,
    RankSpec,
    encode_message,
    make_group,
    mask_from_json,
    read_message,
)
from models import load_family
from models.parallel import TensorParallel

logger = logging.getLogger(__name__)


def follow(spec: RankSpec, inbox: IO[bytes], outbox: IO[bytes]) -> None:
    """A rank's life: join the group, build the runner on its shard, run every step rank 0
    sends (and the KV connector's block copies in and out), until its pipe closes."""
    torch.set_num_threads(spec.threads)
    device = resolve_device(spec.lm.device, "lm.device")
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, False, GROUP_TIMEOUT)
    group = make_group(store, spec.rank, spec.size, device)
    tp = TensorParallel(
        spec.rank,
        spec.size,
        group,
        torch.device("cuda", spec.rank) if device.type == "cuda" else device,
    )
    family = load_family(spec.model_path, spec.options)
    runner, _, _ = build_runner(spec.lm, family, spec.dtype, tp=tp)
    cache = runner.attention.kv_cache
    while True:
        try:
            header, tensors = read_message(inbox)
        except EOFError:
            return
        kind = header["kind"]
        if kind == "kv_out":  # the KV connector saves blocks: this rank's heads of them
            ids = torch.as_tensor(header["ids"], device=cache.device)
            outbox.write(encode_message({"kind": "kv"}, [cache.index_select(2, ids)]))
            outbox.flush()
        elif kind == "kv_in":  # blocks from elsewhere: this rank's heads, before the step
            ids = torch.as_tensor(header["ids"], device=cache.device)
            cache.index_copy_(2, ids, tensors[0].to(cache.device))
        elif kind == "step":
            inputs = runner.load_step(StepArrays.from_json(header["step"]))
            runner.forward(inputs, tensors, mask_from_json(header["mask"]))


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s tp-rank %(name)s: %(message)s"
    )
    inbox = sys.stdin.buffer
    # Replies go to rank 0 on the stdout it gave this process; anything else printed there
    # (a library's print) would corrupt them: file descriptor 1 goes to stderr instead.
    outbox = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        spec = RankSpec.from_json(read_message(inbox)[0]["spec"])
    except EOFError:
        return
    try:
        follow(spec, inbox, outbox)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        os._exit(1)


if __name__ == "__main__":
    main()
