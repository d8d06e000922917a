"""The LM path against transformers on the same checkpoint: M-RoPE positions equal
`get_rope_index`, prefill logits within 1e-4 (fp32), greedy generation token for token."""

from __future__ import annotations

import pytest
import torch

from models import SamplingParams
from models.qwen2_vl.language_model import Qwen2LanguageModel
from models.qwen2_vl.rope import MediaSpan, mrope_decode_positions, mrope_positions
from models.testing import ContiguousKVAttention, ImageItem, ReferenceModel, VideoItem
from tests.model_helpers import build_tiny, hf_inputs, hf_model, png

LOGITS_ATOL = 1e-4
NEW_TOKENS = 40


def image(part_text: str | None = None) -> list[dict]:
    parts = [{"type": "image"}]
    return parts + ([{"type": "text", "text": part_text}] if part_text else [])


PROMPTS = {
    "text only": (
        [{"role": "user", "content": "Write a short poem about the sea at night."}],
        [],
    ),
    "one image": (
        [{"role": "user", "content": image("Describe the image.")}],
        [ImageItem(png(100, 80, seed=1))],
    ),
    "two images": (
        [{"role": "user", "content": [*image(), *image("What differs?")]}],
        [ImageItem(png(60, 140, seed=2)), ImageItem(png(90, 90, seed=3))],
    ),
    "interleaved": (
        [
            {"role": "user", "content": [{"type": "text", "text": "First:"}, *image("then")]},
            {"role": "assistant", "content": "A red bicycle."},
            {"role": "user", "content": [*image("And this one, with"), *image("?")]},
        ],
        [
            ImageItem(png(50, 50, seed=4)),
            ImageItem(png(200, 30, seed=5), {"max_pixels": 28 * 28 * 8}),
            ImageItem(png(40, 70, seed=6)),
        ],
    ),
    "video": (
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Summarise."}]}],
        [VideoItem(tuple(png(64, 48, seed=10 + i) for i in range(5)), fps=2.0)],
    ),
    "video and image": (
        [{"role": "user", "content": [*image("vs"), {"type": "video"}]}],
        [
            ImageItem(png(70, 70, seed=7)),
            VideoItem(tuple(png(56, 84, seed=20 + i) for i in range(4)), fps=0.5),
        ],
    ),
}

CHECKPOINTS = [("qwen2_vl", False), ("qwen2_vl", True), ("qwen2_5_vl", False), ("qwen2_5_vl", True)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """pair(arch, tie) -> (our ReferenceModel, transformers' model), built once per module."""
    root = tmp_path_factory.mktemp("lm")
    loaded = {}

    def get(arch: str, tie: bool):
        if (arch, tie) not in loaded:
            ckpt = build_tiny(root, arch, tie_word_embeddings=tie)
            loaded[arch, tie] = ReferenceModel(ckpt), hf_model(ckpt)
        return loaded[arch, tie]

    return get


@pytest.mark.parametrize(("arch", "tie"), CHECKPOINTS, ids=lambda v: str(v))
@pytest.mark.parametrize("prompt", PROMPTS, ids=str)
def test_positions_and_logits_equal_reference(pair, arch, tie, prompt):
    ours, theirs = pair(arch, tie)
    messages, media = PROMPTS[prompt]
    prepared = ours.prepare(messages, media)
    inputs = hf_inputs(ours, prepared)
    positions, delta = ours.positions(prepared)
    if media:
        want_pos, want_delta = theirs.model.get_rope_index(**inputs)
        assert torch.equal(positions, want_pos[:, 0])
        assert delta == int(want_delta)
    else:
        assert torch.equal(positions, torch.arange(len(prepared.token_ids)).expand(3, -1))
        assert delta == 0
    with torch.no_grad():
        want = theirs(**inputs).logits[0]
    got = ours.prefill_logits(prepared)
    diff = (got - want).abs().max().item()
    assert diff <= LOGITS_ATOL, diff
    assert want.std() > 0.1  # logits with real spread


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("prompt", ["text only", "two images", "video and image"], ids=str)
def test_greedy_generation_equals_reference(pair, arch, prompt):
    ours, theirs = pair(arch, arch == "qwen2_vl")
    messages, media = PROMPTS[prompt]
    prepared = ours.prepare(messages, media)
    inputs = hf_inputs(ours, prepared)
    want = theirs.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)[
        0, len(prepared.token_ids) :
    ].tolist()
    got = ours.generate(messages, media, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert len(got) == NEW_TOKENS >= 32
    assert got == want


def test_packed_sequences_equal_one_at_a_time(pair):
    ours, _ = pair("qwen2_5_vl", False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prepared = [ours.prepare(*PROMPTS[name]) for name in ("one image", "text only", "video")]
    together = ours.generate_many(prepared, params)
    alone = [ours.generate_many([p], params)[0] for p in prepared]
    assert together == alone
    # Stopping: eos ends a sequence early (its cache is freed), max_tokens bounds it.
    first = alone[1][0]
    stopped = ours.generate_many(
        [prepared[1]], SamplingParams(12, temperature=0.0, stop_token_ids=(first,))
    )
    assert stopped == [[first]]
    assert ours.attention.num_sequences == 0


def test_sampling_is_seeded(pair):
    ours, _ = pair("qwen2_5_vl", False)
    messages, media = PROMPTS["one image"]
    a = ours.generate(messages, media, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    b = ours.generate(messages, media, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    c = ours.generate(messages, media, max_tokens=16, temperature=1.0, top_k=5, seed=8)
    assert a == b and len(c) == 16


def test_mrope_positions_edge_cases(pair):
    # A video whose scaled time runs past its height and width, and a non-integer interval.
    ours, theirs = pair("qwen2_5_vl", False)
    tok = ours.arch.tokens
    spans = [
        MediaSpan(3, (2, 4, 4), "video", 4.0),  # interval 2 * 4 = 8 > max(h, w) / 2
        MediaSpan(12, (3, 2, 6), "video", 2 / 3),  # interval 1.33
        MediaSpan(25, (1, 2, 2), "image"),
    ]
    ids = torch.full((1, 30), 5)
    types = torch.zeros_like(ids)
    for s in spans:
        n = s.grid_thw[0] * s.grid_thw[1] * s.grid_thw[2] // 4
        is_video = s.modality == "video"
        ids[0, s.offset : s.offset + n] = tok.video_token_id if is_video else tok.image_token_id
        types[0, s.offset : s.offset + n] = 2 if is_video else 1
    want, want_delta = theirs.model.get_rope_index(
        ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor([spans[2].grid_thw]),
        video_grid_thw=torch.tensor([spans[0].grid_thw, spans[1].grid_thw]),
        second_per_grid_ts=torch.tensor([4.0, 2 / 3]),
    )
    got, delta = mrope_positions(30, spans, 2, ours.arch.vision.tokens_per_second)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    assert torch.equal(mrope_decode_positions(30, 2, delta), torch.tensor([[30, 31]] * 3) + delta)
    with pytest.raises(ValueError, match="overlap"):
        mrope_positions(30, [spans[0], MediaSpan(4, (1, 2, 2), "image")], 2)


def test_lm_interface(pair):
    ours, _ = pair("qwen2_vl", True)
    lm = ours.lm
    assert (lm.requires_raw_input_tokens, lm.supports_realtime) == (False, False)
    assert lm.supports_multimodal_pruning is True  # EVS embeddings, stripped by its state
    assert lm.lm_head.weight is lm.embed_tokens.weight  # tied: the head is the embedding matrix
    ids = torch.tensor([1, 2, 3, 4, 5])
    rows = [torch.randn(2, lm.config.hidden_size), torch.randn(1, lm.config.hidden_size)]
    mask = torch.tensor([False, True, True, False, True])
    embeds = lm.embed_input_ids(ids, rows, mask)
    assert torch.equal(embeds[mask], torch.cat(rows))
    assert torch.equal(embeds[~mask], lm.embed_input_ids(ids)[~mask])
    with pytest.raises(ValueError, match="3 rows marked"):
        lm.embed_input_ids(ids, rows[:1], mask)


def test_lm_loads_with_any_backend(pair):
    # The model calls backend(layer_idx, q, k, v, metadata) and nothing else.
    ours, _ = pair("qwen2_5_vl", False)
    calls = []

    def backend(layer_idx, q, k, v, attn_metadata):
        calls.append((layer_idx, q.shape, k.shape, attn_metadata))
        return ContiguousKVAttention(1)(0, q, k, v, ContiguousKVAttention(1).metadata([0], [5]))

    lm = Qwen2LanguageModel(ours.lm.config, backend)
    lm.load_weights(ours.lm.state_dict())
    hidden = lm(torch.arange(5), torch.arange(5), attn_metadata="step-1")
    cfg = ours.lm.config
    assert hidden.shape == (5, cfg.hidden_size)
    assert calls == [
        (i, (5, cfg.num_heads, cfg.head_dim), (5, cfg.num_kv_heads, cfg.head_dim), "step-1")
        for i in range(cfg.num_layers)
    ]


def test_merged_projections_give_the_checkpoints_numbers(pair):
    # The serving model merges q / k / v and gate / up into one layer each: same logits over a
    # prefill and a decode step as the checkpoint's separate layers.
    ours, _ = pair("qwen2_5_vl", False)
    cfg = ours.lm.config
    models = []
    for merge in (False, True):
        attention = ContiguousKVAttention(cfg.num_layers)
        lm = Qwen2LanguageModel(cfg, attention)
        lm.load_weights(ours.lm.state_dict())
        if merge:
            lm.merge_projections()
        models.append((lm, attention))
    merged = models[1][0]
    assert merged.layers[0].self_attn.qkv_proj.out_features == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    )
    assert not hasattr(merged.layers[0].mlp, "gate_proj")
    outs = []
    with torch.inference_mode():
        for lm, attention in models:
            ids = torch.arange(7) + 3
            prefill = lm(ids, torch.arange(7), attn_metadata=attention.metadata([0], [7]))
            step = lm(
                torch.tensor([9]), torch.tensor([7]), attn_metadata=attention.metadata([0], [1])
            )
            outs.append(lm.compute_logits(torch.cat([prefill, step])))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=LOGITS_ATOL)
