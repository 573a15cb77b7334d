"""One rule for comparing recorded losses with a rerun's (the default run's golden losses,
the shipped tiny base's pretraining steps)."""

from __future__ import annotations

import pytest
import torch


def assert_losses_repeat(
    losses: list[float], recorded: list[float], *, where: dict, threads: int | None = None
) -> None:
    """``losses`` equal ``recorded`` bitwise when they ran on the machine kind that recorded
    them (``where``: its ``torch`` build, ``cpu_capability`` and ``threads``; ``threads``: the
    rerun's, default this process's), else to 1e-5 relative: another CPU instruction set or
    thread count sums in another order."""
    here = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads() if threads is None else threads,
    }
    assert len(losses) == len(recorded)
    if all(where[k] == v for k, v in here.items()):
        assert losses == recorded  # bitwise: floats read back from JSON exactly
    else:
        print(f"losses recorded on {where}, compared on {here}: to 1e-5, not bitwise")
        assert losses == pytest.approx(recorded, rel=1e-5)
