"""Everything Megatron-Bridge, none of it importing Bridge: the packline config as a Bridge run
(``overrides.py``: recipe + dotted ConfigContainer overrides, and the rules that run must
keep), Bridge's config classes and fields as far as overrides reach (``fields.py``,
generated from the pinned release's source), and the Bridge commit and image the cluster
runs (``container.py``). Only ``stages/train_megatron.py`` imports ``megatron.bridge``,
inside the cluster's container."""
