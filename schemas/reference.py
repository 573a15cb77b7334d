"""The config reference (``docs/config.md``), generated from the schema: one row per setting
(its dotted key), its type, its default and its meaning. The meaning is the docstring under
the field in ``schemas/config.py`` (read from the source with ``ast``, as documentation tools
read attribute docstrings), so the reference cannot say other than the schema does.
``python -m pipelines.reference`` writes it together with the CLI reference."""

from __future__ import annotations

import ast
import re
import typing
from dataclasses import MISSING, Field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from schemas import config
from schemas.ranges import Range, field_range

HEADER = """\
# Config reference

Every setting of a pipeline config, by its dotted key (`key=value` on the command line),
generated from the schema (`schemas/config.py`, the docstring under each field) by
`.venv/bin/python -m pipelines.reference`: do not edit by hand. The range is what a setting
may take, declared once on its field: any command refuses a value outside it before anything
runs (exit 2), listing every such value at once with its fix; `null` is allowed where the
type says so. The defaults are the schema's; a config file sets some of them differently
(`configs/tiny_cpu.yaml` is the default file), and `packline config [CONFIG] [key=value ...]`
prints the resolved values and where each came from.
"""


def field_docs(source: str) -> dict[tuple[str, str], str]:
    r"""Each field's docstring, by (class name, field name): the string literal right under an
    annotated assignment in a class body.

    >>> field_docs("class A:\n    x: int = 1\n    'The x.'\n    y: int = 2\n")
    {('A', 'x'): 'The x.'}
    """
    docs: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = after.value.value
    return docs


def _markdown(text: str) -> str:
    """A docstring as one table cell: one line, ``rst`` literals and roles as Markdown code,
    pipes escaped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", text)
    text = text.replace("``", "`")
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(hint: Any) -> str:
    """A field's type as a reader writes its value: ``int``, ``str or null``, ``list of
    int``, ``one of `a`, `b```."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in hint)
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join([*(_type_name(a) for a in rest), "null"])
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    return getattr(hint, "__name__", str(hint))


def _value(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Enum):
        return f"`{value.value}`"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _range(f: Field, hint: Any) -> str:
    """The values a field may take, as the reference shows them (empty: any of its type)."""
    rng = field_range(f)
    if rng is None and "float" in str(hint):
        rng = Range()
    if rng is None:
        return ""
    text = rng.text()
    if "float" in str(hint):
        text = "finite" if text == "any" else f"finite, {text}"
    return text.replace(">=", "≥").replace("<=", "≤")


Row = tuple[str, str, str, str, str]


def _sections(
    cls: type, prefix: str, docs: dict[tuple[str, str], str]
) -> list[tuple[str, str, list[Row]]]:
    """(dotted section name, its docstring, its rows) for ``cls`` and every section nested
    in it, in the schema's order; a row is (key, type, default, range, meaning)."""
    hints = typing.get_type_hints(cls, vars(config))
    rows: list[Row] = []
    nested: list[tuple[str, str, list[Row]]] = []
    for f in fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        default = _default(f)
        if is_dataclass(default):
            nested += _sections(type(default), key, docs)
            continue
        meaning = docs.get((cls.__name__, f.name))
        if meaning is None:
            raise ValueError(f"schemas/config.py: {cls.__name__}.{f.name} has no docstring")
        shown = "required" if default is MISSING or default == "???" else _value(default)
        rng = _range(f, hints[f.name])
        row = (f"`{key}`", _type_name(hints[f.name]), shown, rng, _markdown(meaning))
        rows.append(row)
    own = (prefix or "top level", _markdown(cls.__doc__ or ""), rows)
    return [own, *nested] if rows else nested


def config_reference() -> str:
    """The Markdown of ``docs/config.md``: a table per config section."""
    docs = field_docs(Path(config.__file__).read_text())
    out = [HEADER.rstrip("\n")]
    for name, doc, rows in _sections(config.PipelineConfig, "", docs):
        out += ["", f"## `{name}`" if name != "top level" else "## Top level", ""]
        if doc:
            out += [doc, ""]
        out += ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
        out += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(out) + "\n"
