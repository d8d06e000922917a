"""Qwen3-VL, dense and MoE, held against transformers on checkpoints of odd sizes, including
ones transformers itself wrote (`save_pretrained` of the model it loaded from ours); then
through the LM engine (chunked prefill through an image, prefill -> decode handover) and
start-up refusals of configs this code cannot serve. Video: sampling, sizing, timestamps and
the prompt run as transformers' Qwen3-VL processor makes them, positions, logits and tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from connector.wire import decode, encode
from lm_worker.request import Request
from models import MediaInput, MMFeature, SamplingParams, load_family
from models.checkpoint import CheckpointError
from models.qwen3_vl.language_model import Experts
from models.testing import ImageItem, ReferenceModel, VideoItem, make_checkpoint
from tests.lm_helpers import case_parts, make_engine, png, run
from tests.model_helpers import (
    TORCH_THREADS,
    hf_image_processor,
    hf_inputs,
    make_video,
    random_image,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")
# (name, arch, overrides): odd sizes; the MoE one with a dense layer among its sparse ones.
CHECKPOINTS = {
    "dense": ("qwen3_vl", {}),
    "dense-odd": (
        "qwen3_vl",
        {"vision_depth": 4, "deepstack_visual_indexes": (1, 2, 3), "num_layers": 4},
    ),
    "moe": ("qwen3_vl_moe", {}),
    "moe-odd": (
        "qwen3_vl_moe",
        {"num_experts": 5, "num_experts_per_tok": 3, "tie_word_embeddings": True},
    ),
}


def hf_class(arch: str):
    import transformers

    if arch == "qwen3_vl_moe":
        return transformers.Qwen3VLMoeForConditionalGeneration
    return transformers.Qwen3VLForConditionalGeneration


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (checkpoint dir, ReferenceModel, transformers model). Each `-hf` entry is the
    checkpoint transformers wrote from the model it loaded (its own layout and names)."""
    torch.set_num_threads(TORCH_THREADS)
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        path = make_checkpoint(root / name, arch, "tiny", seed=3, **overrides)
        hf = hf_class(arch).from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (path, ReferenceModel(path), hf)
        if name in ("dense", "moe"):
            written = root / f"{name}-hf"
            hf.save_pretrained(written)
            for file in TOKENIZER_FILES:
                shutil.copy(path / file, written / file)
            out[f"{name}-hf"] = (written, ReferenceModel(written), hf)
    return out


def chat(*parts):
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


IMAGES = [png(100, 70), png(64, 130, (10, 200, 30)), png(200, 40, (0, 0, 255))]
VIDEO = make_video("mp4", 11, 4, 96, 64, seed=3)  # 5 frames sampled: 3 temporal patches
PROMPTS = {
    "text": (chat("Tell me about the weather."), []),
    "image": (chat(None, "What is this?"), IMAGES[:1]),
    "two images": (chat(None, "and", None, "compared?"), IMAGES[1:]),
}


def test_preprocessing_equals_reference(pairs):
    path, ref, _ = pairs["dense"]
    settings = json.loads((path / "preprocessor_config.json").read_text())
    theirs = hf_image_processor(
        **{k: settings[k] for k in ("patch_size", "merge_size", "size", "image_mean", "image_std")}
    )
    for size in [(100, 70), (33, 250), (512, 300)]:
        data = random_image(*size, seed=sum(size))
        ours = ref.processor.process_picture(data)
        expected = theirs(images=[data], return_tensors="pt")
        assert list(ours.grid.grid_thw) == expected["image_grid_thw"][0].tolist()
        torch.testing.assert_close(ours.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["dense", "dense-odd", "moe-odd", "dense-hf"])
def test_vision_outputs_and_every_deepstack_level_equal_reference(pairs, name):
    _, ref, hf = pairs[name]
    media = [ref.processor.process_image(d) for d in IMAGES]
    pixels = torch.cat([m.pixel_values for m in media])
    grids = torch.tensor([m.grid.grid_thw for m in media])
    with torch.no_grad():
        theirs = hf.model.visual(pixels, grid_thw=grids)
    ours = torch.cat(ref.embed_media(media))  # [tokens, 1 + levels, hidden]
    levels = theirs.deepstack_features
    assert ours.shape == (theirs.pooler_output.shape[0], 1 + len(levels), ref.arch.text.hidden_size)
    torch.testing.assert_close(ours[:, 0], theirs.pooler_output, rtol=1e-5, atol=1e-5)
    for i, level in enumerate(levels):
        torch.testing.assert_close(ours[:, 1 + i], level, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [*list(CHECKPOINTS), "dense-hf", "moe-hf"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_logits_equal_reference(pairs, name, prompt):
    _, ref, hf = pairs[name]
    messages, images = PROMPTS[prompt]
    prepared = ref.prepare(messages, [ImageItem(d) for d in images])
    with torch.no_grad():
        theirs = hf(**hf_inputs(ref, prepared)).logits[0]
    torch.testing.assert_close(ref.prefill_logits(prepared), theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["dense", "moe", "moe-hf"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_tokens_equal_reference(pairs, name, prompt):
    _, ref, hf = pairs[name]
    messages, images = PROMPTS[prompt]
    items = [ImageItem(d) for d in images]
    prepared = ref.prepare(messages, items)
    with torch.no_grad():
        out = hf.generate(**hf_inputs(ref, prepared), max_new_tokens=16, do_sample=False)
    theirs = out[0, len(prepared.token_ids) :].tolist()
    ours = ref.generate(messages, items, max_tokens=16)
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_engine_equals_reference_with_chunks_through_an_image(pairs, name):
    path, ref, _ = pairs[name]
    cases = {
        "text": case_parts(ref, "text", ["Hello there, how are you today?"]),
        "image": case_parts(ref, "image", [IMAGES[0], "What is in this picture?"]),
        "two": case_parts(ref, "two", [IMAGES[1], "and", IMAGES[2], "compare"]),
    }
    out = run(make_engine(path), *cases.values())
    for key, c in cases.items():
        assert out[key].token_ids == c.expected, key
    # Chunks of 8 cut each image's placeholders: every chunk gathers its rows of every level.
    image = cases["two"]
    f = image.features[0]
    assert any(f.offset < k < f.offset + f.length for k in range(8, f.offset + f.length, 8))
    engine = make_engine(path, max_num_batched_tokens=8, max_num_seqs=4)
    out = run(engine, image, cases["text"])
    assert out["two"].token_ids == image.expected
    assert out["text"].token_ids == cases["text"].expected


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_fused_cpu_decode_gives_the_reference_tokens(pairs, name):
    """Decode steps through the fused C decode (per-head q / k norms; the MoE's routed
    experts) give the reference's tokens; the batch-invariant C forward, which runs prefill
    too, refuses a model with deepstack levels, by name."""
    from lm_worker.cpu_kernels import c_library

    if c_library()[1]:
        pytest.skip(f"our C kernels cannot run here: {c_library()[1]}")
    path, ref, _ = pairs[name]
    cases = [
        case_parts(ref, "text", ["Hello there, how are you today?"]),
        case_parts(ref, "image", [IMAGES[0], "What is in this picture?"]),
    ]
    engine = make_engine(path, cpu_fused_decode="on")
    assert engine.runner.fused is not None
    for c in cases:
        assert run(engine, c)[c.request_id].token_ids == c.expected
    with pytest.raises(RuntimeError, match="deepstack"):
        make_engine(path, batch_invariant=True)


def test_prefill_then_decode_equals_the_reference(pairs, redis_server):
    """P + D: the prefill engine adds the deepstack levels; the decode engine takes the KV
    they went into and gathers no embedding at all."""
    from tests.test_kv_connector import handover, shared_engine

    path, ref, _ = pairs["moe"]
    c = case_parts(ref, "pd", [IMAGES[0], "Describe", IMAGES[1]])
    prefill = shared_engine(path, redis_server.url)
    decode_engine = shared_engine(path, redis_server.url)
    tokens, rest = handover(prefill, decode_engine, c)
    assert tokens == c.expected
    assert rest.last.num_cached_tokens == len(c.token_ids)


@pytest.mark.parametrize(("total", "fps"), [(11, 4.0), (48, 24.0), (300, 30.0), (7, 2.0), (3, 1.0)])
def test_video_sampling_sizing_and_timestamps_equal_reference(total, fps):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    from models.qwen3_vl.processing import (
        VIDEO_DEFAULTS,
        patch_timestamps,
        sample_frame_indices,
        video_resize,
    )

    theirs = Qwen3VLVideoProcessor(min_frames=4, max_frames=768, fps=2)
    want = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=2).tolist()
    ours = sample_frame_indices(total, fps, VIDEO_DEFAULTS)
    assert ours == want
    assert patch_timestamps(ours, fps, 2) == Qwen3VLProcessor._calculate_timestamps(
        None, list(want), fps, 2
    )
    cfg = VIDEO_DEFAULTS
    for frames, h, w in [(len(ours) or 2, 480, 640), (5, 64, 96), (40, 1080, 1920), (2, 20, 500)]:
        if frames < 2:
            continue
        expected = smart_resize(frames, h, w, 2, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        assert video_resize(frames, h, w, cfg) == expected


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_video_prompt_positions_logits_and_tokens_equal_reference(pairs, name):
    """A container through Qwen3-VL's video rules: the prompt transformers' processor writes
    (timestamped frames, computed from the header), its positions (each temporal patch
    positioned as an image of its own), logits and greedy tokens."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    _, ref, hf = pairs[name]
    messages = chat(None, "What happens, and in this?", None)
    messages[0]["content"][0] = {"type": "video"}
    items = [VideoItem(container=VIDEO), ImageItem(IMAGES[0])]
    prepared = ref.prepare(messages, items)
    video, image = prepared.media
    meta = video.grid.video_metadata
    # The prompt as transformers' processor writes it: the template's video markers replaced
    # by one timestamped run per temporal patch, the text tokenized whole.
    t, h, w = video.grid.grid_thw
    pads = "<|video_pad|>" * (h * w // 4)
    times = Qwen3VLProcessor._calculate_timestamps(None, list(meta.frames_indices), meta.fps, 2)
    assert len(times) == t
    run = "".join(f"<{s:.1f} seconds><|vision_start|>{pads}<|vision_end|>" for s in times)
    text = ref.tokenizer.apply_chat_template(messages)
    text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", run)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * image.grid.num_tokens)
    assert prepared.token_ids == ref.tokenizer.encode(text)
    inputs = hf_inputs(ref, prepared)
    with torch.no_grad():
        positions, delta = hf.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            inputs["image_grid_thw"],
            inputs["video_grid_thw"],
        )
        ours, our_delta = ref.positions(prepared)
        assert torch.equal(ours, positions[:, 0]) and our_delta == int(delta)
        theirs = hf(**inputs).logits[0]
        out = hf.generate(**inputs, max_new_tokens=12, do_sample=False)
    torch.testing.assert_close(ref.prefill_logits(prepared), theirs, rtol=1e-4, atol=1e-4)
    want = out[0, len(prepared.token_ids) :].tolist()
    assert ref.generate(messages, items, max_tokens=12)[: len(want)] == want


def test_engine_gathers_a_video_run_in_chunks(pairs):
    """The LM engine on a video whose run holds timestamps between its frames, in chunks of 8
    that cut frames and timestamps: the reference's tokens."""
    path, ref, _ = pairs["moe"]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Go"}]}]
    items = [VideoItem(container=VIDEO)]
    prepared = ref.prepare(messages, items)
    (embeds,) = ref.embed_media(prepared.media)
    grid = prepared.media[0].grid
    offset = prepared.token_ids.index(grid.run.tokens[0])
    feature = MMFeature(
        "vid",
        offset,
        len(grid.run.tokens),
        np.asarray(grid.run.is_embed),
        "video",
        grid.grid_thw,
    )
    expected = ref.generate(messages, items, max_tokens=12, ignore_eos=True)
    for budget in (256, 8):
        engine = make_engine(path, max_num_batched_tokens=budget, max_num_seqs=4)
        request = Request(
            "v",
            list(prepared.token_ids),
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12),
            [feature],
        )
        out = run(engine, (request, {"vid": embeds}))
        assert out["v"].token_ids == expected, budget


def test_an_embedding_travels_with_its_level_count():
    """One cache entry per item: the wire header's shape says how many levels it holds; a
    worker whose model takes another count refuses it by name."""

    rows = torch.randn(6, 3, 64)
    back = decode(encode(rows))
    assert back.shape == (6, 3, 64) and torch.equal(back, rows)


def test_the_model_state_refuses_embeddings_of_another_shape(pairs):
    from models.family import EmbeddingMismatch

    path, _, _ = pairs["dense"]
    family = load_family(path)
    state = family.model_state(None)
    hidden, levels = family.text.hidden_size, family.arch.vision.num_levels
    good = torch.zeros(5, levels, hidden)
    assert state.process_mm_embeds("h", good, 5).embeds is good
    for bad, what in [
        (torch.zeros(5, hidden), r"\(5, 3, 64\)"),  # a Qwen2-VL entry: no levels
        (torch.zeros(5, levels + 1, hidden), "levels"),
        (torch.zeros(4, levels, hidden), "levels"),
    ]:
        with pytest.raises(EmbeddingMismatch, match=what):
            state.process_mm_embeds("h", bad, 5)


def test_dense_experts_equal_the_routed_ones():
    """The static path CUDA graphs capture (every expert, unrouted ones weighted zero) gives
    the routed path's outputs; on a CPU the routed path runs."""
    from models.qwen3_vl.config import MoEConfig

    torch.manual_seed(0)
    moe = MoEConfig(6, 2, 24, True, 1, ())
    experts = Experts(32, moe)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x = torch.randn(9, 32)
    top_weight, top_index = torch.rand(9, 6).softmax(-1).topk(2)
    with torch.no_grad():
        routed = experts.routed(x, top_index, top_weight)
        torch.testing.assert_close(experts.dense(x, top_index, top_weight), routed)
        torch.testing.assert_close(experts(x, top_index, top_weight), routed)


def _edit(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
        (
            lambda c: c["text_config"]["rope_parameters"].update(mrope_interleaved=False),
            "mrope_interleaved",
        ),
        (lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 9]), "deepstack"),
        (lambda c: c["vision_config"].update(num_position_embeddings=30), "num_position"),
        (lambda c: c["text_config"].update(num_experts_per_tok=9), "num_experts_per_tok"),
        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[6, 5]), "section"),
    ],
)
def test_configs_it_cannot_serve_are_refused_naming_the_field(tmp_path, edit, field):
    path = make_checkpoint(tmp_path / "c", "qwen3_vl_moe", "tiny")
    _edit(path, edit)
    with pytest.raises(CheckpointError, match=field):
        load_family(path).text  # noqa: B018 (parsing the config is the check)


def test_evs_lays_out_each_frame_as_it_kept_and_moves_no_position(pairs):
    """EVS (video_pruning_rate 0.6) through the proxy's run, the encoder and the LM engine.
    The reference, from the model's own position rule: the unpruned prompt's positions as
    transformers computes them (get_rope_index), each frame's run keeping its timestamp and
    markers and only its kept placeholders (the kept set from the unpruned tower's output), each
    token at its unpruned position; its tokens come from a plain forward of our LM on it."""
    from models import FamilyOptions, expand_media
    from models.qwen2_vl.evs import retention_mask
    from models.qwen2_vl.rope import mrope_decode_positions

    path, ref, hf = pairs["dense"]
    q = 0.6
    family = load_family(path, FamilyOptions(video_pruning_rate=q))
    video = make_video("mp4", 24, 4, 96, 64, seed=5, still_every=2)
    item = MediaInput("video", video=video)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Go"}]}]
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(messages))
    placeholders = tuple(family.placeholder_token_ids.values())
    # What the proxy sends: the run with the kept count spread evenly over the frames.
    processor = family.processor()
    grid = processor.grid(item)
    assert 0 < grid.num_tokens < grid.num_unpruned_tokens
    prompt, [(offset, length, is_embed)] = expand_media(ids, placeholders, [grid.run])
    with torch.inference_mode():
        (pruned,) = family.load_encoder(torch.float32, torch.device("cpu")).embed(
            [processor.preprocess(item)]
        )
    engine = make_engine(path, family=family)
    feature = MMFeature("v", offset, length, np.asarray(is_embed), "video", grid.grid_thw)
    request = Request(
        "v", list(prompt), SamplingParams(temperature=0, ignore_eos=True, max_tokens=10), [feature]
    )
    loaded = engine.load_embedding("v", pruned, grid.num_tokens)
    tokens = run(engine, (request, {"v": loaded}))["v"].token_ids

    # The reference: the unpruned prompt, its positions (transformers), the kept set.
    full = ref.prepare(messages, [VideoItem(container=video)])
    (unpruned,) = ref.embed_media(full.media)
    m = ref.arch.vision.spatial_merge_size
    kept = retention_mask(unpruned[:, 0], grid.grid_thw, m, q)
    inputs = hf_inputs(ref, full)
    with torch.no_grad():
        positions, _ = hf.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], None, inputs["video_grid_thw"]
        )
    video_id = family.placeholder_token_ids["video"]
    pad_at = [i for i, t in enumerate(full.token_ids) if t == video_id]
    drop = {i for i, k in zip(pad_at, kept.tolist(), strict=True) if not k}
    keep = [i for i in range(len(full.token_ids)) if i not in drop]
    want_ids = [full.token_ids[i] for i in keep]
    want_positions = positions[:, 0, keep]
    assert request.input_token_ids == want_ids
    assert request.prompt_token_ids == prompt and prompt != want_ids  # hashes read the proxy's
    np.testing.assert_array_equal(request.rope[0], want_positions.numpy())

    # A plain forward of our LM on that prompt, then greedy decoding.
    lm, attention = ref.lm, ref.attention
    with torch.inference_mode():
        ids_t = torch.tensor(want_ids)
        is_mm = ids_t == video_id
        embeds = lm.embed_input_ids(ids_t, [unpruned[kept]], is_mm)
        meta = attention.metadata([999], [len(want_ids)])
        hidden = lm(None, want_positions, inputs_embeds=embeds, attn_metadata=meta)
        delta = int(want_positions.max()) + 1 - len(want_ids)
        expected = [int(lm.compute_logits(hidden[-1:]).argmax())]
        while len(expected) < 10:
            at = len(want_ids) + len(expected) - 1
            step = lm(
                torch.tensor(expected[-1:]),
                mrope_decode_positions(at, 1, delta),
                attn_metadata=attention.metadata([999], [1]),
            )
            expected.append(int(lm.compute_logits(step).argmax()))
        attention.free(999)
    assert tokens == expected


def test_a_missing_deepstack_merger_is_refused_at_load(tmp_path):
    """A config that lists three deepstack layers over a checkpoint with two mergers."""
    path = make_checkpoint(tmp_path / "c", "qwen3_vl", "tiny")
    _edit(path, lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 1, 2]))
    with pytest.raises(CheckpointError, match=r"deepstack_merger_list\.2"):
        load_family(path).load_encoder(torch.float32, torch.device("cpu"))
