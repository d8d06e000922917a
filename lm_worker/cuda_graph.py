"""CUDA graphs for decode, the proven way (nano-vllm, mini-sglang, vLLM's CudaGraphManager):
bucketed batch sizes, static input buffers (the runner's persistent ones), warm up then capture
largest first into one shared memory pool; a batch is padded to the next bucket and replayed.

Capture is handed the buffers, a run function and the sizes, never the runner. The run function
feeds the model `dummy_inputs_embeds` over the null block, so capture never runs an encoder.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from lm_worker.buffers import InputBuffers

logger = logging.getLogger(__name__)


def graph_sizes(max_size: int) -> list[int]:
    """Captured decode batch sizes: [1, 2, 4, 8] + range(16, max + 1, 16)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    return sizes + list(range(16, max_size + 1, 16))


class CudaGraphRunner:
    def __init__(
        self,
        buffers: InputBuffers,
        run: Callable[[int], torch.Tensor],  # a forward over the first N decode slots
        sizes: list[int],
    ):
        self.buffers = buffers
        self.run = run
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.monotonic()
        # Every captured slot points at the null block until a real batch fills the buffers.
        self.buffers.point_at_null_block()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            for _ in range(2):  # warm-up: allocator and kernels settle before capture
                self.run(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.run(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (sizes %s) in %.1fs",
            len(self.graphs),
            self.sizes,
            time.monotonic() - started,
        )

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` over whatever the buffers hold now."""
        self.graphs[size].replay()
        return self.outputs[size]
