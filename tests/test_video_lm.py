"""Video prompts through the LM engine against transformers' Qwen2.5-VL.

- EVS off: a video file's prompt gives transformers' logits and greedy tokens (transformers
  runs its own tower and M-RoPE on our pixel values);
- EVS on (q = 0.5, 0.75): the encoder prunes and appends positions; the engine's model state
  strips them and recomputes the prompt's M-RoPE positions. Held against transformers' language
  model run on the same pruned embeddings at positions computed here, independently, from the
  rule (kept tokens at their own (t, h, w) offset by where the video starts; text resumes after
  max(h, w) as with every token kept); prefill chunks that start, end or cut through a video,
  several videos and an image in one prompt, and the decode delta after it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lm_worker.request import Request
from models import FamilyOptions, MMFeature, SamplingParams, expand_placeholders, load_family
from models.qwen2_vl.evs import POSITION_CHANNELS
from models.testing import VideoItem
from tests.lm_helpers import make_engine, run
from tests.model_helpers import hf_inputs, hf_model, make_video, png

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def theirs(tiny_checkpoint):
    return hf_model(tiny_checkpoint)


def test_video_file_logits_and_greedy_equal_transformers(tiny_checkpoint, tiny_ref, theirs):
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}
    ]
    media = [VideoItem(container=make_video("mp4", 16, 4, 64, 48, seed=1))]
    prepared = tiny_ref.prepare(messages, media)
    assert prepared.media[0].grid.grid_thw[0] == 4  # 8 frames sampled at 2 fps
    inputs = hf_inputs(tiny_ref, prepared)
    with torch.no_grad():
        want_logits = theirs(**inputs).logits[0]
    got_logits = tiny_ref.prefill_logits(prepared)
    assert (got_logits - want_logits).abs().max().item() <= 2e-4
    want = theirs.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    want = want[0, len(prepared.token_ids) :].tolist()
    # Through the engine too (the proxy's placeholder count, the encoder's embedding).
    (embeds,) = tiny_ref.embed_media(prepared.media)
    span = prepared.spans[0]
    feature = MMFeature(
        "v", span.offset, len(embeds), None, "video", span.grid_thw, span.second_per_grid_t
    )
    request = Request(
        "r",
        list(prepared.token_ids),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS),
        [feature],
    )
    out = run(make_engine(tiny_checkpoint), (request, {"v": embeds}))
    assert out["r"].token_ids == want


# -- EVS ------------------------------------------------------------------------------------------


def expected_positions(token_ids, items, merge: int) -> tuple[np.ndarray, int]:
    """[3, P] positions and the decode delta, from the rule (see the module docstring)."""
    columns, cursor, pos = [], 0, 0
    for offset, length, grid, kept in items:
        for _ in range(offset - cursor):
            columns.append((pos, pos, pos))
            pos += 1
        gh, gw = grid[1] // merge, grid[2] // merge
        if kept is None:  # an image: its whole grid
            kept = [(0, h, w) for h in range(gh) for w in range(gw)]
        assert len(kept) == length
        columns.extend((t + pos, h + pos, w + pos) for t, h, w in kept)
        pos += max(gh, gw)
        cursor = offset + length
    for _ in range(len(token_ids) - cursor):
        columns.append((pos, pos, pos))
        pos += 1
    positions = np.asarray(columns, dtype=np.int64).T
    return positions, int(positions.max()) + 1 - len(token_ids)


def decode_channels(wide: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list]:
    """The test's own reading of the published layout: [hidden | t_hi t_lo h_hi h_lo w_hi w_lo
    gw_hi gw_lo]."""
    tail = wide[:, hidden:].round().long().tolist()
    kept = [(r[0] * 256 + r[1], r[2] * 256 + r[3], r[4] * 256 + r[5]) for r in tail]
    return wide[:, :hidden], kept


@torch.inference_mode()
def hf_greedy(theirs, token_ids, mm_rows, positions, delta, steps: int) -> list[int]:
    """transformers' language model on the given embeddings and positions, greedy, no cache."""
    lm = theirs.model.language_model
    ids = torch.tensor(token_ids)
    embeds = lm.embed_tokens(ids)
    for offset, rows in mm_rows:
        embeds[offset : offset + len(rows)] = rows
    pos = torch.from_numpy(positions)
    out = []
    for _ in range(steps):
        hidden = lm(inputs_embeds=embeds[None], position_ids=pos[:, None, :]).last_hidden_state
        token = int(theirs.lm_head(hidden[0, -1]).argmax())
        out.append(token)
        index = embeds.shape[0]
        embeds = torch.cat([embeds, lm.embed_tokens(torch.tensor([token]))])
        pos = torch.cat([pos, torch.full((3, 1), index + delta)], dim=1)
    return out


@pytest.fixture(scope="module")
def evs_prompt(tiny_checkpoint):
    """prompt(q) -> (family, token ids, features, published embeddings by hash, items)."""
    cache = {}

    def get(q: float):
        if q in cache:
            return cache[q]
        family = load_family(tiny_checkpoint, FamilyOptions(video_pruning_rate=q))
        processor = family.processor()
        encoder = family.load_encoder(torch.float32, torch.device("cpu"))
        tok = family.tokenizer()
        from models import MediaInput

        media = [
            MediaInput("video", video=make_video("mp4", 16, 4, 112, 112, seed=2, still_every=2)),
            MediaInput("image", image=png(56, 84, seed=3)),
            MediaInput("video", video=make_video("webm", 12, 4, 84, 112, seed=4)),
        ]
        content = [
            {"type": "text", "text": "First"},
            {"type": "video"},
            {"type": "image"},
            {"type": "text", "text": "then"},
            {"type": "video"},
            {"type": "text", "text": "compare them."},
        ]
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))
        processed = [processor.preprocess(m) for m in media]
        ph = family.placeholder_token_ids
        ids, runs = expand_placeholders(
            ids, (ph["image"], ph["video"]), [p.grid.num_tokens for p in processed]
        )
        with torch.inference_mode():
            outputs = encoder.embed(processed)
        features, published = [], {}
        for i, ((offset, length), p, out) in enumerate(zip(runs, processed, outputs, strict=True)):
            h = f"q{q}-item{i}"
            g = p.grid
            features.append(
                MMFeature(h, offset, length, None, g.modality, g.grid_thw, g.second_per_grid_t)
            )
            published[h] = out
        cache[q] = family, ids, features, published, processed
        return cache[q]

    return get


def video_time_positions(
    grid_t: int, second_per_grid_t: float, tokens_per_second: float
) -> list[int]:
    """Temporal positions of a Qwen2.5-VL video's patches at position 0, from the rule: patch i
    sits at i * (tokens_per_second * second_per_grid_t), the interval a float32 product and the
    position truncated toward zero (as transformers' get_rope_index computes it)."""
    interval = np.float32(tokens_per_second) * np.float32(second_per_grid_t)
    return (np.arange(grid_t, dtype=np.float32) * interval).astype(np.int64).tolist()


@pytest.mark.parametrize("q", [0.5, 0.75])
def test_evs_grid_and_published_layout(tiny_checkpoint, evs_prompt, q):
    family, _, features, published, processed = evs_prompt(q)
    hidden = family.text.hidden_size
    # Read from the checkpoint itself, not from the family's parsed config.
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    tokens_per_second = config["vision_config"]["tokens_per_second"]
    for f, p in zip(features, processed, strict=True):
        wide = published[f.mm_hash]
        if f.modality == "image":
            assert wide.shape == (f.length, hidden)
            continue
        assert p.grid.num_unpruned_tokens > f.length == wide.shape[0]
        assert wide.shape[1] == hidden + POSITION_CHANNELS
        _, kept = decode_channels(wide, hidden)
        gt, gh, gw = p.grid.grid_thw[0], p.grid.grid_thw[1] // 2, p.grid.grid_thw[2] // 2
        per_frame = gh * gw
        # The first temporal patch whole, then kept tokens in frame-major order.
        assert [k[1:] for k in kept[:per_frame]] == [(h, w) for h in range(gh) for w in range(gw)]
        assert kept == sorted(kept) and len(set(kept)) == len(kept)
        assert f.length == max(per_frame, int(gt * per_frame * (1 - q)))
        times = video_time_positions(gt, p.grid.second_per_grid_t, tokens_per_second)
        grid = {(t, h, w) for t in times for h in range(gh) for w in range(gw)}
        assert set(kept) <= grid, (sorted(set(kept) - grid), times)
        # Past the first temporal patch, every kept token carries a later patch's time.
        assert {k[0] for k in kept[per_frame:]} <= set(times[1:]), times
        assert int(wide[0, -2:].round()[0]) * 256 + int(wide[0, -1].round()) == gw


_HF_TOKENS: dict[float, list[int]] = {}


@pytest.mark.parametrize("q", [0.5, 0.75])
@pytest.mark.parametrize("chunk", [4096, 7], ids=lambda c: f"chunk{c}")
def test_evs_greedy_equals_transformers_lm(tiny_checkpoint, theirs, evs_prompt, q, chunk):
    family, ids, features, published, _ = evs_prompt(q)
    hidden = family.text.hidden_size
    items, mm_rows = [], []
    for f in features:
        wide = published[f.mm_hash]
        if f.modality == "video":
            rows, kept = decode_channels(wide, hidden)
        else:
            rows, kept = wide, None
        items.append((f.offset, f.length, f.grid_thw, kept))
        mm_rows.append((f.offset, rows))
    positions, delta = expected_positions(ids, items, merge=2)
    if q not in _HF_TOKENS:  # the same for every chunk size
        _HF_TOKENS[q] = hf_greedy(theirs, ids, mm_rows, positions, delta, NEW_TOKENS)
    want = _HF_TOKENS[q]

    engine = make_engine(
        tiny_checkpoint, family=family, max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 16)
    )
    loaded = {
        f.mm_hash: engine.load_embedding(f.mm_hash, published[f.mm_hash], f.num_embeds)
        for f in features
    }
    request = Request(
        "r",
        list(ids),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS),
        list(features),
    )
    out = run(engine, (request, loaded))
    assert out["r"].last.error is None
    prompt_positions, got_delta = request.rope
    np.testing.assert_array_equal(prompt_positions, positions)
    assert got_delta == delta
    assert out["r"].token_ids == want
    if chunk < 100:  # chunk boundaries fall inside the videos
        boundaries = range(0, len(ids), chunk)
        cut = [f for f in features if any(f.offset < k < f.offset + f.length for k in boundaries)]
        assert any(f.modality == "video" for f in cut)


def test_pruned_embedding_refused_with_evs_off(tiny_checkpoint, evs_prompt):
    _, _, features, published, _ = evs_prompt(0.5)
    engine = make_engine(tiny_checkpoint)  # the checkpoint's own rate: 0, off
    video = next(f for f in features if f.modality == "video")
    from models import EmbeddingMismatch

    with pytest.raises(EmbeddingMismatch, match="video pruning is off"):
        engine.load_embedding(video.mm_hash, published[video.mm_hash], video.num_embeds)
