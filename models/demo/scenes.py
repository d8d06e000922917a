"""The scene world the built-in model is trained on: pictures of 1-3 coloured shapes, and
questions about them with exact answers.

A `Scene` is what a picture shows: each shape's kind, colour and place (left, right, top,
bottom or center; one shape per place). `render` draws it at any size and aspect ratio, on a
plain or textured background, with the shapes' sizes and exact positions jittered by a seed.
Two renders of one scene (different seeds) show the same scene; a scene differing in any
shape's kind, colour or place is another scene.

Everything is a function of a seed: `sample(seed)` gives the same question, answer and images
on every machine (Python's `random.Random` and Pillow drawing, no global state).
"""

from __future__ import annotations

import functools
import io
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from PIL import Image, ImageDraw

KINDS = ("circle", "square", "triangle", "star", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (30, 160, 60),
    "blue": (35, 75, 215),
    "yellow": (235, 195, 20),
    "purple": (135, 50, 185),
    "orange": (245, 125, 20),
}
# Places in reading order (left to right, then top to bottom): a scene keeps its shapes so.
PLACES: dict[str, tuple[float, float]] = {
    "left": (0.2, 0.5),
    "top": (0.5, 0.2),
    "center": (0.5, 0.5),
    "bottom": (0.5, 0.8),
    "right": (0.8, 0.5),
}
WHERE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
# A shape's radius, a fraction of the picture's shorter side, and how far its centre may stray
# from its place's (a fraction of each side).
SHAPE_RADIUS = (0.09, 0.14)
PLACE_JITTER = 0.04
NUMBERS = ("zero", "one", "two", "three")
ORDINALS = ("first", "second")
BACKGROUNDS = ("plain", "noise", "stripes", "checks", "gradient")

QuestionKind = Literal["describe", "colour", "count", "where", "which", "same"]


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    place: str

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]  # in reading order (PLACES' order)

    def describe(self) -> str:
        """'a red circle', 'a red circle and a blue square', 'a, b and c': the shapes in
        KINDS' order, not in reading order: which shape comes next then depends on what is
        there, not on where. The tiny model learns places slowly; trained on descriptions in
        reading order it answered far fewer "where" questions (runs AJ, AL in RUNS.md)."""
        shapes = sorted(self.shapes, key=lambda s: KINDS.index(s.kind))
        names = [f"{_article(s.colour)} {s.name}" for s in shapes]
        if len(names) == 1:
            return names[0]
        return ", ".join(names[:-1]) + " and " + names[-1]

    @classmethod
    def of(cls, shapes: list[Shape]) -> Scene:
        order = list(PLACES)
        return cls(tuple(sorted(shapes, key=lambda s: order.index(s.place))))

    @classmethod
    def parse(cls, text: str) -> Scene:
        """'red circle, blue square' (places left to right when not given) or
        'red circle left, blue square top'."""
        shapes = []
        default_places = {1: ["center"], 2: ["left", "right"], 3: ["left", "center", "right"]}
        items = [i.split() for i in text.split(",") if i.strip()]
        if not 1 <= len(items) <= 3:
            raise ValueError(f"a scene has 1 to 3 shapes, got {len(items)}: {text!r}")
        for i, words in enumerate(items):
            if len(words) not in (2, 3):
                raise ValueError(f"a shape is 'COLOUR KIND [PLACE]', got {' '.join(words)!r}")
            colour, kind = words[0], words[1]
            place = words[2] if len(words) == 3 else default_places[len(items)][i]
            if colour not in COLOURS or kind not in KINDS or place not in PLACES:
                raise ValueError(
                    f"unknown shape {' '.join(words)!r}: colours {list(COLOURS)}, "
                    f"kinds {list(KINDS)}, places {list(PLACES)}"
                )
            shapes.append(Shape(kind, colour, place))
        scene = cls.of(shapes)
        for attr in ("kind", "colour", "place"):
            if len({getattr(s, attr) for s in shapes}) != len(shapes):
                raise ValueError(f"the shapes of a scene differ in {attr}: {text!r}")
        return scene


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def random_scene(rng: random.Random, count: int | None = None) -> Scene:
    """1-3 shapes of different kinds, colours and places."""
    n = count or rng.randint(1, 3)
    kinds = rng.sample(KINDS, n)
    colours = rng.sample(list(COLOURS), n)
    places = rng.sample(list(PLACES), n)
    return Scene.of([Shape(k, c, p) for k, c, p in zip(kinds, colours, places, strict=True)])


def altered(scene: Scene, rng: random.Random) -> Scene:
    """Another scene that differs from `scene` in one thing: a shape's kind, colour or place,
    or one shape more or fewer."""
    shapes = list(scene.shapes)
    changes = ["kind", "colour", "place"]
    if len(shapes) < 3:
        changes.append("add")
    if len(shapes) > 1:
        changes.append("remove")
    change = rng.choice(changes)
    i = rng.randrange(len(shapes))
    if change == "kind":
        kind = rng.choice([k for k in KINDS if k not in {s.kind for s in shapes}])
        shapes[i] = replace(shapes[i], kind=kind)
    elif change == "colour":
        colour = rng.choice([c for c in COLOURS if c not in {s.colour for s in shapes}])
        shapes[i] = replace(shapes[i], colour=colour)
    elif change == "place":
        place = rng.choice([p for p in PLACES if p not in {s.place for s in shapes}])
        shapes[i] = replace(shapes[i], place=place)
    elif change == "add":
        shapes.append(
            Shape(
                rng.choice([k for k in KINDS if k not in {s.kind for s in shapes}]),
                rng.choice([c for c in COLOURS if c not in {s.colour for s in shapes}]),
                rng.choice([p for p in PLACES if p not in {s.place for s in shapes}]),
            )
        )
    else:
        shapes.pop(i)
    return Scene.of(shapes)


# -- drawing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placed:
    """Where a shape was drawn: its centre and radius as fractions of the picture's width,
    height and shorter side."""

    shape: Shape
    x: float
    y: float
    radius: float


# What makes a scene's picture from a seed: the picture and where its shapes were drawn.
Drawer = Callable[["Scene", int], tuple[Image.Image, tuple[Placed, ...]]]


def render(scene: Scene, seed: int, size: tuple[int, int] | None = None) -> Image.Image:
    """The scene drawn at `size` (width, height; random when None), background, shape sizes
    and positions jittered by `seed`."""
    return draw(scene, seed, size)[0]


def draw(
    scene: Scene, seed: int, size: tuple[int, int] | None = None
) -> tuple[Image.Image, tuple[Placed, ...]]:
    """`render`, and where each shape was drawn."""
    rng = random.Random(seed)
    width, height = size or random_size(rng)
    # Small pictures are drawn at twice the size, then downsampled, for smooth edges.
    scale = 2 if min(width, height) < 160 else 1
    image = _background(rng, (scale * width, scale * height))
    pen = ImageDraw.Draw(image)
    unit = scale * min(width, height)
    placed = []
    for shape in scene.shapes:
        fx, fy = PLACES[shape.place]
        x = fx + rng.uniform(-PLACE_JITTER, PLACE_JITTER)
        y = fy + rng.uniform(-PLACE_JITTER, PLACE_JITTER)
        radius = rng.uniform(*SHAPE_RADIUS)
        _draw_shape(pen, shape.kind, COLOURS[shape.colour], x * scale * width,
                    y * scale * height, radius * unit)  # fmt: skip
        placed.append(Placed(shape, x, y, radius))
    if scale != 1:
        image = image.resize((width, height), Image.Resampling.BOX)
    return image, tuple(placed)


def random_size(rng: random.Random) -> tuple[int, int]:
    """Any resolution from 72 to 360 pixels a side, aspect ratios 1:2 to 2:1 (width, height)."""
    side = rng.randint(72, 360)
    aspect = math.exp(rng.uniform(-math.log(2), math.log(2)))
    return max(48, round(side * math.sqrt(aspect))), max(48, round(side / math.sqrt(aspect)))


def png(image: Image.Image) -> bytes:
    # The fastest zlib level: a training step draws dozens of pictures, and the pixels are
    # the same at any level.
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


@functools.lru_cache(maxsize=64)
def drawn(scene: Scene, seed: int) -> tuple[Image.Image, tuple[Placed, ...]]:
    """draw(scene, seed), the last ones kept: each question about a picture
    (scenes.questions) draws it again. Never draw into the picture returned."""
    return draw(scene, seed)


def blank(scene: Scene, seed: int) -> tuple[Image.Image, tuple[Placed, ...]]:
    """In place of `drawn`: a blank picture of the size draw(scene, seed) would draw, and
    no shapes. A sample made with it costs next to nothing and has the real one's sizes (a
    training step is split between its workers by the size of its pictures)."""
    return Image.new("1", random_size(random.Random(seed))), ()


def _background(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    base = tuple(rng.randint(200, 255) for _ in range(3))
    other = tuple(max(170, c - rng.randint(15, 40)) for c in base)
    style = rng.choice(BACKGROUNDS)
    image = Image.new("RGB", size, base)
    draw = ImageDraw.Draw(image)
    width, height = size
    if style == "stripes":
        step = rng.randint(6, 20)
        for x in range(-height, width, 2 * step):
            corners = [(x, 0), (x + step, 0), (x + step + height, height), (x + height, height)]
            draw.polygon(corners, fill=other)
    elif style == "checks":
        step = rng.randint(10, 30)
        for y in range(0, height, step):
            for x in range((y // step) % 2 * step, width, 2 * step):
                draw.rectangle([x, y, x + step - 1, y + step - 1], fill=other)
    elif style == "gradient":
        ramp = Image.linear_gradient("L").resize(size)  # 0 at the top, 255 at the bottom
        image = Image.composite(Image.new("RGB", size, other), image, ramp)
    elif style == "noise":
        # Blocks of 8 pixels, each shifted by up to +-24 grey levels.
        cols, rows = -(-width // 8), -(-height // 8)
        values = _noise(rng, cols * rows, 24)
        noise = Image.frombytes("L", (cols, rows), values).resize(size, Image.Resampling.NEAREST)
        image = Image.merge(
            "RGB", [Image.eval(noise, lambda v, c=c: min(255, max(0, c + v - 128))) for c in base]
        )
    return image


def _noise(rng: random.Random, count: int, spread: int) -> bytes:
    """bytes(128 + rng.randint(-spread, spread) for _ in range(count)), the same numbers drawn
    the same way (randint's rejection sampling on just enough random bits), without its
    three calls a number: a noise background has up to 2,000 blocks, and training draws
    thousands."""
    span = 2 * spread + 1
    width, bits = span.bit_length(), rng.getrandbits
    values = bytearray(count)
    for i in range(count):
        r = bits(width)
        while r >= span:
            r = bits(width)
        values[i] = 128 - spread + r
    return bytes(values)


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    kind: str,
    colour: tuple[int, int, int],
    cx: float,
    cy: float,
    r: float,
) -> None:
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif kind == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=colour)
    elif kind == "triangle":
        draw.polygon(
            [(cx, cy - r), (cx + r * 0.95, cy + r * 0.7), (cx - r * 0.95, cy + r * 0.7)],
            fill=colour,
        )
    elif kind == "star":
        points = []
        for i in range(10):
            angle = -math.pi / 2 + i * math.pi / 5
            radius = r if i % 2 == 0 else r * 0.45
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=colour)
    elif kind == "cross":
        w = r * 0.35
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=colour)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=colour)
    else:
        raise ValueError(f"unknown shape kind {kind!r}")


# -- questions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One question about one or two pictures, and its exact answer."""

    kind: QuestionKind
    question: str
    answer: str
    pictures: tuple[Image.Image, ...]
    scenes: tuple[Scene, ...]
    placed: tuple[tuple[Placed, ...], ...] = ()  # per image, where its shapes were drawn

    @functools.cached_property
    def images(self) -> tuple[bytes, ...]:
        """The pictures as PNG files, as a client sends them. (Training takes the pictures
        themselves: encoding and decoding them was a sixth of the cost of drawing a batch.)"""
        return tuple(png(p) for p in self.pictures)


# How often each kind of question is asked, in training and in the held-out set.
QUESTION_WEIGHTS: dict[QuestionKind, int] = {
    "describe": 4,
    "colour": 2,
    "count": 1,
    "where": 2,
    "which": 1,
    "same": 2,
}
DESCRIBE = ("What is in this picture?", "Describe the image.", "What do you see?")
SAME_SCENE = "Do these two pictures show the same scene?"


def sample(seed: int, kind: QuestionKind | None = None, draw: Drawer | None = None) -> Sample:
    """The question, answer and images of one seed (pictures made by `draw`, by default
    `drawn`; `blank` gives their sizes alone)."""
    draw = draw or drawn
    rng = random.Random(seed * 7919 + 17)
    kinds = list(QUESTION_WEIGHTS)
    kind = kind or rng.choices(kinds, [QUESTION_WEIGHTS[k] for k in kinds])[0]
    scene = random_scene(rng)
    image, placed = draw(scene, rng.getrandbits(32))
    one = ((image,), (scene,), (placed,))
    if kind == "describe":
        return Sample(kind, rng.choice(DESCRIBE), scene.describe(), *one)
    shape = rng.choice(scene.shapes)
    if kind == "colour":
        return Sample(kind, f"What colour is the {shape.kind}?", shape.colour, *one)
    if kind == "count":
        return Sample(kind, "How many shapes are there?", NUMBERS[len(scene.shapes)], *one)
    if kind == "where":
        return Sample(kind, f"Where is the {shape.name}?", WHERE[shape.place], *one)
    if kind == "which":
        return Sample(kind, f"Which shape is {shape.colour}?", f"the {shape.kind}", *one)
    # Two pictures: the same scene drawn twice, or a scene that differs in one thing; or a
    # question about one of them.
    same = rng.random() < 0.5
    other = scene if same else altered(scene, rng)
    image2, placed2 = draw(other, rng.getrandbits(32))
    two = ((image, image2), (scene, other), (placed, placed2))
    if rng.random() < 0.5:
        return Sample(kind, SAME_SCENE, "yes" if same else "no", *two)
    which = rng.randrange(2)
    question = f"What is in the {ORDINALS[which]} picture?"
    return Sample(kind, question, (scene, other)[which].describe(), *two)


def questions(
    seed: int,
    count: int,
    weights: dict[QuestionKind, int] | None = None,
    draw: Drawer | None = None,
) -> list[Sample]:
    """`count` questions of different kinds (weighted as `weights`, by default
    QUESTION_WEIGHTS) about seed's picture: sample(seed, kind) draws the same scene and
    picture whatever the kind."""
    rng = random.Random(seed * 7919 + 11)
    weights = QUESTION_WEIGHTS if weights is None else weights
    kinds = [k for k in QUESTION_WEIGHTS if weights.get(k, 0) > 0]
    chosen: list[QuestionKind] = []
    while len(chosen) < min(count, len(kinds)):
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        if kind not in chosen:
            chosen.append(kind)
    return [sample(seed, kind, draw) for kind in chosen]


def answer_corpus() -> list[str]:
    """Every question and answer word the world uses (the tokenizer's training text)."""
    lines = list(DESCRIBE)
    lines += ["How many shapes are there?", SAME_SCENE]
    lines += [f"What is in the {o} picture?" for o in ORDINALS]
    lines += ["yes", "no", *NUMBERS, *WHERE.values()]
    for kind in KINDS:
        lines += [f"What colour is the {kind}?", f"the {kind}"]
        for colour in COLOURS:
            name = f"{_article(colour)} {colour} {kind}"
            lines += [f"Where is the {colour} {kind}?", name, f"{name},", f"and {name}"]
            lines += [f"Which shape is {colour}?", colour]
    return lines
