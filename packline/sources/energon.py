"""An Energon dataset in Megatron-Bridge's ChatML layout as a source: adopted in place,
never read into new shards — prepare checks it shard by shard
(:mod:`packline.energon.chatml`, ``stages/prepare.py``), so its reader has no row stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packline.sources import hash_tree
from schemas.config import PipelineConfig


class EnergonReader:
    """The adopted dataset's samples carry their media; its files are its fingerprint."""

    llava_records = False

    def rows(self, cfg: PipelineConfig, source: Path, on_offset):
        raise TypeError("an Energon dataset is adopted shard by shard, not read as rows")

    def media(self, cfg: PipelineConfig, source: Path) -> None:
        return None

    def fingerprint(self, cfg: PipelineConfig) -> list[Any]:
        return [hash_tree(Path(cfg.data.source).expanduser().resolve())]


ENERGON = EnergonReader()
