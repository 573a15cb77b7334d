"""What a base sees in the shapes set's pictures, read from its own captions.

The tiny base (``scripts/build-tiny-base``) learns the pictures from captions, so what it
perceives shows in how well it continues one, teacher-forced, on pictures it has not seen:
the top-1 prediction of the word that only the picture can tell. :func:`_describe`'s style
("There is 1 shape: a red circle at the top left.") puts each such word where the text before
it does not give it away:

- ``count``: the number after "There are" (pictures of 2 to 6 shapes; chance 1/5);
- ``colour``, ``kind`` and ``position`` of a picture's one shape (pictures cut to their
  first shape): its colour after "a", its kind after the colour, its cell after the
  preposition, every word of it and the full stop after it ("at the" leaves 1 of 6 cells,
  "on the" 1 of 2, "in the" only the centre: chance 1/3 over the cells).

A word counts as right when every one of its tokens is the model's top prediction.

A caption that lists several shapes gives the rest away (its count follows the list; the
grid cells come in reading order), which is why the pictures are cut and only the head of
the multi-shape caption is read. ``python -m packline.shapes.perception DIR`` prints the
figures of the checkpoint in ``DIR`` beside each one's chance.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from packline.shapes.generate import (
    _describe,
    _draw_picture,
    _palette,
    _Picture,
    _pretraining_sized,
    _sample_picture,
)
from packline.shapes.words import POSITION_NAMES, PREPOSITION, SHAPE_NAMES

ATTRIBUTES = ("count", "colour", "kind", "position")


def _picture(rng: random.Random, *, one: bool) -> _Picture:
    while True:
        pic = _sample_picture(rng)
        if not _pretraining_sized(pic):
            continue  # the pretraining pictures' sizes
        if one:
            return replace(pic, shapes=pic.shapes[:1])
        if len(pic.shapes) >= 2:
            return pic


def _chance(attribute: str, pic: _Picture) -> float:
    if attribute == "count":
        return 1 / 5
    if attribute == "colour":
        return 1 / len(_palette(pic.background))
    if attribute == "kind":
        return 1 / len(SHAPE_NAMES)
    prep = PREPOSITION[pic.shapes[0].position].rsplit(" the ", 1)[0]
    return 1 / sum(PREPOSITION[p].startswith(prep + " ") for p in POSITION_NAMES)


def _probes(pic: _Picture, caption: str) -> list[tuple[str, int, int]]:
    """(attribute, start, end): the characters of ``caption`` that only the picture tells."""
    if len(pic.shapes) > 1:
        start = len("There are ")
        return [("count", start, start + len(str(len(pic.shapes))))]
    s = pic.shapes[0]
    head = "There is 1 shape: "
    colour = len(head) + caption[len(head) :].index(s.colour)
    kind = colour + len(s.colour) + 1
    where = kind + len(s.kind) + 1 + len(PREPOSITION[s.position]) - len(s.position)
    return [
        ("colour", colour, colour + len(s.colour)),
        ("kind", kind, kind + len(s.kind)),
        ("position", where, where + len(s.position) + 1),  # "top" is not "top left"
    ]


@torch.no_grad()
def perception(model, processor, *, pictures: int = 60, seed: int = 0) -> dict[str, dict]:
    """Per attribute of :data:`ATTRIBUTES`: ``accuracy`` (top-1, teacher-forced, over
    ``pictures`` one-shape and as many several-shape pictures from ``seed``), ``chance``
    (its mean over the same words) and ``words`` (how many were read)."""
    from packline.qwen.generate import Prompt, model_inputs

    tokenizer = processor.tokenizer
    rng = random.Random(f"packline-perception:{seed}")
    hits: dict[str, list[bool]] = defaultdict(list)
    chance: dict[str, list[float]] = defaultdict(list)
    model.eval()
    device = next(model.parameters()).device
    for i in range(2 * pictures):
        pic = _picture(rng, one=i % 2 == 0)
        caption = _describe(pic)
        conversation = [
            {"role": "user", "content": [{"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": caption}]},
        ]
        inputs = model_inputs(
            processor, Prompt(conversation, [_draw_picture(pic)], []), add_generation_prompt=False
        )
        ids = inputs["input_ids"][0].tolist()
        caption_ids = tokenizer(caption, add_special_tokens=False).input_ids
        start = next(
            s
            for s in range(len(ids) - len(caption_ids), -1, -1)
            if ids[s : s + len(caption_ids)] == caption_ids
        )
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits[0]
        predicted = logits.argmax(-1).tolist()
        for attribute, begin, end in _probes(pic, caption):
            first, last = (
                len(tokenizer(text, add_special_tokens=False).input_ids)
                for text in (caption[:begin].rstrip(), caption[:end])
            )
            right = all(predicted[start + j - 1] == caption_ids[j] for j in range(first, last))
            hits[attribute].append(right)
            chance[attribute].append(_chance(attribute, pic))
    return {
        a: {
            "accuracy": sum(hits[a]) / len(hits[a]),
            "chance": sum(chance[a]) / len(chance[a]),
            "words": len(hits[a]),
        }
        for a in ATTRIBUTES
    }


def main(argv: list[str]) -> None:
    from transformers import AutoModelForImageTextToText

    from packline.qwen.processor import load_processor

    path = Path(argv[0]) if argv else Path("models/tiny-base")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    figures = perception(model, load_processor(path))
    for attribute, f in figures.items():
        print(f"{attribute:9s} {f['accuracy']:.3f}  (chance {f['chance']:.3f}, {f['words']} words)")


if __name__ == "__main__":
    main(sys.argv[1:])
