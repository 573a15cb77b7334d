"""The built-in *shapes* set, whole: its generator (pictures, clips, conversations and
the pretraining rows: ``generate.py``), its words (``words.py``: the names it draws and
phrases with, which the tiny processor's vocabulary holds), how its answers are scored
(``answers.py``), the pretraining of the tiny base that sees them (``pretrain.py``,
behind ``scripts/build-tiny-base``) and what a base perceives in them (``perception.py``).
Its reader, as a source of prepare, is ``packline/sources/synthetic.py``."""
