"""The model runner: persistent input buffers, per-step inputs, the multimodal gather, and the
forward pass (eager, or a CUDA graph for decode batches).

Buffers are allocated once (vLLM's InputBuffers); each step fills a prefix of them and builds
an `InputBatch` that says how much is real. The model always starts from `inputs_embeds`: token
embeddings (plus media or realtime embeddings) are computed eagerly outside the graph and copied
into the static buffer, so graphs never depend on an encoder and `input_ids` is passed as None
(seed 004) unless the model declares `requires_raw_input_tokens`.

Decode-only batches are padded to the next captured size when graphs are on; the padded request
count is what the attention metadata uses (seed 004), and padded slots write to the null block.
With graphs off (the CPU) the same buffers and the same code run eagerly without padding.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

from lm_worker.attention import PagedAttention, PagedAttentionMetadata
from lm_worker.block_manager import NULL_BLOCK
from lm_worker.mm import MMEmbeddings, RealtimeStream
from lm_worker.model_state import ModelState
from lm_worker.request import Request
from lm_worker.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


def graph_sizes(max_size: int) -> list[int]:
    """Captured decode batch sizes: [1, 2, 4, 8] + range(16, max + 1, 16)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    return sizes + list(range(16, max_size + 1, 16))


@dataclass
class InputBatch:
    """One step's inputs: the real part of the persistent buffers, and what it means."""

    requests: list[Request]
    num_tokens: int  # real tokens
    num_tokens_padded: int  # tokens the forward runs over (a graph size, or num_tokens)
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    num_computed_tokens: np.ndarray  # [num_reqs], before this step
    prefill_lens: np.ndarray  # [num_reqs], prompt lengths
    logits_indices: torch.Tensor  # [num_sampling] token index of each sampling request
    sampling_requests: list[Request]  # requests whose window reaches their last token
    attn_metadata: PagedAttentionMetadata
    use_graph: bool


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attention: PagedAttention,
        model_state_cls: type[ModelState],
        rope,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        use_graphs: bool,
        max_graph_batch_size: int,
        pad_decodes: bool = False,
    ):
        self.model = model
        self.attention = attention
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Decode batches are padded to graph sizes under graphs; `pad_decodes` does the same
        # eagerly (tests run the exact graph-path inputs on the CPU).
        self.pad_decodes = use_graphs or pad_decodes
        sizes = graph_sizes(min(max_graph_batch_size, max_num_seqs))
        self.graph_sizes = sizes if self.pad_decodes else []
        self.requires_raw_input_tokens = getattr(model, "requires_raw_input_tokens", False)
        self.is_realtime = getattr(model, "supports_realtime", False)
        self.init_buffers(max(max_num_batched_tokens, max_num_seqs), max_num_seqs)
        self.model_state = model_state_cls(model, rope, self.inputs_embeds)
        self.mm = MMEmbeddings(self.is_realtime)
        self.realtime: dict[str, RealtimeStream] = {}
        self.init_kv_cache(num_blocks)
        self.graphs = None
        if use_graphs:
            from lm_worker.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self)
            self.graphs.capture()

    # -- set-up -------------------------------------------------------------------------------

    def init_buffers(self, max_tokens: int, max_num_seqs: int) -> None:
        config = self.model.config
        dev = self.device
        self.max_tokens = max_tokens
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(3, max_tokens, dtype=torch.long, device=dev)
        self.inputs_embeds = torch.zeros(
            max_tokens, config.hidden_size, dtype=self.dtype, device=dev
        )
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.decode_block_tables = torch.zeros(
            max_num_seqs, self.max_blocks_per_seq, dtype=torch.long, device=dev
        )
        self.decode_seq_lens = torch.ones(max_num_seqs, dtype=torch.long, device=dev)
        # Host-side twins, filled with numpy each step, copied over in one go.
        self.host_block_tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int64)

    def init_kv_cache(self, num_blocks: int) -> None:
        c = self.model.config
        self.attention.allocate(
            c.num_layers, num_blocks, c.num_kv_heads, c.head_dim, self.dtype, self.device
        )

    # -- per step -----------------------------------------------------------------------------

    def prepare_inputs(self, batch: ScheduledBatch) -> InputBatch:
        requests = batch.requests
        num_reqs = len(requests)
        counts = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        computed = np.asarray([r.num_computed_tokens for r in requests], dtype=np.int64)
        prefill_lens = np.asarray([r.num_prompt_tokens for r in requests], dtype=np.int64)

        ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty((3, num_tokens), dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        logits_indices, sampling = [], []
        for i, request in enumerate(requests):
            start, n = int(computed[i]), int(counts[i])
            at = int(query_start_loc[i])
            ids[at : at + n] = self._token_window(request, start, n)
            positions[:, at : at + n] = self.model_state.positions(request, start, start + n)
            index = np.arange(start, start + n)
            blocks = np.asarray(request.block_ids, dtype=np.int64)
            slots[at : at + n] = blocks[index // self.block_size] * self.block_size + (
                index % self.block_size
            )
            if start + n == request.num_tokens:
                logits_indices.append(at + n - 1)
                sampling.append(request)

        num_decodes = batch.num_decodes
        pad = self.pad_decodes and 0 < num_decodes == num_reqs <= self.graph_sizes[-1]
        use_graph = pad and self.graphs is not None
        padded = (
            self.graph_sizes[bisect.bisect_left(self.graph_sizes, num_decodes)]
            if pad
            else num_tokens
        )

        _fill(self.input_ids, ids, padded, 0)
        _fill(self.positions.T, positions.T, padded, 0)
        _fill(self.slot_mapping, slots, padded, NULL_BLOCK * self.block_size)

        # Decode block tables: full width when padded (graph shapes), else just wide enough.
        decode_rows = padded if pad else num_decodes
        seq_lens = computed[:num_decodes] + 1
        if pad:
            width = self.max_blocks_per_seq
        else:
            width = max(-(-int(seq_lens.max(initial=1)) // self.block_size), 1)
        tables = self.host_block_tables[:decode_rows, :width]
        tables.fill(NULL_BLOCK)
        for i in range(num_decodes):
            row = requests[i].block_ids
            tables[i, : len(row)] = row
        _fill(self.decode_block_tables[:, :width], tables, decode_rows, NULL_BLOCK)
        _fill(self.decode_seq_lens, seq_lens, decode_rows, 1)

        prefill = range(num_decodes, num_reqs)
        meta = PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:padded],
            num_decodes=decode_rows,
            decode_block_tables=self.decode_block_tables[:decode_rows, :width],
            decode_seq_lens=self.decode_seq_lens[:decode_rows],
            prefill_query_lens=[int(counts[i]) for i in prefill],
            prefill_seq_lens=[int(computed[i] + counts[i]) for i in prefill],
            prefill_block_tables=[
                torch.as_tensor(requests[i].block_ids, dtype=torch.long, device=self.device)
                for i in prefill
            ],
        )
        return InputBatch(
            requests=requests,
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            num_scheduled_tokens=counts,
            query_start_loc=query_start_loc,
            num_computed_tokens=computed,
            prefill_lens=prefill_lens,
            logits_indices=torch.as_tensor(logits_indices, dtype=torch.long, device=self.device),
            sampling_requests=sampling,
            attn_metadata=meta,
            use_graph=use_graph,
        )

    def gather_mm_embeddings(self, inputs: InputBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
        return self.mm.gather_mm_embeddings(
            [r.request_id for r in inputs.requests],
            inputs.num_tokens,
            inputs.num_scheduled_tokens,
            inputs.query_start_loc,
            inputs.prefill_lens,
            inputs.num_computed_tokens,
            realtime=self.realtime,
        )

    @torch.inference_mode()
    def forward(
        self, inputs: InputBatch, mm_embeds: list[torch.Tensor], is_mm_embed: torch.Tensor
    ) -> torch.Tensor:  # [num_sampling, vocab]
        T, padded = inputs.num_tokens, inputs.num_tokens_padded
        embeds = self.model.embed_input_ids(
            self.input_ids[:T],
            [e.to(self.device, self.dtype) for e in mm_embeds] or None,
            is_mm_embed.to(self.device) if mm_embeds else None,
        )
        self.inputs_embeds[:T].copy_(embeds)
        if inputs.use_graph:
            hidden = self.graphs.replay(padded)
        else:
            hidden = self.model(
                self.input_ids[:padded] if self.requires_raw_input_tokens else None,
                self.positions[:, :padded],
                self.inputs_embeds[:padded],
                inputs.attn_metadata,
                intermediate_tensors=None,
            )
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> torch.Tensor:
        """A forward pass over `num_tokens` decode slots of the null block, fed from
        `dummy_inputs_embeds`: warm-up and graph capture never run an encoder (seed 000)."""
        meta = self.static_decode_metadata(num_tokens)
        return self.model(
            self.input_ids[:num_tokens] if self.requires_raw_input_tokens else None,
            self.positions[:, :num_tokens],
            self.model_state.dummy_inputs_embeds(num_tokens),
            meta,
            intermediate_tensors=None,
        )

    def static_decode_metadata(self, num_decodes: int) -> PagedAttentionMetadata:
        """Views of the persistent buffers, full width: what graphs capture and replay."""
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:num_decodes],
            num_decodes=num_decodes,
            decode_block_tables=self.decode_block_tables[:num_decodes],
            decode_seq_lens=self.decode_seq_lens[:num_decodes],
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_block_tables=[],
        )

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _token_window(request: Request, start: int, n: int) -> list[int]:
        prompt_len = request.num_prompt_tokens
        if start >= prompt_len:
            return request.output_token_ids[start - prompt_len : start - prompt_len + n]
        if start + n <= prompt_len:
            return request.prompt_token_ids[start : start + n]
        return request.all_token_ids[start : start + n]


def _fill(dst: torch.Tensor, src: np.ndarray, total: int, fill: int) -> None:
    """dst[:total] = src, then `fill` past it (along the first dimension)."""
    n = src.shape[0]
    dst[:n].copy_(torch.from_numpy(np.ascontiguousarray(src)), non_blocking=True)
    if total > n:
        dst[n:total].fill_(fill)
