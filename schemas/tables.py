"""pandera models of the tables the stages write; each stage validates what it writes.

- ``manifest.parquet`` (prepare): one row per accepted sample.
- ``rejects.jsonl`` (prepare): one row per rejected input row, with its reason.
- ``lengths.parquet`` (connect): exact token counts per sample.
"""

from __future__ import annotations

import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError, SchemaErrors
from pandera.typing import Series

SPLITS = ["train", "val"]
#: A manifest key: what prepare writes (:func:`packline.conversations.key_for_id`), or the
#: ``__key__`` Energon gives a sample of an adopted dataset, which may name dirs inside its tar.
KEY_PATTERN = r"^[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*$"

REJECT_REASONS = [
    "malformed_json",  # the line is not a JSON object
    "malformed",  # fields missing or of the wrong type, empty id, empty text
    "missing_image",  # an image path that does not exist
    "image_unreadable",  # bytes that are not a decodable image
    "image_path_unsafe",  # an absolute path, or one that escapes the folder
    "image_size_refused",  # the processor's resize rule refuses the image (e.g. aspect > 200)
    "too_many_images",  # more images than prepare.max_images
    "marker_count_mismatch",  # number of <image> (<video>) markers differs from images (videos)
    "missing_video",  # a video path that does not exist
    "video_path_unsafe",  # a video path that is absolute, or escapes the folder
    "video_unreadable",  # no decodable video stream, a truncated file, the frame size changes
    "video_too_short",  # fewer sampled frames than the processor needs (temporal_patch_size)
    "video_size_refused",  # the video processor's resize rule refuses the frame size
    "too_many_videos",  # more videos than prepare.max_videos
    "too_many_frames",  # more sampled frames in a video than prepare.max_frames_per_video
    "video_too_long",  # a video longer than prepare.max_video_seconds
    "video_frames_unsupported",  # an Energon sample's video given as a list of frames, not a file
    "no_assistant_turn",  # nothing to train on
    "unknown_role",  # a role other than system / user / assistant (or LLaVA's human / gpt)
    "duplicate_id",  # the id was seen on an earlier row, or another id maps to the same key
    "text_not_utf8",  # text that is not UTF-8: an undecodable byte, a lone surrogate escape
    "text_too_long",  # more characters of text than prepare.max_text_chars
    "shard_unreadable",  # an adopted Energon dataset's shard that cannot be read as a tar
    "image_null",  # a Parquet row's image entry holds neither bytes nor a path
    "video_null",  # a Parquet row's video entry holds neither bytes nor a path
    "missing_column",  # a Parquet row lacks what its layout needs (its conversation column)
    "wrong_type",  # a Parquet column of the wrong type (a conversation that is not a list)
]


class ManifestModel(pa.DataFrameModel):
    """One accepted sample of the prepared dataset."""

    key: Series[str] = pa.Field(unique=True, str_matches=KEY_PATTERN)
    """WebDataset key (the sample's ``__key__``): letters, digits, ``_`` and ``-``, with ``/``
    between the dir names of an adopted Energon dataset's keys (a dir inside the tar)."""
    id: Series[str] = pa.Field(unique=True)
    """The row's id in the source."""
    split: Series[str] = pa.Field(isin=SPLITS)
    shard: Series[str]
    """Shard file, relative to the prepare dir."""
    num_images: Series[int] = pa.Field(ge=0)
    num_turns: Series[int] = pa.Field(ge=1)
    """Messages in the conversation (system, user and assistant)."""
    num_assistant_turns: Series[int] = pa.Field(ge=1)
    text_chars: Series[int] = pa.Field(ge=0)
    image_bytes: Series[int] = pa.Field(ge=0)
    num_videos: Series[int] = pa.Field(ge=0)
    video_bytes: Series[int] = pa.Field(ge=0)
    video_frames: Series[int] = pa.Field(ge=0)
    """Frames in the sample's video files (decoded counts), summed; not the sampled frames."""

    class Config:
        strict = True
        coerce = True

    @pa.dataframe_check
    def videos_have_frames(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["num_videos"] == 0) == (df["video_frames"] == 0)


class RejectsModel(pa.DataFrameModel):
    """One rejected row of the source, with why."""

    line: Series[int] = pa.Field(ge=1)
    """1-based line number in conversations.jsonl (a LLaVA file's record, an adopted
    dataset's sample, a Parquet source's row counted over its files; the detail of a Parquet
    row's reject begins with its file, row group and row)."""
    id: Series[str] = pa.Field(nullable=True)
    reason: Series[str] = pa.Field(isin=REJECT_REASONS)
    detail: Series[str]

    class Config:
        strict = True
        coerce = True


class LengthsModel(pa.DataFrameModel):
    """Exact token counts of one sample under the connected processor."""

    key: Series[str] = pa.Field(unique=True)
    split: Series[str] = pa.Field(isin=SPLITS)
    text_tokens: Series[int] = pa.Field(ge=1)
    image_tokens: Series[int] = pa.Field(ge=0)
    num_images: Series[int] = pa.Field(ge=0)
    total_tokens: Series[int] = pa.Field(ge=1)
    loss_tokens: Series[int] = pa.Field(ge=1)
    image_grids: Series[str] = pa.Field(str_startswith="[")
    """JSON list of each image's (t, h, w) patch grid, in order."""
    images_moved: Series[bool]
    """Megatron-Bridge's encoder moves some image of this sample before its turn's text."""
    video_tokens: Series[int] = pa.Field(ge=0)
    """``<|video_pad|>`` tokens (timestamps and per-group vision start/end are text)."""
    num_videos: Series[int] = pa.Field(ge=0)
    video_frames: Series[int] = pa.Field(ge=0)
    """Frames the video processor samples from the sample's videos (before odd counts are
    padded)."""
    video_grids: Series[str] = pa.Field(str_startswith="[")
    """JSON list of each video's (t, h, w) patch grid (t: temporal groups), in order."""
    video_frame_counts: Series[str] = pa.Field(str_startswith="[")
    """JSON list of each video's sampled frames, in order."""
    flops: Series[float] = pa.Field(gt=0)
    """Executed training FLOPs of the sample alone at its aligned length
    (``FlopsModel.sample_flops``): what it adds to any pack, what FLOPs balance weighs."""

    class Config:
        strict = True
        coerce = True

    @pa.dataframe_check
    def total_is_text_plus_media(cls, df: pd.DataFrame) -> Series[bool]:
        return df["total_tokens"] == df["text_tokens"] + df["image_tokens"] + df["video_tokens"]

    @pa.dataframe_check
    def loss_within_text(cls, df: pd.DataFrame) -> Series[bool]:
        return df["loss_tokens"] <= df["text_tokens"]

    @pa.dataframe_check
    def images_have_tokens(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["num_images"] == 0) == (df["image_tokens"] == 0)

    @pa.dataframe_check
    def videos_have_tokens_and_frames(cls, df: pd.DataFrame) -> Series[bool]:
        no_video = df["num_videos"] == 0
        return (no_video == (df["video_tokens"] == 0)) & (no_video == (df["video_frames"] == 0))


def validate_table(model: type[pa.DataFrameModel], df: pd.DataFrame, name: str) -> pd.DataFrame:
    """Validate ``df`` against ``model`` (every failure at once); ``ValueError`` lists them."""
    try:
        return model.validate(df, lazy=True)
    except SchemaErrors as exc:
        cases = exc.failure_cases
        lines = [
            f"{r.get('column') or r.get('check')}: {r.get('check')} failed "
            f"(index {r.get('index')}, value {r.get('failure_case')!r})"
            for r in cases.head(20).to_dict("records")
        ]
        more = f" (+{len(cases) - 20} more)" if len(cases) > 20 else ""
        raise ValueError(f"{name} breaks its schema:\n  " + "\n  ".join(lines) + more) from None
    except SchemaError as exc:  # pragma: no cover - lazy=True raises SchemaErrors
        raise ValueError(f"{name} breaks its schema: {exc}") from None


# --- across tables (the validate stage) -----------------------------------------------------


class SampleJoinModel(pa.DataFrameModel):
    """``manifest.parquet`` outer-joined with ``lengths.parquet`` on ``key``; ``source`` is
    the join indicator (``both``, ``left_only``: manifest only, ``right_only``: lengths only).
    Each check's ``error`` names the keys that break it."""

    key: Series[str]
    source: Series[str]
    split_manifest: Series[str] = pa.Field(nullable=True)
    split_lengths: Series[str] = pa.Field(nullable=True)
    num_images_manifest: Series[float] = pa.Field(nullable=True)
    num_images_lengths: Series[float] = pa.Field(nullable=True)

    class Config:
        coerce = True

    @pa.dataframe_check(error="lengths.parquet key(s) not in manifest.parquet")
    def lengths_key_in_manifest(cls, df: pd.DataFrame) -> Series[bool]:
        return df["source"] != "right_only"

    @pa.dataframe_check(error="manifest.parquet key(s) missing from lengths.parquet")
    def manifest_key_has_lengths(cls, df: pd.DataFrame) -> Series[bool]:
        return df["source"] != "left_only"

    @pa.dataframe_check(error="key(s) with another split in lengths.parquet than in the manifest")
    def split_agrees(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["source"] != "both") | (df["split_manifest"] == df["split_lengths"])

    @pa.dataframe_check(
        error="key(s) with another image count in lengths.parquet than in the manifest"
    )
    def num_images_agree(cls, df: pd.DataFrame) -> Series[bool]:
        both = df["source"] == "both"
        return ~both | (df["num_images_manifest"] == df["num_images_lengths"])


def _examples(values: list, shown: int = 5) -> str:
    text = ", ".join(repr(v) for v in values[:shown])
    return text + (f" and {len(values) - shown} more" if len(values) > shown else "")


def _failures(model: type[pa.DataFrameModel], df: pd.DataFrame, name: str) -> list[str]:
    """One readable line per broken check of ``model`` on ``df`` (all checks run)."""
    try:
        model.validate(df, lazy=True)
        return []
    except SchemaErrors as exc:
        cases = exc.failure_cases
    cases = cases.assign(
        column=cases["column"].where(cases["schema_context"] == "Column", None).astype(object)
    )  # a dataframe check is reported once per column: group it as one
    lines: list[str] = []
    for (column, check), group in cases.groupby(["column", "check"], dropna=False, sort=False):
        column = column if isinstance(column, str) else None
        index = [i for i in dict.fromkeys(group["index"].tolist()) if i is not None]
        keys = list(dict.fromkeys(df.loc[i, "key"] for i in index)) if "key" in df else []
        if check == "field_uniqueness" and column == "key":
            dup = sorted(set(group["failure_case"].astype(str)))
            lines.append(f"{name} has {len(dup)} duplicated key(s): {_examples(dup)}")
        elif column is None and "key(s)" in str(check) and keys:
            lines.append(f"{len(keys)} {check}: {_examples(keys)}")
        else:
            values = list(dict.fromkeys(group["failure_case"].astype(str).tolist()))
            where = f"column {column}" if column else "the table"
            lines.append(f"{name}: {where} fails {check} ({_examples(values)})")
    return lines


def cross_table_problems(manifest: pd.DataFrame, lengths: pd.DataFrame) -> list[tuple[str, str]]:
    """(table at fault, problem) for each broken rule of the manifest, the lengths table and
    the two together: each table's own model (keys unique, ...), every lengths key in the
    manifest and the reverse, and the same split and image count for a key in both."""
    out = [("manifest.parquet", p) for p in _failures(ManifestModel, manifest, "manifest.parquet")]
    out += [("lengths.parquet", p) for p in _failures(LengthsModel, lengths, "lengths.parquet")]
    if not {"key", "split", "num_images"} <= set(manifest.columns) & set(lengths.columns):
        return out  # reported above as missing columns
    joined = manifest[["key", "split", "num_images"]].merge(
        lengths[["key", "split", "num_images"]],
        on="key",
        how="outer",
        suffixes=("_manifest", "_lengths"),
        indicator="source",
    )
    joined["source"] = joined["source"].astype(str)
    out += [
        ("lengths.parquet", p)
        for p in _failures(SampleJoinModel, joined.reset_index(drop=True), "the join")
    ]
    return out
