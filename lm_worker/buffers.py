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

    def static_decode_metadata(self, num_decodes: int) -> PagedAttentionMetadata:
        """Views of the buffers, full width: what graphs capture and replay."""
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:num_decodes],
            num_decodes=num_decodes,
            decode_block_tables=self.decode_block_tables[:num_decodes],
            decode_seq_lens=self.decode_seq_lens[:num_decodes],
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_block_tables=[],
        )
