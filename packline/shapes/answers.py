"""How the built-in shapes set grades an answer: a generated reply against the expected
answer of a question kind, leniently (case, punctuation and common variants ignored; a
position, a count, a colour, a direction or an order found in the reply), and the closed
answer sets that give each kind's chance. The set supplies :data:`SHAPES_SCORER` to the
trainer's evaluation (:class:`packline.train.evaluate.AnswerScorer`)."""

from __future__ import annotations

import re

from packline.shapes.words import (
    ANSWER_CHOICES,
    ANSWER_KINDS,
    COLOUR_NAMES,
    COLOUR_RGB,
    DIRECTION_NAMES,
    NUMBER_WORDS,
    POSITION_NAMES,
    SHAPE_NAMES,
)

_SYNONYMS = {
    "center": "centre",
    "middle": "centre",
    "gray": "grey",
    "violet": "purple",
    "upper": "top",
    "lower": "bottom",
}
_POSITION_ALIASES = (
    ("top centre", "top"),
    ("bottom centre", "bottom"),
    ("centre left", "left"),
    ("centre right", "right"),
    ("left centre", "left"),
    ("right centre", "right"),
    ("left top", "top left"),
    ("right top", "top right"),
    ("left bottom", "bottom left"),
    ("right bottom", "bottom right"),
)
_POSITION_RE = re.compile(r"\b(" + "|".join(sorted(POSITION_NAMES, key=len, reverse=True)) + r")\b")
_TRIPLE_RE = re.compile(
    r"\b(" + "|".join(COLOUR_NAMES) + r") (" + "|".join(SHAPE_NAMES) + r")s? "
    r"(?:(?:is|are|sits|located) )?(?:at|in|on) the ("
    + "|".join(sorted(POSITION_NAMES, key=len, reverse=True))
    + r")\b"
)
_ORDINAL_RE = re.compile(r"\b(?:(first|1st|second|2nd|third|3rd)|image (1|2|3|one|two|three))\b")
_ORDINAL_INDEX = {
    "first": 0,
    "1st": 0,
    "1": 0,
    "one": 0,
    "second": 1,
    "2nd": 1,
    "2": 1,
    "two": 1,
    "third": 2,
    "3rd": 2,
    "3": 2,
    "three": 2,
}


# Directions as replies word them; "top"/"bottom" name where a shape goes ("to the top").
_DIRECTION_WORDS = {
    **{d: d for d in DIRECTION_NAMES},
    **{d + "ward": d for d in DIRECTION_NAMES},
    **{d + "wards": d for d in DIRECTION_NAMES},
    "top": "up",
    "bottom": "down",
}
_SHAPE_RE = re.compile(r"\b(" + "|".join(SHAPE_NAMES) + r")s?\b")


def _where_to(norm: str, names: list[str]) -> list[str]:
    """The ``names`` a reply gives as where something ends, in order: "from X to Y" and
    "X to Y" keep Y only, and "from X" alone is dropped (a reply may say where it began)."""
    alt = "|".join(sorted(names, key=len, reverse=True))
    norm = re.sub(rf"\b(?:from )?(?:the )?({alt}) (?:to|into) (?:the )?({alt})\b", r"\2", norm)
    norm = re.sub(rf"\bfrom (?:the )?({alt})\b", " ", norm)
    return re.findall(rf"\b({alt})\b", norm)


def normalize_answer(text: str) -> str:
    """Lower-case words with the common variants mapped (see :func:`answer_matches`)."""
    words = re.sub(r"[^a-z0-9]+", " ", text.lower()).split()
    norm = " ".join(_SYNONYMS.get(w, w) for w in words)
    for alias, canonical in _POSITION_ALIASES:
        norm = re.sub(rf"\b{alias}\b", canonical, norm)
    return norm


def _first_number(norm: str) -> int | None:
    for word in norm.split():
        if word.isdigit():
            return int(word)
        if word in NUMBER_WORDS:
            return NUMBER_WORDS.index(word)
    words = norm.split()
    return 0 if "none" in words or "no" in words else None


def _triples(norm: str) -> set[tuple[str, str, str]]:
    return set(_TRIPLE_RE.findall(norm))


def answer_matches(expected: str, generated: str, kind: str) -> bool:
    """Whether a generated reply gives the expected answer, leniently.

    Case, whitespace and punctuation are ignored, and common variants are mapped first
    (center/middle → centre, gray → grey, upper/lower → top/bottom, "top-left" → "top left").

    * ``count``: the first number in the reply (digits or a word up to "twenty"; "no"/"none"
      when there is no number) equals the expected number.
    * ``colour``: the reply names the expected colour and no other palette colour.
    * ``position``: the first grid position named in the reply is the expected one.
    * ``describe``: every "<colour> <shape> at/in/on the <position>" phrase of the expected
      reply also appears in the generated one (in any order, extra detail allowed).
    * ``compare``: "same"/"equal" for a tie; otherwise the first image ordinal named
      ("first", "2nd", "image 3", ...) is the expected one and no tie is claimed.
    * ``text``: the number rule for numeric answers, the colour rule for colours, else the
      expected words (optionally plural) appear in the reply.
    * ``direction``: the reply names the expected direction and no other, where
      "leftwards"/"to the left" is left, "to the top" is up, and a starting point ("from
      right to left", "from the bottom") does not count.
    * ``order``: the first shape kind the reply names (singular or plural) is the expected
      one.
    * ``count_time``: the number rule.
    * ``colour_change``: the colour rule on the colour the reply ends at ("from red to
      blue" names blue).

    >>> answer_matches("3", "There are three shapes.", "count")
    True
    >>> answer_matches("top left", "It is in the upper-left corner.", "position")
    True
    >>> answer_matches("left", "The red circle moves from right to left.", "direction")
    True
    >>> answer_matches("blue", "The square turns from red to blue.", "colour_change")
    True
    """
    if kind not in ANSWER_KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; expected one of {ANSWER_KINDS}")
    exp, gen = normalize_answer(expected), normalize_answer(generated)
    if kind == "text":
        if exp.isdigit():
            kind = "count"
        elif exp in COLOUR_NAMES:
            kind = "colour"
        else:
            return bool(exp) and re.search(rf"\b{re.escape(exp)}s?\b", gen) is not None
    if kind == "direction":
        named = {_DIRECTION_WORDS[w] for w in _where_to(gen, list(_DIRECTION_WORDS))}
        return exp in DIRECTION_NAMES and named == {exp}
    if kind == "order":
        found = _SHAPE_RE.search(gen)
        return found is not None and found.group(1) == exp
    if kind == "colour_change":
        return exp in COLOUR_RGB and set(_where_to(gen, list(COLOUR_RGB))) == {exp}
    if kind in ("count", "count_time"):
        want = _first_number(exp)
        return want is not None and _first_number(gen) == want
    if kind == "colour":
        named = {w for w in gen.split() if w in COLOUR_RGB}
        return named == {exp}
    if kind == "position":
        found = _POSITION_RE.search(gen)
        return found is not None and found.group(1) == exp
    if kind == "describe":
        want = _triples(exp)
        if not want:
            return bool(exp) and exp in gen
        return want <= _triples(gen)
    # compare
    tie = re.search(r"\b(same|equal)\b", gen) is not None
    if re.search(r"\b(same|equal)\b", exp):
        return tie
    want_m, got_m = _ORDINAL_RE.search(exp), _ORDINAL_RE.search(gen)
    if tie or want_m is None or got_m is None:
        return False
    return (
        _ORDINAL_INDEX[want_m.group(1) or want_m.group(2)]
        == _ORDINAL_INDEX[got_m.group(1) or got_m.group(2)]
    )


class ShapesScorer:
    """The shapes set's grading as the evaluation asks for it."""

    choices = ANSWER_CHOICES

    @staticmethod
    def normalize(text: str) -> str:
        return normalize_answer(text)

    @staticmethod
    def matches(expected: str, generated: str, kind: str) -> bool:
        return answer_matches(expected, generated, kind)


SHAPES_SCORER = ShapesScorer()
