"""The values each setting may take, held once, on the field itself.

A numeric or list setting of the config (``schemas/config.py``) declares its range where it
is declared, with :func:`ranged` in place of a plain default::

    lr: float = ranged(1e-3, gt=0)
    val_fraction: float = ranged(0.05, ge=0, lt=1)
    forecast_buffer_sizes: list[int] = ranged(factory=lambda: [1, 16], nonempty=True, each_ge=1)

``load_config`` checks every range of every section at once (:func:`range_problems`), the
validate stage lists them, and ``docs/config.md`` shows them (:meth:`Range.text`): one home.
A float must also be finite wherever it is (``inf`` and ``nan`` pass no comparison a
setting means). ``None`` is a value of its own for an optional setting (``int | None``):
the range applies to the numbers.

    >>> Range(gt=0).problem(float("inf")), Range(gt=0).problem(float("nan"))
    ('must be a finite number > 0', 'must be a finite number > 0')
    >>> Range(ge=0, lt=1).problem(1.0), Range(ge=0, lt=1).text()
    ('must be in [0, 1)', 'in [0, 1)')
    >>> Range(nonempty=True, each_ge=1).problem([4, 0])
    'must be a list of values >= 1 (0 is not)'
    >>> Range(nonempty=True).problem([])
    'must be a non-empty list'
    >>> Range(ge=1).problem(None) is None, Range(gt=0).problem(3) is None
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

RANGE = "packline_range"
"""The key of a field's :class:`Range` in its ``metadata``."""


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Range:
    """Bounds of a number (``ge``/``gt`` below, ``le``/``lt`` above), or of a list: not
    empty, each item at least ``each_ge``."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    nonempty: bool = False
    each_ge: float | None = None

    def text(self) -> str:
        """The range as a reader writes it: ``> 0``, ``>= 1``, ``in [0, 1)``, ``non-empty,
        each >= 1``."""
        if self.nonempty or self.each_ge is not None:
            parts = ["non-empty"] if self.nonempty else []
            if self.each_ge is not None:
                parts.append(f"each >= {_num(self.each_ge)}")
            return ", ".join(parts)
        low = (self.ge, "[") if self.ge is not None else (self.gt, "(")
        high = (self.le, "]") if self.le is not None else (self.lt, ")")
        if low[0] is not None and high[0] is not None:
            return f"in {low[1]}{_num(low[0])}, {_num(high[0])}{high[1]}"
        if low[0] is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(low[0])}"
        if high[0] is not None:
            return f"{'<=' if self.le is not None else '<'} {_num(high[0])}"
        return "any"

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # a type OmegaConf already refused, or a list (see problem)
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (``must be ...``), or None when it is in range."""
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            if self.nonempty and not value:
                return "must be a non-empty list"
            if self.each_ge is not None:
                bad = [v for v in value if not Range(ge=self.each_ge).holds(v)]
                if bad:
                    return (
                        f"must be a list of values >= {_num(self.each_ge)} ({_num(bad[0])} is not)"
                    )
            return None
        if self.holds(value):
            return None
        text = self.text()
        if text == "any":
            return "must be a finite number"
        finite = not isinstance(value, float) or math.isfinite(value)
        return f"must be {text}" if finite else f"must be a finite number {text}"


def ranged(
    default: Any = MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    nonempty: bool = False,
    each_ge: float | None = None,
) -> Any:
    """A dataclass field with its default (or ``factory``) and its :class:`Range`."""
    meta = {RANGE: Range(ge=ge, gt=gt, le=le, lt=lt, nonempty=nonempty, each_ge=each_ge)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def field_range(f: Field) -> Range | None:
    """The range a field declares, None when it declares none."""
    return f.metadata.get(RANGE)


def _floats(f: Field) -> bool:
    return "float" in str(f.type)


def _shown(value: Any) -> str:
    """A value as YAML writes it (``null``, ``[1, 2]``)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_num(v) for v in value) + "]"
    return _num(value)


def _fix(key: str, rng: Range, default: Any) -> str:
    """What to set instead of a value out of ``rng``.

    >>> _fix("train.lr", Range(gt=0), 0.001)
    'set train.lr to a value > 0 (default 0.001)'
    >>> _fix("processor.max_pixels", Range(ge=1), None)
    'set processor.max_pixels to a value >= 1, or null (the default)'
    >>> _fix("packing.forecast_buffer_sizes", Range(nonempty=True, each_ge=1), [1, 16])
    'set packing.forecast_buffer_sizes to a non-empty list, each >= 1 (default [1, 16])'
    """
    text = rng.text()
    if rng.nonempty or rng.each_ge is not None:
        wanted = f"a {'non-empty ' if rng.nonempty else ''}list"
        if rng.each_ge is not None:
            wanted += f", each >= {_num(rng.each_ge)}"
    else:
        wanted = "a finite number" if text == "any" else f"a value {text}"
    if default is None:
        return f"set {key} to {wanted}, or null (the default)"
    return f"set {key} to {wanted} (default {_shown(default)})"


def range_problems(section: Any, prefix: str) -> list[str]:
    """One line per setting of ``section`` (a config dataclass whose settings are
    ``<prefix>.<name>``) out of its range, with the fix; a float setting must be finite
    whether it declares a range or not. Nested sections are not entered."""
    out: list[str] = []
    for f in fields(section):
        value = getattr(section, f.name)
        rng = field_range(f)
        if rng is None and _floats(f):
            rng = Range()  # finite, nothing more
        if rng is None:
            continue
        problem = rng.problem(value)
        if problem is None:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append(f"{key} {problem}, got {_shown(value)}; fix: {_fix(key, rng, default)}")
    return out
