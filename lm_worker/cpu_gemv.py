"""CPU linear layers through oneDNN (MKL-DNN) with weights packed once at start-up.

Decode on a CPU is a chain of small matrix products that should run at memory speed. Measured
here (2 cores, fp32, weights streaming from DRAM; 40 layers of 2048x768): torch's `F.linear`
takes 20 ms at 1 row and 51 ms at 32 rows, oneDNN's `mkldnn_linear` on packed weights 11 ms and
35 ms; the 32000x768 LM head 7.3 ms vs 3.1 ms at 1 row; from 2048 rows (prefill) on they are
even. Both run on torch's own thread pool (NumPy's OpenBLAS was as fast alone, but fought
torch's spinning OpenMP threads for the two cores). Chosen once at start-up by the runner; the
model code does not know.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """nn.Linear computed by oneDNN from a packed weight (inference only). The dense weight
    is dropped unless another module shares it (a tied LM head shares the embedding's)."""

    packed_weight: torch.Tensor
    packed_bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        rows = x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn()
        out = torch._C._nn.mkldnn_linear(rows, self.packed_weight, self.packed_bias).to_dense()
        return out.view(*x.shape[:-1], self.out_features)


def pack_linear_layers(model: nn.Module) -> int:
    """Switch the model's CPU fp32 linear layers to PackedLinear; returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    uses = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    count = 0
    for module in model.modules():
        w = module.weight if type(module) is nn.Linear else None
        if w is None or w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        module.__class__ = PackedLinear
        module.packed_weight = w.detach().to_mkldnn()
        module.packed_bias = None if module.bias is None else module.bias.detach().to_mkldnn()
        if uses[id(w)] == 1:
            module.weight = None  # the packed copy is the only one needed
        count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every linear layer's (packed copies where
    packed), norms and biases; an embedding table is looked up, one row a token, so it does
    not count (a tied LM head reads its own packed copy)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        tensors = list(module._parameters.values())
        if isinstance(module, PackedLinear):
            tensors = [module.packed_weight, module.packed_bias]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
