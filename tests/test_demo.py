"""The scene world, the training path and the shipped built-in model (no cluster: see
tests/test_semantic.py for the same model through real processes)."""

from __future__ import annotations

import io
import json
import platform
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from common.served_model import builtin_model
from epd.cli import main as epd_main
from models import load_family
from models.demo import probe, scenes
from models.demo import train as train_module
from models.demo.train import (
    DEMO_SHAPE,
    LABELS,
    AttentionProbe,
    Encoder,
    PackedCausalAttention,
    PackedMetadata,
    Supervision,
    TrainSettings,
    _balanced,
    _probes,
    _share,
    evaluate,
    forward_loss,
    layout,
    token_labels,
    train,
    validate,
    with_overrides,
    write_config,
)
from models.qwen2_vl.config import load_arch_config
from models.qwen2_vl.language_model import Qwen2LanguageModel
from models.qwen2_vl.vision import VisionTower
from models.sampling import SamplingParams
from models.testing.attention import causal_attention
from models.testing.reference import PreparedPrompt

ROOT = Path(__file__).resolve().parents[1]

# The least exact-match accuracy the shipped model must keep on the tests' subsets of the
# held-out scenes. It scores 95.0% on all 500 (README: the figure and the command that measures
# it), 92% on the first 100 and 95.8% (46) on the first 48 on the reference path; the floor
# lets three answers of either subset flip on bf16 near-ties (another CPU's rounding, or the
# cluster's paged attention). A model answering from the wrong picture scores under 30%.
ACCURACY_FLOOR = 0.89

# -- the scene world ---------------------------------------------------------------------------


def test_samples_are_deterministic_and_answers_follow_the_scene():
    for seed in range(60):
        a, b = scenes.sample(seed), scenes.sample(seed)
        assert a == b
        scene = a.scenes[0]
        assert 1 <= len(scene.shapes) <= 3
        for attr in ("kind", "colour", "place"):
            assert len({getattr(s, attr) for s in scene.shapes}) == len(scene.shapes)
        if a.kind == "count":
            assert a.answer == scenes.NUMBERS[len(scene.shapes)]
        if a.kind == "describe":
            assert a.answer == scene.describe()
        if a.kind == "same" and a.answer in ("yes", "no"):
            assert (a.answer == "yes") == (a.scenes[0] == a.scenes[1])
    kinds = {scenes.sample(seed).kind for seed in range(200)}
    assert kinds == set(scenes.QUESTION_WEIGHTS)


def test_render_sizes_backgrounds_and_descriptions():
    scene = scenes.Scene.parse("blue square, red circle top, orange star")
    # Shapes in reading order (left, top, center, bottom, right), described in KINDS' order.
    assert scene.describe() == "a red circle, a blue square and an orange star"
    assert [s.place for s in scene.shapes] == ["left", "top", "right"]
    sizes = set()
    for seed in range(12):
        image = Image.open(io.BytesIO(scenes.png(scenes.render(scene, seed))))
        sizes.add(image.size)
        assert image.mode == "RGB"
    assert len(sizes) > 6  # varied resolutions and aspect ratios
    fixed = scenes.render(scene, 3, (200, 100))
    assert fixed.size == (200, 100)
    # The red circle sits in the top middle: its centre pixel is red-dominant.
    r, g, b = fixed.getpixel((100, 20))
    assert r > 150 and g < 100 and b < 100


def test_noise_blocks_are_randints_drawn_the_same_way():
    # scenes._noise replaces a randint a block: the same bytes, and the generator left in
    # the same state (the shapes after the background draw the same numbers).
    for seed in range(200):
        a, b = random.Random(seed), random.Random(seed)
        count = 1 + 11 * seed
        assert scenes._noise(a, count, 24) == bytes(128 + b.randint(-24, 24) for _ in range(count))
        assert a.random() == b.random()


@pytest.mark.parametrize(
    "text",
    ["", "red circle, blue square, green star, yellow cross", "red circle, red square",
     "pink circle", "red circle middle", "red"],
)  # fmt: skip
def test_scene_parse_refuses_what_the_world_cannot_show(text):
    with pytest.raises(ValueError):
        scenes.Scene.parse(text)


def test_altered_scenes_differ_in_one_thing():
    import random

    rng = random.Random(5)
    for _ in range(100):
        scene = scenes.random_scene(rng)
        other = scenes.altered(scene, rng)
        assert other != scene
        assert abs(len(other.shapes) - len(scene.shapes)) <= 1


def test_draw_says_where_each_shape_is():
    for seed in range(20):
        sample = scenes.sample(seed)
        for data, placed, scene in zip(sample.images, sample.placed, sample.scenes, strict=True):
            image = Image.open(io.BytesIO(data))
            assert tuple(p.shape for p in placed) == scene.shapes
            for p in placed:
                assert 0.09 <= p.radius <= 0.14
                # Every kind covers its centre: the pixel there has the shape's colour.
                x, y = int(p.x * image.width), int(p.y * image.height)
                got = image.getpixel((x, y))
                want = scenes.COLOURS[p.shape.colour]
                assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 40, (seed, p)


def test_token_labels_mark_the_tokens_each_drawn_shape_covers():
    scene = scenes.Scene.parse("red circle left, blue star top, green cross right")
    _, placed = scenes.draw(scene, 7, (308, 308))
    grid = (1, 22, 22)  # 308 / 14 patches a side, 11 merged tokens
    labels = token_labels(placed, grid, 2).view(11, 11, 3)
    for p in placed:
        row, col = int(p.y * 11), int(p.x * 11)
        shape = p.shape
        assert labels[row, col].tolist() == [
            1 + list(scenes.COLOURS).index(shape.colour),
            1 + scenes.KINDS.index(shape.kind),
            1 + list(scenes.PLACES).index(shape.place),
        ]
    # Away from every shape: background. Each shape covers a few tokens, not many.
    assert labels[10, 0].tolist() == [0, 0, 0] and labels[5, 5].tolist() == [0, 0, 0]
    for p in placed:
        covered = labels[..., 1] == 1 + scenes.KINDS.index(p.shape.kind)
        assert 1 <= int(covered.sum()) <= 16


def test_cli_scene_writes_the_picture_it_names(tmp_path, capsys):
    out = tmp_path / "scene.png"
    assert epd_main(["scene", str(out), "--shapes", "red circle, blue square"]) == 0
    assert "a red circle and a blue square" in capsys.readouterr().out
    assert Image.open(out).size == (224, 160)
    assert epd_main(["scene", str(out), "--shapes", "red blob"]) == 2
    assert "unknown shape" in capsys.readouterr().err


# -- the training path -------------------------------------------------------------------------


def test_packed_causal_attention_equals_per_sequence_causal_attention():
    gen = torch.Generator().manual_seed(0)
    lens = [5, 9, 1, 7, 3, 12]
    T = sum(lens)
    q = torch.randn(T, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(T, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(T, 2, 8, generator=gen, requires_grad=True)
    weights = torch.randn(T, 4, 8, generator=gen)
    want, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        want.append(causal_attention(q[s], k[s], v[s]))
        start += n
    want_grads = torch.autograd.grad((torch.cat(want) * weights).sum(), (q, k, v))
    # Sequences grouped by length, two (three groups) and eight (one) to a batched call.
    for group in (2, 8):
        got = PackedCausalAttention(group)(0, q, k, v, PackedMetadata(tuple(lens)))
        torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_attention_probe_loss_is_minus_log_the_weight_on_the_targets():
    gen = torch.Generator().manual_seed(1)
    lens = [6, 9, 4]
    T = sum(lens)
    q, k, v = (torch.randn(T, 4, 8, generator=gen) for _ in range(3))
    # Query row 7 (the second sequence's second token) onto its keys 6 and 7; row 14 (its
    # ninth) onto 10-12; heads 1 and 3.
    rows, targets = [7, 14], [[6, 7], [10, 11, 12]]
    allowed = torch.zeros(2, T, dtype=torch.bool)
    allowed[0, 6:8], allowed[1, 6:15] = True, True
    wanted = torch.zeros(2, T, dtype=torch.bool)
    for i, t in enumerate(targets):
        wanted[i, t] = True
    probe = AttentionProbe((1,), (1, 3), torch.tensor(rows), allowed, wanted)
    attention = PackedCausalAttention()
    attention(0, q, k, v, PackedMetadata(tuple(lens), (probe,)))  # not a supervised layer
    assert probe.losses == []
    attention(1, q, k, v, PackedMetadata(tuple(lens), (probe,)))
    losses = []
    for row, t in zip(rows, targets, strict=True):
        for head in (1, 3):
            weights = (q[row, head] @ k[6 : row + 1, head].T / 8**0.5).softmax(-1)
            losses.append(-weights[[i - 6 for i in t]].sum().log())
    torch.testing.assert_close(probe.losses[0], torch.stack(losses).mean())

    # Read supervision: a head must tell each looked-up shape's labels from what heads 1 and
    # 3 read (their attention outputs side by side).
    reader = torch.nn.Linear(16, sum(LABELS))
    labels = torch.tensor([[1, 2, 3], [4, 5, 1]])
    probe = AttentionProbe(
        (1,), (1, 3), torch.tensor(rows), allowed, wanted, read=labels, readers={"1": reader}
    )

    attention(1, q, k, v, PackedMetadata(tuple(lens), (probe,)))
    outs = []
    for row in rows:
        per_head = []
        for head in (1, 3):
            weights = (q[row, head] @ k[6 : row + 1, head].T / 8**0.5).softmax(-1)
            per_head.append(weights @ v[6 : row + 1, head])
        outs.append(torch.cat(per_head))
    logits = reader(torch.stack(outs)).split(LABELS, -1)
    want = sum(torch.nn.functional.cross_entropy(x, labels[:, i]) for i, x in enumerate(logits))
    torch.testing.assert_close(probe.read_losses[0], want)


def test_lookups_point_each_named_colour_or_kind_at_its_shape():
    encoder = Encoder(builtin_model())
    seen = set()
    for seed in range(60):
        sample = scenes.sample(seed)
        example = encoder.example(sample, drawn_labels=True)
        seen.add(sample.kind)
        if sample.question.startswith("Do these"):
            assert example.lookups == []
            continue
        words = [encoder.tokenizer.decode([t]).strip() for t in example.token_ids]
        for row, image, kind in example.lookups:
            shape = next(s for s in sample.scenes[image].shapes if s.kind == scenes.KINDS[kind - 1])
            if row == example.num_prompt - 1 and sample.kind == "where":
                assert shape.name in sample.question
            else:
                assert words[row + 1] in (shape.kind, shape.colour)
            assert (example.token_labels[image][:, 1] == kind).any()
        answer_words = sample.answer.replace(",", " ").split()
        named = [w for w in answer_words if w in scenes.KINDS or w in scenes.COLOURS]
        assert len(example.lookups) == len(named) + (sample.kind == "where")
    assert seen == set(scenes.QUESTION_WEIGHTS)


def test_descriptions_look_up_each_next_shape_and_what_is_left_to_name():
    encoder = Encoder(builtin_model())
    batch, samples = [], []
    for seed in range(80):
        sample = scenes.sample(seed)
        if sample.answer.startswith(("a ", "an ")):
            plain = encoder.example(sample, drawn_labels=True)
            batch.append(encoder.example(sample, drawn_labels=True, describe_order=True))
            samples.append(sample)
            assert plain.continues == [] and set(plain.lookups) < set(batch[-1].lookups)
    assert {s.kind for s in samples} == {"describe", "same"}  # one picture; one of two
    probes = _probes(batch, Supervision(1.0, (1, 2), (0, 1), (0,)))
    left = probes[-1]  # the continues' set: after the lookups' and the fetches'
    assert (left.layers, left.heads, left.read) == ((1, 2), (0, 1), None)
    start, q, sizes = 0, 0, set()
    for e, sample in zip(batch, samples, strict=True):
        words = [encoder.tokenizer.decode([t]).strip() for t in e.token_ids]
        image = 0 if len(sample.scenes) == 1 else int(" second " in sample.question)
        shapes = sorted(sample.scenes[image].shapes, key=lambda s: scenes.KINDS.index(s.kind))
        articles = [j for j in range(e.num_prompt, len(words)) if words[j] in ("a", "an")]
        names = [j for j in range(e.num_prompt, len(words)) if words[j] in scenes.KINDS]
        assert len(articles) == len(names) == len(shapes)
        sizes.add(len(shapes))
        for i, shape in enumerate(shapes):
            kind = 1 + scenes.KINDS.index(shape.kind)
            # The row before the article looks the shape up ("an" is for orange).
            assert (articles[i] - 1, image, kind) in e.lookups
            if i:  # it and the article's row fetch the kind named last
                assert (articles[i] - 1, [names[i - 1]]) in e.fetches
                assert (articles[i], [names[i - 1]]) in e.fetches
            # The kind word's row (",", " and" or the end next) sees the shapes left.
            later = {1 + scenes.KINDS.index(s.kind) for s in shapes[i + 1 :]}
            assert left.rows[q] == start + names[i]
            keys = left.targets[q].nonzero().squeeze(1) - start - e.spans[image].offset
            if later:
                assert set(e.token_labels[image][keys, 1].tolist()) == later
            else:
                assert keys.tolist() == [-e.spans[image].offset]  # the first token
            q += 1
        start += len(e.token_ids)
    assert q == len(left.rows) and sizes == {1, 2, 3}


def _same_scene_questions(encoder: Encoder, seeds: int) -> tuple[list, list[scenes.Sample]]:
    """The "same scene?" questions among the first `seeds` held-out samples, as examples."""
    samples = [scenes.sample(s) for s in range(seeds)]
    samples = [s for s in samples if s.question == scenes.SAME_SCENE]
    return [encoder.example(s, drawn_labels=True) for s in samples], samples


def test_same_scene_questions_match_the_second_pictures_shapes_to_the_first():
    batch, samples = _same_scene_questions(Encoder(builtin_model()), 60)
    assert {s.answer for s in samples} == {"yes", "no"}
    assert all(e.same_scene for e in batch)
    probes = _probes(
        batch, Supervision(1.0, (1,), (0, 1), (), match_layers=(1, 2), match_heads=(3, 2))
    )
    tokens, last = [p for p in probes if p.heads in ((3,), (2,))]
    assert (tokens.layers, last.layers) == ((1,), (2,))
    starts = [0]
    for e in batch[:-1]:
        starts.append(starts[-1] + len(e.token_ids))
    q = 0
    for i, (e, sample, start) in enumerate(zip(batch, samples, starts, strict=True)):
        first, second = (start + s.offset for s in e.spans)
        kinds = [{s.kind: s for s in scene.shapes} for scene in sample.scenes]
        # Each shape token of the second picture: onto the first picture's tokens of the
        # same colour and kind, or the sequence's first token.
        for t in (e.token_labels[1][:, 1] > 0).nonzero().squeeze(1).tolist():
            assert tokens.rows[q] == second + t
            shape = kinds[1][scenes.KINDS[e.token_labels[1][t, 1] - 1]]
            twin = kinds[0].get(shape.kind)
            keys = tokens.targets[q].nonzero().squeeze(1).tolist()
            if twin is not None and twin.colour == shape.colour:
                labels = e.token_labels[0][[k - first for k in keys]]
                assert all(scenes.KINDS[k - 1] == shape.kind for k in labels[:, 1].tolist())
            else:
                assert keys == [start]
            q += 1
        # The last prompt row: onto the shapes either picture lacks, none when the same.
        assert last.rows[i] == start + e.num_prompt - 1
        keys = last.targets[i].nonzero().squeeze(1).tolist()
        if sample.answer == "yes":
            assert keys == [start]
        else:
            odd = set(sample.scenes[0].shapes) ^ set(sample.scenes[1].shapes)
            assert odd and start not in keys
            for k in keys:
                picture = 0 if k < second else 1
                row = e.token_labels[picture][k - (first, second)[picture]]
                assert (scenes.KINDS[row[1] - 1], list(scenes.PLACES)[row[2] - 1]) in {
                    (s.kind, s.place) for s in odd
                }
    assert q == len(tokens.rows)


def test_same_scene_place_words_compare_the_shapes_at_their_place_in_both_pictures():
    encoder = Encoder(builtin_model())
    batch, samples = _same_scene_questions(encoder, 80)
    supervision = Supervision(
        1.0, (1,), (0, 1), (), match_layers=(1, 2), match_heads=(3, 2), compare_heads=(0, 2)
    )
    probes = _probes(batch, supervision)
    firsts, seconds = [p for p in probes if p.heads in ((0,), (2,)) and p.layers == (1,)]
    last = next(p for p in probes if p.layers == (2,) and p.heads == (2,))
    places = list(scenes.PLACES)
    starts = [0]
    for e in batch[:-1]:
        starts.append(starts[-1] + len(e.token_ids))
    differ = 0
    for i, (e, sample, start) in enumerate(zip(batch, samples, starts, strict=True)):
        offsets = [start + s.offset for s in e.spans]
        words = offsets[1] + e.media[1].grid.num_tokens + 1
        assert encoder.tokenizer.decode(e.token_ids[words - start : words - start + 5]) == (
            "Do these two pictures show"
        )
        by_place = [{s.place: s for s in scene.shapes} for scene in sample.scenes]
        marked = set(last.targets[i].nonzero().squeeze(1).tolist())
        for w, place in enumerate(places):
            for picture, gathers in enumerate((firsts, seconds)):
                row = 5 * i + w
                assert gathers.rows[row] == words + w
                keys = gathers.targets[row].nonzero().squeeze(1).tolist()
                shape = by_place[picture].get(place)
                if shape is None:
                    assert keys == [start]
                else:
                    labels = e.token_labels[picture][[k - offsets[picture] for k in keys]]
                    assert {tuple(r) for r in labels.tolist()} == {
                        (1 + list(scenes.COLOURS).index(shape.colour),
                         1 + scenes.KINDS.index(shape.kind), 1 + w)
                    }  # fmt: skip
            # The last row marks the place words whose two shapes differ, and no token of the
            # first picture (none can know what the second lacks).
            same = by_place[0].get(place) == by_place[1].get(place)
            assert (words + w in marked) == (not same)
            differ += not same
        assert not any(offsets[0] <= k < offsets[0] + e.media[0].grid.num_tokens for k in marked)
        assert (sample.answer == "yes") == (marked == {start})
    assert differ > 0 and len(firsts.rows) == len(seconds.rows) == 5 * len(batch)


def test_tower_forward_is_the_served_numerics_with_gradients(tiny_checkpoint):
    arch = load_arch_config(tiny_checkpoint)
    tower = VisionTower.from_checkpoint(tiny_checkpoint, arch.vision)
    processor = load_family(tiny_checkpoint).processor()
    items = [processor.process_image(scenes.sample(s).images[0]) for s in (1, 2)]
    pixels = torch.cat([m.pixel_values for m in items])
    grids = [m.grid.grid_thw for m in items]
    served = tower.embed_multimodal(pixels, grids)
    trained = tower(pixels, grids)
    for a, b in zip(served, trained, strict=True):
        assert torch.equal(a, b)
    sum(t.sum() for t in trained).backward()
    assert tower.patch_embed.proj.weight.grad is not None


# A model small enough to train a few steps in a test; three layers, so that the recipe's
# attention supervision (layers 0-2) runs.
SMALL = replace(
    DEMO_SHAPE, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
    num_kv_heads=1, mrope_section=(2, 3, 3), vision_depth=1, vision_hidden=32,
    vision_heads=1, vision_intermediate=32, fullatt_block_indexes=(0,),
)  # fmt: skip
# SMALL has two query heads: the recipe's match heads (3, 2) become its heads 1 and 0, and
# its compare heads (2, 3) heads 0 and 1.
SMALL_HEADS = {"match_heads": (1, 0), "compare_heads": (0, 1)}


def test_training_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    # Two workers (the recipe's): the progress is the first's, once a step.
    settings = TrainSettings(
        steps=6, batch_size=4, warmup=1, lr=1e-2, tower_steps=4, tower_batch=4,
        drawn_labels=True, aux_background_weight=0.3, shape=SMALL, workers=2, **SMALL_HEADS,
    )  # fmt: skip
    losses = []
    out = train(
        tmp_path / "m",
        settings,
        progress=lambda step, steps, loss, acc: losses.append(loss),
    )
    # The tower's pre-training steps, then the joint ones: each phase lowers its loss.
    assert len(losses) == 10
    assert losses[3] < losses[0] and losses[-1] < losses[4]
    family = load_family(out)
    assert family.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert family.dtype == torch.bfloat16
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    # The prompt the trainer builds is the chat template's, placeholders expanded.
    example = Encoder(out).example(scenes.sample(0))
    tokenizer = family.tokenizer()
    text = tokenizer.decode(example.token_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert text.endswith(scenes.sample(0).answer + "<|im_end|>")


def test_questions_about_one_picture_share_its_scene_and_pixels():
    qs = scenes.questions(1_000_123, 3)
    assert len(qs) == 3 and len({q.kind for q in qs}) == 3
    assert len({q.images[0] for q in qs}) == 1 and len({q.scenes[0] for q in qs}) == 1
    for q in qs:
        assert q == scenes.sample(1_000_123, q.kind)
    assert len(scenes.questions(7, 99)) == len(scenes.QUESTION_WEIGHTS)
    # Training may ask some kinds more often than the held-out set does, or never.
    only = {"where": 3, "colour": 1}
    asked = {q.kind for seed in range(50) for q in scenes.questions(seed, 2, only)}
    assert asked == {"where", "colour"}


@pytest.mark.parametrize(
    "freeze", [{"freeze_tower": True}, {"freeze_tower_at": 1}, {}], ids=["phase", "at-1", "never"]
)
def test_a_frozen_tower_keeps_its_weights_while_the_lm_learns(tmp_path, freeze):
    # Frozen after its phase, or from joint step 1 on: the weights saved after joint step 1
    # (the first save) are the last ones. Never frozen, the tower goes on learning.
    settings = TrainSettings(
        steps=3, batch_size=4, warmup=1, tower_steps=2, tower_batch=2,
        shape=SMALL, workers=1, **SMALL_HEADS, **freeze,
    )  # fmt: skip
    saved = []

    def on_save(step: int) -> None:
        with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
            saved.append({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118

    train(tmp_path / "m", settings, save_every=1, on_save=on_save)
    on_save(settings.steps)
    first, last = saved[0], saved[-1]
    tower_same = [torch.equal(first[k], last[k]) for k in first if k.startswith("visual.")]
    assert all(tower_same) if freeze else not all(tower_same)
    assert not all(torch.equal(first[k], last[k]) for k in first if not k.startswith("visual."))


def test_progress_bar_counts_time_left_at_the_recent_rate(monkeypatch):
    # 100 cheap tower steps (0.1 s each), then joint steps of 1 s: after 250 of 400 steps,
    # 150 s are left, not the 96 s that the mean rate since the start would promise.
    clock = [0.0]
    monkeypatch.setattr(train_module.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    show = train_module.progress_bar(stream)
    for step in range(1, 251):
        clock[0] += 0.1 if step <= 100 else 1.0
        show(step, 400, 1.0, 0.5)
    last = stream.getvalue().rsplit("\r", 1)[-1]
    assert "250/400" in last and "1.00 steps/s" in last and "2.5 min left" in last, last


def test_settings_overrides_parse_by_field_type_and_refuse_unknown_fields():
    s = with_overrides(
        TrainSettings(),
        ["questions_per_picture=2", "freeze_tower=true", "vision_lr=4e-3", "match_layers=",
         "shape.fullatt_block_indexes=0,1,2", "shape.vision_hidden=96"],
    )  # fmt: skip
    assert (s.questions_per_picture, s.freeze_tower, s.vision_lr) == (2, True, 4e-3)
    assert s.match_layers == ()
    assert s.shape.fullatt_block_indexes == (0, 1, 2) and s.shape.vision_hidden == 96
    for bad in ("nope=1", "steps", "steps=x", "freeze_tower=maybe", "shape=1", "shape.nope=2"):
        with pytest.raises(ValueError):
            with_overrides(TrainSettings(), [bad])
    steps = TrainSettings().steps  # joint steps 0 .. steps - 1
    for bad in ("freeze_tower_at=-1", f"freeze_tower_at={steps}"):
        with pytest.raises(ValueError, match="freeze_tower_at"):
            validate(with_overrides(TrainSettings(), [bad]))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_training_keeps_freed_memory_for_reuse():
    # In a process of its own: the setting lasts for the process.
    code = "from models.demo.train import keep_freed_memory as k; raise SystemExit(not k())"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_cli_train_demo_refuses_an_unknown_setting(tmp_path, capsys):
    assert epd_main(["train-demo", str(tmp_path / "m"), "--set", "nope=1"]) == 2
    assert "nope=1" in capsys.readouterr().err
    for bad in (
        "question_weights=1,2", "workers=0", "attn_heads=0,4", "attn_fetch_layers=3",
        "match_layers=1", "match_heads=0,4",
    ):  # fmt: skip
        assert epd_main(["train-demo", str(tmp_path / "m"), "--set", bad]) == 2
        assert bad.partition("=")[0] in capsys.readouterr().err


def _small_model(out: Path, attention: PackedCausalAttention):
    """SMALL's config, tokenizer and freshly initialised tower and LM (seed 0) in `out`."""
    write_config(out, SMALL)
    arch = load_arch_config(out)
    torch.manual_seed(0)
    return arch, VisionTower(arch.vision), Qwen2LanguageModel(arch.text, attention), Encoder(out)


def test_a_shared_picture_is_encoded_once_with_the_same_loss(tmp_path):
    """Questions about one picture share its tower pass; the loss and gradients equal those
    of each question encoding its own copy."""
    arch, tower, lm, encoder = _small_model(tmp_path / "m", PackedCausalAttention())
    qs = scenes.questions(1_000_321, 3)
    processed: dict = {}
    shared = [encoder.example(q, True, processed) for q in qs]
    own = [encoder.example(q, True) for q in qs]
    assert shared[0].media[0] is shared[1].media[0] and own[0].media[0] is not own[1].media[0]
    calls = []
    tower.register_forward_hook(lambda m, args, out: calls.append(len(args[1])))
    grads = []
    for batch in (shared, own):
        tower.zero_grad()
        lm.zero_grad()
        loss, _ = forward_loss(tower, lm, batch, arch.vision.spatial_merge_size)
        loss.backward()
        grads.append(tower.patch_embed.proj.weight.grad.clone())
        grads.append(loss.item())
    pictures = sum(len(q.images) for q in qs)
    assert calls == [pictures - (len(qs) - 1), pictures]  # the first picture once, not 3 times
    assert grads[1] == pytest.approx(grads[3], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-4, atol=1e-6)


def test_questions_sharing_a_prefix_give_the_loss_and_gradients_of_each_alone(tmp_path):
    """share_prefix packs the questions about one picture as one sequence, the picture's
    prefix once: the loss (answers, auxiliary and attention supervision) and every gradient
    are those of the questions packed apart."""
    arch, tower, lm, encoder = _small_model(tmp_path / "m", PackedCausalAttention(group=2))
    width = 2 * arch.text.head_dim
    readers = torch.nn.ModuleDict({str(i): torch.nn.Linear(width, sum(LABELS)) for i in (1, 2)})
    heads = [torch.nn.Linear(arch.text.hidden_size, n) for n in (13, 19)]
    batch = []
    for seed in (1_000_321, 1_000_400, 1_000_305):  # each picture with three questions
        processed: dict = {}
        batch += [encoder.example(q, True, processed) for q in scenes.questions(seed, 3)]
    # Two-picture questions share their first picture, one of them "same scene?".
    assert sum(len(e.media) == 2 for e in batch) == 2 and any(e.same_scene for e in batch)
    packing = layout(batch, share_prefix=True)
    assert len(packing.seq_lens) == 3
    assert sum(packing.seq_lens) < sum(len(e.token_ids) for e in batch) * 0.6
    supervision = Supervision(1.0, (1, 2), (0, 1), (0,), readers, 1.0, (1, 2), (1, 0))
    params = [p for m in (tower, lm, readers, *heads) for p in m.parameters()]
    results = []
    for share in (False, True):
        loss, right = forward_loss(
            tower, lm, batch, arch.vision.spatial_merge_size, heads[0], heads[1],
            0.5, 0.5, 0.3, supervision, share_prefix=share,
        )  # fmt: skip
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        results.append((loss, right, grads))
    (loss, right, grads), (loss2, right2, grads2) = results
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-6)
    assert right2 == right
    for g, g2 in zip(grads, grads2, strict=True):
        assert (g is None) == (g2 is None)
        if g is not None:
            torch.testing.assert_close(g2, g, rtol=1e-4, atol=1e-6)


def test_training_flushes_denormals_and_evaluation_keeps_them(tmp_path):
    settings = TrainSettings(
        steps=2, batch_size=2, warmup=1, tower_steps=1, tower_batch=2, shape=SMALL,
        workers=1, flush_denormals=True, **SMALL_HEADS,
    )  # fmt: skip
    tiny = torch.tensor([1e-40])  # a float32 denormal
    during = []
    train(tmp_path / "m", settings, progress=lambda *_: during.append((tiny * 2).item()))
    assert during == [0.0] * 3  # flushed in every step of both phases
    assert (tiny * 2).item() == pytest.approx(2e-40)  # as before, once training is over


def test_partial_checkpoints_are_evaluated_without_changing_the_training(tmp_path):
    # Two workers: the same settings give the same bytes (the gradients' mean is exact: both
    # workers add the same two tensors).
    settings = TrainSettings(
        steps=4, batch_size=4, warmup=1, tower_steps=1, tower_batch=2, rope_theta=100.0,
        shape=SMALL, workers=2, **SMALL_HEADS,
    )  # fmt: skip
    seen = []

    def on_save(step: int) -> None:
        # The partial checkpoint is on disk and answers through the reference path.
        seen.append((step, evaluate(tmp_path / "a", range(2)).total))

    a = train(tmp_path / "a", settings, save_every=2, on_save=on_save)
    b = train(tmp_path / "b", settings)
    assert seen == [(2, 2)]  # after step 2; step 4 is the end, saved once
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert load_arch_config(a).text.rope_theta == 100.0
    assert load_arch_config(tmp_path / "b").text.rope_theta == 100.0


def test_workers_share_each_batch_in_whole_pictures():
    pictures = range(1_000_000, 1_000_032, 2)  # 16 pictures, 2 questions each
    for workers in (1, 2, 3):
        shares = [list(_share(pictures, rank, workers)) for rank in range(workers)]
        assert [p for share in shares for p in share] == list(pictures)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_workers_share_each_batch_by_its_pictures_cost():
    sizes = {s: [p.size for x in scenes.questions(s, 3) for p in x.pictures] for s in range(40)}
    planned = {
        s: [p.size for x in scenes.questions(s, 3, draw=scenes.blank) for p in x.pictures]
        for s in range(40)
    }
    assert planned == sizes  # blank pictures: the drawn ones' sizes, undrawn
    costs = {s: 10 * s for s in range(16)}
    for workers in (1, 2, 3):
        shares = [_balanced(range(16), rank, workers, costs.get) for rank in range(workers)]
        assert sorted(p for share in shares for p in share) == list(range(16))
        assert all(share == sorted(share) for share in shares)  # the batch's order kept
        loads = [sum(costs[p] for p in share) for share in shares]
        assert max(loads) - min(loads) <= max(costs.values())
    # Two dear pictures among cheap ones: one each, the cheap ones filling up around them.
    dear = {0: 100, 1: 100, **{s: 10 for s in range(2, 12)}}
    shares = [_balanced(range(12), rank, 2, dear.get) for rank in range(2)]
    assert [sum(dear[p] for p in share) for share in shares] == [150, 150]
    assert len(shares[0]) == len(shares[1]) == 6


def test_a_failing_worker_stops_training_instead_of_hanging(tmp_path):
    settings = TrainSettings(
        steps=3, batch_size=4, warmup=1, tower_steps=0, shape=SMALL, workers=2, **SMALL_HEADS
    )

    def on_save(step: int) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        train(tmp_path / "m", settings, save_every=1, on_save=on_save)


# -- the shipped model -------------------------------------------------------------------------


def test_shipped_model_is_small_bf16_and_loads_as_the_default():
    path = builtin_model()
    total = sum(p.stat().st_size for p in path.iterdir())
    assert total <= 20 * 1024 * 1024
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["dtype"] == "bfloat16"


def test_shipped_model_answers_held_out_scenes():
    """The reference path (our model code, no cluster), bf16 as served: 100 of the 500
    held-out scenes (the README has the full figure)."""
    accuracy = evaluate(builtin_model(), range(100), torch.bfloat16)
    assert accuracy.value >= ACCURACY_FLOOR, accuracy.summary()


def test_forward_loss_of_the_shipped_model_is_low():
    path = builtin_model()
    arch = load_arch_config(path)
    tower = VisionTower.from_checkpoint(path, arch.vision)
    lm = Qwen2LanguageModel.from_checkpoint(path, arch.text, PackedCausalAttention())
    encoder = Encoder(path)
    batch = [encoder.example(scenes.sample(s)) for s in range(8)]
    with torch.no_grad():
        loss, _ = forward_loss(tower, lm, batch, arch.vision.spatial_merge_size)
    assert float(loss) < 1.5  # an untrained model: ln(vocab) = 6.2


def test_tower_probe_tells_the_shipped_towers_kinds_from_an_untrained_ones(tmp_path):
    """The probe (models/demo/RUNS.md, runs LA-LE) on fewer pictures: the shipped tower's
    shapes are told by kind (92% on the full probe, 88% on this one), a tower after three steps
    of its phase barely (23%; a fifth by chance); both scored on the same shapes."""
    fit, test = range(probe.FIT.start, probe.FIT.start + 120), probe.TEST[:100]
    path = builtin_model()
    shipped = probe.tower_kinds(probe.checkpoint_tower(path), Encoder(path), fit, test)
    settings = replace(TrainSettings(), tower_steps=3, tower_batch=2)
    fresh = probe.tower_kinds(*probe.tower_alone(tmp_path, settings), fit, test)
    assert shipped.count == fresh.count > 150
    assert shipped.shapes >= 0.8, shipped.summary()
    assert fresh.shapes <= shipped.shapes - 0.3, (fresh.summary(), shipped.summary())
    assert sum(shipped.confusions.values()) == round((1 - shipped.shapes) * shipped.count)


def test_transformers_loads_the_shipped_model_and_answers_alike():
    """The shipped checkpoint is a Hugging Face one: transformers' Qwen2.5-VL gives the same
    greedy answers as our code (fp32 both)."""
    from models.testing import ReferenceModel
    from tests.model_helpers import hf_inputs, hf_model

    path = builtin_model()
    ours, theirs = ReferenceModel(path), hf_model(path)
    encoder = Encoder(path)
    for seed in range(6):
        sample = scenes.sample(seed)
        e = encoder.prompt(sample)
        prepared = PreparedPrompt(e.token_ids, e.media, e.spans)
        inputs = hf_inputs(ours, prepared)
        with torch.no_grad():
            out = theirs.generate(**inputs, max_new_tokens=24, do_sample=False)
        want = out[0, len(e.token_ids) :].tolist()
        got = ours.generate_many([prepared], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert got == want
