"""Packing algorithms on plain ints: no Energon, no NeMo-Run, no torch."""

from packline.packing.selection import (
    align_up,
    best_fit_decreasing,
    first_fit_decreasing,
    pack_fill,
)

__all__ = ["align_up", "best_fit_decreasing", "first_fit_decreasing", "pack_fill", "select_packs"]
