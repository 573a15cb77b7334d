"""The one typed config tree of a packline pipeline.

A YAML file is merged onto these OmegaConf structured dataclasses, then ``key=value``
overrides on top; every problem (unknown key, wrong type, missing value, a rule a section
breaks) is collected and reported together as one :class:`UserError`. Past
:func:`load_config` the pipeline passes :class:`PipelineConfig` objects, never raw dicts.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from schemas.choices import (
    ATTENTION_PROJECTIONS,
    MLP_PROJECTIONS,
    STAGES,  # noqa: F401 - re-exported: schemas.config.STAGES
    Algorithm,
    Attention,
    Balance,
    CudaGraphImpl,
    EncoderMode,
    ExecutorKind,
    LossWeighting,
    OverlengthPolicy,
    Packer,
    PipelineSchedule,
    Precision,
    SourceKind,
    TrainBackend,
)
from schemas.errors import UserError
from schemas.hub import cached, fetch_command, local_dir, repo_id
from schemas.paths import PROJECT_ROOT, special_kind, unreadable
from schemas.ranges import range_problems, ranged
from schemas.rules import Check, Finding, config_findings

DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "tiny_cpu.yaml"
TINY_BASE = PROJECT_ROOT / "models" / "tiny-base"
"""Where ``scripts/build-tiny-base`` writes the tiny Qwen3-VL base by default (a config
names it ``model.path: ${project:models/tiny-base}``)."""


def project_path(rel: str = "") -> str:
    """The ``${project:REL}`` interpolation of a config value: ``REL`` inside this checkout,
    wherever it lies and whatever the working directory (e.g. a base ``scripts/build-tiny-base``
    wrote into ``models/``)."""
    return str(PROJECT_ROOT / rel)


if not OmegaConf.has_resolver("project"):
    OmegaConf.register_resolver("project", project_path)


def _check(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


_RULES_DEFERRED: ContextVar[bool] = ContextVar("rules_deferred", default=False)


@contextmanager
def _rules_deferred() -> Iterator[None]:
    """Build sections without checking their rules (``load_config`` checks them all after)."""
    token = _RULES_DEFERRED.set(True)
    try:
        yield
    finally:
        _RULES_DEFERRED.reset(token)


class _Section:
    """Mixin: ``__post_init__`` gathers every broken rule of a section into one error: each
    setting out of the range its field declares (:func:`schemas.ranges.ranged`), then the
    section's own rules across its settings (:meth:`rules`)."""

    KEY: ClassVar[str] = ""
    """The section's dotted key in the config tree (``train.parallel``)."""

    def rules(self) -> list[str]:  # pragma: no cover - overridden where a section has rules
        return []

    def own_problems(self) -> list[str]:
        """This section's settings out of range, then its broken rules (none of the
        sections nested in it)."""
        return range_problems(self, self.KEY) + self.rules()

    def all_rules(self) -> list[str]:
        """This section's problems and those of the sections nested in it."""
        problems = self.own_problems()
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _Section):
                problems += value.all_rules()
        return problems

    def __post_init__(self) -> None:
        if _RULES_DEFERRED.get():
            return
        problems = self.own_problems()
        if problems:
            raise ValueError("\n".join(problems))


def source_kind(source: str) -> SourceKind | None:
    """What ``data.source`` names, or None when it names nothing packline reads:

    - ``synthetic``: the built-in set;
    - a dir with ``.nv-meta/dataset.yaml``: an Energon dataset, adopted in place;
    - a dir with ``conversations.jsonl``: a conversation folder;
    - a ``.json`` file: a LLaVA-style list of records;
    - a ``.jsonl`` file or a glob of them (:func:`jsonl_files`);
    - Parquet files: one, a glob of them or a folder holding them (:func:`parquet_files`),
      or a Hub dataset id;
    - a folder ``datasets``' ``save_to_disk`` wrote (:func:`arrow_files`).

    >>> source_kind("synthetic").value
    'synthetic'
    >>> source_kind("/nowhere/at/all") is None
    True
    """
    if source == "synthetic":
        return SourceKind.synthetic
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / ".nv-meta" / "dataset.yaml").is_file():
            return SourceKind.energon
        if (path / "conversations.jsonl").is_file():
            return SourceKind.folder
        if arrow_files(source):
            return SourceKind.arrow
    if path.is_file() and path.suffix.lower() == ".json":
        return SourceKind.llava
    if jsonl_files(source):
        return SourceKind.jsonl
    if repo_id(source) is not None or parquet_files(source):  # a Hub dataset: Parquet files
        return SourceKind.parquet
    return None


PARQUET = ".parquet"
#: What ``data.columns`` may map a table's columns to: the three conversation layouts
#: (:mod:`packline.sources.layouts`), the media, the id, the split and a system prompt.
DATA_COLUMNS = (
    "messages", "conversations", "texts", "images", "image", "videos", "video", "id", "split",
    "system",
)  # fmt: skip


def parquet_files(source: str, subset: str | None = None) -> list[Path]:
    """The Parquet files ``data.source`` names, in the order prepare reads them: the file
    itself, a glob's matches (``data/*.parquet``, ``**`` recursing), a folder's
    ``*.parquet`` files and those of its subfolders (a Hugging Face dataset's
    ``data/train-00000-of-00002.parquet``...), or those of a Hub dataset repo id's snapshot
    in the local Hugging Face cache; of a folder or a repo, ``subset`` (a dataset's config)
    names the subfolder read. Sorted by path; [] when it names none.

    >>> parquet_files("/nowhere/*.parquet")
    []
    """
    path = Path(source).expanduser()
    if (repo := repo_id(source)) is not None:
        snapshot = cached(repo, "dataset")
        if snapshot is None:
            return []
        path = snapshot
    if subset:
        path = path / subset
    if glob.has_magic(source):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
    elif path.is_dir():
        if (path / "conversations.jsonl").exists() or (path / ".nv-meta").exists():
            return []  # a conversation folder or an Energon dataset, whatever else it holds
        found = sorted(path.rglob(f"*{PARQUET}"))
    else:
        found = [path]
    # absolute, links kept: a Hub snapshot's files are links to blobs named by their hash,
    # and a file's name says its split
    return [Path(os.path.abspath(p)) for p in found if p.suffix.lower() == PARQUET and p.is_file()]


def jsonl_files(source: str) -> list[Path]:
    """The ``.jsonl`` files ``data.source`` names: the file itself or a glob's matches
    (``data/*.jsonl``), sorted by path; [] when it names none (a folder with
    ``conversations.jsonl`` is a folder source).

    >>> jsonl_files("/nowhere/*.jsonl")
    []
    """
    path = Path(source).expanduser()
    found = (
        sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        if glob.has_magic(source)
        else [path]
    )
    return [Path(os.path.abspath(p)) for p in found if p.suffix.lower() == ".jsonl" and p.is_file()]


def arrow_files(source: str) -> list[Path]:
    """The Arrow files of a folder ``datasets``' ``save_to_disk`` wrote, in the order
    prepare reads them: a ``DatasetDict``'s splits as ``dataset_dict.json`` lists them, each
    split's files as its ``state.json`` does (a single ``Dataset``: its own ``state.json``);
    [] when ``source`` is no such folder (or its files are missing).

    >>> arrow_files("/nowhere")
    []
    """
    path = Path(source).expanduser()
    splits = [path]
    try:
        if (path / "dataset_dict.json").is_file():
            names = json.loads((path / "dataset_dict.json").read_text())["splits"]
            splits = [path / str(name) for name in names]
        found = []
        for split in splits:
            state = json.loads((split / "state.json").read_text())
            found += [split / str(f["filename"]) for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not found or not all(f.is_file() for f in found):
        return []
    return [Path(os.path.abspath(f)) for f in found]


def source_problem(source: str, subset: str | None = None) -> str | None:
    """Why ``data.source`` names nothing packline can read (what it is instead, and the
    fix), None when it names a source this user can read.

    >>> source_problem("/dev/null").split("; fix:")[0]
    'data.source: /dev/null is a character device, not a folder or a file'
    >>> source_problem("synthetic") is None
    True
    """
    if source == "synthetic":
        return None
    path = Path(source).expanduser()
    fix = (
        "fix: point data.source at a conversation folder, a LLaVA-style .json file, "
        "Parquet files or an Energon dataset dir"
    )
    if (special := special_kind(path)) is not None:
        return f"data.source: {path} is {special}, not a folder or a file; {fix}"
    rows = path / "conversations.jsonl"
    if path.is_dir() and (special := special_kind(rows)) is not None:
        return (
            f"data.source: {rows} is {special}, not a regular file: prepare reads the file "
            "whole, its size first; fix: write the rows to a regular file"
        )
    kind = source_kind(source)
    if (repo := repo_id(source)) is not None:
        if cached(repo, "dataset") is None:
            return (
                f"data.source {source!r}: a Hugging Face dataset the local cache ($HF_HOME) "
                f"lacks; fix: run `{fetch_command(repo, 'dataset')}` where the Hub can be "
                "reached, or set data.download: true"
            )
        if not parquet_files(source, subset):
            where = f" under {subset!r}" if subset else ""
            return (
                f"data.source {source!r}: its cached snapshot holds no Parquet files{where}; "
                "fix: name the dataset's config as data.subset, or fetch its Parquet files"
            )
    if kind is None:
        return (
            f"data.source: {source!r} is neither 'synthetic', a folder with "
            "conversations.jsonl, a LLaVA-style .json file, Parquet files (a file, a glob "
            "or a folder of *.parquet) nor an Energon dataset (a dir with "
            ".nv-meta/dataset.yaml)"
        )
    read = {
        SourceKind.folder: [path, rows],
        SourceKind.llava: [path],
        SourceKind.energon: [path, path / ".nv-meta", path / ".nv-meta" / "dataset.yaml"],
        SourceKind.parquet: parquet_files(source, subset),
        SourceKind.arrow: [path, *arrow_files(source)],
        SourceKind.jsonl: jsonl_files(source),
    }[kind]
    for item in read:
        if (why := unreadable(item)) is not None:
            return (
                f"data.source: cannot read {item} ({why}); fix: make it readable for this "
                "user (chmod/chown), or run packline as its owner"
            )
    return None


@dataclass(kw_only=True)
class DataConfig(_Section):
    """Where the conversations come from."""

    KEY: ClassVar[str] = "data"

    source: str = "synthetic"
    """``synthetic`` for the built-in shapes set; a folder holding ``conversations.jsonl``
    and the media it names (paths relative to the folder); a LLaVA-style ``.json`` file (one
    list of records with ``image``/``images`` and ``conversations``); or an existing Energon
    dataset in Megatron-Bridge's ChatML layout (a dir with ``.nv-meta/dataset.yaml``), which
    prepare adopts in place without rewriting a shard; Parquet files (one file, a glob such
    as ``data/*.parquet``, a folder of them, or a Hugging Face dataset id read from the
    local cache); a folder ``datasets``' ``save_to_disk`` wrote (Arrow); or ``.jsonl`` files
    (one, or a glob such as ``data/*.jsonl``), rows as in a folder's, media relative to each
    file's folder. Parquet and
    Arrow images may be embedded as bytes or HF ``Image`` structs (``docs/data.md``)."""
    media_dir: str | None = None
    """LLaVA-style JSON source: the folder its image and video paths are relative to;
    ``null`` → the JSON file's own folder."""
    subset: str | None = None
    """Parquet folder or Hub dataset: the subfolder to read (a dataset's config, e.g.
    ``vqav2`` of ``HuggingFaceM4/the_cauldron``); ``null``: every Parquet file."""
    columns: dict[str, str] = field(default_factory=dict)
    """Parquet or Arrow source: packline's name → the table's column, for tables that name them
    otherwise (as LLaMA-Factory's ``dataset_info`` or axolotl's field mapping), e.g.
    ``{conversations: dialog, images: pictures, id: uid, system: system_prompt}``. Names:
    ``messages``, ``conversations`` or ``texts`` (the layout), ``images``/``image``,
    ``videos``/``video``, ``id``, ``split`` and ``system`` (a system prompt put first)."""
    download: bool = False
    """Let prepare download a Hub dataset ``data.source`` names when the local Hugging Face
    cache lacks it (``HF_HUB_OFFLINE=1`` forbids it all the same). ``false`` (the default):
    nothing is downloaded, and such a source is refused with the command that fetches it."""
    num_train: int = ranged(2000, ge=1)
    """Synthetic set: number of training conversations."""
    num_val: int = ranged(200, ge=0)
    """Synthetic set: number of held-out validation conversations."""
    seed: int = ranged(0, ge=0)
    """Synthetic set: seed; the same seed gives byte-identical data."""
    video_share: float = ranged(0.15, ge=0, le=1)
    """Synthetic set: share of the conversations that are about a video clip (0: images and
    text only)."""

    @property
    def kind(self) -> SourceKind:
        """What ``source`` names (:func:`source_kind`); the rules refuse a source that names
        nothing readable, so a loaded config always has one."""
        kind = source_kind(self.source)
        if kind is None:
            raise ValueError(f"data.source {self.source!r} names nothing packline reads")
        return kind

    def table_files(self) -> list[Path]:
        """The files of a table source: Parquet (:func:`parquet_files`) or Arrow
        (:func:`arrow_files`); [] for the other sources."""
        if self.kind is SourceKind.arrow:
            return arrow_files(self.source)
        if self.kind is SourceKind.parquet:
            return parquet_files(self.source, self.subset)
        return []

    def llava_media_dir(self) -> Path | None:
        """The folder a LLaVA file's media paths are relative to, resolved: ``media_dir``,
        else the file's own folder; None for the other sources."""
        if source_kind(self.source) is not SourceKind.llava:
            return None
        return Path(self.media_dir or Path(self.source).expanduser().parent).expanduser().resolve()

    def rules(self) -> list[str]:
        p: list[str] = []
        kind = source_kind(self.source)
        repo = repo_id(self.source)
        if repo is not None and self.download and cached(repo, "dataset") is None:
            pass  # a Hub dataset the cache lacks: prepare fetches it
        elif (problem := source_problem(self.source, self.subset)) is not None:
            p.append(problem)
        for name in self.columns:
            _check(
                p,
                name in DATA_COLUMNS,
                f"data.columns: {name!r} is none of packline's names {list(DATA_COLUMNS)}",
            )
        _check(
            p,
            not self.columns or kind in (SourceKind.parquet, SourceKind.arrow),
            "data.columns maps the columns of a Parquet or Arrow source only",
        )
        if self.media_dir is not None:
            _check(
                p,
                kind is SourceKind.llava,
                "data.media_dir is only read with a LLaVA-style .json source",
            )
            _check(
                p,
                Path(self.media_dir).expanduser().is_dir(),
                f"data.media_dir: {self.media_dir!r} is not a folder",
            )
        return p


@dataclass(kw_only=True)
class PrepareConfig(_Section):
    """Stage prepare: conversations → WebDataset shards + Energon metadata."""

    KEY: ClassVar[str] = "prepare"

    samples_per_shard: int = ranged(500, ge=1)
    """Samples per WebDataset tar shard."""
    val_fraction: float = ranged(0.05, ge=0, lt=1)
    """Share of rows sent to the val split when a row has no ``split`` field
    (chosen by a hash of its id, so stable across reruns)."""
    max_images: int = ranged(8, ge=0)
    """Rows with more images are rejected as ``too_many_images``."""
    max_videos: int = ranged(4, ge=0)
    """Rows with more videos are rejected as ``too_many_videos``."""
    max_frames_per_video: int = ranged(64, ge=1)
    """Videos of which the processor samples more frames (at its ``fps``, within its
    ``min_frames``/``max_frames``) are rejected as ``too_many_frames``."""
    max_video_seconds: float = ranged(600.0, gt=0)
    """Videos longer than this (frames / frame rate) are rejected as ``video_too_long``."""
    max_text_chars: int = ranged(1_000_000, ge=1)
    """Rows whose conversation holds more characters of text are rejected as
    ``text_too_long`` before anything tokenizes them (about 250k tokens at 4 characters a
    token: many times any ``packing.seq_length`` a row must fit, yet it bounds what one row
    costs connect's processor)."""
    max_media_bytes: int = ranged(1 << 30, ge=1)
    """Image and video files larger than this (bytes, from the file system, before a byte
    is read) are rejected as ``image_size_refused`` / ``video_size_refused``: prepare holds a
    file whole in memory while it checks it, so this bounds its memory whatever the files'
    sizes (default 1 GiB)."""
    max_reject_fraction: float = ranged(0.05, ge=0, le=1)
    """The stage fails (exit 2) when rejected rows exceed this share of all rows."""
    num_workers: int = ranged(2, ge=1)
    """Processes that read, check and write the rows (and index the shards with Energon);
    the output is the same for any count."""


@dataclass(kw_only=True)
class ConnectConfig(_Section):
    """Stage connect: every sample's exact token length, measured in parts that spread over
    Energon loader workers and SLURM tasks and that a killed run resumes from. None of these
    settings changes the lengths, so none of them reruns a connect that is up to date
    (``--from connect`` does)."""

    KEY: ClassVar[str] = "connect"

    num_workers: int = ranged(2, ge=0)
    """Energon loader worker processes of each connect task (0: measure in the task's own
    process)."""
    num_tasks: int = ranged(1, ge=1)
    """Tasks of the SLURM connect job (``executor.kind: slurm``): task r of N measures
    Energon's rank r share (``WorkerConfig(rank=r, world_size=N)``) and writes its parts;
    the task that finishes last merges them into ``lengths.parquet``. A process on its own
    (a local run, ``packline stage connect``) measures the N shares in turn: the same parts
    and the same table."""
    nodes: int = ranged(1, ge=1)
    """Nodes of the SLURM connect job; ``num_tasks`` is spread evenly over them."""
    part_size: int = ranged(2000, ge=1)
    """Samples per part file: a killed connect resumes after its last finished part."""
    verify: str = "all"
    """Samples the real processor measures to check the cheap length rule: ``all`` (every
    sample, the default), or a number N: a seeded sample of N (``train.seed``), the others
    taking the cheap rule's lengths unchecked (no pixel or frame of them decoded); the cheap
    rule measures every sample either way, and connect's record and metrics say which was
    done."""

    @property
    def verify_samples(self) -> int | None:
        """N of ``verify: N``; None for ``all``."""
        return None if self.verify == "all" else int(self.verify)

    def rules(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            self.nodes < 1 or self.num_tasks % self.nodes == 0,
            f"connect.num_tasks ({self.num_tasks}) must spread evenly over connect.nodes "
            f"({self.nodes})",
        )
        _check(
            p,
            self.verify == "all" or (self.verify.isdigit() and int(self.verify) >= 1),
            f"connect.verify must be 'all' or a number of samples >= 1, got {self.verify!r}",
        )
        return p


@dataclass(kw_only=True)
class ProcessorConfig(_Section):
    """The Qwen3-VL processor (tokenizer + chat template + image processor)."""

    KEY: ClassVar[str] = "processor"

    path: str | None = None
    """A local HF Qwen3-VL processor dir, or a Hugging Face Hub repo id found in the local
    Hugging Face cache (as ``model.path``); ``null`` builds the built-in tiny one (byte-level
    BPE, vocab 4,096, patch 16, merge 2) deterministically."""

    @property
    def dir(self) -> Path | None:
        """The processor's dir on this machine: ``path`` itself, or a Hub repo's cached
        snapshot; None for the tiny one or a repo the cache lacks."""
        return local_dir(self.path)

    # The visual geometry: what decides an image's token count. ``null`` keeps the processor
    # dir's value. connect writes the resolved values into the processor dir it measures with
    # (``<work>/connect/processor``), the local backend trains with that dir, and the megatron
    # backend sends the same values to Bridge's task encoder (``dataset.task_encoder.*``),
    # whose own defaults (min 200,704, max 1,003,520 pixels, patch 14) would otherwise apply.
    min_pixels: int | None = ranged(None, ge=1)
    """Images are upscaled to at least this many pixels (``size.shortest_edge``)."""
    max_pixels: int | None = ranged(None, ge=1)
    """Images are downscaled to at most this many pixels (``size.longest_edge``)."""
    patch_size: int | None = ranged(None, ge=1)
    """Side of one ViT patch in pixels (Qwen3-VL: 16)."""
    temporal_patch_size: int | None = ranged(None, ge=1)
    """Frames per temporal patch (Qwen3-VL: 2; a still image fills it with copies)."""
    merge_size: int | None = ranged(None, ge=1)
    """Patches merged per side into one LLM token (Qwen3-VL: 2)."""

    def geometry_overrides(self) -> dict[str, int]:
        """The geometry fields set in the config (the rest come from the processor dir)."""
        names = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def rules(self) -> list[str]:
        p: list[str] = []
        if self.path is not None and repo_id(self.path) is None:
            _check(
                p,
                Path(self.path).expanduser().is_dir(),
                f"processor.path: {self.path!r} is neither a directory nor a Hugging Face "
                "Hub repo id; fix: point it at a processor dir, or a repo id (Org/Name)",
            )
        if self.min_pixels is not None and self.max_pixels is not None:
            _check(
                p,
                self.min_pixels <= self.max_pixels,
                f"processor.min_pixels {self.min_pixels} exceeds processor.max_pixels "
                f"{self.max_pixels}",
            )
        return p


@dataclass(kw_only=True)
class PackingConfig(_Section):
    """Energon-native online sequence packing (THD rows, one pack per micro-batch)."""

    KEY: ClassVar[str] = "packing"

    enabled: bool = True
    """Pack several conversations per row; ``false`` pads one conversation per row."""
    seq_length: int = ranged(4096, gt=0)
    """Tokens per packed row (the capacity C)."""
    packing_buffer_size: int = ranged(64, gt=0)
    """Samples per DataLoader worker that selection chooses packs from."""
    algorithm: Algorithm = Algorithm.refined
    """Selection algorithm: ``refined`` (FFD plus packline's refinement, the default), or
    plain ``ffd`` / ``bfd``; ``packing.packer: bridge`` needs ``ffd`` (Bridge's)."""
    max_carry_rounds: int = ranged(4, ge=0)
    """Carry-over: a round's underfull packs go back into the next round's buffer instead
    of being emitted, each sample at most this many rounds (then it is emitted in the
    fullest pack that holds it); flushed at the end of an epoch. ``0``: off, Energon's own
    rounds (fill bounded per round). Not with ``packing.packer: bridge``."""
    balance: Balance = Balance.none
    """``flops``: each round's packs are also balanced by compute (connect's per-sample
    FLOPs), so data-parallel ranks finish each step together (the forecast's straggler
    ratio); fill may drop by up to about 1%. ``none``: fill only. Not with
    ``packing.packer: bridge``."""
    packer: Packer = Packer.packline
    """Who packs with ``train.backend: megatron``: ``packline`` (packline's dataset for
    Bridge: lazy exact lengths from connect, ``packing.algorithm``, carry-over) or
    ``bridge`` (Bridge's own ``EnergonDatasetConfig``: eager, plain FFD, no carry-over).
    The local backend always packs with packline's."""
    tensor_parallel: int = ranged(1, ge=1)
    """TP size (alignment only: with sequence parallel each conversation aligns to CP·TP)."""
    context_parallel: int = ranged(1, ge=1)
    """CP size (alignment: each conversation aligns to 2·CP when CP > 1)."""
    sequence_parallel: bool = False
    """Sequence parallelism on (alignment only)."""
    pad_to_max_length: bool = False
    """Pad every row to ``seq_length`` (fixed width; required with EP > 1 or PP > 1)."""
    overlength: OverlengthPolicy = OverlengthPolicy.drop
    """What to do with a conversation longer than ``seq_length``: ``drop`` or ``fail``."""
    encoder: EncoderMode = EncoderMode.lazy
    """``lazy`` (images processed after selection) or ``eager`` (before, Bridge-style)."""
    forecast_buffer_sizes: list[int] = ranged(
        factory=lambda: [1, 16, 64, 256, 1024], nonempty=True, each_ge=1
    )
    """Buffer sizes the connect stage forecasts fill for."""

    @property
    def alignment(self) -> int:
        """m = lcm(2·CP if CP > 1, CP·TP if SP and TP > 1): every conversation's padded
        length is a multiple of m."""
        cp_term = 2 * self.context_parallel if self.context_parallel > 1 else 1
        sp = self.sequence_parallel and self.tensor_parallel > 1
        sp_term = self.context_parallel * self.tensor_parallel if sp else 1
        return math.lcm(cp_term, sp_term)

    def rules(self) -> list[str]:
        p: list[str] = []
        if self.tensor_parallel >= 1 and self.context_parallel >= 1 and self.seq_length > 0:
            m = self.alignment
            _check(
                p,
                self.seq_length % m == 0,
                f"packing.seq_length {self.seq_length} is not a multiple of the alignment "
                f"m = lcm(2·CP, CP·TP) = {m} (TP {self.tensor_parallel}, CP "
                f"{self.context_parallel}, SP {self.sequence_parallel}); use "
                f"{(self.seq_length // m + 1) * m} or {(self.seq_length // m) * m}",
            )
        return p


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """The Qwen3-VL model trained."""

    KEY: ClassVar[str] = "model"

    name: str = "tiny"
    """``tiny`` builds a small random Qwen3-VL deterministically; else a label for ``path``."""
    path: str | None = None
    """A local HF Qwen3-VL / Qwen3-VL-MoE checkpoint dir, or a Hugging Face Hub repo id
    (``Qwen/Qwen3-VL-2B-Instruct``) found in the local Hugging Face cache (``$HF_HOME``)
    (``null`` with ``name: tiny``)."""
    download: bool = False
    """Let connect download ``model.path`` and ``processor.path`` repos the local Hugging
    Face cache lacks (Hugging Face's own ``HF_HUB_OFFLINE=1`` forbids it all the same).
    ``false`` (the default): nothing is downloaded, and a repo the cache lacks is refused
    with the command that fetches it (``hf download Org/Name``)."""
    moe: bool = False
    """The model is a Mixture-of-Experts: the tiny model is built as Qwen3VLMoe; with
    ``train.backend: megatron`` the MoE overrides apply (EP, alltoall dispatcher, no MTP,
    no CUDA graphs, EP overlap off)."""
    attention: Attention = Attention.auto
    """Language-model attention of the local backend: ``auto`` (the default: ``varlen`` on
    a CUDA GPU that runs it, else ``thd``), ``varlen`` (PyTorch's varlen flash kernel,
    CUDA), ``thd`` (per conversation, the CPU's), ``flex`` (HF's flex_attention; no
    backward on CPU), ``sdpa`` or ``eager`` (dense masks); the logits agree within 1e-5
    (fp32)."""

    @property
    def dir(self) -> Path | None:
        """The checkpoint's dir on this machine: ``path`` itself, or a Hub repo's cached
        snapshot; None for the tiny model or a repo the cache lacks."""
        return local_dir(self.path)


@dataclass(kw_only=True)
class LoraConfig(_Section):
    """PEFT LoRA adapters on the language model."""

    KEY: ClassVar[str] = "lora"

    rank: int = ranged(8, gt=0)
    """Adapter rank r."""
    alpha: int = ranged(16, gt=0)
    """Scaling numerator: adapters are scaled by alpha / rank."""
    dropout: float = ranged(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[str] = field(
        default_factory=lambda: [*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS]
    )
    """Linear layers wrapped with adapters (attention and dense MLP projections)."""
    target_parameters: list[str] = field(default_factory=list)
    """3-D parameters wrapped with adapters (MoE experts, e.g. ``mlp.experts.gate_up_proj``):
    ``target_modules`` silently match nothing on MoE experts."""

    def rules(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            bool(self.target_modules or self.target_parameters),
            "lora.target_modules and lora.target_parameters are both empty: no adapter would "
            "train; fix: list the layers to adapt (default: "
            f"{', '.join([*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS])}), or MoE experts in "
            "lora.target_parameters",
        )
        for key in ("target_modules", "target_parameters"):
            names = getattr(self, key)
            _check(
                p,
                all(isinstance(n, str) and n.strip() for n in names),
                f"lora.{key} holds an empty name: {names}; fix: remove it",
            )
        return p


# --- Megatron-Bridge settings and validate thresholds ---------------------------------------
# The cross-section rules (schemas/rules.py) and validate's rules (packline/rules/) check
# these against packing.


@dataclass(kw_only=True)
class MegatronConfig(_Section):
    """Train backend ``megatron`` (Megatron-Bridge, inside the cluster container): the recipe
    packline's overrides apply to (``packline/megatron/overrides.py`` lists every one), and the
    settings Energon packing constrains — Bridge rejects a wrong one at start-up on the
    cluster, one at a time; the validate stage checks them all at once on the laptop, and the
    overrides send exactly these values."""

    KEY: ClassVar[str] = "megatron"

    recipe: str = "qwen3_vl_8b_peft_energon_config"
    """Recipe function in ``megatron.bridge.recipes.qwen_vl`` the run starts from."""
    step_func: str = "vlm_step"
    """Bridge forward step module in ``megatron.bridge.training`` (``vlm_step``)."""
    run_name: str = "train-megatron"
    """MLflow run name of Bridge's own logger (nested under the train stage's run)."""
    extra_overrides: list[str] = field(default_factory=list)
    """More ``key=value`` Bridge overrides, applied last (dotted ConfigContainer fields)."""

    mtp_num_layers: int = ranged(0, ge=0)
    """Multi-token-prediction layers (Bridge ``mtp_num_layers``); packing needs 0."""
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.none
    """CUDA graphs of the language model: ``none``, ``local`` or ``transformer_engine``;
    packing needs ``none``."""
    vision_cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.none
    """CUDA graphs of the vision tower; packing needs ``none``."""
    calculate_per_token_loss: bool = True
    """Bridge ``model.calculate_per_token_loss``: token losses summed and divided by the
    global batch's loss-token count. Packing needs true."""
    average_in_collective: bool = False
    """Bridge ``ddp.average_in_collective``: average (not sum) gradients in the DP
    all-reduce. Packing needs false."""
    overlap_moe_expert_parallel_comm: bool = False
    """Overlap the EP all-to-all with compute; Bridge turns it off with packing (warning)."""
    delay_wgrad_compute: bool = False
    """Delay the weight-gradient GEMMs (EP overlap); Bridge turns it off with packing
    (warning)."""
    task_encoder: str = "QwenVLEnergonTaskEncoderConfig"
    """Bridge's task-encoder config class; Energon packing works only with
    ``QwenVLEnergonTaskEncoderConfig``."""
    max_num_images: int = ranged(10, ge=0)
    """Bridge's encoder skips, uncounted, samples with more images than this."""
    max_visual_tokens: int = ranged(16384, ge=1)
    """Bridge's encoder skips, uncounted, samples with more visual tokens than this."""

    def rules(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            all("=" in o for o in self.extra_overrides),
            "megatron.extra_overrides entries must be key=value",
        )
        return p


@dataclass(kw_only=True)
class ValidateConfig(_Section):
    """Stage validate: the thresholds of its warnings (errors have no knobs)."""

    KEY: ClassVar[str] = "validate"

    worker_memory_warn_gib: float = ranged(4.0, gt=0)
    """Warn when one loader worker's packing buffer is estimated to hold more (GiB)."""
    min_forecast_fill: float = ranged(0.7, ge=0, le=1)
    """Warn when the forecast fill at ``packing.packing_buffer_size`` is lower."""
    max_visual_tokens: int = ranged(16384, ge=1)
    """Warn when a sample has more visual tokens (its images' and videos' together)."""


@dataclass(kw_only=True)
class ParallelConfig(_Section):
    """How the model is split over the train job's ranks, for both backends. The ranks are
    ``train.nproc_per_node`` (local executor) or the SLURM train job's ``nodes ×
    nproc_per_node``: ``pipeline_parallel`` stages of ``ranks / pipeline_parallel``
    data-parallel ranks each, which read distinct rows; the experts are split
    ``expert_parallel`` ways over a stage's data-parallel ranks. Validate refuses, with every
    reason at once, a layout the engines cannot run (``schemas.layout``)."""

    KEY: ClassVar[str] = "train.parallel"

    expert_parallel: int = ranged(1, ge=1)
    """EP (MoE only): each rank of a stage holds 1/EP of the experts and trains their
    adapters. Local: transformers' expert-parallel plan (gloo on CPU, nccl on GPU); Bridge:
    ``model.expert_model_parallel_size``. EP > 1 needs fixed-width rows
    (``packing.pad_to_max_length: true``)."""
    pipeline_parallel: int = ranged(1, ge=1)
    """PP: the decoder layers split into this many stages (the vision tower on the first).
    Local: ``torch.distributed.pipelining``, one packed row per micro-batch, packed runs only
    (``train.compare_packing: false``). Bridge's Energon packing needs 1."""
    schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """Local PP schedule: ``1f1b`` (needs global_batch_size / data-parallel ranks >= PP) or
    ``gpipe``."""
    fsdp: bool = False
    """Local: shard the model over a stage's data-parallel ranks with FSDP2. With EP 1,
    packline's (``fully_shard`` per decoder layer, built on the meta device: the frozen base,
    the adapters and AdamW each 1/N per GPU, one full copy in rank 0's host RAM). Implied by
    EP > 1 without PP (transformers' engine splits the experts over the FSDP ranks and
    shards the frozen rest); not available with PP > 1."""


@dataclass(kw_only=True)
class TrainConfig(_Section):
    """Training loop settings (embedded local backend or Megatron-Bridge)."""

    KEY: ClassVar[str] = "train"

    backend: TrainBackend = TrainBackend.local
    """``local`` (HF + PEFT, CPU default) or ``megatron`` (Megatron-Bridge on the cluster)."""
    max_steps: int = ranged(60, gt=0)
    """Optimizer steps."""
    global_batch_size: int = ranged(4, gt=0)
    """Packed rows (micro-batches of one row) per optimizer step, over all DP ranks."""
    micro_batch_size: int = ranged(1, gt=0)
    """Physical rows per forward; packing requires 1."""
    unpacked_micro_batch_size: int = ranged(8, gt=0)
    """Packing off (the baseline): conversations per micro-batch, padded to the longest."""
    lr: float = ranged(1e-3, gt=0)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = ranged(5, ge=0)
    """Linear warmup steps before cosine decay."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = ranged(1.0, gt=0)
    """Max global gradient norm."""
    adam_beta1: float = ranged(0.9, gt=0, lt=1)
    """AdamW's decay of the gradient's running mean."""
    adam_beta2: float = ranged(0.999, gt=0, lt=1)
    """AdamW's decay of the squared gradient's running mean."""
    loss: LossWeighting = LossWeighting.token
    """``token``: Σ token loss ÷ the global batch's target tokens, each token alike (long
    conversations weigh more). ``sample``: each conversation's mean token loss, averaged over
    the global batch's conversations, each conversation alike. Both are over every
    micro-batch and rank, and equal packed and unpacked. Backend local only: Megatron-Bridge
    main's loss is per token with no hook to replace it (validate refuses ``sample``)."""
    precision: Precision = Precision.auto
    """Backend local: ``auto`` (bf16 on a GPU that has it, fp32 on CPU), ``bf16`` or
    ``fp32``. With bf16 the frozen base is loaded in bf16 (no fp32 copy of it is ever made)
    and its forwards run in bf16, while the LoRA adapters and AdamW's state stay fp32;
    evaluation and generation run in the same dtype. Megatron-Bridge takes its precision
    from its recipe."""
    activation_checkpointing: bool = False
    """Backend local: keep only each decoder layer's and vision block's inputs in the
    forward and recompute the rest in the backward (torch's non-reentrant checkpoint):
    activation memory of a row drops to about one layer's, for about a third more compute."""
    gpu_memory_gib: float | None = ranged(None, gt=0)
    """Backend local: memory of one GPU of the train run (GiB), which validate's per-GPU
    forecast of a step's peak must fit; ``null`` reads it from this machine's GPU (no check
    where there is none)."""
    loss_chunk_tokens: int = ranged(1024, ge=1)
    """Backend local: row positions whose logits exist at once in the loss (the LM head runs
    chunk by chunk and each chunk's logits are recomputed in the backward): no [T, vocab]
    tensor is made. Qwen3-VL's vocabulary of 151,936 makes 1,024 positions 0.6 GB of fp32
    logits. Not under EP or PP, whose engines run the whole logits."""
    seed: int = ranged(0, ge=0)
    """Seed of model init, data order and packing shuffles."""
    num_workers: int = ranged(0, ge=0)
    """DataLoader workers per rank."""
    shuffle_buffer_size: int = ranged(100, ge=1)
    """Samples in Energon's shuffle buffer of the training stream (Bridge:
    ``dataset.shuffle_buffer_size``)."""
    max_samples_per_sequence: int = ranged(100, ge=1)
    """Samples read in a row from one shard before the stream moves to another (Bridge:
    ``dataset.max_samples_per_sequence``)."""
    nproc_per_node: int = ranged(1, ge=1)
    """Processes of a local-executor train run (backend local): > 1 runs each training run
    under torchrun, gloo on CPU, nccl on GPU, split as ``train.parallel`` says
    (``global_batch_size`` must divide by the data-parallel ranks)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The model's split over the ranks (EP, PP, FSDP); data parallel over the rest."""
    moe_aux_loss_coef: float = ranged(0.0, ge=0)
    """Backend local, MoE: weight of the router's load-balancing loss in the trained loss.
    It is always computed over real tokens only (padding and alignment gaps excluded) and
    logged as ``moe/aux_loss`` with the max/min expert load. 0 (the default) logs it without
    training on it: LoRA leaves the router frozen, and a nonzero term is computed per
    micro-batch, so packing on and off (which group conversations differently) no longer
    compute the same gradient. Not available with pipeline_parallel > 1 (its formula needs
    every layer's routing at once)."""
    save_every: int = ranged(20, ge=1)
    """Checkpoint every N optimizer steps."""
    keep_last: int = ranged(2, ge=1)
    """Checkpoints kept."""
    eval: bool = True
    """Evaluate on the val split: the eval loss (and the answer accuracy of
    ``eval_samples`` questions) at the start, every ``eval_every`` steps and at the end.
    ``false`` trains without eval, for a data set with no validation rows (validate refuses
    ``true`` there); the runs then report no eval figures."""
    eval_every: int = ranged(0, ge=0)
    """Evaluate every N steps (0: only at the start and the end)."""
    eval_samples: int = ranged(100, ge=0)
    """Val questions answered greedily for the accuracy figure."""
    compare_packing: bool = True
    """Train packing on and off side by side (the A/B); false trains ``packing.enabled`` only."""


@dataclass(kw_only=True)
class MlflowConfig(_Section):
    """Experiment tracking."""

    KEY: ClassVar[str] = "mlflow"

    tracking_uri: str | None = None
    """MLflow tracking URI; ``null`` uses the sqlite store ``<work_dir>/mlflow.db``."""
    experiment: str | None = None
    """Experiment name; ``null`` uses the pipeline name."""
    enabled: bool = True
    """Log to MLflow at all."""


@dataclass(kw_only=True)
class SlurmConfig(_Section):
    """SLURM executor settings (used with ``executor.kind: slurm``)."""

    KEY: ClassVar[str] = "executor.slurm"

    account: str = ""
    """Account charged for the jobs."""
    partition: str = ""
    """Partition to submit to."""
    nodes: int = ranged(1, ge=1)
    """Nodes per training job."""
    gpus_per_node: int = ranged(8, ge=0)
    """GPUs per node requested by the train job (0: none); the other stages ask for none."""
    nproc_per_node: int | None = ranged(None, ge=1)
    """torchrun processes per node of the train job; ``null`` → ``gpus_per_node``. With
    ``train.backend: local`` every process is a data-parallel rank, so
    ``train.global_batch_size`` must divide by ``nodes × nproc_per_node``."""
    mem: str | None = None
    """Memory per node of every job (``--mem``, e.g. ``64G``); ``null`` → the cluster default."""
    time: str = "04:00:00"
    """Wall-clock limit per job."""
    container_image: str | None = None
    """Container image (pyxis/enroot); ``null`` runs on the host. The image needs packline's
    Python dependencies; ``train.backend: megatron`` needs the one ``containers/Dockerfile``
    builds (no stock NeMo image has a Bridge with native packing). The work dir is mounted at
    the same path."""
    container_mounts: list[str] = field(default_factory=list)
    """``host:container`` mounts (the work dir is added automatically)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the jobs."""
    host: str | None = None
    """Login host: ``null`` submits from this machine (LocalTunnel), else over SSH."""
    user: str | None = None
    """SSH user for ``host``."""
    job_dir: str | None = None
    """Remote dir for NeMo-Run job files (SSH only)."""

    def rules(self) -> list[str]:
        p: list[str] = []
        _check(
            p,
            all(":" in m for m in self.container_mounts),
            "executor.slurm.container_mounts entries must be host:container",
        )
        return p


@dataclass(kw_only=True)
class ExecutorConfig(_Section):
    """Where the stages run."""

    KEY: ClassVar[str] = "executor"

    kind: ExecutorKind = ExecutorKind.local
    """``local`` (NeMo-Run LocalExecutor) or ``slurm``."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """SLURM settings."""


@dataclass(kw_only=True)
class PipelineConfig(_Section):
    """The whole pipeline: one run of prepare → connect → validate → train."""

    name: str = MISSING
    """Pipeline name: default work dir ``runs/<name>`` and MLflow experiment."""
    work_dir: str | None = None
    """Where every stage writes; ``null`` → ``./runs/<name>``."""
    data: DataConfig = field(default_factory=DataConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    connect: ConnectConfig = field(default_factory=ConnectConfig)
    processor: ProcessorConfig = field(default_factory=ProcessorConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    @property
    def trains_packed(self) -> bool:
        """Whether a packed run trains: packing on, or the on/off comparison."""
        return self.packing.enabled or self.train.compare_packing

    @property
    def work_path(self) -> Path:
        """Absolute work dir."""
        return Path(self.work_dir or Path("runs") / self.name).expanduser().resolve()

    def inputs(self) -> dict[str, Path]:
        """The user's inputs this config reads, by setting, resolved: the source (unless
        the built-in set), a LLaVA file's media dir, the processor and model dirs."""
        found: dict[str, Path] = {}
        if (repo := repo_id(self.data.source)) is not None:
            if (snapshot := cached(repo, "dataset")) is not None:
                found["data.source"] = snapshot
        elif self.data.source != "synthetic":
            path = Path(self.data.source).expanduser()
            while glob.has_magic(str(path)):  # a glob: the dir its matches lie under
                path = path.parent
            found["data.source"] = path.resolve()
        if (media := self.data.llava_media_dir()) is not None:
            found["data.media_dir"] = media
        for key, ref in (("processor.path", self.processor.path), ("model.path", self.model.path)):
            if (where := local_dir(ref)) is not None:
                found[key] = where
        return found

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable dict of the resolved config (enums as values)."""
        return OmegaConf.to_container(OmegaConf.structured(self), resolve=True, enum_to_str=True)

    def to_yaml(self) -> str:
        """The resolved config as YAML that :func:`load_config` reads back unchanged."""
        return OmegaConf.to_yaml(self.to_dict())

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (what a stage's output depends on)."""
        d = self.to_dict()
        payload = json.dumps({s: d[s] for s in sections}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


def _suggest(key: str, node: DictConfig) -> str:
    close = difflib.get_close_matches(key, [str(k) for k in node.keys()], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Leaf (dotted key, value) pairs of a nested dict; lists and empty dicts are leaves."""
    if isinstance(d, dict) and d:
        out: list[tuple[str, Any]] = []
        for k, v in d.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, d)]


def _set_key(cfg: DictConfig, key: str, value: Any, origin: str, problems: list[str]) -> None:
    """Set one dotted key on the structured config, recording a readable problem on failure."""
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        is_leaf = i == len(parts) - 1
        if isinstance(node, DictConfig) and part not in node.keys():
            schema_open = OmegaConf.get_type(node) is dict  # free-form dicts take any key
            if not schema_open:
                where = ".".join(parts[:i]) or "the top level"
                problems.append(
                    f"{origin}: unknown key '{key}': '{part}' is not a setting of "
                    f"{where}{_suggest(part, node)}"
                )
                return
        if is_leaf:
            break
        node = node[part] if isinstance(node, DictConfig) and part in node.keys() else None
        if node is None:
            break
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as exc:
        expected = _expected_type(key)
        msg = f"{origin}: '{key}' = {value!r} is invalid"
        problems.append(f"{msg}: expected {expected}" if expected else f"{msg}: {exc.msg}")


def _expected_type(key: str) -> str | None:
    cls: Any = PipelineConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        fmap = {f.name: f for f in fields(cls)} if is_dataclass(cls) else {}
        if part not in fmap:
            return None
        f = fmap[part]
        if i == len(parts) - 1:
            t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            enum_cls = globals().get(t.split(" ")[0]) if isinstance(t, str) else None
            if isinstance(enum_cls, type) and issubclass(enum_cls, Enum):
                return "one of " + ", ".join(repr(m.value) for m in enum_cls)
            return t
        cls = globals().get(f.type) if isinstance(f.type, str) else f.type
    return None


#: The free-form maps: the only places a key can be added (``+key=value``) or deleted
#: (``~key``); every other key is a setting of the schema, always there.
OPEN_MAPS = ("executor.slurm.env",)


_ABSENT = object()


def _open_map(key: str) -> bool:
    return key.rpartition(".")[0] in OPEN_MAPS


def _add_or_delete(cfg: DictConfig, item: str, problems: list[str]) -> bool:
    """Hydra's ``+key=value`` (add) and ``~key`` (delete): applied inside a free-form map
    (:data:`OPEN_MAPS`), else a problem saying what to write instead. False when ``item``
    is a plain ``key=value``."""
    if not item.startswith(("+", "~")):
        return False
    sign, key = item[0], item[1:].partition("=")[0].strip()
    parent, _, leaf = key.rpartition(".")
    known = OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT
    if sign == "~":
        if _open_map(key) and known:
            del OmegaConf.select(cfg, parent)[leaf]
        elif _open_map(key):
            problems.append(f"override '{item}': {parent} has no key '{leaf}' to delete")
        else:
            problems.append(
                f"override '{item}': '~' deletes a key of a free-form map "
                f"({', '.join(OPEN_MAPS)}); '{key}' is a setting, which always has a value: "
                f"set it ({key}=VALUE), or leave it out of the config for its default"
            )
        return True
    if "=" not in item:
        problems.append(f"override '{item}' is not of the form +key=value")
    elif known:
        problems.append(
            f"override '{item}': '+' adds a key that is not there, and '{key}' is: write {item[1:]}"
        )
    elif _open_map(key):
        _set_key(cfg, key, _parse_override(item[1:])[1], "override", problems)
    else:
        _set_key(cfg, key, None, "override", problems)  # the unknown key's own problem
        problems[-1] += f"; keys can be added only to {', '.join(OPEN_MAPS)}"
    return True


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"override '{item}' is not of the form key=value")
    key, _, raw = item.partition("=")
    value = OmegaConf.from_dotlist([f"_v={raw}"])["_v"] if raw != "" else ""
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
    return key.strip(), value


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError([f"config file {str(path)!r} does not exist"])
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except Exception as exc:
        raise UserError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise UserError([f"{path}: the top level must be a mapping"])
    return raw


def value_sources(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> dict[str, tuple[Any, str]]:
    """Each setting :func:`load_config` resolves, by dotted key: its value and where it came
    from, the config file's name, ``override`` (the last one wins, as in ``load_config``) or
    ``default``; a key an override deleted (``~key``) has the value None.

        >>> value_sources(None, ["train.lr=1e-3"])["train.lr"]
        (0.001, 'override')
        >>> where = value_sources(None, [])
        >>> where["packing.seq_length"][1], where["train.grad_clip"][1]
        ('tiny_cpu.yaml', 'default')
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    values = dict(_flatten(load_config(path, overrides).to_dict()))
    sources = dict.fromkeys(values, "default")
    for key, _ in _flatten(_read_yaml(path)):
        sources[key] = path.name
    for item in overrides or []:
        sources[item.lstrip("+~").partition("=")[0].strip()] = "override"
    return {key: (values.get(key), source) for key, source in sources.items()}


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """YAML at ``path`` (default ``configs/tiny_cpu.yaml``) merged onto the schema, then
    ``key=value`` overrides. Raises :class:`UserError` listing every problem."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    problems: list[str] = []
    cfg = OmegaConf.structured(PipelineConfig)
    raw = _read_yaml(path)
    for key, value in _flatten(raw):
        _set_key(cfg, key, value, str(path.name), problems)
    for item in overrides or []:
        if _add_or_delete(cfg, item, problems):
            continue
        try:
            key, value = _parse_override(item)
        except (ValueError, OmegaConfBaseException) as exc:
            problems.append(str(exc))
            continue
        _set_key(cfg, key, value, "override", problems)
    for key in sorted(OmegaConf.missing_keys(cfg)):
        problems.append(f"missing value: '{key}' must be set")
    problems += _rule_problems(cfg)
    if problems:
        raise UserError(problems)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _rule_problems(cfg: DictConfig) -> list[str]:
    """Every broken rule at once: each section's own rules (ranges, paths, the alignment)
    and, when every section could be built, the errors of the cross-section rules
    (``schemas/rules.py``: the packing rules Megatron-Bridge enforces at start-up)."""
    names = [f.name for f in fields(PipelineConfig) if f.name not in ("name", "work_dir")]
    problems: list[str] = []
    built: dict[str, _Section] = {}
    with _rules_deferred():
        for name in names:
            try:
                built[name] = OmegaConf.to_object(cfg[name])  # type: ignore[assignment]
            except (ValueError, OmegaConfBaseException) as exc:
                msg = exc.msg if isinstance(exc, OmegaConfBaseException) else str(exc)
                problems += [m.strip() for m in msg.split("\n") if m.strip()]
    for section in built.values():
        problems += section.all_rules()
    if len(built) == len(names):
        with _rules_deferred():
            whole = PipelineConfig(
                name="" if OmegaConf.is_missing(cfg, "name") else cfg.name,
                work_dir=cfg.work_dir,
                **built,  # type: ignore[arg-type]
            )
        problems += [f.text for f in config_findings(whole) if f.severity == "error"]
    return problems


# --- each section's rules as findings (the validate stage's report) ------------------------------


def section_findings(cfg: PipelineConfig) -> tuple[list[Finding], list[Check]]:
    """The rules of every config section (ranges, paths, the alignment, ...) as findings:
    ``load_config`` already refuses a config breaking one; the validate stage checks them
    again on the object it is handed and lists each section in its report."""
    findings: list[Finding] = []
    checks: list[Check] = []
    for f in fields(cfg):
        section = getattr(cfg, f.name)
        if not isinstance(section, _Section):
            continue
        rule_id = f"config.{f.name}"
        requires = f"types, ranges and enums of `{f.name}` (schemas/config.py)"
        found = []
        for problem in section.all_rules():
            message, _, fix = problem.partition("; fix: ")
            key = _leading_key(message, f.name)
            fix = fix or f"change {key} (schemas/config.py documents it)"
            found.append(Finding("error", key, message, fix, rule=rule_id, requires=requires))
        findings += found
        checks.append(Check(rule_id, "config", requires, "error" if found else "ok"))
    return findings, checks


def _leading_key(message: str, section: str) -> str:
    first = message.split(" ", 1)[0].rstrip(":,")
    return first if first.startswith(f"{section}.") else section
