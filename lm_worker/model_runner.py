"""The model runner: per-step inputs, the multimodal gather (over each request's inputs,
lm_worker/inputs.py), and the forward pass (eager, a CUDA graph for decode batches, or on a
CPU the fused C decode for decode steps of a few sequences).

This file must only contain code common to every model. What differs between families goes
through the family's `ModelState` (models/family.py): the position scheme, the check (and, for
pruning models, reshape) of fetched embeddings, what capture feeds the model.

Buffers are allocated once (lm_worker/buffers.py); each step fills a prefix of them and builds
an `InputBatch` that says how much is real. The model always starts from `inputs_embeds`: token
embeddings (plus media or realtime embeddings) are computed eagerly outside the graph and copied
into the static buffer, so graphs never depend on an encoder, and `input_ids` is passed as None
unless the model declares `requires_raw_input_tokens`.

Decode-only batches are padded to the next captured size when graphs are on; the padded request
count is what the attention metadata uses (metadata built for the real count would not match
the captured shapes), and padded slots write to the null block. With graphs off (the CPU) the
same buffers and the same code run eagerly without padding.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from lm_worker.attention import PagedAttention, PagedAttentionMetadata
from lm_worker.block_manager import NULL_BLOCK
from lm_worker.buffers import InputBuffers
from lm_worker.cpu_decode import FusedDecode, InvariantForward
from lm_worker.cuda_graph import CudaGraphRunner, graph_sizes
from lm_worker.inputs import EmbeddingCache, RealtimeRows, RequestInputs, gather_mm_embeddings
from lm_worker.request import Request
from lm_worker.scheduler import ScheduledBatch
from models import LoadedEmbedding, ModelState
from models.family import LanguageModel

if TYPE_CHECKING:
    from lm_worker.tensor_parallel import Ranks, WholeHeadsCache

logger = logging.getLogger(__name__)


def _no_counts() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class InputBatch:
    """One step's inputs: the real part of the persistent buffers, and what it means. The
    request fields are rank 0's (the other ranks of a tensor-parallel worker run the step
    from its arrays alone)."""

    num_tokens: int  # real tokens
    num_tokens_padded: int  # tokens the forward runs over (a graph size, or num_tokens)
    # The token index of each sampling request: [num_sampling], or the slice of all tokens
    # when each is a sampling request's last (a decode-only step: no gather of rows).
    logits_indices: torch.Tensor | slice
    attn_metadata: PagedAttentionMetadata
    use_graph: bool
    step: StepArrays  # what it was loaded from (a tensor-parallel worker sends it)
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: np.ndarray = field(default_factory=_no_counts)  # [num_reqs]
    query_start_loc: np.ndarray = field(default_factory=_no_counts)  # [num_reqs + 1]
    # [num_reqs], before this step
    num_computed_tokens: np.ndarray = field(default_factory=_no_counts)
    prefill_lens: np.ndarray = field(default_factory=_no_counts)  # [num_reqs], prompt lengths
    sampling_requests: list[Request] = field(default_factory=list)  # windows at their last token


@dataclass
class StepArrays:
    """A step's inputs as host arrays, before they are in the buffers: what rank 0 of a
    tensor-parallel worker sends the other ranks (lm_worker/tensor_parallel.py)."""

    ids: np.ndarray  # [T]
    positions: np.ndarray  # [axes, T]
    slots: np.ndarray  # [T]
    num_tokens: int
    num_decodes: int
    pad: bool  # a decode-only step padded to a graph size
    decode_seq_lens: np.ndarray  # [num_decodes]
    decode_block_ids: list[list[int]]
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]
    prefill_block_ids: list[list[int]]
    logits_indices: list[int] | None  # None: every token's

    _ARRAYS: ClassVar[tuple[str, ...]] = ("ids", "positions", "slots", "decode_seq_lens")

    def to_json(self) -> dict:
        """Plain lists and numbers (a tensor-parallel rank's message header)."""
        return {
            f.name: v.tolist() if f.name in self._ARRAYS else v
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }

    @classmethod
    def from_json(cls, d: dict) -> StepArrays:
        return cls(**{k: np.asarray(v, np.int64) if k in cls._ARRAYS else v for k, v in d.items()})


class ModelRunner:
    def __init__(
        self,
        model: LanguageModel,
        attention: PagedAttention,  # its KV cache allocated
        make_model_state: Callable[[LanguageModel], ModelState],
        *,
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
        # Capabilities, read once.
        self.requires_raw_input_tokens = model.requires_raw_input_tokens
        self.is_realtime = model.supports_realtime
        self.model_state = make_model_state(model)
        self.buffers = InputBuffers(
            max(max_num_batched_tokens, max_num_seqs),
            max_num_seqs,
            self.max_blocks_per_seq,
            self.model_state.hidden_size,
            self.model_state.position_axes,
            block_size,
            dtype,
            device,
        )
        self.model_state.inputs_embeds = self.buffers.inputs_embeds
        self.embeddings = EmbeddingCache()  # by mm_hash, for the live requests
        # The fused CPU decode (lm_worker/cpu_decode.py), where the loader chose it.
        self.fused: FusedDecode | None = None
        # lm.batch_invariant: every step through it instead (set by the loader).
        self.invariant: InvariantForward | None = None
        # Tensor parallelism: rank 0's handle on the other ranks (lm_worker/tensor_parallel.py),
        # sent each step's inputs before its forward.
        self.ranks: Ranks | None = None
        # Under tensor parallelism, every rank's heads of the KV cache (see `connector_cache`).
        self.whole_heads: WholeHeadsCache | None = None
        # Captured by `capture_graphs`, once the KV cache is allocated at its planned size.
        self.graphs: CudaGraphRunner | None = None
        self.use_graphs = use_graphs
        assert not use_graphs or device.type == "cuda", "CUDA graphs need a CUDA device"

    @property
    def connector_cache(self) -> torch.Tensor | WholeHeadsCache:
        """What the KV connector reads and writes blocks through: the KV cache, or under
        tensor parallelism every rank's heads of it."""
        return self.whole_heads if self.whole_heads is not None else self.attention.kv_cache

    def capture_graphs(self) -> None:
        """The decode graphs, over the KV cache the attention holds now (their addresses)."""
        if self.use_graphs:
            self.graphs = CudaGraphRunner(self.buffers, self.dummy_run, self.graph_sizes)
            self.graphs.capture()

    # -- requests -----------------------------------------------------------------------------

    def make_inputs(self, request: Request) -> RequestInputs:
        """The request's inputs besides its token ids, over this runner's embedding cache (a
        realtime request's rows on this runner's device)."""
        rows = None
        if request.realtime_session is not None:
            rows = RealtimeRows(self.model_state.hidden_size, self.dtype, self.device)
        return RequestInputs(request, self.embeddings, self.model_state, rows)

    def load_embedding(
        self, mm_hash: str, tensor: torch.Tensor, num_embeds: int
    ) -> LoadedEmbedding:
        """A fetched embedding on this runner's device and dtype, checked (and split) by the
        model state (EmbeddingMismatch when it cannot fill its placeholders). Thread-safe."""
        embeds = tensor.to(self.device, self.dtype)
        return self.model_state.process_mm_embeds(mm_hash, embeds, num_embeds)

    # -- per step -----------------------------------------------------------------------------

    def prepare_inputs(self, batch: ScheduledBatch) -> InputBatch:
        b = self.buffers
        requests = batch.requests
        num_reqs = len(requests)
        counts = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        computed = np.asarray([r.num_computed_tokens for r in requests], dtype=np.int64)
        prefill_lens = np.asarray([r.num_prompt_tokens for r in requests], dtype=np.int64)

        ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty((b.positions.shape[0], num_tokens), dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        logits_indices, sampling = [], []
        state = self.model_state
        bs = self.block_size
        for i, request in enumerate(requests):
            start, n = int(computed[i]), int(counts[i])
            at = int(query_start_loc[i])
            ids[at : at + n] = self._token_window(request, start, n)
            positions[:, at : at + n] = state.positions(
                request.rope, request.num_prompt_tokens, start, start + n
            )
            if n == 1:  # a decode: one slot, in Python's integers
                slots[at] = request.block_ids[start // bs] * bs + start % bs
            else:
                index = np.arange(start, start + n)
                blocks = np.asarray(request.block_ids, dtype=np.int64)
                slots[at : at + n] = blocks[index // bs] * bs + index % bs
            if start + n == request.num_tokens:
                logits_indices.append(at + n - 1)
                sampling.append(request)

        num_decodes = batch.num_decodes
        pad = self.pad_decodes and 0 < num_decodes == num_reqs <= self.graph_sizes[-1]
        computed_all = computed + counts
        step = StepArrays(
            ids=ids,
            positions=positions,
            slots=slots,
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            pad=pad,
            decode_seq_lens=computed[:num_decodes] + 1,
            decode_block_ids=[requests[i].block_ids for i in range(num_decodes)],
            prefill_query_lens=[int(counts[i]) for i in range(num_decodes, num_reqs)],
            prefill_seq_lens=[int(computed_all[i]) for i in range(num_decodes, num_reqs)],
            prefill_block_ids=[list(requests[i].block_ids) for i in range(num_decodes, num_reqs)],
            logits_indices=None if len(logits_indices) == num_tokens else logits_indices,
        )
        return self.load_step(
            step,
            requests=requests,
            num_scheduled_tokens=counts,
            query_start_loc=query_start_loc,
            num_computed_tokens=computed,
            prefill_lens=prefill_lens,
            sampling_requests=sampling,
        )

    def load_step(self, step: StepArrays, **requests_side) -> InputBatch:
        """The step's inputs into this runner's buffers, and their metadata: what every rank
        of a tensor-parallel worker does with the arrays rank 0 prepared (`requests_side`:
        the InputBatch's request fields, rank 0's, from `prepare_inputs`)."""
        b = self.buffers
        num_tokens, num_decodes, pad = step.num_tokens, step.num_decodes, step.pad
        use_graph = pad and self.graphs is not None
        padded = (
            self.graph_sizes[bisect.bisect_left(self.graph_sizes, num_decodes)]
            if pad
            else num_tokens
        )
        bs = self.block_size
        b.fill("input_ids", step.ids, padded, 0)
        b.fill("positions", step.positions, padded, 0)
        b.fill("slot_mapping", step.slots, padded, NULL_BLOCK * bs)

        # Decode block tables: full width when padded (graph shapes), else just wide enough.
        decode_rows = padded if pad else num_decodes
        seq_lens = step.decode_seq_lens
        if pad:
            width = self.max_blocks_per_seq
        else:
            width = max(-(-int(seq_lens.max(initial=1)) // self.block_size), 1)
        tables = b.host_block_tables[:decode_rows, :width]
        tables.fill(NULL_BLOCK)
        for i, row in enumerate(step.decode_block_ids):
            tables[i, : len(row)] = row
        b.fill("decode_block_tables", tables, decode_rows, NULL_BLOCK, width)
        b.fill("decode_seq_lens", seq_lens, decode_rows, 1)

        if step.prefill_query_lens:
            meta = PagedAttentionMetadata(
                slot_mapping=b.slot_mapping[:padded],
                num_decodes=decode_rows,
                decode_block_tables=b.decode_block_tables[:decode_rows, :width],
                decode_seq_lens=b.decode_seq_lens[:decode_rows],
                prefill_query_lens=step.prefill_query_lens,
                prefill_seq_lens=step.prefill_seq_lens,
                prefill_block_tables=[
                    torch.as_tensor(ids, dtype=torch.long, device=self.device)
                    for ids in step.prefill_block_ids
                ],
            )
        else:
            meta = b.decode_metadata(decode_rows, width)
        return InputBatch(
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            logits_indices=(
                slice(0, num_tokens)
                if step.logits_indices is None
                else torch.as_tensor(step.logits_indices, dtype=torch.long, device=self.device)
            ),
            attn_metadata=meta,
            use_graph=use_graph,
            step=step,
            **requests_side,
        )

    def gather_mm_embeddings(
        self, inputs: InputBatch
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The step's embedding rows in token order and is_mm_embed (lm_worker/inputs.py)."""
        return gather_mm_embeddings(
            inputs.requests,
            inputs.num_tokens,
            inputs.num_scheduled_tokens,
            inputs.query_start_loc,
            inputs.prefill_lens,
            inputs.num_computed_tokens,
            self.is_realtime,
        )

    @torch.inference_mode()
    def forward(
        self,
        inputs: InputBatch,
        mm_embeds: list[torch.Tensor],
        is_mm_embed: torch.Tensor | None,
        save_layer: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:  # [num_sampling, vocab]
        """`save_layer(layer, layer_kv)`: called in an eager forward as each layer's KV is in
        the cache (the KV connector's per-layer save; a graph replay calls nothing). Rank 0
        of a tensor-parallel worker sends the step to the other ranks first."""
        if self.ranks is None:
            return self._forward(inputs, mm_embeds, is_mm_embed, save_layer)
        try:
            self.ranks.send_step(inputs.step, mm_embeds, is_mm_embed)
            return self._forward(inputs, mm_embeds, is_mm_embed, save_layer)
        except Exception as e:
            self.ranks.check(e)  # RankLost where another rank is gone
            raise

    def _forward(self, inputs, mm_embeds, is_mm_embed, save_layer) -> torch.Tensor:
        b = self.buffers
        T, padded = inputs.num_tokens, inputs.num_tokens_padded
        if self.fused is not None and not mm_embeds and save_layer is None:
            # A CPU decode step of a few sequences: token ids to logits in C.
            logits = self.fused.step(
                b.input_ids[:padded], b.positions_view(padded), inputs.attn_metadata
            )
            if logits is not None:
                return logits[inputs.logits_indices]
        embeds = self.model.embed_input_ids(
            b.input_ids[:T],
            [e.to(self.device, self.dtype) for e in mm_embeds] or None,
            is_mm_embed.to(self.device) if mm_embeds else None,
        )
        b.inputs_embeds[:T].copy_(embeds)
        if self.invariant is not None:
            return self._invariant_logits(inputs, save_layer)
        if inputs.use_graph:
            hidden = self.graphs.replay(padded)
        else:
            self.attention.on_layer_written = save_layer
            try:
                hidden = self.model(
                    b.input_ids[:padded] if self.requires_raw_input_tokens else None,
                    b.positions_view(padded),
                    b.inputs_embeds[:padded],
                    inputs.attn_metadata,
                    intermediate_tensors=None,
                )
            finally:
                self.attention.on_layer_written = None
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, full_width: bool = True) -> torch.Tensor:
        """A forward pass over `num_tokens` decode slots of the null block, fed from
        `dummy_inputs_embeds`: warm-up and graph capture never run an encoder. The block
        tables are full width, as graphs capture them (torch's decode attention then reads
        max_model_len keys a sequence), or (not `full_width`) one block wide, as an eager step
        of short sequences has them (to time a step)."""
        b = self.buffers
        meta = b.decode_metadata(num_tokens, b.decode_block_tables.shape[1] if full_width else 1)
        return self.model(
            b.input_ids[:num_tokens] if self.requires_raw_input_tokens else None,
            b.positions_view(num_tokens),
            self.model_state.dummy_inputs_embeds(num_tokens),
            meta,
            intermediate_tensors=None,
        )

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, seq_len: int) -> None:
        """The memory planner's largest step (lm_worker/memory_plan.py): one prefill chunk of
        `num_tokens` tokens at the end of a `seq_len`-token sequence (its prefix read from the
        null block; its keys written there), fed from `dummy_inputs_embeds` as media rows are,
        and the logits of as many rows as a step samples at most."""
        b = self.buffers
        meta = PagedAttentionMetadata(
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            num_decodes=0,
            decode_block_tables=b.decode_block_tables[:0],
            decode_seq_lens=b.decode_seq_lens[:0],
            prefill_query_lens=[num_tokens],
            prefill_seq_lens=[seq_len],
            prefill_block_tables=[
                torch.full((-(-seq_len // self.block_size),), NULL_BLOCK, device=self.device)
            ],
        )
        hidden = self.model(
            b.input_ids[:num_tokens] if self.requires_raw_input_tokens else None,
            b.positions_view(num_tokens),
            self.model_state.dummy_inputs_embeds(num_tokens),
            meta,
            intermediate_tensors=None,
        )
        self.model.compute_logits(hidden[-min(num_tokens, b.decode_seq_lens.shape[0]) :])

    @torch.inference_mode()
    def dummy_decode(self, num_seqs: int, fused: FusedDecode | None = None) -> torch.Tensor:
        """A decode step's logits over `num_seqs` slots of the null block, its block tables one
        block wide as an eager step of short sequences has them, through `fused` (None: the
        modules): what the loader times to choose the fused decode."""
        b = self.buffers
        ids, positions = b.input_ids[:num_seqs], b.positions_view(num_seqs)
        meta = b.decode_metadata(num_seqs, 1)
        if fused is not None:
            logits = fused.step(ids, positions, meta)
            if logits is not None:
                return logits
        hidden = self.model(None, positions, self.model.embed_input_ids(ids), meta)
        return self.model.compute_logits(hidden)

    def _invariant_logits(
        self, inputs: InputBatch, save_layer: Callable[[int, torch.Tensor], None] | None
    ) -> torch.Tensor:
        """The step through the batch-invariant forward (its real tokens; padding is for
        graphs). Its layers run in one C call, so the KV connector's per-layer save gets each
        layer after it."""
        T, b = inputs.num_tokens, self.buffers
        sample = inputs.logits_indices
        sample = np.arange(T) if isinstance(sample, slice) else sample.cpu().numpy()
        logits = self.invariant.logits(
            b.inputs_embeds[:T],
            b.positions_view(T),
            [r.block_ids for r in inputs.requests],
            inputs.num_computed_tokens,
            inputs.num_scheduled_tokens,
            sample,
        )
        if save_layer is not None:
            for layer, layer_kv in enumerate(self.attention.kv_cache):
                save_layer(layer, layer_kv)
        return logits

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _token_window(request: Request, start: int, n: int) -> list[int]:
        prompt_len = request.num_prompt_tokens
        if start >= prompt_len:
            return request.output_token_ids[start - prompt_len : start - prompt_len + n]
        prompt = request.model_prompt
        if start + n <= prompt_len:
            return prompt[start : start + n]
        return prompt[start:] + request.output_token_ids[: start + n - prompt_len]
