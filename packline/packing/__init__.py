"""Packing algorithms on plain ints: no Energon, no NeMo-Run, no torch."""

from packline.packing.forecast import Forecast, simulate_packing
from packline.packing.selection import (
    ALGORITHMS,
    align_up,
    best_fit_decreasing,
    first_fit_decreasing,
    pack_fill,
    select_packs,
)

__all__ = [
    "ALGORITHMS",
    "Forecast",
    "align_up",
    "best_fit_decreasing",
    "first_fit_decreasing",
    "pack_fill",
    "select_packs",
    "simulate_packing",
]
