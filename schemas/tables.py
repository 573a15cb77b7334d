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

REJECT_REASONS = [
    "malformed_json",  # the line is not a JSON object
    "malformed",  # fields missing or of the wrong type, empty id, empty text
    "missing_image",  # an image path that does not exist
    "image_unreadable",  # bytes that are not a decodable image
    "image_path_unsafe",  # an absolute path, or one that escapes the folder
    "image_size_refused",  # the processor's resize rule refuses the image (e.g. aspect > 200)
    "too_many_images",  # more images than prepare.max_images
    "marker_count_mismatch",  # number of <image> markers differs from the number of images
    "no_assistant_turn",  # nothing to train on
    "unknown_role",  # a role other than system / user / assistant (or LLaVA's human / gpt)
    "duplicate_id",  # the id was seen on an earlier row
]


class ManifestModel(pa.DataFrameModel):
    """One accepted sample of the prepared dataset."""

    key: Series[str] = pa.Field(unique=True, str_matches=r"^[A-Za-z0-9_\-]+$")
    """WebDataset key (the sample's ``__key__``)."""
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

    class Config:
        strict = True
        coerce = True


class RejectsModel(pa.DataFrameModel):
    """One rejected row of the source, with why."""

    line: Series[int] = pa.Field(ge=1)
    """1-based line number in conversations.jsonl."""
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

    class Config:
        strict = True
        coerce = True

    @pa.dataframe_check
    def total_is_text_plus_image(cls, df: pd.DataFrame) -> Series[bool]:
        return df["total_tokens"] == df["text_tokens"] + df["image_tokens"]

    @pa.dataframe_check
    def loss_within_text(cls, df: pd.DataFrame) -> Series[bool]:
        return df["loss_tokens"] <= df["text_tokens"]

    @pa.dataframe_check
    def images_have_tokens(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["num_images"] == 0) == (df["image_tokens"] == 0)


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
