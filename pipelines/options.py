"""The checks of the CLI's own options (not the config's): an integer option out of its
range is a usage error (exit 2, argparse's message), and an option one benchmark reads is
refused on another."""

from __future__ import annotations

import argparse

from schemas.errors import UserError


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (a usage error, exit 2, otherwise).

    >>> int_in(0, 65535)("70000")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 70000 is not in 0..65535
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is not in {span}")
        return value

    return parse


#: The bench options that only one benchmark reads.
BENCH_ONLY = {
    "samples": "data",
    "small_samples": "data",
    "bridge_path": "cluster-memory",
    "smoke": "gpu",
    "models": "gpu",
    "noise": "train",
    "window": "train",
}


def add_bench_only_options(b: argparse.ArgumentParser) -> None:
    """The options of :data:`BENCH_ONLY` on ``packline bench``'s parser."""
    b.add_argument("--samples", type=int_in(1), help="bench data: conversations of the large "
                   "set (default 20,000; the small one is a quarter of it)")  # fmt: skip
    b.add_argument("--small-samples", type=int_in(1), help="bench data: conversations of the "
                   "small set (its first rows; default a quarter of --samples)")  # fmt: skip
    b.add_argument(
        "--bridge-path",
        help="bench cluster-memory: a dir holding Megatron-Bridge's data path, put first on "
        "the measured processes' PYTHONPATH (default: the installed Bridge)",
    )
    b.add_argument("--smoke", action="store_true", help="bench gpu: tiny sizes on the CPU")
    b.add_argument("--models", help="bench gpu: comma-separated models (default: all)")
    b.add_argument("--noise", action="store_true", help="bench train: a CPU-bound neighbour "
                   "process beside the second half of the windows, and the ratio quiet "
                   "against noisy")  # fmt: skip
    b.add_argument("--window", type=int_in(1), help="bench train: optimizer steps per window "
                   "of packed and unpacked training in turns (default 2)")  # fmt: skip


def train_bench_options(ns: argparse.Namespace) -> dict[str, object]:
    """``packline bench train``'s own options given on its command line."""
    return {"noise": ns.noise} | ({"window_steps": ns.window} if ns.window else {})


def refuse_misplaced_bench_options(ns: argparse.Namespace) -> None:
    """UserError (exit 2) naming each option given to a benchmark that does not read it."""
    misplaced = [
        f"--{opt.replace('_', '-')} applies to bench {what} only, not bench {ns.what}"
        for opt, what in BENCH_ONLY.items()
        if getattr(ns, opt) not in (None, False) and ns.what != what
    ]
    if misplaced:
        raise UserError(misplaced, "bench: an option this benchmark does not read")


def data_bench_sizes(ns: argparse.Namespace) -> dict[str, int]:
    """``packline bench data``'s set sizes given on its command line."""
    sizes = {"num_samples": ns.samples} if ns.samples else {}
    return sizes | ({"small_samples": ns.small_samples} if ns.small_samples else {})


def gpu_bench_argv(ns: argparse.Namespace) -> list[str]:
    """``packline bench gpu``'s options as ``python -m packline.bench.gpu`` takes them."""
    argv = ["--smoke"] if ns.smoke else []
    argv += ["--json"] if ns.json else []
    return argv + (["--models", ns.models] if ns.models else [])
