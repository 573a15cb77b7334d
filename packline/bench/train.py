"""``packline bench train``'s measurement: packing on and off trained in turns, window by
window, in one process, so load that comes and goes lands on both.

Two :class:`~packline.train.trainer.Trainer` (packed, unpacked) start together; then, for
each window of ``window_steps`` optimizer steps, one trains its window and the other trains
the same window (the same conversations: both read the same stream, step for step), the one
that goes first alternating from window to window. Each run's figures come from its own
step records (:func:`packline.report.summary.summarize_run` with the same windows), so the
packed ÷ unpacked ratio of window k compares two stretches of time seconds apart.

With ``noise`` a CPU-bound neighbour process (a Python loop) runs beside the second half of
the windows: the ratio over the quiet half and over the noisy half, both measured here,
show whether the figure follows packing or the machine's load (:data:`NOISE_TOLERANCE`).
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packline.progress import console, progress
from packline.report.summary import RUNS, PackingComparison, Target

NOISE_TOLERANCE = 0.15
"""``bench train --noise``'s target: the packed ÷ unpacked ratio with the neighbour within
this share of the quiet ratio measured in the same invocation."""

NEIGHBOUR = "import packline.dies_with_parent\nwhile True:\n    pass\n"
"""The neighbour's program: one core kept busy until the bench ends it (or ends)."""


@dataclass(kw_only=True)
class Interleaved:
    """What one interleaved bench measured."""

    pair: PackingComparison
    window_steps: int
    noisy_from: int | None
    """The first window the neighbour ran beside (None: no neighbour)."""

    def _half(self, noisy: bool, per_cpu_s: bool) -> float:
        """The median of the window-by-window packed ÷ unpacked ratios over the quiet (or
        the noisy) windows: each ratio is of two runs seconds apart in time."""
        first, last = (self.noisy_from, None) if noisy else (0, self.noisy_from)
        ratios = [r for r in self.pair.window_speedups(per_cpu_s)[first:last] if r == r]
        return statistics.median(ratios) if ratios else math.nan

    def noise_figures(self) -> dict[str, float]:
        """The ratios quiet and noisy, wall-clock and per CPU-second, and each noisy ÷ quiet."""
        out: dict[str, float] = {}
        for key, per_cpu_s in (("wall", False), ("cpu", True)):
            quiet, noisy = self._half(False, per_cpu_s), self._half(True, per_cpu_s)
            out[f"quiet_{key}"], out[f"noisy_{key}"] = quiet, noisy
            out[f"noisy_over_quiet_{key}"] = noisy / quiet if quiet else math.nan
        return out

    def targets(self) -> dict[str, Target]:
        """The pair's targets and, with a neighbour, the ratio's hold under its load."""
        targets = self.pair.targets()
        if self.noisy_from is not None:
            shift = self.noise_figures()["noisy_over_quiet_wall"]
            targets["noise"] = Target(
                held=abs(shift - 1) <= NOISE_TOLERANCE,
                value=shift,
                rule=f"packed ÷ unpacked real tokens/s with a CPU-bound neighbour ÷ the quiet "
                f"ratio within 1 ± {NOISE_TOLERANCE:g}",
            )
        return targets

    def to_dict(self) -> dict[str, Any]:
        """``bench train --json``: the pair side by side, the windows, the noise figures and
        every target."""
        out = self.pair.side_by_side()
        out["window_steps"] = self.window_steps
        out["noisy_from_window"] = self.noisy_from
        if self.noisy_from is not None:
            out["noise"] = self.noise_figures()
        out["targets"] = {name: asdict(t) for name, t in self.targets().items()}
        return out


def _neighbour() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=subprocess.DEVNULL)


def train_interleaved(
    cfg,
    *,
    dataset_path: Path,
    processor_dir: Path,
    lengths_path: Path,
    out_dir: Path,
    window_steps: int,
    noise: bool = False,
) -> Interleaved:
    """Train ``cfg``'s runs packed and unpacked from scratch under ``out_dir`` (``packed/``,
    ``unpacked/``: step and eval records, no MLflow), in turns of ``window_steps`` steps,
    with (``noise``) a CPU-bound neighbour beside the second half of the windows."""
    from packline.qwen.processor import load_processor  # torch: import on use
    from packline.tracking import Tracker
    from packline.train.distributed import rank_device
    from packline.train.evaluate import EvalMemo
    from packline.train.setup import build_trainer

    if cfg.train.nproc_per_node != 1:
        raise ValueError(
            "bench train interleaves packing on and off in one process: it needs "
            f"train.nproc_per_node=1, not {cfg.train.nproc_per_node}"
        )
    windows = math.ceil(cfg.train.max_steps / window_steps)
    noisy_from = windows // 2 if noise else None
    if noise and noisy_from == 0:
        raise ValueError(
            f"bench train --noise needs at least 2 windows: train.max_steps "
            f"{cfg.train.max_steps} in windows of {window_steps} steps gives {windows}"
        )
    processor = load_processor(processor_dir)
    memo = EvalMemo(out_dir / "start_eval.json", key="bench train")
    memo.path.unlink(missing_ok=True)  # from scratch, as the runs
    trainers = {}
    for name in RUNS:
        run_dir = out_dir / name
        shutil.rmtree(run_dir, ignore_errors=True)  # from scratch: no resume
        run_dir.mkdir(parents=True)
        trainers[name] = build_trainer(
            cfg,
            processor,
            packed=name == "packed",
            dataset_path=dataset_path,
            processor_dir=processor_dir,
            lengths_path=lengths_path,
            run_dir=run_dir,
            device=rank_device(),
            tracker=Tracker.disabled(),
            eval_memo=memo,
        )
    for trainer in trainers.values():
        trainer.begin()
    neighbour = None
    try:
        with progress() as bar:
            task = bar.add_task("bench train: packed and unpacked in turns", total=windows)
            for k in range(windows):
                if k == noisy_from:
                    console.log(f"bench train: a CPU-bound neighbour from window {k + 1}")
                    neighbour = _neighbour()
                for name in RUNS if k % 2 == 0 else RUNS[::-1]:
                    trainers[name].advance(window_steps)
                bar.update(task, completed=k + 1)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    summaries = [t.summary(t.finish(), window_steps=window_steps) for t in trainers.values()]
    return Interleaved(
        pair=PackingComparison.of(summaries), window_steps=window_steps, noisy_from=noisy_from
    )
