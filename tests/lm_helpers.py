"""Helpers for the LM worker tests: engines over a tiny checkpoint, the reference path's
expected tokens, and requests built like the proxy builds them."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch
from PIL import Image

from common.config import LMConfig
from lm_worker.engine import LMEngine, RequestOutput
from lm_worker.loader import build_engine
from lm_worker.request import Request
from models import MMFeature, ModelFamily, SamplingParams, load_family
from models.testing import ImageItem, ReferenceModel


def png(width: int, height: int, color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    image = Image.new("RGB", (width, height), color)
    # A gradient, so patches differ and the tower's output is not one repeated row.
    for x in range(0, width, 3):
        image.putpixel((x, x % height), (x % 256, 255 - x % 256, 90))
    image.save(buf, "PNG")
    return buf.getvalue()


def make_engine(checkpoint, family: ModelFamily | None = None, **lm) -> LMEngine:
    """An engine over the checkpoint's family (or `family`: a test family), fp32, no metrics
    registry; `lm` are LMConfig settings, plus pad_decodes."""
    lm.setdefault("kv_cache_bytes", 32 << 20)
    lm.setdefault("max_num_seqs", 16)
    lm.setdefault("max_num_batched_tokens", 256)
    pad = lm.pop("pad_decodes", False)
    kv = {k: lm.pop(k) for k in ("kv_store", "kv_direct") if k in lm}
    family = family or load_family(checkpoint)
    return build_engine(LMConfig(**lm), family, torch.float32, registry=None, pad_decodes=pad, **kv)


@dataclass
class Collected:
    outputs: list[RequestOutput] = field(default_factory=list)

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.append(out)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]


@dataclass
class Case:
    """One prompt with its media, as the engine gets it, and the reference's answer."""

    request_id: str
    token_ids: list[int]
    features: list[MMFeature]
    embeddings: dict[str, torch.Tensor]
    expected: list[int]

    def request(self, **sampling) -> Request:
        sampling.setdefault("temperature", 0.0)
        sampling.setdefault("ignore_eos", True)
        sampling.setdefault("max_tokens", len(self.expected))
        return Request(
            self.request_id, list(self.token_ids), SamplingParams(**sampling), list(self.features)
        )


def case(ref: ReferenceModel, request_id: str, text: str, images=(), max_tokens: int = 24) -> Case:
    """A chat prompt with `images` (PNG bytes) before the text, and the reference's greedy
    tokens for it."""
    return case_parts(ref, request_id, [*images, text], max_tokens)


def three_cases(ref: ReferenceModel) -> dict[str, Case]:
    """The text, one-image and two-image prompts the engine and KV tests hold to the reference."""
    return {
        "text": case(ref, "text", "Hello there, how are you today?"),
        "image": case(ref, "image", "What is in this picture?", [png(120, 64)]),
        "two": case(ref, "two", "Compare them", [png(56, 56), png(84, 112, (10, 200, 30))]),
    }


def case_parts(ref: ReferenceModel, request_id: str, parts, max_tokens: int = 24) -> Case:
    """A chat prompt of `parts` in order (text, or PNG bytes for an image), and the
    reference's greedy tokens for it."""
    content = [
        {"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts
    ]
    messages = [{"role": "user", "content": content}]
    items = [ImageItem(p) for p in parts if isinstance(p, bytes)]
    prepared = ref.prepare(messages, items)
    embeds = ref.embed_media(prepared.media)
    features, embeddings = [], {}
    for i, (span, e) in enumerate(zip(prepared.spans, embeds, strict=True)):
        mm_hash = f"{request_id}-img{i}"
        features.append(MMFeature(mm_hash, span.offset, e.shape[0], None, "image", span.grid_thw))
        embeddings[mm_hash] = e
    expected = ref.generate(messages, items, max_tokens=max_tokens, ignore_eos=True)
    return Case(request_id, prepared.token_ids, features, embeddings, expected)


def run(engine: LMEngine, *cases_and_requests) -> dict[str, Collected]:
    """Add (Request, embeddings) pairs or Cases, run to completion, collect outputs by id."""
    sinks: dict[str, Collected] = {}
    for item in cases_and_requests:
        if isinstance(item, Case):
            request, embeddings = item.request(), item.embeddings
        else:
            request, embeddings = item
        sinks[request.request_id] = Collected()
        engine.add_request(request, sinks[request.request_id], embeddings)
    engine.run_to_completion()
    return sinks


def decode_case(
    dtype, seq_lens, head_dim, device="cuda", block=16, kv_heads=2, heads=8, width=None
):
    """A PagedAttention with a random cache and decode metadata over scattered blocks, block
    tables `width` wide (wider than the longest sequence needs, as under graphs), and a query
    per sequence: the inputs of the paged decode kernel and of the torch path."""
    from lm_worker.attention import PagedAttention, PagedAttentionMetadata

    torch.manual_seed(0)
    need = [-(-n // block) for n in seq_lens]
    att = PagedAttention(block, head_dim)
    att.allocate(1, sum(need) + 8, kv_heads, head_dim, dtype, torch.device(device))
    att.kv_cache.normal_()
    width = width or max(need) + 3
    order = (torch.randperm(sum(need) + 7) + 1).tolist()  # never the null block 0
    tables = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long, device=device),
        num_decodes=len(seq_lens),
        decode_block_tables=tables.to(device),
        decode_seq_lens=torch.tensor(seq_lens, device=device),
        prefill_query_lens=[],
        prefill_seq_lens=[],
        prefill_block_tables=[],
    )
    q = torch.randn(len(seq_lens), heads, head_dim, dtype=dtype, device=device)
    return att, q, meta
