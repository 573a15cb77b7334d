"""The built-in shapes set's words: its colours (with the RGB the pictures are drawn in),
backgrounds, shape kinds, grid positions, directions, ordinals, number words and sizes, and
the closed answer sets of its question kinds. Plain data, no imaging library: the shapes
generator (:mod:`packline.shapes.generate`) draws and phrases with them, and the built-in tiny
tokenizer (:mod:`packline.qwen.processor`) learns them."""

from __future__ import annotations

ANSWER_KINDS = (
    "count",
    "colour",
    "position",
    "describe",
    "compare",
    "text",
    "direction",
    "order",
    "count_time",
    "colour_change",
)
"""What an answer checks; selects the rule :func:`answer_matches` applies."""

COLOUR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (220, 38, 38),
    "green": (34, 160, 64),
    "blue": (37, 90, 220),
    "yellow": (245, 210, 30),
    "purple": (130, 60, 180),
    "orange": (245, 135, 25),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
COLOUR_NAMES = tuple(COLOUR_RGB)
"""Shape colours, as named in questions and answers."""

BACKGROUND_RGB: dict[str, tuple[int, int, int]] = {
    "grey": (128, 128, 128),
    "tan": (196, 178, 140),
    "slate": (64, 84, 100),
    "pale teal": (170, 205, 200),
    "pink": (225, 190, 200),
}
BACKGROUND_NAMES = tuple(BACKGROUND_RGB)
"""Background colours, as named in the detailed descriptions."""
# A shape colour is used on a background only if they are at least this far apart in RGB,
# so no shape is hard to see (e.g. white on pale teal is skipped).
MIN_CONTRAST = 100.0

SHAPE_NAMES = ("circle", "square", "triangle", "rectangle", "star", "pentagon", "hexagon")
"""Shape kinds drawn in the images."""

SIDES = {"triangle": 3, "square": 4, "rectangle": 4, "pentagon": 5, "hexagon": 6}

GRID = (
    ("top left", "top", "top right"),
    ("left", "centre", "right"),
    ("bottom left", "bottom", "bottom right"),
)
POSITION_NAMES = tuple(name for row in GRID for name in row)
"""Cells of the 3x3 grid a shape can sit in, as answered to "Where is ...?"."""

PREPOSITION = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "centre": "in the centre",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}

DIRECTION_NAMES = ("left", "right", "up", "down")
"""Directions a shape moves in, as answered to "Which way does ... move?"."""
ORDINALS = ("first", "second", "third")
"""How the images of a multi-image row are named ("the second image")."""
NUMBER_WORDS = tuple(
    (
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty"
    ).split()
)
"""Numbers as words (index = value), in questions and as accepted answers."""
SIZE_WORDS = ("small", "medium", "large")
"""A shape's size in the detailed descriptions, by its share of its grid cell."""

ANSWER_CHOICES: dict[str, tuple[str, ...]] = {
    "colour": COLOUR_NAMES,
    "position": POSITION_NAMES,
    "direction": DIRECTION_NAMES,
    "order": SHAPE_NAMES,
    "count_time": ("0", "1", "2", "3", "4"),
    "colour_change": COLOUR_NAMES,
}
"""Every answer a question of these kinds can have (the kinds with a closed set), e.g. for
the chance of guessing: ``1 / len(ANSWER_CHOICES[kind])``."""
