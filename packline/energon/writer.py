"""Writing a prepared dataset, one row at a time: WebDataset shards, parquet tables validated
as they are written, ``rejects.jsonl``; then Energon's index over the shards and
Megatron-Bridge's view of the same shards. prepare feeds them; nothing here keeps a list of
all rows.
"""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import webdataset as wds
import yaml

from packline.energon.files import BRIDGE_METADATASET
from schemas.tables import RejectsModel, validate_table

if TYPE_CHECKING:
    from packline.conversations import ConversationRow
    from packline.qwen.vision import VideoGeometry

DATASET_YAML = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
#: Megatron-Bridge's view of the same shards: its ``ChatMLWebdataset`` sample type, fed by
#: packline's sample loader (copied into ``.nv-meta/``), selected by ``bridge.yaml``.
BRIDGE_DATASET_CONFIG = "bridge_dataset.yaml"
BRIDGE_SAMPLE_LOADER = "bridge_sample_loader.py"
BRIDGE_DATASET_YAML = {
    "__module__": "megatron.bridge.data.energon.task_encoder_utils",
    "__class__": "ChatMLWebdataset",
    "sample_loader": f"{BRIDGE_SAMPLE_LOADER}:sample_loader",
    "part_filter": f"{BRIDGE_SAMPLE_LOADER}:part_filter",
}


def _png(frame) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")  # lossless, deterministic
    return buf.getvalue()


def bridge_frame_parts(row: ConversationRow, geometry: VideoGeometry) -> tuple[dict, list[dict]]:
    """The frame parts of a row's videos for Megatron-Bridge (``vid<k>.f<j>.png``: the
    frames ``geometry`` samples, decoded upright) and, per video, what was sampled."""
    from packline.media.video import decode_frames

    parts: dict[str, bytes] = {}
    presampled = []
    for k, video in enumerate(row.videos):
        h = video.header
        indices = [int(i) for i in geometry.sample_indices(h.num_frames, h.fps)]
        for j, frame in enumerate(decode_frames(video.data, indices, rotation=h.rotation)):
            parts[f"vid{k}.f{j:03d}.png"] = _png(frame)
        presampled.append({"indices": indices, "fps": h.fps})
    return parts, presampled


class _Sink:
    """A writer used as a context: closed (its data written out) when the body ends, or,
    when the body fails, abandoned: its files closed without writing another byte, so that a
    device that filled gets its room back when the stage removes its partial output (a file
    still open keeps its blocks after it is deleted)."""

    def close(self):  # pragma: no cover - every sink defines it
        raise NotImplementedError

    def abort(self) -> None:  # pragma: no cover - every sink defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, kind, _exc, _tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def _close_quietly(f) -> None:
    try:
        f.close()
    except (OSError, ValueError):  # its buffer could not be written: the device is full
        pass


class ShardSink(_Sink):
    """The shards of the splits, written as rows arrive: ``<split>-NNNNNN.tar`` holding
    ``per_shard`` rows each (a fixed mtime: the same rows give byte-identical shards)."""

    def __init__(self, out: Path, per_shard: int):
        self.out = out
        self.per_shard = per_shard
        self.names: dict[str, list[str]] = {"train": [], "val": []}
        self._open: dict[str, tuple[wds.TarWriter, int]] = {}

    def write(self, split: str, entry: dict[str, object]) -> str:
        """Write one entry; returns the shard it went to."""
        writer, count = self._open.get(split, (None, self.per_shard))
        if writer is None or count >= self.per_shard:
            if writer is not None:
                writer.close()
            name = f"{split}-{len(self.names[split]):06d}.tar"
            self.names[split].append(name)
            writer, count = wds.TarWriter(str(self.out / name), mtime=0), 0
        writer.write(entry)
        self._open[split] = (writer, count + 1)
        return self.names[split][-1]

    def close(self) -> dict[str, list[str]]:
        for writer, _ in self._open.values():
            writer.close()
        self._open.clear()
        return self.names

    def abort(self) -> None:
        for writer, _ in self._open.values():
            # tarfile's stream would write the archive's end blocks when collected
            writer.tarstream.closed = True
            writer.tarstream.fileobj.closed = True
            _close_quietly(writer.own_fileobj or writer.stream)
        self._open.clear()


class TableSink(_Sink):
    """A parquet table written in row groups of ``batch_rows`` rows, each validated with its
    pandera model as it is written (the whole table is never in memory)."""

    def __init__(self, path: Path, model: type, name: str, batch_rows: int = 10_000):
        self.path, self.model, self.name, self.batch_rows = path, model, name, batch_rows
        self.rows: list[dict[str, object]] = []
        self.num_rows = 0
        self._writer = None

    def add(self, row: dict[str, object]) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.rows:
            return
        frame = validate_table(self.model, pd.DataFrame(self.rows), self.name)
        table = pa.Table.from_pandas(frame, preserve_index=False)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)
        self.num_rows += len(self.rows)
        self.rows = []

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        self.rows = []
        if self._writer is not None:
            _close_quietly(self._writer)
            self._writer = None


class RejectSink(_Sink):
    """``rejects.jsonl``: one record per rejected row, validated in batches, counted by
    reason."""

    def __init__(self, path: Path, batch_rows: int = 1000):
        self.file = path.open("w")
        self.batch_rows = batch_rows
        self.rows: list[dict[str, object]] = []
        self.by_reason: Counter = Counter()

    def add(self, record: dict[str, object]) -> None:
        self.rows.append(record)
        self.by_reason[str(record["reason"])] += 1
        if len(self.rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        validate_table(
            RejectsModel,
            pd.DataFrame(self.rows, columns=["line", "id", "reason", "detail"]).astype(
                {"line": "int64", "reason": "str", "detail": "str"}
            ),
            "rejects.jsonl",
        )
        self.file.writelines(json.dumps(r) + "\n" for r in self.rows)
        self.rows = []

    def close(self) -> None:
        if not self.file.closed:
            self.flush()
            self.file.close()

    def abort(self) -> None:
        self.rows = []
        _close_quietly(self.file)

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())


def index_with_energon(out: Path, shards: dict[str, list[str]], workers: int) -> None:
    """Index the shards with Energon's own prepare API and write the dataset.yaml."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    paths = [name for names in shards.values() for name in names]
    # No backslashes: Energon brace-expands the pattern first, which eats them.
    patterns = [(split, f"^{split}-[0-9]+[.]tar$") for split, names in shards.items() if names]
    BaseWebdatasetFactory.prepare_dataset(
        out,
        paths,
        split_parts_patterns=patterns,
        shuffle_seed=None,
        workers=max(1, min(workers, len(paths))),
    )
    meta = out / ".nv-meta"
    (meta / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    write_bridge_view(out, sorted(split for split, names in shards.items() if names))


def write_bridge_view(out: Path, splits: list[str]) -> None:
    """Megatron-Bridge's dataset config over the same shards, and the metadataset naming it."""
    from packline.energon import bridge_sample_loader

    meta = out / ".nv-meta"
    shutil.copyfile(bridge_sample_loader.__file__, meta / BRIDGE_SAMPLE_LOADER)
    (meta / BRIDGE_DATASET_CONFIG).write_text(yaml.safe_dump(BRIDGE_DATASET_YAML, sort_keys=False))
    metadataset = {
        "__module__": "megatron.energon",
        "__class__": "MetadatasetV2",
        "splits": {
            split: {"path": ".", "dataset_config": BRIDGE_DATASET_CONFIG} for split in splits
        },
    }
    (out / BRIDGE_METADATASET).write_text(yaml.safe_dump(metadataset, sort_keys=False))
