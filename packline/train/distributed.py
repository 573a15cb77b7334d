"""Data parallelism: torchrun for the local train stage, process groups from its env, and
the few collectives the trainer uses (each a no-op without a process group).

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


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout_s: int = 600) -> None:
    """Join the process group torchrun describes in the environment (idempotent). On CPU,
    unless ``OMP_NUM_THREADS`` says otherwise, the node's cores are shared between its
    ranks (a launcher such as torchrun on SLURM starts them all on one node)."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
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


# -- collectives (no-ops without a process group) ---------------------------------------------


def rank_world() -> tuple[int, int]:
    """(this rank, number of ranks); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` (None: all) in place, through the GPU when the
    backend is nccl."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            on_gpu = t.cuda()
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM, group=group)
            t.copy_(on_gpu.cpu())
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def broadcast_object(value, src: int = 0):
    """``value`` of rank ``src`` on every rank (``value`` itself without a process group).

    >>> broadcast_object({"step": 3})
    {'step': 3}
    """
    if dist.is_available() and dist.is_initialized():
        box = [value if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    return value


def all_gather_object(value, group=None) -> list:
    """``value`` of every rank of ``group`` (None: all), in rank order (a one-element list
    without a process group).

    >>> all_gather_object({"step": 3})
    [{'step': 3}]
    """
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out
    return [value]


def sum_grads_over_ranks(params: list[torch.Tensor], group=None) -> None:
    """Sum (never average) the gradients of ``params`` over the ranks of ``group`` (None:
    all), in one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or rank_world()[1] == 1:
        return
    if group is not None and dist.get_world_size(group) == 1:
        return
    flat = all_reduce_sum(torch.cat([g.flatten() for g in grads]), group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def weights_checksum(params: list[torch.Tensor]) -> float:
    """A float64 checksum of ``params`` (position-weighted, so swapped values change it).

    >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0])
    >>> weights_checksum([a]) == weights_checksum([b])
    False
    """
    total = 0.0
    for i, p in enumerate(params, start=1):
        flat = p.detach().double().flatten()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        total += i * float((flat * weights).sum())
    return total


def check_replicas(params: list[torch.Tensor], *, step: int) -> list[float]:
    """Every rank's :func:`weights_checksum` of ``params`` (empty on one rank); raises
    ``RuntimeError`` when the data-parallel replicas no longer hold the same weights."""
    if rank_world()[1] == 1:
        return []
    sums = all_gather_object(weights_checksum(params))
    if len(set(sums)) != 1:
        raise RuntimeError(
            f"data-parallel replicas diverged after step {step}: weight checksums per rank "
            f"{sums}; gradients must be summed identically on every rank"
        )
    return sums


def rank_device() -> torch.device:
    """This rank's GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
