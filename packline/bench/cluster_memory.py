"""``bench cluster-memory``'s measurement: one loader worker's peak RSS over one epoch of the
train split, packing with Bridge's own Qwen-VL encoder (eager: every buffered sample
processed before selection) or packline's encoder in Bridge (lazy: keys and lengths
buffered). Needs Megatron-Bridge's data path importable (the container's Bridge, or Bridge
main's vendored data modules on ``PYTHONPATH``: ``make bench WHAT=cluster-memory``).

Each measurement runs in its own process (a fresh loader worker, nothing left over from the
one before), started by :func:`run_all`::

    python -m packline.bench.cluster_memory {bridge,packline} BUFFER CONFIG [key=value ...]

prints one JSON object on its last line: the packer, the buffer, rows and samples of the
epoch, and the worker's peak and starting RSS (MiB,
:class:`~packline.bench.processes.WorkerRss`). The parent imports pandas either way before
the worker forks, as a training process has it loaded, so both packers' workers start
alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

#: What the default set is prepared and measured with for the cluster path.
MEGATRON = ("train.backend=megatron", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
#: The runs, each in its own process, in this order, once per round.
RUNS = (("bridge", 16), ("packline", 256), ("packline", 16))


def run_all(
    config: str | Path | None,
    settings: list[str],
    *,
    bridge_path: str | Path | None = None,
    rounds: int = 2,
) -> dict[str, Any]:
    """Every run of :data:`RUNS`, ``rounds`` times alternating, each in a fresh process with
    ``bridge_path`` (Megatron-Bridge's data path) first on its ``PYTHONPATH``: the runs, the
    mean per packer and buffer, and the target (packline's lazy encoder at buffer 256 within
    Bridge's eager one at 16)."""
    from packline.progress import console
    from schemas.config import DEFAULT_CONFIG, PROJECT_ROOT

    paths = [str(p) for p in (bridge_path, PROJECT_ROOT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        for packer, buffer in RUNS:
            console.log(f"round {r + 1}/{rounds}: {packer} @ {buffer}, one loader worker")
            cmd = [sys.executable, "-m", __name__, packer, str(buffer)]
            cmd += [str(config or DEFAULT_CONFIG), *settings]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            last = done.stdout.strip().splitlines()[-1]  # Energon may print before it
            runs.setdefault(f"{packer}@{buffer}", []).append(json.loads(last))
    keys = ("peak_mb", "start_mb", "rows", "samples")
    mean = {
        name: {k: sum(f[k] for f in figures) / len(figures) for k in keys}
        for name, figures in runs.items()
    }
    ratio = mean["packline@256"]["peak_mb"] / mean["bridge@16"]["peak_mb"]
    target = {
        "held": ratio <= 1.0,
        "value": ratio,
        "rule": "<= 1x bridge@16 (Bridge's eager encoder at the cluster configs' buffer)",
    }
    return {"runs": runs, "mean": mean, "targets": {"worker_rss.packline@256": target}}


def measure(packer: str, buffer: int, config: str, overrides: list[str]) -> dict:
    """One epoch through one loader worker; its peak RSS."""
    import pandas  # noqa: F401  (see the module docstring)
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from packline.bench.processes import WorkerRss
    from packline.megatron.dataset import bridge_dataset, bridge_stock_encoder
    from schemas.config import load_config

    dataset = bridge_dataset(load_config(config, overrides))
    dataset.packing_buffer_size = buffer
    if packer == "bridge":
        encoder = bridge_stock_encoder(dataset)
    elif packer == "packline":
        encoder = dataset.build_task_encoder()
    else:
        raise ValueError(f"unknown packer {packer!r}: bridge or packline")
    loader = get_savable_loader(
        get_train_dataset(
            dataset.path,
            split_part="train",
            batch_size=1,
            task_encoder=encoder,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=1),
            packing_buffer_size=buffer,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            repeat=False,
        )
    )
    rows = samples = 0
    with WorkerRss() as rss:
        for batch in loader:
            rows += 1
            samples += len(batch["__keys__"])
            rss.sample()
    return {
        "packer": packer,
        "buffer": buffer,
        "rows": rows,
        "samples": samples,
        "peak_mb": rss.peak_mb,
        "start_mb": rss.start_mb or 0.0,
    }


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    figures = measure(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    print(f"\n{json.dumps(figures)}")
