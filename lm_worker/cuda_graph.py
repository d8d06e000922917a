"""CUDA graphs for decode, the proven way (nano-vllm, mini-sglang, vLLM's CudaGraphManager):
bucketed batch sizes, static input buffers (the runner's persistent ones), warm up then capture
largest first into one shared memory pool; a batch is padded to the next bucket and replayed.

Capture runs see only the null block and `dummy_inputs_embeds` (seed 000), never an encoder.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from lm_worker.block_manager import NULL_BLOCK

if TYPE_CHECKING:
    from lm_worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner):
        assert runner.device.type == "cuda", "CUDA graphs need a CUDA device"
        self.runner = runner
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        started = time.monotonic()
        # Every captured slot points at the null block until a real batch fills the buffers.
        r.slot_mapping.fill_(NULL_BLOCK * r.block_size)
        r.decode_block_tables.fill_(NULL_BLOCK)
        r.decode_seq_lens.fill_(1)
        r.positions.zero_()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(r.graph_sizes, reverse=True):
            for _ in range(2):  # warm-up: allocator and kernels settle before capture
                r.dummy_run(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = r.dummy_run(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (sizes %s) in %.1fs",
            len(self.graphs),
            r.graph_sizes,
            time.monotonic() - started,
        )

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` over whatever the runner's buffers hold now."""
        self.graphs[size].replay()
        return self.outputs[size]
