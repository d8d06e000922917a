"""The spoken world of the built-in speech model: sentences about the scene world's shapes
("a red circle and a blue square", "the green star is on the left"), spoken word by word by
espeak-ng in several voices, speeds and pitches, with where each word lies in the clip.

Each word is synthesised on its own and the sentence is put together from the words with
pauses between them, so the clip comes with its alignment (a word's first and last sample),
which a streaming transcription model needs: it writes each word just after hearing it.
Every utterance is a function of its seed (and espeak-ng's version): the held-out sentences
are seeds 0-499, training uses seeds from 1,000,000. Training draws its voices from a fixed
grid of speeds and pitches (`WordBank.grid`, synthesised once); held-out sentences are spoken
at speeds and pitches drawn anywhere in the grid's range, most of them never heard in training.
"""

from __future__ import annotations

import io
import random
import shutil
import subprocess
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import soundfile
import soxr

from models.demo import scenes
from models.media import AudioClip, MediaInput

RATE = 16000
HELD_OUT_SEEDS = range(500)
TRAIN_SEED_BASE = 1_000_000

# espeak-ng voices (language + variant), speeds (words a minute) and pitches (0-99).
VOICES = (
    "en-us",
    "en-us+f2",
    "en-gb",
    "en-gb+f4",
    "en-gb-scotland+m3",
    "en-029+f3",
    "en-gb-x-rp+m5",
    "en-us+klatt2",
)
SPEEDS = (130, 160, 190, 220)
PITCHES = (30, 50, 70)

# "a red circle and a blue square" or "the red circle is on the left": the scene world's
# descriptions and places.
WORDS = tuple(
    sorted(
        {"a", "an", "and", "the", "is"}
        | set(scenes.COLOURS)
        | set(scenes.KINDS)
        | {w for phrase in scenes.WHERE.values() for w in phrase.split()}
    )
)


class EspeakError(RuntimeError):
    pass


def espeak_path() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise EspeakError(
            "espeak-ng is not installed: the speech model's sentences are spoken by it "
            "(Debian: apt-get install espeak-ng)"
        )
    return path


def synthesize(word: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    """One word spoken by espeak-ng: float32 samples at RATE, the silence around it cut off,
    peak 0.5."""
    run = subprocess.run(
        [espeak_path(), "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", word],
        capture_output=True,
        check=False,
    )
    if run.returncode != 0 or not run.stdout:
        raise EspeakError(f"espeak-ng -v {voice} failed: {run.stderr.decode(errors='replace')}")
    samples, rate = soundfile.read(io.BytesIO(run.stdout), dtype="float32")
    samples = soxr.resample(samples, rate, RATE).astype(np.float32)
    loud = np.flatnonzero(np.abs(samples) > 0.02 * np.abs(samples).max())
    if loud.size == 0:
        raise EspeakError(f"espeak-ng said nothing for {word!r} in voice {voice}")
    samples = samples[loud[0] : loud[-1] + 1]
    return samples * (0.5 / np.abs(samples).max())


Key = tuple[str, str, int, int]  # word, voice, speed, pitch


class WordBank:
    """Words spoken once and kept: (word, voice, speed, pitch) -> samples."""

    def __init__(self) -> None:
        self.clips: dict[Key, np.ndarray] = {}

    def get(self, word: str, voice: str, speed: int, pitch: int) -> np.ndarray:
        key = (word, voice, speed, pitch)
        if key not in self.clips:
            self.clips[key] = synthesize(*key)
        return self.clips[key]

    def fill(self, keys: Iterable[Key], threads: int = 2) -> None:
        """Synthesise `keys` not yet held, `threads` espeak-ng processes at a time."""
        todo = [k for k in dict.fromkeys(keys) if k not in self.clips]
        with ThreadPoolExecutor(threads) as pool:
            self.clips.update(zip(todo, pool.map(lambda k: synthesize(*k), todo), strict=True))

    @staticmethod
    def grid() -> list[Key]:
        """Every word in every training voice, speed and pitch."""
        return [(w, v, s, p) for v in VOICES for s in SPEEDS for p in PITCHES for w in WORDS]


@dataclass(frozen=True)
class Utterance:
    text: str  # the words, lower case, single spaces
    samples: np.ndarray  # float32 at RATE
    spans: tuple[tuple[int, int], ...]  # per word: first and one-past-last sample
    voice: str
    speed: int
    pitch: int

    def wav(self) -> bytes:
        buf = io.BytesIO()
        soundfile.write(buf, self.samples, RATE, format="WAV", subtype="PCM_16")
        return buf.getvalue()


def sentence(rng: random.Random) -> str:
    """A description of a random scene (two thirds) or where one of its shapes is."""
    scene = scenes.random_scene(rng)
    if rng.random() < 2 / 3:
        return scene.describe().replace(",", "")
    shape = rng.choice(scene.shapes)
    return f"the {shape.colour} {shape.kind} is {scenes.WHERE[shape.place]}"


def word_list(rng: random.Random) -> str:
    """3-7 of the world's words in any order ("top orange and cross"): no grammar to guess
    from, only the sounds."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7)))


def utterance(seed: int, bank: WordBank, text: str | None = None, words: bool = False) -> Utterance:
    """The sentence of `seed` (its `word_list` when `words`; or `text`) spoken in one voice:
    pauses of 20-200 ms between the words, 50-500 ms of silence before and 50-300 ms after, a
    random loudness and a little noise. Training seeds speak on the bank's grid; others
    anywhere in its range."""
    rng = random.Random(seed)
    drawn = sentence(rng)
    if words:
        drawn = word_list(rng)
    if text is not None:
        text = " ".join(text.lower().replace(",", " ").split())
        unknown = sorted(set(text.split()) - set(WORDS))
        if not text:
            raise ValueError("no words to say")
        if unknown:
            raise ValueError(f"words outside the spoken world: {unknown}; it has {list(WORDS)}")
    else:
        text = drawn
    voice = rng.choice(VOICES)
    if seed >= TRAIN_SEED_BASE:
        speed, pitch = rng.choice(SPEEDS), rng.choice(PITCHES)
    else:
        speed = rng.randint(SPEEDS[0], SPEEDS[-1])
        pitch = rng.randint(PITCHES[0], PITCHES[-1])
    pieces, spans, at = [], [], 0

    def silence(lo: float, hi: float) -> None:
        nonlocal at
        n = int(rng.uniform(lo, hi) * RATE)
        pieces.append(np.zeros(n, np.float32))
        at += n

    silence(0.05, 0.5)
    words = text.split()
    for i, word in enumerate(words):
        clip = bank.get(word, voice, speed, pitch)
        spans.append((at, at + clip.shape[0]))
        pieces.append(clip)
        at += clip.shape[0]
        if i + 1 < len(words):
            silence(0.02, 0.2)
    silence(0.05, 0.3)
    samples = np.concatenate(pieces) * rng.uniform(0.3, 1.6)
    noise = np.random.default_rng(seed).standard_normal(samples.shape[0]).astype(np.float32)
    rms = float(np.sqrt(np.mean(samples**2)))
    samples = samples + noise * rms * 10 ** (-rng.uniform(20, 45) / 20)
    return Utterance(
        text, np.clip(samples, -1, 1).astype(np.float32), tuple(spans), voice, speed, pitch
    )


def media_input(utt: Utterance) -> MediaInput:
    """The utterance as a client sends it: a WAV file."""
    return MediaInput("audio", audio=AudioClip(utt.wav(), "wav", 0))


def word_accuracy(reference: str, hypothesis: str) -> tuple[int, int]:
    """(words right, words in the reference): the reference's length less the word-level edit
    distance (substitutions, insertions and deletions), at least 0."""
    ref, hyp = reference.split(), hypothesis.split()
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return max(0, len(ref) - row[-1]), len(ref)
