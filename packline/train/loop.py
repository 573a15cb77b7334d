"""The embedded training loop: Qwen3-VL + PEFT LoRA on packed (or padded) rows.

One optimizer step consumes ``global_batch_size`` packed rows across all data-parallel
ranks. Packing off lays the *very same conversations* of each step out as padded
micro-batches of ``unpacked_micro_batch_size``: with the per-token loss below, both modes
then compute the same gradient, so the A/B compares cost alone (a loss or accuracy gap
between them would be a bug, not a finding).

Loss: Σ token losses / number of target tokens of the whole global batch (all micro-batches
on all ranks), with gradients summed (never averaged) across ranks — the only normalization
under which packing is invisible.

Data parallel: under ``torch.distributed`` (torchrun; gloo on CPU, nccl on GPU) each rank
reads its own shard of the stream (Energon ``WorkerConfig`` rank / world size), the step's
counters are summed over ranks, and after every optimizer step the ranks compare a checksum
of their trainable weights — replicas that drift apart stop the run instead of training on.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from packline.counters import FlopsModel, PackCounts, RunningCounters
from packline.energon.loader import train_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.packing.ledger import Ledger
from packline.packing.thd import PackedBatch, build_padded_batch, to_device
from packline.qwen.forward import packed_forward, padded_forward, token_loss_sum

CHECKPOINT_PREFIX = "step_"
FAULT_ENV = "PACKLINE_FAULT"  # test hook: "kill_in_checkpoint:<step>" SIGKILLs mid-write


@dataclass(kw_only=True)
class LoopSettings:
    """Plain values the loop needs (picklable, rank-independent)."""

    packed: bool
    max_steps: int
    global_batch_size: int
    unpacked_micro_batch_size: int
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    seed: int
    save_every: int
    precision: str  # auto | bf16 | fp32 (see schemas.config.Precision)
    keep_last: int
    num_workers: int
    packing_buffer_size: int
    encoder_mode: str
    packing: PackingSettings


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether training forwards run under bf16 autocast on ``device`` for ``precision``
    (``auto``: on a GPU that has bf16; ``bf16``: everywhere, an error on a GPU without it;
    ``fp32``: never).

    >>> use_bf16("auto", torch.device("cpu")), use_bf16("bf16", torch.device("cpu"))
    (False, True)
    """
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}: use auto, bf16 or fp32")
    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "bf16" and device.type == "cuda" and not gpu_bf16:
        raise ValueError(
            f"train.precision=bf16 but {torch.cuda.get_device_name(device)} has no bf16: "
            "use train.precision=fp32 (or auto)"
        )
    return precision == "bf16" or (precision == "auto" and gpu_bf16)


def dist_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place (through the GPU when the backend is nccl)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            on_gpu = t.cuda()
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            t.copy_(on_gpu.cpu())
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _all_gather(value) -> list:
    """``value`` of every rank (a one-element list without a process group)."""
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]


def _sum_counts(counts: PackCounts) -> PackCounts:
    """``counts`` summed over all ranks (exact: float64 holds these integers)."""
    names = [f.name for f in fields(PackCounts)]
    t = _all_reduce(torch.tensor([getattr(counts, n) for n in names], dtype=torch.float64))
    return PackCounts(**{n: int(v) for n, v in zip(names, t.tolist(), strict=True)})


def lr_lambda(step: int, *, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    counts: PackCounts  # summed over ranks
    rank_real_tokens: list[int] = field(default_factory=list)
    rank_flops: list[int] = field(default_factory=list)  # useful FLOPs per rank
    keys_by_rank: list[list[str]] = field(default_factory=list)
    row_real_tokens: list[int] = field(default_factory=list)
    """Real tokens of each row as laid out (all ranks): packed rows, or one per
    conversation when packing is off."""
    weights_checksums: list[float] = field(default_factory=list)  # per rank, after the step
    data_seconds: float = 0.0
    """Of ``seconds`` on rank 0: waiting for the step's rows (reading, tokenizing, packing,
    image decoding and processing, unless loader workers did it ahead)."""
    vision_seconds: float = 0.0
    """Of ``seconds`` on rank 0: the vision tower's forwards (the same work packed or not)."""

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.keys_by_rank for k in keys]


class Trainer:
    """Trains one run (packing on or off) from the prepared dataset and processor dir."""

    def __init__(
        self,
        model,
        *,
        settings: LoopSettings,
        dataset_dir: Path,
        processor_dir: Path,
        run_dir: Path,
        flops_model: FlopsModel,
        image_token_id: int,
        pad_token_id: int,
    ):
        self.model = model
        self.s = settings
        self.run_dir = Path(run_dir)
        self.rank, self.world = dist_rank_world()
        if settings.global_batch_size % self.world:
            raise ValueError(
                f"train.global_batch_size {settings.global_batch_size} is not divisible by "
                f"the {self.world} data-parallel ranks"
            )
        self.rows_per_rank = settings.global_batch_size // self.world
        self.flops_model = flops_model
        self.image_token_id = image_token_id
        self.pad_token_id = pad_token_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.bf16 = use_bf16(settings.precision, self.device)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, weight_decay=settings.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_lambda(step, warmup=settings.warmup_steps, total=settings.max_steps),
        )
        encoder = make_encoder(settings.encoder_mode, processor_dir, settings.packing)
        self.loader = train_loader(
            dataset_dir,
            encoder,
            packing_buffer_size=settings.packing_buffer_size,
            rank=self.rank,
            world_size=self.world,
            num_workers=settings.num_workers,
            repeat=True,
            shuffle_buffer_size=100,
            max_samples_per_sequence=100,
            seed_offset=settings.seed,
        )
        self._rows = None
        self._vision_seconds = 0.0
        self._time_vision(model)
        self.step = 0
        self.counters = RunningCounters.fresh()
        self.ledger = Ledger()

    def _time_vision(self, model) -> None:
        """Time the vision tower's forwards with module hooks (synchronized on a GPU)."""
        tower = next((m for n, m in model.named_modules() if n.endswith("visual")), None)
        if tower is None:
            return
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        started: list[float] = []

        def before(_module, _args):
            sync()
            started.append(time.perf_counter())

        def after(_module, _args, _out):
            sync()
            self._vision_seconds += time.perf_counter() - started.pop()

        tower.register_forward_pre_hook(before)
        tower.register_forward_hook(after)

    # -- data -------------------------------------------------------------------------------

    def _next_rows(self) -> list[PackedBatch]:
        if self._rows is None:
            self._rows = iter(self.loader)
        rows = []
        while len(rows) < self.rows_per_rank:
            batch = next(self._rows).batch
            self.ledger.add(seen=batch.seen, packed=batch.num_conversations, dropped=batch.dropped)
            if batch.num_conversations:  # rows that only carry ledger entries are skipped
                rows.append(batch)
        return rows

    # -- one optimizer step -----------------------------------------------------------------

    def micro_batches(self, rows: list[PackedBatch]) -> list:
        """The step's micro-batches: the packed rows themselves, or (packing off) the same
        conversations right-padded in groups of ``unpacked_micro_batch_size``."""
        if self.s.packed:
            return rows
        convs = [c for row in rows for c in row.conversations()]
        k = self.s.unpacked_micro_batch_size
        return [
            build_padded_batch(convs[i : i + k], pad_token_id=self.pad_token_id)
            for i in range(0, len(convs), k)
        ]

    def accumulate_gradients(self, micro: list) -> tuple[float, int]:
        """Backward of Σ token loss / global target count over ``micro`` (all ranks);
        gradients summed across ranks. Returns (global mean token loss, global targets)."""
        local_targets = sum(m.num_loss_tokens for m in micro)
        global_targets = int(_all_reduce(torch.tensor([local_targets], dtype=torch.float64)).item())
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in micro:
            m = to_device(m, self.device)
            forward = packed_forward if self.s.packed else padded_forward
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = forward(self.model, m, image_token_id=self.image_token_id)
            loss_sum, _ = token_loss_sum(logits, m.labels)
            (loss_sum / global_targets).backward()
            loss_total += loss_sum.detach().double()
        loss_total = loss_total.cpu()
        if self.world > 1:  # sum, never average: the loss is already divided globally
            grads = [p.grad for p in self.params if p.grad is not None]
            flat = _all_reduce(torch.cat([g.flatten() for g in grads]))
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        loss_total = _all_reduce(loss_total)
        return float(loss_total.item() / global_targets), global_targets

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        self.model.train()
        self._vision_seconds = 0.0
        rows = self._next_rows()
        data_seconds = time.perf_counter() - t0
        counts = PackCounts()
        for row in rows:
            counts = counts + PackCounts.of(row, self.flops_model, self.s.packing.seq_length)
        micro = self.micro_batches(rows)
        if not self.s.packed:  # the padded layout executes (and wastes) more
            counts.rows = sum(m.input_ids.shape[0] for m in micro)  # one per conversation
            counts.padded_tokens = sum(m.num_padded_tokens for m in micro)
            counts.flops_nominal = sum(self.flops_model.nominal(m.input_ids.numel()) for m in micro)
            counts.flops_executed = sum(
                self.flops_model.executed(
                    [m.input_ids.shape[1]] * m.input_ids.shape[0],
                    [
                        tuple(g)
                        for g in (m.image_grid_thw.tolist() if m.image_grid_thw is not None else [])
                    ],
                )
                for m in micro
            )
        loss, _ = self.accumulate_gradients(micro)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.s.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        gathered = _all_gather(
            (
                counts.tokens_real,
                counts.flops_useful,
                [k for row in rows for k in row.keys],
                (
                    [row.num_real_tokens for row in rows]
                    if self.s.packed
                    else [n for row in rows for n in row.seq_lens]
                ),
            )
        )
        checksums = self.check_replicas()
        total = _sum_counts(counts)
        self.counters.add(total)
        return StepResult(
            step=self.step,
            loss=loss,
            lr=lr,
            grad_norm=float(grad_norm),
            seconds=time.perf_counter() - t0,
            counts=total,
            rank_real_tokens=[g[0] for g in gathered],
            rank_flops=[g[1] for g in gathered],
            keys_by_rank=[g[2] for g in gathered],
            row_real_tokens=[n for g in gathered for n in g[3]],
            weights_checksums=checksums,
            data_seconds=data_seconds,
            vision_seconds=self._vision_seconds,
        )

    def weights_checksum(self) -> float:
        """A float64 checksum of the trainable weights (position-weighted, so swapped
        values change it too)."""
        total = 0.0
        for i, p in enumerate(self.params, start=1):
            flat = p.detach().double().flatten()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
            total += i * float((flat * weights).sum())
        return total

    def check_replicas(self) -> list[float]:
        """Every rank's weights checksum; raises if the data-parallel ranks no longer hold
        the same weights."""
        if self.world == 1:
            return []
        sums = _all_gather(self.weights_checksum())
        if len(set(sums)) != 1:
            raise RuntimeError(
                f"data-parallel replicas diverged after step {self.step}: weight checksums "
                f"per rank {sums}; gradients must be summed identically on every rank"
            )
        return sums

    # -- checkpoints ------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN`` atomically (temp dir, then rename); keep the
        last ``keep_last``."""
        root = self.run_dir / "checkpoints"
        final = root / f"{CHECKPOINT_PREFIX}{self.step:06d}"
        tmp = root / f".tmp-{CHECKPOINT_PREFIX}{self.step:06d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        torch.save(self.loader.save_state_rank(), tmp / f"loader_rank{self.rank:03d}.pt")
        torch.save(_rng_state(), tmp / f"rng_rank{self.rank:03d}.pt")
        (tmp / f"ledger_rank{self.rank:03d}.json").write_text(json.dumps(self._ledger_state()))
        barrier()
        if self.rank == 0:
            torch.save(self.trainable_state(), tmp / "adapter.pt")
            _maybe_fault("kill_in_checkpoint", self.step)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            state = {
                "step": self.step,
                "counters": self.counters.state_dict(),
                "world_size": self.world,
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
            os.replace(tmp, final)
            done = sorted(root.glob(f"{CHECKPOINT_PREFIX}*"))
            for old in done[: -self.s.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def resume(self) -> int:
        """Load the latest complete checkpoint, if any; returns its step (0 when fresh)."""
        root = self.run_dir / "checkpoints"
        done = sorted(root.glob(f"{CHECKPOINT_PREFIX}*")) if root.is_dir() else []
        if not done:
            return 0
        ckpt = done[-1]
        state = json.loads((ckpt / "state.json").read_text())
        if state["world_size"] != self.world:
            raise ValueError(
                f"{ckpt} was written by {state['world_size']} ranks, this run has {self.world}: "
                "the loader state is per rank"
            )
        adapter = torch.load(ckpt / "adapter.pt")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in adapter:
                    p.copy_(adapter[n])
        self.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt"))
        self.scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt"))
        self.loader.restore_state_rank(
            torch.load(ckpt / f"loader_rank{self.rank:03d}.pt", weights_only=False)
        )
        _set_rng_state(torch.load(ckpt / f"rng_rank{self.rank:03d}.pt", weights_only=False))
        self.step = state["step"]
        self.counters.load_state_dict(state["counters"])
        led = json.loads((ckpt / f"ledger_rank{self.rank:03d}.json").read_text())
        self.ledger = Ledger(seen=led["seen"], packed=led["packed"])
        self.ledger.dropped.update(led["dropped"])
        return self.step

    def _ledger_state(self) -> dict:
        """This rank's ledger as of the checkpoint. Samples seen but still waiting in a
        packing buffer are left out of ``seen``: Energon restores its buffers by encoding
        those samples again, which counts them a second time."""
        return {
            "seen": self.ledger.packed + self.ledger.num_dropped,
            "packed": self.ledger.packed,
            "dropped": dict(self.ledger.dropped),
        }

    def ledger_metrics(self) -> dict[str, float]:
        """``data/*`` of all ranks together."""
        merged = Ledger()
        for led in _all_gather(self.ledger):
            merged = merged.merge(led)
        return merged.to_metrics()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _maybe_fault(kind: str, step: int) -> None:
    """Fault injection for the resume tests: a real SIGKILL at a chosen point."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec == f"{kind}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
