"""The built-in ``shapes`` conversation set: deterministic, seeded, and checkable.

Every row is a chat about flat, PIL-drawn pictures (or a short clip) of 1-6 coloured shapes
(circle, square, triangle, rectangle, star, pentagon, hexagon) on a plain background. Each
shape sits inside its own cell of a grid, so shapes never overlap and every count, colour
and position has one right answer. The mix is made to exercise a packing pipeline, not to be
hard:

* **Modality** - about 15% video rows (:data:`VIDEO_SHARE`, see below); of the others,
  about 75% single-image rows, 10% multi-image rows (2-3 images) and 15% text-only rows
  (shape trivia, or counting shapes described in words).
* **Image size** - the visual-token count (one token per 32x32 pixel block, the Qwen3-VL
  merge size) is skewed log-uniform over 16..1,024 with aspect ratios 1:2..2:1; most images
  are small, a long tail is large. Sides are at least 128 px and lie up to 24 px off the
  32 px grid, so the processor's resize rule (rounding, max-pixels downscale) does real work.
* **Answer length** - 1-4 user/assistant turns; most answers are a word or a number, about
  one in six lists every shape ("describe"), and a few list every shape of every image in
  detail (hundreds of tokens).

Row layout (one JSON object per line of ``conversations.jsonl``; image paths are relative to
the dataset directory, and the user text holds one ``<image>`` marker per image, in order)::

    {"id": "shapes-train-000123", "split": "train",
     "images": ["images/shapes-train-000123-0.png"],
     "conversations": [{"role": "user", "content": "<image>\\nHow many shapes are there?"},
                       {"role": "assistant", "content": "3"}],
     "meta": {"answers": [{"turn": 1, "kind": "count", "answer": "3"}]}}

A video row holds one clip, ``clips/<id>.mp4`` (H.264, 6-16 frames at 4 fps, sides of
64-160 px on the 32 px grid), drawn with the same shapes: one shape moving left, right, up or
down past static ones; 2-4 shapes appearing one after another (one may vanish again); or a
shape changing colour. Its questions ask the direction (``direction``), which shape appears
first/second/.../last (``order``), how many shapes there are at the start or end or appear in
all (``count_time``), and what colour a shape turns (``colour_change``), with ``count`` and
``colour`` follow-ups; the user text holds one ``<video>`` marker::

    {"id": "shapes-train-000003", "split": "train", "images": [],
     "videos": ["clips/shapes-train-000003.mp4"],
     "conversations": [{"role": "user", "content": "<video>\\nWhich way does the red circle move?"},
                       {"role": "assistant", "content": "left"}],
     "meta": {"answers": [{"turn": 1, "kind": "direction", "answer": "left"}],
              "clip": {"kind": "move", "num_frames": 9, "fps": 4.0}}}

Every event lasts at least 3 frames, so the processor's default sampling (2 fps, about every
other frame, always the first and the last) shows what the answer says.

``meta.answers[i].turn`` indexes the assistant message whose content holds ``answer``;
``kind`` (one of :data:`ANSWER_KINDS`) tells :func:`answer_matches` how to grade a generated
reply. Every row draws from its own ``random.Random`` keyed by ``(seed, split, index)``, so a
row does not depend on the rows around it: a smaller set is a prefix of a larger one, the
same arguments give byte-identical files, and ``val`` rows are a held-out stream. Whether a
row is a video row is a draw of its own, so the image and text rows are the same whatever
the video share.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from packline.media.video import write_video
from packline.shapes.answers import answer_matches, normalize_answer  # noqa: F401
from packline.shapes.words import (  # noqa: F401 - the set's words, re-exported
    ANSWER_CHOICES,
    ANSWER_KINDS,
    BACKGROUND_NAMES,
    BACKGROUND_RGB,
    COLOUR_NAMES,
    COLOUR_RGB,
    DIRECTION_NAMES,
    GRID,
    MIN_CONTRAST,
    NUMBER_WORDS,
    ORDINALS,
    POSITION_NAMES,
    PREPOSITION,
    SHAPE_NAMES,
    SIDES,
    SIZE_WORDS,
)

__all__ = [
    "ANSWER_CHOICES",
    "ANSWER_KINDS",
    "BACKGROUND_NAMES",
    "CLIP_FPS",
    "CLIP_KINDS",
    "COLOUR_NAMES",
    "DIRECTION_NAMES",
    "NUMBER_WORDS",
    "ORDINALS",
    "POSITION_NAMES",
    "SHAPES_VERSION",
    "SHAPE_NAMES",
    "SIZE_WORDS",
    "VIDEO_SHARE",
    "answer_matches",
    "normalize_answer",
    "write_shapes_dataset",
]

SHAPES_VERSION = 2
"""Bumped when what :func:`write_shapes_dataset` writes for the same arguments changes (2:
video rows), so a generated copy kept on disk can tell it is stale."""

_MIN_TOKENS, _MAX_TOKENS = 16, 1024
_TOKEN_PX = 32  # one LLM token per 32x32 block (16 px ViT patches, 2x2 merge)
_MIN_SIDE_BLOCKS = 4  # 4 * 32 = 128 px
_JITTER = 24  # px off the 32 px grid, either way (never below 128 px)
# u ** _SIZE_SKEW with u uniform puts most images at the small end of the log range.
_SIZE_SKEW = 1.7

_TEXT_ONLY_FRACTION = 0.15
_MULTI_IMAGE_FRACTION = 0.10
_SYSTEM_FRACTION = 0.30
_TURN_WEIGHTS = (0.45, 0.30, 0.15, 0.10)  # 1, 2, 3, 4 user turns

_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant that answers questions about simple pictures of shapes.",
    "Answer briefly and precisely.",
    "You are a careful visual assistant. Count carefully and name colours and positions "
    "exactly as you see them.",
)

# Fixed PNG options keep the bytes identical across runs; level 1 is fast and flat colours
# still compress well.
_PNG_OPTIONS = {"format": "PNG", "compress_level": 1, "optimize": False}

VIDEO_SHARE = 0.15
"""Share of the rows that are video conversations (one clip each), by default."""
CLIP_KINDS = ("move", "appear", "colour")
"""What happens in a clip: one shape moves across, shapes appear one after another, or a
shape's colour changes."""
CLIP_FPS = 4.0
"""Frame rate of every clip. The processor samples 2 frames a second by default (at least
4), so about every other frame is seen."""
_CLIP_FRAMES = (6, 16)  # frames per clip, both ends included (1.5 to 4 seconds)
# Frames between two events of an "appear" clip (a shape appearing or vanishing). At 2 fps
# from a 4-fps clip of 6-16 frames, sampled indices are at most 3 apart and always include
# the first and last frame, so every run of 3 frames holds a sampled one: the order and the
# counts the questions ask about are the ones the sampled frames show.
_EVENT_GAP = 3
_MARGIN = 4  # px between a clip's shapes and the frame's edge
# The two colours of a colour change are at least this far apart in RGB, so the change
# survives the lossy encode (yellow -> orange, 75 apart, would not be asked).
_MIN_CHANGE_CONTRAST = 120.0
_VIDEO_TURN_WEIGHTS = (0.55, 0.30, 0.15)  # 1, 2, 3 user turns
_VIDEO_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer briefly and precisely.",
    "You are a careful visual assistant. Watch the whole clip before you answer.",
)


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """One drawn shape; ``cx``/``cy``/``size`` are in pixels."""

    kind: str
    colour: str
    row: int
    col: int
    cx: int
    cy: int
    size: int
    """Width of the shape's bounding square in pixels."""
    size_word: str

    @property
    def position(self) -> str:
        return GRID[self.row][self.col]


@dataclass(frozen=True, kw_only=True)
class _Picture:
    """One image: its pixel size, background and shapes in reading order."""

    width: int
    height: int
    background: str
    shapes: tuple[_Shape, ...]


@dataclass(frozen=True, kw_only=True)
class _Turn:
    """One question with its assistant reply and the checkable answer inside the reply."""

    question: str
    reply: str
    kind: str
    answer: str
    topic: str = ""
    """What is asked, so a conversation never asks it twice in other words (default: the
    question text)."""


# --------------------------------------------------------------------------- images


def _palette(background: str) -> list[str]:
    """The shape colours that stand out on ``background``, in :data:`COLOUR_NAMES` order."""
    bg_rgb = BACKGROUND_RGB[background]
    return [c for c, rgb in COLOUR_RGB.items() if math.dist(rgb, bg_rgb) >= MIN_CONTRAST]


def _sample_picture(rng: random.Random) -> _Picture:
    tokens = _MIN_TOKENS * (_MAX_TOKENS / _MIN_TOKENS) ** (rng.random() ** _SIZE_SKEW)
    aspect = 2.0 ** rng.uniform(-1.0, 1.0)  # width / height
    wb = max(_MIN_SIDE_BLOCKS, round(math.sqrt(tokens * aspect)))
    hb = max(_MIN_SIDE_BLOCKS, round(math.sqrt(tokens / aspect)))
    wb, hb = min(wb, 2 * hb), min(hb, 2 * wb)
    while wb * hb > _MAX_TOKENS:
        if wb >= hb:
            wb -= 1
        else:
            hb -= 1
    # Jitter the sides off the 32 px grid so the processor's resize rule (rounding to the
    # nearest multiple of 32, and the max-pixels downscale) really runs on this data.
    width = wb * _TOKEN_PX + rng.randint(0 if wb == _MIN_SIDE_BLOCKS else -_JITTER, _JITTER)
    height = hb * _TOKEN_PX + rng.randint(0 if hb == _MIN_SIDE_BLOCKS else -_JITTER, _JITTER)

    background = rng.choice(list(BACKGROUND_RGB))
    palette = _palette(background)
    num_shapes = rng.randint(1, 6)
    cells = sorted(rng.sample(range(9), num_shapes))
    cell_w, cell_h = width / 3, height / 3
    shapes = []
    for cell in cells:
        row, col = divmod(cell, 3)
        fraction = rng.uniform(0.45, 0.85)
        size = int(min(cell_w, cell_h) * fraction)
        slack_x, slack_y = (cell_w - size) / 2, (cell_h - size) / 2
        cx = int(col * cell_w + cell_w / 2 + rng.uniform(-0.8, 0.8) * slack_x)
        cy = int(row * cell_h + cell_h / 2 + rng.uniform(-0.8, 0.8) * slack_y)
        small, medium, large = SIZE_WORDS
        size_word = small if fraction < 0.58 else medium if fraction < 0.72 else large
        shapes.append(
            _Shape(
                kind=rng.choice(SHAPE_NAMES),
                colour=rng.choice(palette),
                row=row,
                col=col,
                cx=cx,
                cy=cy,
                size=size,
                size_word=size_word,
            )
        )
    return _Picture(width=width, height=height, background=background, shapes=tuple(shapes))


def _star_points(cx: int, cy: int, r: float) -> list[tuple[int, int]]:
    points = []
    for i in range(10):
        radius = r if i % 2 == 0 else r * 0.45
        angle = -math.pi / 2 + i * math.pi / 5
        points.append((round(cx + radius * math.cos(angle)), round(cy + radius * math.sin(angle))))
    return points


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, cx: int, cy: int, size: int, colour: str):
    """Draw one shape of bounding width ``size`` centred at (``cx``, ``cy``): the one home
    of a shape's look, for pictures and clip frames alike."""
    fill = COLOUR_RGB[colour]
    r = size / 2
    if kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "square":
        h = r * 0.85
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif kind == "rectangle":
        draw.rectangle((cx - r, cy - r * 0.5, cx + r, cy + r * 0.5), fill=fill)
    elif kind == "star":
        draw.polygon(_star_points(cx, cy, r), fill=fill)
    else:
        draw.regular_polygon((cx, cy, r), SIDES[kind], fill=fill)


def _draw_picture(picture: _Picture) -> Image.Image:
    image = Image.new("RGB", (picture.width, picture.height), BACKGROUND_RGB[picture.background])
    draw = ImageDraw.Draw(image)
    for s in picture.shapes:
        _draw_shape(draw, s.kind, s.cx, s.cy, s.size, s.colour)
    return image


# --------------------------------------------------------------------------- phrasing


def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _plural(kind: str) -> str:
    return kind + "s"


def _join(items: list[str], conjunction: str = "and") -> str:
    if len(items) == 1:
        return items[0]
    return f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


def _shape_phrase(s: _Shape, *, detail: bool) -> str:
    core = f"{s.colour} {s.kind} {PREPOSITION[s.position]}"
    if not detail:
        return _article(core)
    return (
        f"{_article(s.size_word + ' ' + core)}, about {s.size} pixels across, "
        f"centred near ({s.cx}, {s.cy})"
    )


def _describe(picture: _Picture) -> str:
    phrases = [_shape_phrase(s, detail=False) for s in picture.shapes]
    n = len(phrases)
    head = "There is 1 shape" if n == 1 else f"There are {n} shapes"
    return f"{head}: {_join(phrases)}."


def _describe_detail(picture: _Picture) -> str:
    n = len(picture.shapes)
    noun = "shape" if n == 1 else "shapes"
    lines = [
        f"The image is {picture.width} by {picture.height} pixels with a {picture.background} "
        f"background and {n} {noun}."
    ]
    for i, s in enumerate(picture.shapes, start=1):
        phrase = _shape_phrase(s, detail=True)
        lines.append(f"{i}. {phrase[0].upper()}{phrase[1:]}.")
    colours = Counter(s.colour for s in picture.shapes)
    kinds = Counter(s.kind for s in picture.shapes)
    lines.append("Colours: " + ", ".join(f"{k} {c}" for c, k in sorted(colours.items())) + ".")
    lines.append(
        "Kinds: "
        + ", ".join(f"{k} {c if k == 1 else _plural(c)}" for c, k in sorted(kinds.items()))
        + "."
    )
    return "\n".join(lines)


def _count_reply(rng: random.Random, n: int, noun: str, where: str = "") -> str:
    """The bare number, or a sentence holding it as a digit (0 stays bare)."""
    if n == 0 or rng.random() < 0.65:
        return str(n)
    verb, noun = ("is", noun) if n == 1 else ("are", _plural(noun))
    return f"There {verb} {n} {noun}{where}."


# --------------------------------------------------------------------------- questions


def _q_count_total(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    if idx is None and len(pics) > 1:
        n = sum(len(p.shapes) for p in pics)
        q = rng.choice(
            (
                "How many shapes are there in all the images together?",
                "How many shapes are there across the images in total?",
            )
        )
        return _Turn(
            question=q,
            reply=_count_reply(rng, n, "shape", " in total"),
            kind="count",
            answer=str(n),
            topic="count:None",
        )
    pic, where = _target(pics, idx)
    n = len(pic.shapes)
    q = rng.choice(
        (
            f"How many shapes are in {where}?",
            f"How many shapes are there in {where}?",
            f"Count the shapes in {where}.",
        )
    )
    return _Turn(
        question=q,
        reply=_count_reply(rng, n, "shape"),
        kind="count",
        answer=str(n),
        topic=f"count:{idx}",
    )


def _q_count_colour(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    pic, where = _target(pics, idx)
    present = sorted({s.colour for s in pic.shapes})
    colour = rng.choice(present) if rng.random() < 0.75 else rng.choice(COLOUR_NAMES)
    n = sum(s.colour == colour for s in pic.shapes)
    q = f"How many {colour} shapes are in {where}?"
    return _Turn(
        question=q, reply=_count_reply(rng, n, f"{colour} shape"), kind="count", answer=str(n)
    )


def _q_count_kind(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    pic, where = _target(pics, idx)
    present = sorted({s.kind for s in pic.shapes})
    kind = rng.choice(present) if rng.random() < 0.8 else rng.choice(SHAPE_NAMES)
    n = sum(s.kind == kind for s in pic.shapes)
    q = f"How many {_plural(kind)} are in {where}?"
    return _Turn(question=q, reply=_count_reply(rng, n, kind), kind="count", answer=str(n))


def _q_colour(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    pic, where = _target(pics, idx)
    kinds = Counter(s.kind for s in pic.shapes)
    unique = [s for s in pic.shapes if kinds[s.kind] == 1]
    if not unique:
        return None
    s = rng.choice(unique)
    suffix = "" if len(pics) == 1 else f" in {where}"
    q = rng.choice(
        (f"What colour is the {s.kind}{suffix}?", f"Which colour is the {s.kind}{suffix}?")
    )
    reply = s.colour if rng.random() < 0.65 else f"The {s.kind} is {s.colour}."
    return _Turn(
        question=q, reply=reply, kind="colour", answer=s.colour, topic=f"colour:{idx}:{s.kind}"
    )


def _q_position(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    pic, where = _target(pics, idx)
    pairs = Counter((s.colour, s.kind) for s in pic.shapes)
    kinds = Counter(s.kind for s in pic.shapes)
    unique = [s for s in pic.shapes if pairs[(s.colour, s.kind)] == 1]
    if not unique:
        return None
    s = rng.choice(unique)
    name = s.kind if kinds[s.kind] == 1 and rng.random() < 0.5 else f"{s.colour} {s.kind}"
    suffix = "" if len(pics) == 1 else f" in {where}"
    q = f"Where is the {name}{suffix}?"
    if rng.random() < 0.65:
        reply = s.position
    else:
        reply = f"The {name} is {PREPOSITION[s.position]}."
    return _Turn(
        question=q,
        reply=reply,
        kind="position",
        answer=s.position,
        topic=f"position:{idx}:{s.colour}:{s.kind}",
    )


def _q_describe(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    if len(pics) == 1:
        q = rng.choice(
            (
                "Describe every shape in the image.",
                "List all the shapes with their colours and positions.",
                "What shapes do you see, and where are they?",
            )
        )
        reply = _describe(pics[0])
    else:
        q = rng.choice(("Describe the shapes in each image.", "List every shape in every image."))
        reply = "\n".join(f"Image {i}: {_describe(p)}" for i, p in enumerate(pics, start=1))
    return _Turn(question=q, reply=reply, kind="describe", answer=reply, topic="describe")


def _q_describe_detail(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    what = "the image" if len(pics) == 1 else "every image"
    q = (
        f"Describe {what} in detail: for each shape give its size, colour, position and "
        "approximate centre in pixels, then summarise the colours and kinds."
    )
    if len(pics) == 1:
        reply = _describe_detail(pics[0])
    else:
        reply = "\n\n".join(
            f"Image {i}:\n{_describe_detail(p)}" for i, p in enumerate(pics, start=1)
        )
    return _Turn(question=q, reply=reply, kind="describe", answer=reply, topic="describe-detail")


def _q_compare(rng: random.Random, pics: list[_Picture], idx: int | None) -> _Turn | None:
    counts = [len(p.shapes) for p in pics]
    if len(pics) == 2:
        q = "Which image has more shapes?"
        if counts[0] == counts[1]:
            answer = "they have the same number"
            reply = rng.choice(
                (
                    "They have the same number.",
                    f"They have the same number of shapes ({counts[0]} each).",
                )
            )
            return _Turn(question=q, reply=reply, kind="compare", answer=answer)
    else:
        q = "Which image has the most shapes?"
        if counts.count(max(counts)) > 1:
            return None
    best = counts.index(max(counts))
    answer = f"the {ORDINALS[best]} image"
    if rng.random() < 0.5:
        reply = f"The {ORDINALS[best]} image."
    else:
        reply = f"The {ORDINALS[best]} image, with {counts[best]} shapes."
    return _Turn(question=q, reply=reply, kind="compare", answer=answer)


def _target(pics: list[_Picture], idx: int | None) -> tuple[_Picture, str]:
    if len(pics) == 1:
        return pics[0], "the image"
    assert idx is not None
    return pics[idx], f"the {ORDINALS[idx]} image"


_QuestionFn = Callable[[random.Random, list[_Picture], int | None], _Turn | None]

# (weight, builder, needs an image index when there are several images)
_IMAGE_QUESTIONS: tuple[tuple[float, _QuestionFn, bool], ...] = (
    (0.14, _q_count_total, False),
    (0.11, _q_count_colour, True),
    (0.10, _q_count_kind, True),
    (0.18, _q_colour, True),
    (0.22, _q_position, True),
    (0.15, _q_describe, False),
    (0.04, _q_describe_detail, False),
)
_MULTI_EXTRA: tuple[tuple[float, _QuestionFn, bool], ...] = ((0.25, _q_compare, False),)


def _image_turns(rng: random.Random, pics: list[_Picture], num_turns: int) -> list[_Turn]:
    table = _IMAGE_QUESTIONS + (_MULTI_EXTRA if len(pics) > 1 else ())
    weights = [w for w, _, _ in table]
    turns: list[_Turn] = []
    asked: set[str] = set()
    for _ in range(num_turns):
        for _attempt in range(12):
            _, fn, per_image = rng.choices(table, weights=weights)[0]
            if len(pics) > 1:
                # For the total count, None asks about all images; otherwise pick one image.
                idx = rng.randrange(len(pics)) if per_image or rng.random() < 0.4 else None
            else:
                idx = None
            turn = fn(rng, pics, idx)
            if turn is not None and (turn.topic or turn.question) not in asked:
                asked.add(turn.topic or turn.question)
                turns.append(turn)
                break
    if not turns:  # unreachable in practice: the total count always applies
        turns.append(_q_count_total(rng, pics, None if len(pics) > 1 else 0))
    return turns


def _text_turns(rng: random.Random, num_turns: int) -> tuple[str, list[_Turn]]:
    """Text-only questions; returns a preamble for the first user message and the turns."""
    if rng.random() < 0.3:
        turns = []
        for kind in rng.sample(sorted(SIDES), min(num_turns, 3)):
            if rng.random() < 0.6:
                n = SIDES[kind]
                q = f"How many sides does {_article(kind)} have?"
                reply = (
                    str(n)
                    if rng.random() < 0.6
                    else f"{_article(kind).capitalize()} has {n} sides."
                )
                turns.append(_Turn(question=q, reply=reply, kind="text", answer=str(n)))
            else:
                n = SIDES[kind]
                others = [k for k in SIDES if SIDES[k] != n]
                options = [*rng.sample(others, 2), kind]
                rng.shuffle(options)
                listed = _join([_article(o) for o in options], "or")
                q = f"Which of these shapes has {n} sides: {listed}?"
                reply = kind if rng.random() < 0.6 else f"The {kind} has {n} sides."
                turns.append(_Turn(question=q, reply=reply, kind="text", answer=kind))
        return "", turns

    groups = []
    used = set()
    for _ in range(rng.randint(2, 4)):
        colour, kind = rng.choice(COLOUR_NAMES), rng.choice(SHAPE_NAMES)
        if (colour, kind) not in used:
            used.add((colour, kind))
            groups.append((rng.randint(1, 4), colour, kind))
    phrases = [
        f"{NUMBER_WORDS[n]} {colour} {kind if n == 1 else _plural(kind)}"
        for n, colour, kind in groups
    ]
    place = rng.choice(("A drawing shows", "A box holds", "On a poster there are"))
    preamble = f"{place} {_join(phrases)}."

    candidates: list[_Turn] = []
    total = sum(n for n, _, _ in groups)
    candidates.append(
        _Turn(
            question="How many shapes are there in total?",
            reply=str(total),
            kind="text",
            answer=str(total),
        )
    )
    for colour in sorted({c for _, c, _ in groups}):
        n = sum(k for k, c, _ in groups if c == colour)
        candidates.append(
            _Turn(
                question=f"How many {colour} shapes are there?",
                reply=str(n),
                kind="text",
                answer=str(n),
            )
        )
    for kind in sorted({k for _, _, k in groups}):
        of_kind = [(n, c) for n, c, k in groups if k == kind]
        n = sum(m for m, _ in of_kind)
        candidates.append(
            _Turn(
                question=f"How many {_plural(kind)} are there?",
                reply=str(n),
                kind="text",
                answer=str(n),
            )
        )
        if len(of_kind) == 1:
            colour = of_kind[0][1]
            noun = kind if of_kind[0][0] == 1 else _plural(kind)
            verb = "is" if of_kind[0][0] == 1 else "are"
            candidates.append(
                _Turn(
                    question=f"What colour {verb} the {noun}?",
                    reply=colour,
                    kind="text",
                    answer=colour,
                )
            )
        if kind in SIDES:
            corners = n * SIDES[kind]
            candidates.append(
                _Turn(
                    question=f"How many corners do the {_plural(kind)} have altogether?",
                    reply=str(corners),
                    kind="text",
                    answer=str(corners),
                )
            )
    turns = [candidates[0]] if rng.random() < 0.5 else []
    rest = candidates[1:] if turns else candidates
    turns += rng.sample(rest, min(num_turns - len(turns), len(rest)))
    return preamble, turns


# --------------------------------------------------------------------------- clips


@dataclass(frozen=True, kw_only=True)
class _Sprite:
    """One shape in one frame of a clip; ``cx``/``cy``/``size`` are in pixels."""

    kind: str
    colour: str
    cx: int
    cy: int
    size: int


@dataclass(frozen=True, kw_only=True)
class _Clip:
    """One short video: the shapes of every frame, drawn in order.

    In ``move`` and ``colour`` clips the last sprite of every frame is the subject (the shape
    that moves, or changes colour); the facts the questions ask about are read off
    ``frames``, so what is asked is what is drawn."""

    kind: str
    """One of :data:`CLIP_KINDS`."""
    width: int
    height: int
    background: str
    frames: tuple[tuple[_Sprite, ...], ...]
    fps: float = CLIP_FPS

    @property
    def num_frames(self) -> int:
        return len(self.frames)


def _clip_frames_count(rng: random.Random) -> int:
    return rng.randint(*_CLIP_FRAMES)


def _sample_move(rng: random.Random, num_frames: int, background: str) -> _Clip:
    """One shape crossing the frame (left, right, up or down) in a straight line at a steady
    speed, and 0-2 static shapes beside its lane (never in its way)."""
    direction = rng.choice(DIRECTION_NAMES)
    vertical = direction in ("up", "down")
    if vertical:
        height, width = rng.choice((128, 160)), rng.choice((64, 96, 128))
    else:
        height, width = rng.choice((64, 96, 128)), rng.choice((128, 160))
    along, across = (height, width) if vertical else (width, height)
    palette = _palette(background)
    colour, kind = rng.choice(palette), rng.choice(SHAPE_NAMES)
    size = max(20, int(min(height, width) * rng.uniform(0.28, 0.4)))
    # From near one edge to near the other: 48+ px in all, 3+ px a frame.
    free = along - size - 2 * _MARGIN
    travel = int(free * rng.uniform(0.7, 1.0))
    start = _MARGIN + size // 2 + rng.randint(0, free - travel)
    end = start + travel
    if direction in ("left", "up"):
        start, end = along - start, along - end

    room = across - size - 3 * _MARGIN  # what is left beside the mover's lane
    num_static = rng.choice((0, 1, 1, 2)) if room >= 20 else 0
    lo = 0  # where the static shapes' side begins, across the lane
    if num_static:
        near_side = rng.random() < 0.5
        lane = _MARGIN + size // 2 if near_side else across - _MARGIN - size // 2
        lo = size + 2 * _MARGIN if near_side else _MARGIN
    else:
        lane = rng.randint(_MARGIN + size // 2, across - _MARGIN - size // 2)
    statics = []
    others = [c for c in palette if c != colour]
    segment = along / max(num_static, 1)
    for i in range(num_static):
        d_size = max(16, min(int(room * rng.uniform(0.7, 1.0)), int(segment - 2 * _MARGIN)))
        d_across = lo + d_size // 2 + rng.randint(0, max(0, room - d_size))
        slack = max(0.0, (segment - d_size) / 2 - _MARGIN)
        d_along = int(segment * i + segment / 2 + rng.uniform(-1.0, 1.0) * slack)
        cx, cy = (d_across, d_along) if vertical else (d_along, d_across)
        d_kind = rng.choice(SHAPE_NAMES)
        statics.append(_Sprite(kind=d_kind, colour=rng.choice(others), cx=cx, cy=cy, size=d_size))

    frames = []
    for t in range(num_frames):
        pos = round(start + (end - start) * t / (num_frames - 1))
        cx, cy = (lane, pos) if vertical else (pos, lane)
        mover = _Sprite(kind=kind, colour=colour, cx=cx, cy=cy, size=size)
        frames.append((*statics, mover))
    return _Clip(
        kind="move", width=width, height=height, background=background, frames=tuple(frames)
    )


def _sample_appear(rng: random.Random, num_frames: int, background: str) -> _Clip:
    """2-4 shapes of different kinds appearing one after another in cells of a 2x3 grid,
    each event at least :data:`_EVENT_GAP` frames after the one before; sometimes one shape
    vanishes again afterwards, so the count at the end differs from the count that
    appeared."""
    height, width = rng.choice((96, 128)), rng.choice((128, 160))
    palette = _palette(background)
    first = rng.choice((0, 1))  # the first shape is there from the start, or one frame later
    # The last shape appears at least two frames before the end (the last frame is sampled).
    most = min(4, 1 + (num_frames - 2 - first) // _EVENT_GAP)
    num_shapes = rng.randint(2, most)
    slack = num_frames - 2 - first - _EVENT_GAP * (num_shapes - 1)
    times = [first]
    for _ in range(num_shapes - 1):
        extra = rng.randint(0, slack)
        slack -= extra
        times.append(times[-1] + _EVENT_GAP + extra)
    vanish_at, vanisher = num_frames, -1  # none
    if times[-1] + _EVENT_GAP <= num_frames - 1 and rng.random() < 0.4:
        vanish_at = rng.randint(times[-1] + _EVENT_GAP, num_frames - 1)
        vanisher = rng.randrange(num_shapes)

    cell_w, cell_h = width / 3, height / 2
    kinds = rng.sample(SHAPE_NAMES, num_shapes)
    shapes = []
    for kind, cell in zip(kinds, rng.sample(range(6), num_shapes), strict=True):
        row, col = divmod(cell, 3)
        size = int(min(cell_w, cell_h) * rng.uniform(0.65, 0.85))
        slack_x, slack_y = (cell_w - size) / 2, (cell_h - size) / 2
        cx = int(col * cell_w + cell_w / 2 + rng.uniform(-0.6, 0.6) * slack_x)
        cy = int(row * cell_h + cell_h / 2 + rng.uniform(-0.6, 0.6) * slack_y)
        shapes.append(_Sprite(kind=kind, colour=rng.choice(palette), cx=cx, cy=cy, size=size))
    frames = tuple(
        tuple(
            s
            for i, s in enumerate(shapes)
            if times[i] <= t and not (i == vanisher and t >= vanish_at)
        )
        for t in range(num_frames)
    )
    return _Clip(kind="appear", width=width, height=height, background=background, frames=frames)


def _sample_colour_change(rng: random.Random, num_frames: int, background: str) -> _Clip:
    """One large shape whose colour changes once, from one strong colour to another far from
    it, with 0-2 static shapes of other kinds and colours beside it."""
    height, width = rng.choice((64, 96, 128)), rng.choice((96, 128, 160))
    palette = _palette(background)
    pairs = [
        (a, b)
        for a in palette
        for b in palette
        if a != b and math.dist(COLOUR_RGB[a], COLOUR_RGB[b]) >= _MIN_CHANGE_CONTRAST
    ]
    before, after = rng.choice(pairs)
    change_at = rng.randint(2, num_frames - 2)  # each colour shows for 2+ frames
    num_cols = rng.choice([n for n in (1, 2, 3) if width / n >= 48])
    cell_w = width / num_cols
    main_col = rng.randrange(num_cols)
    kind = rng.choice(SHAPE_NAMES)
    other_kinds = [k for k in SHAPE_NAMES if k != kind]
    other_colours = [c for c in palette if c not in (before, after)]
    statics, subject = [], None
    for col in range(num_cols):
        is_main = col == main_col
        if is_main:
            size = int(min(cell_w, height) * rng.uniform(0.6, 0.85))
        elif other_colours:
            size = int(min(cell_w, height) * rng.uniform(0.45, 0.7))
        else:
            continue
        slack_x, slack_y = (cell_w - size) / 2, (height - size) / 2
        cx = int(col * cell_w + cell_w / 2 + rng.uniform(-0.6, 0.6) * slack_x)
        cy = int(height / 2 + rng.uniform(-0.6, 0.6) * slack_y)
        if is_main:
            subject = (cx, cy, size)
        else:
            statics.append(
                _Sprite(
                    kind=rng.choice(other_kinds),
                    colour=rng.choice(other_colours),
                    cx=cx,
                    cy=cy,
                    size=size,
                )
            )
    assert subject is not None
    cx, cy, size = subject
    frames = tuple(
        (
            *statics,
            _Sprite(kind=kind, colour=before if t < change_at else after, cx=cx, cy=cy, size=size),
        )
        for t in range(num_frames)
    )
    return _Clip(kind="colour", width=width, height=height, background=background, frames=frames)


_CLIP_SAMPLERS: dict[str, Callable[[random.Random, int, str], _Clip]] = {
    "move": _sample_move,
    "appear": _sample_appear,
    "colour": _sample_colour_change,
}


def _sample_clip(rng: random.Random) -> _Clip:
    """A clip of a kind drawn evenly from :data:`CLIP_KINDS`, 6-16 frames at
    :data:`CLIP_FPS`, every side a multiple of 32 px (so the processor does not resize),
    large shapes in strong colours (so what happens survives the lossy encode)."""
    kind = rng.choice(CLIP_KINDS)
    num_frames = _clip_frames_count(rng)
    background = rng.choice(list(BACKGROUND_RGB))
    return _CLIP_SAMPLERS[kind](rng, num_frames, background)


def _draw_clip(clip: _Clip) -> np.ndarray:
    """The clip's frames as one ``(T, H, W, 3)`` uint8 RGB array, drawn with
    :func:`_draw_shape` as pictures are."""
    out = np.empty((clip.num_frames, clip.height, clip.width, 3), dtype=np.uint8)
    for t, sprites in enumerate(clip.frames):
        image = Image.new("RGB", (clip.width, clip.height), BACKGROUND_RGB[clip.background])
        draw = ImageDraw.Draw(image)
        for s in sprites:
            _draw_shape(draw, s.kind, s.cx, s.cy, s.size, s.colour)
        out[t] = np.asarray(image)
    return out


# ----------------------------------------------------------------- clip questions


def _direction(first: _Sprite, last: _Sprite) -> str:
    dx, dy = last.cx - first.cx, last.cy - first.cy
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _appearance_order(clip: _Clip) -> list[_Sprite]:
    """The clip's shapes in the order they first show (kinds are distinct in an ``appear``
    clip)."""
    seen: dict[str, _Sprite] = {}
    for sprites in clip.frames:
        for s in sprites:
            seen.setdefault(s.kind, s)
    return list(seen.values())


_TOWARDS = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}
_OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def _q_direction(rng: random.Random, clip: _Clip) -> _Turn | None:
    first, last = clip.frames[0][-1], clip.frames[-1][-1]
    direction = _direction(first, last)
    unique_kind = sum(s.kind == first.kind for s in clip.frames[0]) == 1
    name = first.kind if unique_kind and rng.random() < 0.4 else f"{first.colour} {first.kind}"
    q = rng.choice(
        (
            f"Which way does the {name} move?",
            f"In which direction does the {name} move?",
            f"Does the {name} move left, right, up or down?",
        )
    )
    r = rng.random()
    if r < 0.6:
        reply = direction
    elif r < 0.8 or direction in ("up", "down"):
        reply = f"The {name} moves {_TOWARDS[direction]}."
    else:
        reply = f"The {name} moves from {_OPPOSITE[direction]} to {direction}."
    return _Turn(question=q, reply=reply, kind="direction", answer=direction, topic="direction")


def _q_order(rng: random.Random, clip: _Clip) -> _Turn | None:
    order = _appearance_order(clip)
    i = rng.randrange(len(order))
    last = i == len(order) - 1
    word = "last" if last and (i >= len(ORDINALS) or rng.random() < 0.6) else ORDINALS[i]
    s = order[i]
    q = rng.choice((f"Which shape appears {word}?", f"Which shape appears {word} in the video?"))
    r = rng.random()
    if r < 0.55:
        reply = s.kind
    elif r < 0.8:
        reply = f"The {s.kind} appears {word}."
    else:
        reply = f"The {s.colour} {s.kind}."
    return _Turn(question=q, reply=reply, kind="order", answer=s.kind, topic=f"order:{i}")


def _q_count_time(rng: random.Random, clip: _Clip) -> _Turn | None:
    r = rng.random()
    if r < 0.6:
        n = len(clip.frames[-1])
        q = rng.choice(
            (
                "How many shapes are there at the end?",
                "How many shapes are there at the end of the video?",
                "How many shapes can you see in the last frame?",
            )
        )
        where, topic = " at the end", "count_time:end"
    elif r < 0.8:
        n = len(clip.frames[0])
        q = rng.choice(
            ("How many shapes are there at the start?", "How many shapes are in the first frame?")
        )
        where, topic = " at the start", "count_time:start"
    else:
        n = len({s.kind for sprites in clip.frames for s in sprites})
        q = rng.choice(
            ("How many shapes appear in the video?", "How many shapes appear one after another?")
        )
        where, topic = " in all", "count_time:all"
    return _Turn(
        question=q,
        reply=_count_reply(rng, n, "shape", where),
        kind="count_time",
        answer=str(n),
        topic=topic,
    )


def _q_colour_change(rng: random.Random, clip: _Clip) -> _Turn | None:
    first, last = clip.frames[0][-1], clip.frames[-1][-1]
    kind = first.kind
    q = rng.choice(
        (
            f"What colour does the {kind} turn?",
            f"What colour does the {kind} change to?",
            f"What colour is the {kind} at the end?",
        )
    )
    r = rng.random()
    if r < 0.6:
        reply = last.colour
    elif r < 0.8:
        reply = f"It turns {last.colour}."
    else:
        reply = f"The {kind} turns from {first.colour} to {last.colour}."
    return _Turn(
        question=q, reply=reply, kind="colour_change", answer=last.colour, topic="colour:end"
    )


def _q_colour_start(rng: random.Random, clip: _Clip) -> _Turn | None:
    first = clip.frames[0][-1]
    q = rng.choice(
        (
            f"What colour is the {first.kind} at the start?",
            f"What colour is the {first.kind} in the first frame?",
        )
    )
    reply = first.colour if rng.random() < 0.6 else f"The {first.kind} is {first.colour} at first."
    return _Turn(question=q, reply=reply, kind="colour", answer=first.colour, topic="colour:start")


def _q_clip_count(rng: random.Random, clip: _Clip) -> _Turn | None:
    n = len(clip.frames[0])  # the same in every frame of a move or colour clip
    q = rng.choice(("How many shapes are there?", "How many shapes are in the video?"))
    return _Turn(
        question=q, reply=_count_reply(rng, n, "shape"), kind="count", answer=str(n), topic="count"
    )


_ClipQuestionFn = Callable[[random.Random, _Clip], _Turn | None]

# Per clip kind: (weight, builder) of the first question, and of the follow-ups.
_CLIP_QUESTIONS: dict[str, tuple[tuple[tuple[float, _ClipQuestionFn], ...], ...]] = {
    "move": (((1.0, _q_direction),), ((1.0, _q_clip_count),)),
    "appear": (
        ((0.55, _q_order), (0.45, _q_count_time)),
        ((0.55, _q_order), (0.45, _q_count_time)),
    ),
    "colour": (((1.0, _q_colour_change),), ((0.6, _q_colour_start), (0.4, _q_clip_count))),
}


def _clip_turns(rng: random.Random, clip: _Clip, num_turns: int) -> list[_Turn]:
    firsts, follow_ups = _CLIP_QUESTIONS[clip.kind]
    turns: list[_Turn] = []
    asked: set[str] = set()
    for t in range(num_turns):
        table = firsts if t == 0 else firsts + follow_ups
        for _attempt in range(12):
            fn = rng.choices([f for _, f in table], weights=[w for w, _ in table])[0]
            turn = fn(rng, clip)
            if turn is not None and turn.topic not in asked:
                asked.add(turn.topic)
                turns.append(turn)
                break
    return turns


# --------------------------------------------------------------------------- rows


def _row_rng(seed: int, split: str, index: int) -> random.Random:
    # A str seed is hashed with SHA-512 by random.Random: stable across runs and processes.
    return random.Random(f"packline-shapes:{seed}:{split}:{index}")


def _make_row(seed: int, split: str, index: int, out_dir: Path) -> dict:
    rng = _row_rng(seed, split, index)
    row_id = f"shapes-{split}-{index:06d}"
    u = rng.random()
    num_images = 0 if u < _TEXT_ONLY_FRACTION else 1
    if _TEXT_ONLY_FRACTION <= u < _TEXT_ONLY_FRACTION + _MULTI_IMAGE_FRACTION:
        num_images = 2 if rng.random() < 0.7 else 3
    num_turns = rng.choices(range(1, len(_TURN_WEIGHTS) + 1), weights=_TURN_WEIGHTS)[0]
    system = rng.choice(_SYSTEM_PROMPTS) if rng.random() < _SYSTEM_FRACTION else None

    pics = [_sample_picture(rng) for _ in range(num_images)]
    images = []
    for i, pic in enumerate(pics):
        rel = f"images/{row_id}-{i}.png"
        _draw_picture(pic).save(out_dir / rel, **_PNG_OPTIONS)
        images.append(rel)

    if pics:
        turns = _image_turns(rng, pics, num_turns)
        if len(pics) == 1:
            markers = "<image>"
        elif rng.random() < 0.5:
            markers = "\n".join("<image>" for _ in pics)
        else:
            markers = "\n".join(f"Image {i}: <image>" for i in range(1, len(pics) + 1))
        if rng.random() < 0.2:
            first = f"{turns[0].question}\n{markers}"
        else:
            first = f"{markers}\n{turns[0].question}"
    else:
        preamble, turns = _text_turns(rng, num_turns)
        first = f"{preamble} {turns[0].question}" if preamble else turns[0].question

    conversations = [{"role": "system", "content": system}] if system else []
    answers = []
    for t, turn in enumerate(turns):
        conversations.append({"role": "user", "content": first if t == 0 else turn.question})
        answers.append({"turn": len(conversations), "kind": turn.kind, "answer": turn.answer})
        conversations.append({"role": "assistant", "content": turn.reply})
    return {
        "id": row_id,
        "split": split,
        "images": images,
        "conversations": conversations,
        "meta": {"answers": answers},
    }


def _video_rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"packline-shapes-video:{seed}:{split}:{index}")


def _is_video_row(seed: int, split: str, index: int, video_share: float) -> bool:
    """Whether row ``index`` is a video conversation: a draw of its own, apart from the row's
    RNG, so the other rows do not change with ``video_share`` (and a larger share only turns
    more rows into video rows)."""
    return video_share > 0 and _video_rng(seed, split, index).random() < video_share


def _row_clip(seed: int, split: str, index: int) -> tuple[random.Random, _Clip]:
    """The clip of video row ``index``, and the RNG its conversation goes on drawing from."""
    rng = _video_rng(seed, split, index)
    rng.random()  # the draw _is_video_row made
    return rng, _sample_clip(rng)


def _make_video_row(seed: int, split: str, index: int, out_dir: Path) -> dict:
    rng, clip = _row_clip(seed, split, index)
    row_id = f"shapes-{split}-{index:06d}"
    rel = f"clips/{row_id}.mp4"
    write_video(out_dir / rel, _draw_clip(clip), clip.fps)

    num_turns = rng.choices(range(1, len(_VIDEO_TURN_WEIGHTS) + 1), weights=_VIDEO_TURN_WEIGHTS)[0]
    system = rng.choice(_VIDEO_SYSTEM_PROMPTS) if rng.random() < _SYSTEM_FRACTION else None
    turns = _clip_turns(rng, clip, num_turns)
    if rng.random() < 0.2:
        first = f"{turns[0].question}\n<video>"
    else:
        first = f"<video>\n{turns[0].question}"
    conversations = [{"role": "system", "content": system}] if system else []
    answers = []
    for t, turn in enumerate(turns):
        conversations.append({"role": "user", "content": first if t == 0 else turn.question})
        answers.append({"turn": len(conversations), "kind": turn.kind, "answer": turn.answer})
        conversations.append({"role": "assistant", "content": turn.reply})
    return {
        "id": row_id,
        "split": split,
        "images": [],
        "videos": [rel],
        "conversations": conversations,
        "meta": {
            "answers": answers,
            "clip": {"kind": clip.kind, "num_frames": clip.num_frames, "fps": clip.fps},
        },
    }


def write_shapes_dataset(
    out_dir: Path,
    *,
    num_train: int = 2000,
    num_val: int = 200,
    seed: int = 0,
    video_share: float = VIDEO_SHARE,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the ``shapes`` set to ``out_dir`` and return ``out_dir``.

    Writes ``out_dir/conversations.jsonl`` (``num_train`` train rows, then ``num_val`` val
    rows), one PNG per image under ``out_dir/images/`` and one H.264 MP4 per video row under
    ``out_dir/clips/``. About ``video_share`` of the rows are video conversations (0 writes
    none: the image and text rows are the same either way). The same arguments give
    byte-identical files; row ``i`` of a split depends only on ``(seed, split, i)`` (and
    ``video_share``), so changing ``num_train`` does not change the rows both sets share.
    Files of an earlier run with the same names are overwritten; other files in ``out_dir``
    are left alone.
    ``progress(n)`` is called with the number of rows just finished (``n == 1`` per row).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = write_shapes_dataset(Path(tmp), num_train=60, num_val=10)
        ...     len((path / "conversations.jsonl").read_text().splitlines())
        70
    """
    if num_train < 0 or num_val < 0:
        raise ValueError(f"num_train and num_val must be >= 0, got {num_train} and {num_val}")
    if num_train + num_val == 0:
        raise ValueError("num_train + num_val must be at least 1 to write a dataset")
    if not 0.0 <= video_share <= 1.0:
        raise ValueError(f"video_share must be within [0, 1], got {video_share}")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    if video_share > 0:
        (out_dir / "clips").mkdir(exist_ok=True)

    def make(split: str, index: int) -> dict:
        if _is_video_row(seed, split, index, video_share):
            return _make_video_row(seed, split, index, out_dir)
        return _make_row(seed, split, index, out_dir)

    return _write_rows(out_dir, make, num_train=num_train, num_val=num_val, progress=progress)


def shapes_dataset_problem(out_dir: Path, *, num_rows: int) -> str | None:
    """Why ``out_dir`` is not a whole set of ``num_rows`` rows as :func:`write_shapes_dataset`
    writes it (None when it is): every row of ``conversations.jsonl`` present and whole, and
    every image and video it names on disk with some bytes. A set a killed or raced
    generation left is caught here instead of by prepare's ``missing_image`` rejects.

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = write_shapes_dataset(Path(tmp), num_train=4, num_val=1)
        ...     ok = shapes_dataset_problem(path, num_rows=5)
        ...     (path / "images" / "shapes-train-000000-0.png").unlink()
        ...     print(ok, "|", shapes_dataset_problem(path, num_rows=5))
        None | images/shapes-train-000000-0.png (row 1) is missing or empty
    """
    jsonl = Path(out_dir) / "conversations.jsonl"
    if not jsonl.is_file():
        return "conversations.jsonl is missing"
    rows = 0
    with jsonl.open(encoding="utf-8") as f:
        for rows, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return f"line {rows} of conversations.jsonl is cut short"
            for rel in [*(row.get("images") or []), *(row.get("videos") or [])]:
                media = Path(out_dir) / rel
                if not media.is_file() or media.stat().st_size == 0:
                    return f"{rel} (row {rows}) is missing or empty"
    if rows != num_rows:
        return f"conversations.jsonl has {rows} rows, not {num_rows}"
    return None


def _write_rows(
    out_dir: Path,
    make: Callable[[str, int], dict],
    *,
    num_train: int,
    num_val: int,
    progress: Callable[[int], None] | None,
) -> Path:
    """``conversations.jsonl`` of ``make(split, index)`` for every train then val row, written
    to a temp file and moved into place when whole."""
    final = out_dir / "conversations.jsonl"
    tmp = out_dir / "conversations.jsonl.tmp"
    with tmp.open("w", encoding="utf-8", newline="\n") as f:
        for split, count in (("train", num_train), ("val", num_val)):
            for index in range(count):
                f.write(json.dumps(make(split, index), ensure_ascii=False) + "\n")
                if progress is not None:
                    progress(1)
    os.replace(tmp, final)
    return out_dir


# --------------------------------------------------------------------------- pretraining

_CAPTION_PROMPTS = ("<image>", "<image>\nCaption:", "Picture: <image>")
_FACT_PROMPTS = ("Shapes:", "A fact about shapes.", "Tell me something about shapes.")


def _caption_by_cell(pic: _Picture) -> str:
    """Every shape after its grid cell, in reading order, then the counts: the words that
    say where come first, the colour and kind after them."""
    lines = [
        f"{PREPOSITION[s.position].capitalize()}, {_article(s.colour + ' ' + s.kind)}."
        for s in pic.shapes
    ]
    return " ".join([*lines, _counts(pic)])


def _caption_by_kind(pic: _Picture) -> str:
    """Every shape named by its kind and cell first, its colour last, then the counts."""
    lines = [f"The {s.kind} {PREPOSITION[s.position]} is {s.colour}." for s in pic.shapes]
    return " ".join([*lines, _counts(pic)])


def _colours_by_kind(pic: _Picture) -> str:
    """Each shape's colour, the shape named by its kind (and its cell when another shape
    has that kind): ``"The circle is red. The star at the top is blue."``."""
    kinds = Counter(s.kind for s in pic.shapes)
    return " ".join(
        f"The {s.kind} is {s.colour}."
        if kinds[s.kind] == 1
        else f"The {s.kind} {PREPOSITION[s.position]} is {s.colour}."
        for s in pic.shapes
    )


def _cells_by_name(pic: _Picture) -> str:
    """Each shape's cell, the shape named by its colour and kind:
    ``"The red circle is at the top left."``."""
    return " ".join(f"The {s.colour} {s.kind} is {PREPOSITION[s.position]}." for s in pic.shapes)


def _total(pic: _Picture) -> str:
    n = len(pic.shapes)
    return f"{n} {'shape' if n == 1 else 'shapes'}."


def _tally(colours: Counter, kinds: Counter) -> str:
    """Shapes counted by colour, then by kind, as digits: ``"1 black and 2 green; 2 circles
    and 1 star"``."""
    by_colour = _join([f"{n} {c}" for c, n in sorted(colours.items())])
    by_kind = _join([f"{n} {k if n == 1 else _plural(k)}" for k, n in sorted(kinds.items())])
    return f"{by_colour}; {by_kind}"


def _counts(pic: _Picture) -> str:
    """How many shapes, of each colour and of each kind, as digits."""
    n = len(pic.shapes)
    colours = Counter(s.colour for s in pic.shapes)
    kinds = Counter(s.kind for s in pic.shapes)
    return f"{n} {'shape' if n == 1 else 'shapes'} in all: {_tally(colours, kinds)}."


_CAPTION_STYLES = (_describe, _caption_by_cell, _caption_by_kind, _describe_detail)
# A label after the picture that says which statement follows: no question is asked, but
# what the reply says depends on the user's words, not only on the picture.
_PROMPTED = (
    ("Count:", _total),
    ("Counts:", _counts),
    ("Colours:", _colours_by_kind),
    ("Positions:", _cells_by_name),
    ("Shapes:", _describe),
)


@dataclass(frozen=True)
class PretrainMix:
    """What share of the pretraining rows is which (:func:`write_pretraining_set`)."""

    text_share: float
    """Text-only statements about shapes (:func:`_fact_row`)."""
    chat_share: float
    """Text-only chat (:func:`_chat_row`); the rest are captioned pictures."""
    caption_weights: tuple[float, float, float, float]
    """Weights of :data:`_CAPTION_STYLES` (``_describe``, by cell, by kind, in detail)."""
    cut_share: float = 0.0
    """Pictures cut to one or two of their shapes (chosen at random), so a caption's words
    about each shape are few and its cell and kind must be seen."""
    lone_share: float = 0.0
    """Pictures of one large shape in the centre (:func:`_lone_picture`): a shape's kind
    across many patches."""
    prompted_share: float = 0.0
    """Pictures whose user turn ends in a label (:data:`_PROMPTED`: "Count:", "Colours:",
    "Positions:" ...) that says which statement the caption is, so the base learns to
    follow the user's words after a picture."""


FIRST_MIX = PretrainMix(text_share=0.2, chat_share=0.2, caption_weights=(0.35, 0.25, 0.25, 0.15))
"""The first phase's mix: whole pictures in four caption styles."""
SEEING_MIX = PretrainMix(
    text_share=0.1,
    chat_share=0.1,
    caption_weights=(0.5, 0.25, 0.25, 0.0),
    cut_share=0.35,
    lone_share=0.2,
    prompted_share=0.5,
)
"""The second phase's: fewer words, more pictures, many with one or two shapes or one large
one, so kind and cell are what is left to learn."""


def _pretraining_sized(pic: _Picture) -> bool:
    """Whether ``pic`` is at most :data:`PRETRAIN_MAX_TOKENS` visual tokens (32 px blocks)."""
    return (pic.width // _TOKEN_PX) * (pic.height // _TOKEN_PX) <= PRETRAIN_MAX_TOKENS


def _lone_picture(rng: random.Random) -> _Picture:
    """One shape filling 55-90% of a small picture (4-8 blocks a side), in the centre cell."""
    width = rng.randint(_MIN_SIDE_BLOCKS, 2 * _MIN_SIDE_BLOCKS) * _TOKEN_PX
    height = rng.randint(_MIN_SIDE_BLOCKS, 2 * _MIN_SIDE_BLOCKS) * _TOKEN_PX
    background = rng.choice(list(BACKGROUND_RGB))
    fraction = rng.uniform(0.55, 0.9)
    size = int(min(width, height) * fraction)
    shape = _Shape(
        kind=rng.choice(SHAPE_NAMES),
        colour=rng.choice(_palette(background)),
        row=1,
        col=1,
        cx=width // 2 + rng.randint(-4, 4),
        cy=height // 2 + rng.randint(-4, 4),
        size=size,
        size_word=SIZE_WORDS[-1],
    )
    return _Picture(width=width, height=height, background=background, shapes=(shape,))


def _pretraining_picture(rng: random.Random, mix: PretrainMix) -> _Picture:
    """A picture of the shapes set at most :data:`PRETRAIN_MAX_TOKENS` tokens, cut or replaced
    by a lone large shape in ``mix``'s shares (no draw at all when both are 0, so the first
    mix's rows stay as they were)."""
    pick = rng.random() if mix.cut_share or mix.lone_share else 1.0
    if pick < mix.lone_share:
        return _lone_picture(rng)
    pic = _sample_picture(rng)
    while not _pretraining_sized(pic):
        pic = _sample_picture(rng)  # small pictures: many more of them per packed row
    if pick < mix.lone_share + mix.cut_share:
        n = min(len(pic.shapes), 1 if rng.random() < 0.6 else 2)
        pic = replace(pic, shapes=tuple(sorted(rng.sample(pic.shapes, n), key=_reading_order)))
    return pic


def _reading_order(s: _Shape) -> tuple[int, int]:
    return (s.row, s.col)


def _caption_row(seed: int, split: str, index: int, out_dir: Path, mix: PretrainMix) -> dict:
    """An image and its caption (every shape, its colour and position, and their count), as
    the user's and the assistant's turn: no question is asked. The caption lists the shapes
    in one of four styles (:data:`_CAPTION_STYLES`), so the base learns each attribute from
    the others, not only in one order."""
    rng = random.Random(f"packline-pretrain-caption:{seed}:{split}:{index}")
    row_id = f"pretrain-{split}-{index:06d}"
    pic = _pretraining_picture(rng, mix)
    rel = f"images/{row_id}.png"
    _draw_picture(pic).save(out_dir / rel, **_PNG_OPTIONS)
    if mix.prompted_share and rng.random() < mix.prompted_share:
        label, style = rng.choice(_PROMPTED)
        prompt, caption = f"<image>\n{label}", style(pic)
    else:
        caption = rng.choices(_CAPTION_STYLES, weights=mix.caption_weights)[0](pic)
        prompt = rng.choice(_CAPTION_PROMPTS)
    return {
        "id": row_id,
        "split": split,
        "images": [rel],
        "conversations": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": caption},
        ],
    }


def _fact_row(seed: int, split: str, index: int) -> dict:
    """Text only: statements about shapes (sides, and groups of shapes counted up, in all,
    by colour and by kind), no question asked."""
    rng = random.Random(f"packline-pretrain-fact:{seed}:{split}:{index}")
    facts = []
    for kind in rng.sample(sorted(SIDES), rng.randint(1, 3)):
        facts.append(f"{_article(kind).capitalize()} has {SIDES[kind]} sides.")
    groups = {}
    for _ in range(rng.randint(2, 4)):
        groups.setdefault((rng.choice(COLOUR_NAMES), rng.choice(SHAPE_NAMES)), rng.randint(1, 4))
    phrases = [
        f"{NUMBER_WORDS[n]} {colour} {kind if n == 1 else _plural(kind)}"
        for (colour, kind), n in groups.items()
    ]
    total = sum(groups.values())
    colours, kinds = Counter(), Counter()
    for (colour, kind), n in groups.items():
        colours[colour] += n
        kinds[kind] += n
    facts.append(
        f"{_join(phrases).capitalize()} make {total} shapes in all: {_tally(colours, kinds)}."
    )
    rng.shuffle(facts)
    return {
        "id": f"pretrain-{split}-{index:06d}",
        "split": split,
        "images": [],
        "conversations": [
            {"role": "user", "content": rng.choice(_FACT_PROMPTS)},
            {"role": "assistant", "content": " ".join(facts)},
        ],
    }


def _chat_row(seed: int, split: str, index: int) -> dict:
    """Text-only chat: a short question about a list of words or numbers in the message and
    its short answer (the bare word or number, or a sentence holding it). Nothing about
    shapes in pictures: it teaches the base to answer a question from what it is shown."""
    rng = random.Random(f"packline-pretrain-chat:{seed}:{split}:{index}")
    words = rng.sample([*COLOUR_NAMES, *SHAPE_NAMES, *DIRECTION_NAMES], rng.randint(3, 6))
    listed = ", ".join(words)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        q, short, long = f"What is {a} plus {b}?", str(a + b), f"{a} plus {b} is {a + b}."
    elif kind == 1:
        i = rng.randrange(len(words))
        nth = ("first", "second", "third", "fourth", "fifth", "sixth")[i]
        q = f"Words: {listed}. What is the {nth} word?"
        short, long = words[i], f"The {nth} word is {words[i]}."
    elif kind == 2:
        i = rng.randrange(len(words) - 1)
        q = f"Words: {listed}. Which word comes after {words[i]}?"
        short, long = words[i + 1], f"After {words[i]} comes {words[i + 1]}."
    else:
        q = f"Words: {listed}. How many words are there?"
        short, long = str(len(words)), f"There are {len(words)} words."
    return {
        "id": f"pretrain-{split}-{index:06d}",
        "split": split,
        "images": [],
        "conversations": [
            {"role": "user", "content": q},
            {"role": "assistant", "content": short if rng.random() < 0.65 else long},
        ],
    }


PRETRAIN_MAX_TOKENS = 256
"""Pretraining pictures are drawn as the shapes set's, but at most this many visual tokens."""


def write_pretraining_set(
    out_dir: Path,
    *,
    num_train: int,
    num_val: int = 0,
    seed: int = 0,
    mix: PretrainMix = FIRST_MIX,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the tiny base's pretraining mix to ``out_dir`` (``conversations.jsonl`` and
    ``images/``, the folder layout :func:`write_shapes_dataset` writes) and return it.

    Not the fine-tuning task: nothing is asked about a picture. With the default ``mix``
    (:data:`FIRST_MIX`) about 60% of the rows are a picture of the shapes set and its caption,
    which names every shape with its colour and position and counts them (in one of four
    styles); 20% state facts in words (a hexagon's sides, groups of shapes summed); 20% are
    text-only chat, a short question about a list of words or a sum and its short answer
    (:func:`_chat_row`). :data:`SEEING_MIX` (the base's second phase) has fewer words and
    pictures of fewer shapes, half of them captioned after a label. Row ``i`` depends only on
    ``(seed, split, i)``; the same arguments give the same bytes.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     rows = write_pretraining_set(Path(tmp), num_train=8) / "conversations.jsonl"
        ...     [json.loads(r)["conversations"][1]["content"][:20] for r in rows.open()][2:5]
        ['A hexagon has 6 side', 'In the centre, a gre', 'After red comes down']
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)

    def make(split: str, index: int) -> dict:
        text = random.Random(f"packline-pretrain:{seed}:{split}:{index}").random()
        if text < mix.text_share:
            return _fact_row(seed, split, index)
        if text < mix.text_share + mix.chat_share:
            return _chat_row(seed, split, index)
        return _caption_row(seed, split, index, out_dir, mix)

    return _write_rows(out_dir, make, num_train=num_train, num_val=num_val, progress=progress)
