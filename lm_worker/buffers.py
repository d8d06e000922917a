"""The LM runner's persistent input buffers (vLLM's InputBuffers), allocated once.

Each step fills a prefix of them; decode batches under CUDA graphs read them in place, so a
graph captured once replays over whatever a later step wrote here.
"""

from __future__ import annotations

import numpy as np
import torch

from lm_worker.attention import PagedAttentionMetadata
from lm_worker.block_manager import NULL_BLOCK


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        position_axes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(position_axes, max_tokens, dtype=torch.long, device=device)
        self.inputs_embeds = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.decode_block_tables = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.long, device=device
        )
        self.decode_seq_lens = torch.ones(max_num_seqs, dtype=torch.long, device=device)
        # Host-side twin of the block tables, filled with numpy each step, copied in one go.
        self.host_block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)
        self._decode_metadata: dict[tuple[int, int], PagedAttentionMetadata] = {}
        # On a CPU, NumPy views of the buffers (the same memory): a step writes them without
        # torch's dispatch, which it pays with the caches the weights' stream has emptied.
        self.views: dict[str, np.ndarray] = {}
        if device.type == "cpu":
            for name in (
                "input_ids", "positions", "slot_mapping", "decode_block_tables", "decode_seq_lens"
            ):  # fmt: skip
                self.views[name] = getattr(self, name).numpy()

    def point_at_null_block(self) -> None:
        """Every slot writes to, and every decode row reads, the null block (before capture)."""
        self.slot_mapping.fill_(NULL_BLOCK * self.block_size)
        self.decode_block_tables.fill_(NULL_BLOCK)
        self.decode_seq_lens.fill_(1)
        self.positions.zero_()

    def positions_view(self, num_tokens: int) -> torch.Tensor:
        """What the model takes: [axes, T] for multi-axis positions (M-RoPE), else [T]."""
        if self.positions.shape[0] == 1:
            return self.positions[0, :num_tokens]
        return self.positions[:, :num_tokens]

    def fill(self, name: str, src: np.ndarray, total: int, value: int, width: int = 0) -> None:
        """Buffer `name`'s first `total` tokens (or sequences) from `src`, then `value` past
        it: along the last dimension of the positions ([axes, T]), the first of the others;
        the block tables `width` blocks wide (0: all). On a CPU through the buffer's NumPy
        view, on a GPU by a copy from the host."""
        view = self.views.get(name)
        dst = getattr(self, name) if view is None else view
        if name == "positions":
            dst, src = dst.T, src.T
        if width:
            dst = dst[:, :width]
        n = src.shape[0]
        if view is not None:
            dst[:n] = src
            dst[n:total] = value
            return
        dst[:n].copy_(torch.from_numpy(np.ascontiguousarray(src)), non_blocking=True)
        if total > n:
            dst[n:total].fill_(value)

    def decode_metadata(self, num_decodes: int, width: int) -> PagedAttentionMetadata:
        """A decode-only step's metadata: views of the buffers, `width` blocks of each table
        wide (graphs capture them full width). Made once per shape; each step writes the
        buffers under them (a step of a few sequences spends more on making tensor views than
        on filling them)."""
        key = (num_decodes, width)
        meta = self._decode_metadata.get(key)
        if meta is None:
            meta = self._decode_metadata[key] = PagedAttentionMetadata(
                slot_mapping=self.slot_mapping[:num_decodes],
                num_decodes=num_decodes,
                decode_block_tables=self.decode_block_tables[:num_decodes, :width],
                decode_seq_lens=self.decode_seq_lens[:num_decodes],
                prefill_query_lens=[],
                prefill_seq_lens=[],
                prefill_block_tables=[],
            )
        return meta
