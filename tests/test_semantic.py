"""The shipped built-in model through the whole cluster (real processes: embedded Redis, two
encoders, an LM worker, the proxy): answers about pictures must be the model's answers about
that very picture (MIN_AGREEMENT of them: see there).

A wrong embedding (another request's, a stale cache entry, an item gathered off by one) turns
into a different answer here, where the random test models only give different noise. The
expected answer of every request is the reference path's (our model code, no cluster, the same
bf16 weights) for the same picture and question; held-out accuracy is checked on top.
"""

from __future__ import annotations

import base64
import json
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis

from common.served_model import builtin_model
from epd.demo import ask
from models.demo import scenes
from models.demo.train import Accuracy, answers
from tests.test_benches import bench
from tests.test_demo import ACCURACY_FLOOR

HELD_OUT = range(48)  # of the 500 held-out scenes (seeds 0 .. 499); the README has all 500
# How many answers must equal the reference path's. NOTE: not all: the shipped model is unsure
# of shape kinds, and bf16 rounds differently in the engine's paged attention than in the
# reference path, so near-tie tokens flip in a few answers. A request answered from another
# picture's embedding disagrees on nearly every answer.
# The colours an answer names, in order, are what the model is sure of: those must all agree.
MIN_AGREEMENT = 0.75


def agreement(got: list[str], want: list[str]) -> float:
    assert len(got) == len(want)
    return sum(a == b for a, b in zip(got, want, strict=True)) / len(want)


def colours(answers: list[str]) -> list[tuple[str, ...]]:
    return [
        tuple(w.strip(",") for w in a.split() if w.strip(",") in scenes.COLOURS) for a in answers
    ]


@pytest.fixture(scope="module")
def cluster(builtin_cluster):
    return builtin_cluster


def expected(samples: list[scenes.Sample]) -> list[str]:
    return answers(builtin_model(), samples)


def content(sample: scenes.Sample) -> list[dict]:
    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in sample.images]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [*parts, {"type": "text", "text": sample.question}]


def ask_openai(client: openai.OpenAI, sample: scenes.Sample) -> str:
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content(sample)}],
        temperature=0.0,
        max_tokens=24,
    )
    return reply.choices[0].message.content


def test_held_out_scenes_with_two_encoders_and_a_flushed_cache(cluster):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.proxy_http}/v1", api_key="none")
    samples = [scenes.sample(seed) for seed in HELD_OUT]
    half = len(samples) // 2
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda s: ask_openai(client, s), samples[:half]))
        # Every embedding gone mid-run: the encoders compute again what the LM worker misses.
        redis.Redis.from_url(cluster.redis.url).flushall()
        again = list(pool.map(lambda s: ask_openai(client, s), samples[:8]))
        second = list(pool.map(lambda s: ask_openai(client, s), samples[half:]))
    got = first + second
    assert agreement(got, expected(samples)) >= MIN_AGREEMENT
    assert agreement(again, first[:8]) >= MIN_AGREEMENT
    accuracy = Accuracy()
    for seed, sample, answer in zip(HELD_OUT, samples, got, strict=True):
        accuracy.add(seed, sample, answer)
    assert accuracy.value >= ACCURACY_FLOOR, accuracy.summary()


def test_one_image_under_many_requests(cluster):
    """One picture held under 26 concurrent questions, encoded once: each answered about it."""
    scene = scenes.Scene.parse("red circle left, blue square top, green star right")
    image = scenes.render(scene, 11, (200, 150))
    questions = [*scenes.DESCRIBE, "How many shapes are there?"]
    for s in scene.shapes:
        questions += [f"What colour is the {s.kind}?", f"Where is the {s.name}?"]
        questions += [f"Which shape is {s.colour}?"]
    samples = [scenes.Sample("describe", q, "", (image,), (scene,)) for q in questions * 2]
    want = expected(samples)
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    with ThreadPoolExecutor(len(samples)) as pool:
        got = list(pool.map(lambda s: ask(cluster.stub, s, 60), samples))
    assert colours(got) == colours(want)
    assert agreement(got, want) >= MIN_AGREEMENT
    assert cluster.metric("epd_mm_items_total", result="encoded") == encoded + 1


def test_many_different_images_at_once_each_gets_its_own_answer(cluster):
    samples = [scenes.sample(seed, "describe") for seed in range(1000, 1032)]
    want = expected(samples)
    assert len(set(colours(want))) >= 16  # different pictures, different colours: a swap shows
    start = threading.Barrier(len(samples))

    def together(sample: scenes.Sample) -> str:
        start.wait()
        return ask(cluster.stub, sample, 60)

    with ThreadPoolExecutor(len(samples)) as pool:
        got = list(pool.map(together, samples))
    assert colours(got) == colours(want)
    assert agreement(got, want) >= MIN_AGREEMENT


def test_multi_image_prompts_are_answered_about_the_right_image(cluster):
    """Two different pictures, asked about the first and the second one, in both orders:
    every answer is the reference path's for the same pictures in the same order."""
    samples = []
    for seed in range(2000, 2012):
        rng = random.Random(seed)
        a, b = (scenes.render(scenes.random_scene(rng), seed + i) for i in (0, 1))
        for images in ((a, b), (b, a)):
            for which in scenes.ORDINALS:
                question = f"What is in the {which} picture?"
                samples.append(scenes.Sample("same", question, "", images, ()))
    want = expected(samples)
    # The reference path's answers depend on the pictures' order (in all 12 pairs with the
    # shipped model, which answers 32 of the 48 right): a request whose pictures were swapped
    # or mixed up on the way answers about the wrong one.
    # samples[4k .. 4k+3]: (a, b) first, (a, b) second, (b, a) first, (b, a) second.
    assert sum(want[i] != want[i + 2] for i in range(0, len(want), 4)) >= len(want) // 8
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: ask(cluster.stub, s, 60), samples))
    # Pictures swapped on the way would change the colours of at least 6 answers (the pairs
    # whose answers depend on the order). Two may differ: two unrelated pictures are not what
    # the model was trained on (its two-picture questions are about one scene and an altered
    # copy), and on such a pair the model can be unsure of every word (the model shipped
    # before this one answered "a red square and a green star" in bf16 on one, a run of
    # repeated shapes in float32).
    differ = sum(a != b for a, b in zip(colours(got), colours(want), strict=True))
    assert differ <= 2, list(zip(got, want, strict=True))
    assert agreement(got, want) >= MIN_AGREEMENT


def test_scene_eval_scores_the_cluster_on_the_scenes_asked_for(cluster, capsys):
    from epd.cli import main as epd_main

    target = f"127.0.0.1:{cluster.proxy_grpc}"
    assert epd_main(["scene-eval", "--target", target, "--first", "500", "--count", "6"]) == 0
    summary = json.loads(capsys.readouterr().out)
    # Validation scenes 500-505 (the first six held-out ones ask other kinds of question).
    samples = [scenes.sample(seed) for seed in range(500, 506)]
    kinds = Counter(s.kind for s in samples)
    assert {k: int(v.split("/")[1]) for k, v in summary["by_kind"].items()} == kinds
    # Right as often as the reference path, give or take one near-tie.
    right = sum(g == s.answer for g, s in zip(expected(samples), samples, strict=True))
    assert abs(summary["right"] - right) <= 1 and summary["total"] == 6


@pytest.mark.timeout(300)
def test_answers_hold_during_and_after_bench_serve_load(cluster):
    """`epd bench serve` loads the cluster (noise pictures, half of them sent again, all at once
    and at 8 requests/s) while held-out questions are asked over and over, and they are asked
    again after it: load must not hand a request another's embedding, KV blocks or prefix."""
    samples = [scenes.sample(seed) for seed in range(48, 72)]  # held out, others than HELD_OUT
    want = expected(samples)
    encoded = cluster.metric("epd_mm_items_total", result="encoded")
    with ThreadPoolExecutor(1) as background, ThreadPoolExecutor(4) as pool:
        load = background.submit(
            bench,
            "serve", "--target", f"127.0.0.1:{cluster.proxy_grpc}", "--topology", "e+pd",
            "--num-requests", "32", "--request-rate", "inf,8", "--reuse", "0.5",
            "--image-width", "160", "--image-height", "120", "--output-tokens", "16",
        )  # fmt: skip
        # Asked once the load is on: its warm-up and first burst's pictures are being encoded.
        cluster.wait_metric("epd_mm_items_total", encoded + 4, timeout=60, result="encoded")
        rounds = []  # the questions again and again until the load is over (its two rates)
        while not rounds or not load.done():
            rounds.append(list(pool.map(lambda s: ask(cluster.stub, s, 120), samples)))
        rows = load.result()["results"]
        assert [(r["completed"], r["failed"]) for r in rows] == [(32, 0), (32, 0)], rows
        after = list(pool.map(lambda s: ask(cluster.stub, s, 120), samples))
    for got in [*rounds, after]:
        assert colours(got) == colours(want), list(zip(got, want, strict=True))
        assert agreement(got, want) >= MIN_AGREEMENT
