"""The names of the Energon metadataset files prepare writes into its dir, in one home: the
light stages import them without loading Energon, and the adoption code writes them."""

PACKLINE_METADATASET = "packline.yaml"
"""packline's own loaders' view of prepare's output: a ``MetadatasetV2`` in prepare's dir (over
the source dataset when an Energon dataset is adopted in place)."""

BRIDGE_METADATASET = "bridge.yaml"
"""The file Megatron-Bridge's ``dataset.path`` names (a ``MetadatasetV2`` whose sample type is
Bridge's ``ChatMLWebdataset``)."""
