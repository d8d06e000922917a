"""The built-in models' commands: `epd train-demo` (train the vision model), `epd scene` (draw a
picture to ask it about), `epd scene-eval` (its accuracy on held-out scenes through a running
cluster), `epd tower-probe` (how well a vision tower tells the shapes' kinds); `epd
train-speech` (train the speech model) and `epd say` (a sentence spoken as it was trained on,
to transcribe)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# NOTE: torch, grpc and Pillow are imported by the commands, not here: `epd health` (a
# container's liveness check) builds the same parser and must start fast.
HELD_OUT = 500  # the held-out set: scenes.sample(0 .. 499)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train-demo", help="train the built-in model (a tiny Qwen2.5-VL on pictures of shapes)"
    )
    train.add_argument("out", help="output directory (created; must be empty)")
    train.add_argument("--steps", type=int, help="optimizer steps (default: the shipped model's)")
    train.add_argument(
        "--batch-size", type=int,
        help="questions per joint step (default: the shipped model's, 48)",
    )  # fmt: skip
    train.add_argument(
        "--tower-steps", type=int,
        help="steps of the vision tower alone first (default: the shipped model's)",
    )  # fmt: skip
    train.add_argument(
        "--rope-theta", type=float,
        help="the LM's M-RoPE base (default: the shipped model's, 10)",
    )  # fmt: skip
    train.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="any other training setting (models/demo/train.py TrainSettings), e.g. "
        "questions_per_picture=3 or shape.vision_hidden=96; repeatable",
    )  # fmt: skip
    train.add_argument(
        "--workers", type=int,
        help="training processes in data parallel, each on its share of every batch (default: "
        "the recipe's, 2; the result depends on it, not on the machine's cores)",
    )  # fmt: skip
    train.add_argument(
        "--threads", type=int, default=1, help="torch threads per worker (default 1: each "
        "worker draws its next pictures on a second thread meanwhile; the tensors are too "
        "small for two threads to beat one)",
    )  # fmt: skip
    train.add_argument(
        "--eval", type=int, default=HELD_OUT, metavar="N",
        help="then measure exact-match accuracy on the first N held-out scenes (0: skip)",
    )  # fmt: skip
    train.add_argument(
        "--eval-every", type=int, default=0, metavar="STEPS",
        help="also save and evaluate the partial model every STEPS joint steps on the first "
        "--eval-seeds held-out scenes, printing its accuracy by kind of question (0: never)",
    )  # fmt: skip
    train.add_argument(
        "--eval-seeds", type=int, default=100, metavar="N",
        help="held-out scenes for --eval-every (default 100)",
    )  # fmt: skip
    train.set_defaults(func=cmd_train_demo)

    probe = sub.add_parser(
        "tower-probe",
        help="how well a vision tower tells the kinds of shapes (a linear probe on its output)",
    )
    probe.add_argument(
        "--checkpoint", type=Path, help="the checkpoint whose tower to probe (default: the "
        "built-in model's)",
    )  # fmt: skip
    probe.add_argument(
        "--alone", action="store_true",
        help="probe a tower trained here by the recipe's tower phase alone instead (one "
        "process; --set tower_steps=1200 etc. change it)",
    )  # fmt: skip
    probe.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="with --alone: a training setting (TrainSettings), e.g. tower_steps=1200; repeatable",
    )  # fmt: skip
    probe.set_defaults(func=cmd_tower_probe)

    scene = sub.add_parser("scene", help="draw a picture of the scene world (a PNG)")
    scene.add_argument("out", help="PNG file to write")
    scene.add_argument(
        "--shapes", default="red circle, blue square",
        help="'COLOUR KIND [PLACE], ...' (1-3 shapes; default 'red circle, blue square')",
    )  # fmt: skip
    scene.add_argument("--seed", type=int, default=0, help="background and jitter (default 0)")
    scene.add_argument("--size", default="224x160", help="WIDTHxHEIGHT (default 224x160)")
    scene.set_defaults(func=cmd_scene)

    ev = sub.add_parser(
        "scene-eval", help="accuracy of a running cluster (the built-in model) on held-out scenes"
    )
    ev.add_argument("--target", default="127.0.0.1:50051", help="proxy gRPC address")
    ev.add_argument("--count", type=int, default=HELD_OUT, help="scenes (default 500)")
    ev.add_argument(
        "--first", type=int, default=0, metavar="SEED",
        help="the first scene's seed (default 0: the held-out scenes are 0-499; the validation "
        "scenes, neither held out nor trained on, 500-4499: --first 500 --count 1000)",
    )  # fmt: skip
    ev.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ev.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ev.set_defaults(func=cmd_scene_eval)

    speech = sub.add_parser(
        "train-speech",
        help="train the built-in speech model (a tiny Voxtral Realtime on spoken sentences)",
    )
    speech.add_argument("out", help="output directory (created; must be empty)")
    speech.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="any training setting (models/demo/train_speech.py SpeechSettings), e.g. "
        "steps=800 or shape.audio_layers=2; repeatable",
    )  # fmt: skip
    speech.add_argument(
        "--eval", type=int, default=HELD_OUT, metavar="N",
        help="then measure word accuracy on the first N held-out sentences, and on their "
        "word lists (the words in any order) (0: skip)",
    )  # fmt: skip
    speech.set_defaults(func=cmd_train_speech)

    say = sub.add_parser(
        "say", help="speak a sentence of the speech model's world into a WAV file (espeak-ng)"
    )
    say.add_argument("out", help="WAV file to write")
    say.add_argument(
        "--text", help="the words (default: the sentence of --seed); only the world's words: "
        "a, an, and, the, is, on, at, in, colours, shapes, places",
    )  # fmt: skip
    say.add_argument("--seed", type=int, default=0, help="voice, speed, pauses (default 0)")
    say.set_defaults(func=cmd_say)

    sev = sub.add_parser(
        "speech-eval",
        help="word accuracy of a running cluster (the built-in speech model) on held-out sentences",
    )
    sev.add_argument("--target", default="127.0.0.1:50051", help="proxy gRPC address")
    sev.add_argument("--count", type=int, default=HELD_OUT, help="sentences (default 500)")
    sev.add_argument(
        "--word-lists", action="store_true",
        help="the sentences' word lists instead (the words in any order: no grammar to go by)",
    )  # fmt: skip
    sev.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    sev.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    sev.set_defaults(func=cmd_speech_eval)


def cmd_train_demo(args: argparse.Namespace) -> int:
    import torch

    from models.demo import train

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"epd train-demo: {out} is not empty", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    settings = train.TrainSettings()
    if args.steps:
        settings = dataclasses.replace(settings, steps=args.steps)
    if args.batch_size:
        settings = dataclasses.replace(settings, batch_size=args.batch_size)
    if args.rope_theta:
        settings = dataclasses.replace(settings, rope_theta=args.rope_theta)
    if args.tower_steps is not None:
        settings = dataclasses.replace(settings, tower_steps=args.tower_steps)
    if args.workers:
        settings = dataclasses.replace(settings, workers=args.workers)
    try:
        settings = train.with_overrides(settings, args.set)
    except ValueError as e:
        print(f"epd train-demo: --set {e}", file=sys.stderr)
        return 2
    try:
        train.validate(settings)
    except ValueError as e:  # from --workers as well as --set
        print(f"epd train-demo: {e}", file=sys.stderr)
        return 2
    if not train.keep_freed_memory():
        print("epd train-demo: not glibc's malloc: freed memory goes back to the kernel and "
              "training runs slower (page faults)", file=sys.stderr)  # fmt: skip
    print(
        f"training the vision tower alone {settings.tower_steps} steps of "
        f"{settings.tower_batch} pictures, then the whole model {settings.steps} steps of "
        f"{settings.batch_size} samples, in {settings.workers} worker process(es) of "
        f"{torch.get_num_threads()} thread(s)",
        flush=True,
    )
    start = time.monotonic()
    paused = 0.0  # seconds spent evaluating partial models, not training

    def on_save(step: int) -> None:
        nonlocal paused
        began = time.monotonic()
        minutes = (began - start - paused) / 60
        accuracy = train.evaluate(out, range(args.eval_seeds))
        paused += time.monotonic() - began
        line = {"joint_step": step, "train_minutes": round(minutes, 1)} | accuracy.summary()
        print(f"\n{json.dumps(line)}", flush=True)

    train.train(
        out, settings, train.progress_bar(), args.eval_every, on_save if args.eval_every else None
    )
    minutes = (time.monotonic() - start - paused) / 60
    print(f"wrote {out} in {minutes:.1f} min", flush=True)
    if args.eval:
        accuracy = train.evaluate(out, range(args.eval))
        print(json.dumps(accuracy.summary() | {"train_minutes": round(minutes, 1)}))
    return 0


def cmd_train_speech(args: argparse.Namespace) -> int:
    from models.demo import speech, train_speech
    from models.demo.train import with_overrides

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"epd train-speech: {out} is not empty", file=sys.stderr)
        return 2
    try:
        settings = with_overrides(train_speech.SpeechSettings(), args.set)
    except ValueError as e:
        print(f"epd train-speech: --set {e}", file=sys.stderr)
        return 2
    print(
        f"training {settings.steps} steps of {settings.batch_size} sentences on "
        f"{settings.threads} thread(s)",
        flush=True,
    )
    start = time.monotonic()
    try:
        train_speech.train(out, settings)
    except speech.EspeakError as e:  # raised before anything is written
        print(f"epd train-speech: {e}", file=sys.stderr)
        return 2
    minutes = (time.monotonic() - start) / 60
    print(f"wrote {out} in {minutes:.1f} min", flush=True)
    if args.eval:
        summary: dict[str, Any] = {}
        for key, lists in (("sentences", False), ("word_lists", True)):
            right, words, _ = train_speech.evaluate(out, range(args.eval), words=lists)
            summary[key] = {
                "word_accuracy": round(right / words, 4),
                "right": right,
                "words": words,
            }
        print(json.dumps(summary | {"train_minutes": round(minutes, 1)}))
    return 0


def cmd_say(args: argparse.Namespace) -> int:
    from models.demo import speech

    try:
        utt = speech.utterance(args.seed, speech.WordBank(), text=args.text)
    except (speech.EspeakError, ValueError) as e:
        print(f"epd say: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_bytes(utt.wav())
    seconds = utt.samples.shape[0] / speech.RATE
    print(
        f"{utt.text} ({utt.voice}, {utt.speed} words a minute, pitch {utt.pitch}, {seconds:.1f} s)"
    )
    return 0


def cmd_scene(args: argparse.Namespace) -> int:
    from models.demo import scenes

    try:
        scene = scenes.Scene.parse(args.shapes)
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError as e:
        print(f"epd scene: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_bytes(scenes.png(scenes.render(scene, args.seed, (width, height))))
    print(f"wrote {args.out}: {scene.describe()}")
    return 0


def ask(stub: Any, sample: Any, timeout: float) -> str:
    """The cluster's greedy answer (an InferenceStub's) to one scenes.Sample's question."""
    from proto import epd_pb2

    request = epd_pb2.GenerateRequest(
        request_id=f"scene-{uuid.uuid4().hex[:12]}",
        media=[epd_pb2.MediaItem(image=data) for data in sample.images],
        sampling=epd_pb2.SamplingParams(temperature=0.0, max_tokens=24),
    )
    parts = [epd_pb2.ContentPart(media_index=i) for i in range(len(sample.images))]
    parts.append(epd_pb2.ContentPart(text=sample.question))
    request.chat.messages.append(epd_pb2.ChatMessage(role="user", content=parts))
    return "".join(r.text for r in stub.Generate(request, timeout=timeout))


def cmd_tower_probe(args: argparse.Namespace) -> int:
    """Print the probe's kind accuracy (JSON): by token, by shape, and what was taken for what."""
    import torch

    from models.checkpoint import CheckpointError
    from models.demo import BUILTIN_DIR, probe, train

    if args.set and not args.alone:
        print("epd tower-probe: --set goes with --alone", file=sys.stderr)
        return 2
    try:
        settings = train.with_overrides(train.TrainSettings(), args.set)
    except ValueError as e:
        print(f"epd tower-probe: --set {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as each training worker
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="epd-tower-") as tmp:
        if args.alone:
            tower, encoder = probe.tower_alone(Path(tmp), settings)
        else:
            checkpoint = args.checkpoint or BUILTIN_DIR
            try:
                tower, encoder = probe.checkpoint_tower(checkpoint), train.Encoder(checkpoint)
            except CheckpointError as e:
                print(f"epd tower-probe: {e}", file=sys.stderr)
                return 2
        result = probe.tower_kinds(tower, encoder).summary()
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result))
    return 0


def cmd_scene_eval(args: argparse.Namespace) -> int:
    import grpc

    from common.server import GRPC_OPTIONS
    from models.demo import scenes
    from models.demo.train import Accuracy
    from proto import epd_pb2_grpc

    seeds = range(args.first, args.first + args.count)
    samples = [(seed, scenes.sample(seed)) for seed in seeds]
    accuracy = Accuracy()
    start = time.monotonic()
    with grpc.insecure_channel(args.target, options=GRPC_OPTIONS) as channel:
        stub = epd_pb2_grpc.InferenceStub(channel)
        with ThreadPoolExecutor(args.concurrency) as pool:
            try:
                answers = list(pool.map(lambda s: ask(stub, s[1], args.timeout), samples))
            except grpc.RpcError as e:
                print(f"epd scene-eval: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
    for (seed, sample), answer in zip(samples, answers, strict=True):
        accuracy.add(seed, sample, answer)
    for seed, question, want, got in accuracy.mistakes[:10]:
        print(f"seed {seed}: {question!r}: want {want!r}, got {got!r}", file=sys.stderr)
    seconds = time.monotonic() - start
    print(json.dumps(accuracy.summary() | {"seconds": round(seconds, 1)}))
    return 0


def cmd_speech_eval(args: argparse.Namespace) -> int:
    import grpc

    from common.server import GRPC_OPTIONS
    from models.demo import speech
    from proto import epd_pb2, epd_pb2_grpc

    try:
        bank = speech.WordBank()
        utts = [speech.utterance(s, bank, words=args.word_lists) for s in range(args.count)]
    except speech.EspeakError as e:
        print(f"epd speech-eval: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()

    def transcribe(stub, utt: speech.Utterance) -> str:
        request = epd_pb2.GenerateRequest(
            media=[epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=utt.wav()))],
            sampling=epd_pb2.SamplingParams(temperature=0.0),
        )
        return "".join(r.text for r in stub.Generate(request, timeout=args.timeout)).strip()

    with grpc.insecure_channel(args.target, options=GRPC_OPTIONS) as channel:
        stub = epd_pb2_grpc.InferenceStub(channel)
        with ThreadPoolExecutor(args.concurrency) as pool:
            try:
                texts = list(pool.map(lambda u: transcribe(stub, u), utts))
            except grpc.RpcError as e:
                print(f"epd speech-eval: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
    right = words = 0
    mistakes = []
    for seed, (utt, text) in enumerate(zip(utts, texts, strict=True)):
        r, n = speech.word_accuracy(utt.text, text)
        right, words = right + r, words + n
        if text != utt.text:
            mistakes.append(f"seed {seed}: want {utt.text!r}, got {text!r}")
    for line in mistakes[:10]:
        print(line, file=sys.stderr)
    summary = {
        "word_accuracy": round(right / max(1, words), 4),
        "words": words,
        "sentences_exact": len(utts) - len(mistakes),
        "sentences": len(utts),
        "seconds": round(time.monotonic() - start, 1),
    }
    print(json.dumps(summary))
    return 0
