"""The perception probe reads, in each caption, exactly the words only the picture tells."""

from __future__ import annotations

import random

from packline.shapes.generate import _describe
from packline.shapes.perception import _chance, _picture, _probes
from packline.shapes.words import PREPOSITION


def test_each_probe_spans_the_word_it_reads_and_nothing_the_text_gives_away():
    rng = random.Random(0)
    for i in range(40):
        pic = _picture(rng, one=i % 2 == 0)
        caption = _describe(pic)
        probes = {a: caption[b:e] for a, b, e in _probes(pic, caption)}
        if len(pic.shapes) > 1:
            assert caption.startswith("There are ") and probes == {"count": str(len(pic.shapes))}
            continue
        s = pic.shapes[0]
        assert probes == {"colour": s.colour, "kind": s.kind, "position": s.position + "."}
        assert caption.endswith(f"{s.colour} {s.kind} {PREPOSITION[s.position]}.")


def test_chance_is_one_over_the_answers_left_open():
    rng = random.Random(1)
    pics = [_picture(rng, one=True) for _ in range(200)]
    by_cell = {p.shapes[0].position: _chance("position", p) for p in pics}
    assert by_cell["centre"] == 1 and by_cell["left"] == by_cell["right"] == 1 / 2
    assert by_cell["top left"] == by_cell["bottom"] == 1 / 6
    assert _chance("kind", pics[0]) == 1 / 7 and _chance("count", pics[0]) == 1 / 5
