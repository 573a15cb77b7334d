"""The row layouts of Hugging Face-style datasets, each brought to the row form
:func:`packline.conversations.parse_record` reads (``conversations`` + ``images`` +
``videos``). A table's columns name its layout (:func:`layout_of`), checked once per file;
:func:`to_record` converts one row.

- ``messages``: HF/OpenAI chat, typed content parts; ``{"type": "image"}`` parts place the
  row's ``images`` column in order, or a part carries its own image (``"image"``: bytes, a
  struct or a path);
- ``conversations``: ShareGPT/LLaVA turns (``from``/``value`` or ``role``/``content``) with
  ``images`` (a list) or ``image`` (one; LLaVA-OneVision), ``<image>`` markers placing them;
- ``texts``: the_cauldron's ``[{"user", "assistant"}]`` pairs with ``images``, all placed
  before the first user text.

Arrow gives a list of structs the union of its items' fields, the missing ones as null
(``{"type": "text", "text": "Hi", "image": None}``): a null field is taken as absent. A row
without an ``id`` column gets ``<file>-g<chunk>-r<row>`` (the file's path in the source
without its suffix, the chunk its row group or batch), stable across runs. A
``system`` column (a system prompt) becomes the first turn. ``data.columns`` maps a table's
own column names to these (:mod:`packline.sources.parquet`).

    >>> row = {"texts": [{"user": "Colour?", "assistant": "Red.", "source": "x"}],
    ...        "images": [{"bytes": b"...", "path": None}]}
    >>> rec = to_record(row, "texts", default_id="train-g0-r3")
    >>> rec["id"], rec["conversations"][0], len(rec["images"])
    ('train-g0-r3', {'role': 'user', 'content': 'Colour?'}, 1)
    >>> layout_of(["id", "prompt", "response"]) is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from packline.conversations import Rejected

#: Each layout by the column that names it, in the order they are tried.
LAYOUTS = ("messages", "conversations", "texts")
#: The media columns each layout may have.
MEDIA_COLUMNS = {"image": ("images", "image"), "video": ("videos", "video")}


def layout_of(columns: Iterable[str]) -> str | None:
    """The layout of a table with these columns, or None when none is known."""
    names = set(columns)
    return next((layout for layout in LAYOUTS if layout in names), None)


def layout_problem(columns: Iterable[str], where: str, lists: Iterable[str] = ()) -> str:
    """Why a table with these columns cannot be read, and the mapping to write (``lists``:
    its list columns, the likely conversation)."""
    guess = next(iter(lists), "<column>")
    return (
        f"{where} has the columns {sorted(columns)}: none names a conversation packline "
        f"reads ({', '.join(LAYOUTS)}); fix: map the conversation column with data.columns, "
        f"e.g. data.columns={{conversations: {guess}}} (messages: OpenAI/HF chat parts; "
        "conversations: ShareGPT/LLaVA turns; texts: the_cauldron's user/assistant pairs), "
        "and the images likewise (images: <column>)"
    )


def _present(value: Any) -> Any:
    """``value`` with the null fields of every struct dropped (Arrow's union of fields)."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value


def _media_list(row: dict[str, Any], kind: str, sid: str) -> list[Any]:
    """The row's ``images`` (``videos``) column, or its single ``image`` (``video``)."""
    plural, single = MEDIA_COLUMNS[kind]
    if row.get(plural) is not None:
        value = row[plural]
        if not isinstance(value, list):
            raise Rejected(
                "wrong_type", f"'{plural}' must be a list, got {type(value).__name__}", sid
            )
        return value
    if single in row:  # one, possibly null: a null image is the row's problem, said so
        return [row[single]]
    return []


def _messages(row: dict[str, Any], media: dict[str, list[Any]], sid: str) -> list[Any]:
    """``messages`` turns with every media part bare (``{"type": "image"}``); a part that
    carries its own image or video adds it to ``media`` where it stands."""
    turns = []
    for turn in _present(row["messages"]):
        if isinstance(turn, dict) and isinstance(turn.get("content"), list):
            parts = []
            for part in turn["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url":
                    inner = part.get("image_url")
                    part = {
                        "type": "image",
                        "image": inner.get("url") if isinstance(inner, dict) else inner,
                    }
                    kind = "image"
                if kind in MEDIA_COLUMNS:
                    own = [part[k] for k in (kind, "path", "url", "bytes") if k in part]
                    if own:
                        media[kind].append(part if "bytes" in part else own[0])
                    parts.append({"type": kind})
                else:
                    parts.append(part)
            turn = {**turn, "content": parts}
        turns.append(turn)
    return turns


def to_record(row: dict[str, Any], layout: str, *, default_id: str) -> dict[str, Any]:
    """One table row in ``layout`` → the row form of
    :func:`~packline.conversations.parse_record`, or raise :class:`Rejected`."""
    sid = str(row.get("id") if row.get("id") is not None else default_id)
    if row.get(layout) is None:
        raise Rejected("missing_column", f"the row's '{layout}' is null", sid)
    if not isinstance(row[layout], list):
        raise Rejected(
            "wrong_type", f"'{layout}' must be a list, got {type(row[layout]).__name__}", sid
        )
    media = {kind: _media_list(row, kind, sid) for kind in MEDIA_COLUMNS}
    if layout == "messages":
        turns = _messages(row, media, sid)
    elif layout == "conversations":
        turns = _present(row["conversations"])
    else:  # texts
        turns = []
        for pair in _present(row["texts"]):
            if not isinstance(pair, dict):
                raise Rejected("wrong_type", f"a 'texts' item must be an object: {pair!r}", sid)
            turns += [
                {"role": role, "content": pair[name]}
                for name, role in (("user", "user"), ("assistant", "assistant"))
                if name in pair
            ]
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise Rejected("wrong_type", f"'system' must be text, got {type(system).__name__}", sid)
        turns = [{"role": "system", "content": system}, *turns]
    record: dict[str, Any] = {
        "id": row["id"] if row.get("id") is not None else default_id,
        "conversations": turns,
        "images": media["image"],
        "videos": media["video"],
    }
    for optional in ("split", "meta"):
        if row.get(optional) is not None:
            record[optional] = row[optional]
    return record
