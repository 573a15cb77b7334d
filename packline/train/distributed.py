"""Data-parallel launch: torchrun for the local train stage, process groups from its env.

``train.nproc_per_node`` > 1 makes the train stage start itself again under torchrun
(``python -m torch.distributed.run --standalone``) with one process per rank; each rank
joins the process group from the environment torchrun sets (gloo on CPU, nccl on GPU).
When the stage is already running under a launcher (``WORLD_SIZE`` > 1, e.g. torchrun on
SLURM), it joins the group directly instead.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def launched() -> bool:
    """True inside a multi-process launch (torchrun set ``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout_s: int = 600) -> None:
    """Join the process group torchrun describes in the environment (idempotent)."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend(), timeout=timedelta(seconds=timeout_s))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(nproc_per_node: int, module: str, args: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` for one node: ``nproc_per_node`` copies of
    ``python -m module args``, rendezvous on a free local port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        module,
        *args,
    ]


def threads_per_rank(nproc_per_node: int) -> int:
    """CPU threads each rank may use without oversubscribing the machine."""
    return max(1, (os.cpu_count() or 1) // nproc_per_node)
