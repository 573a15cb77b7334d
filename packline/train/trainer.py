"""The embedded trainer: Qwen3-VL + PEFT LoRA on packed (or padded) rows.

:class:`Trainer` owns one training run. It is built from typed settings
(:class:`TrainerSettings`) and its components — the training stream
(:class:`~packline.train.data.TrainStream`), the evaluator
(:class:`~packline.train.evaluate.Evaluator`), the checkpointer
(:class:`~packline.train.checkpoint.Checkpointer`), the FLOPs counters
(:func:`~packline.counters.layout_counts`) and the collectives
(:mod:`packline.train.distributed`) — and :meth:`Trainer.train` runs the loop:
resume → evaluate at step 0 → :meth:`Trainer.train_step` until ``max_steps``, checkpointing
every ``save_every`` and evaluating every ``eval_every`` steps → last checkpoint → final
evaluation. Each step is appended to ``<run_dir>/metrics.jsonl`` and each evaluation to
``eval.jsonl`` (:mod:`packline.train.records`), and logged to MLflow through a
:class:`~packline.tracking.Tracker`.

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
Rank 0 evaluates, logs and writes the records.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from packline import metrics as names
from packline.counters import (
    FlopsModel,
    PackCounts,
    RunningCounters,
    layout_counts,
    layout_metrics,
    row_fills,
)
from packline.energon.packing import PackingSettings
from packline.flops import mfu
from packline.packing.ledger import Ledger
from packline.packing.thd import PackedBatch, build_padded_batch
from packline.progress import console, progress
from packline.qwen.forward import conversation_weights
from packline.report.summary import RunSummary, summarize_run
from packline.tracking import Tracker
from packline.train.checkpoint import AdapterState, Checkpointer, OptimizerState, Pickled
from packline.train.data import StreamSettings, TrainStream
from packline.train.distributed import all_gather_object, barrier, rank_world
from packline.train.engine import DataParallelEngine, Engine, router_metrics
from packline.train.evaluate import EvalMemo, EvalResult, Evaluator, weights_digest
from packline.train.layout import count_once
from packline.train.records import append_record, drop_torn_tail, read_records
from schemas.layout import ParallelLayout

METRICS_LOG = "metrics.jsonl"
EVAL_LOG = "eval.jsonl"


@dataclass(kw_only=True)
class TrainerSettings:
    """What one run needs besides its model and paths (picklable, rank-independent)."""

    packed: bool
    """Packing on (THD rows) or off (the same conversations, padded)."""
    max_steps: int
    global_batch_size: int
    """Packed rows per optimizer step, over all data-parallel ranks."""
    unpacked_micro_batch_size: int
    """Packing off: conversations per padded micro-batch."""
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    betas: tuple[float, float]
    """AdamW's (beta1, beta2)."""
    seed: int
    precision: str
    """``auto`` | ``bf16`` | ``fp32`` (see :func:`use_bf16`)."""
    loss_chunk_tokens: int
    """Row positions whose logits exist at once in the loss."""
    per_sample: bool
    """``train.loss: sample``: each conversation's mean token loss, averaged over the global
    batch's conversations (else Σ token loss ÷ its target tokens)."""
    save_every: int
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int
    eval_every: int
    """Evaluate every N steps besides the start and the end (0: only those)."""
    eval_samples: int
    """Val questions answered per evaluation (0: eval loss only)."""
    stream: StreamSettings
    moe_aux_loss_coef: float = 0.0
    """MoE: weight of the load-balancing loss over each micro-batch's real tokens."""

    @property
    def packing(self) -> PackingSettings:
        return self.stream.packing

    @classmethod
    def from_config(cls, cfg, *, packed: bool, lengths_path: Path | None) -> TrainerSettings:
        """The settings of ``cfg`` (a :class:`schemas.config.PipelineConfig`);
        ``lengths_path``: connect's lengths table (FLOPs balance reads it)."""
        t = cfg.train
        return cls(
            packed=packed,
            max_steps=t.max_steps,
            global_batch_size=t.global_batch_size,
            unpacked_micro_batch_size=t.unpacked_micro_batch_size,
            lr=t.lr,
            warmup_steps=t.warmup_steps,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            betas=(t.adam_beta1, t.adam_beta2),
            precision=t.precision.value,
            loss_chunk_tokens=t.loss_chunk_tokens,
            per_sample=t.loss.value == "sample",
            seed=t.seed,
            save_every=t.save_every,
            keep_last=t.keep_last,
            eval_every=t.eval_every,
            eval_samples=t.eval_samples,
            moe_aux_loss_coef=t.moe_aux_loss_coef,
            stream=StreamSettings(
                packing=PackingSettings.from_config(
                    cfg.packing, seed=t.seed, lengths_path=lengths_path
                ),
                encoder_mode=cfg.packing.encoder.value,
                packing_buffer_size=cfg.packing.packing_buffer_size,
                shuffle_buffer_size=t.shuffle_buffer_size,
                max_samples_per_sequence=t.max_samples_per_sequence,
                num_workers=t.num_workers,
                seed=t.seed,
            ),
        )


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


def lr_lambda(step: int, *, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine to 0 at ``total``.

    >>> [round(lr_lambda(s, warmup=2, total=6), 3) for s in range(7)]
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _sum_counts(counts: PackCounts, layout: ParallelLayout, rank: int) -> PackCounts:
    """``counts`` summed once per data-parallel index (exact: float64 holds these
    integers; the stages of a pipeline read the same rows, only stage 0 counts them)."""
    names = [f.name for f in fields(PackCounts)]
    values = torch.tensor([getattr(counts, n) for n in names], dtype=torch.float64)
    t = count_once(values, layout, rank)
    return PackCounts(**{n: int(v) for n, v in zip(names, t.tolist(), strict=True)})


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
    cpu_seconds: float = 0.0
    """CPU time of the step summed over the ranks' processes, every thread of each."""
    router: dict[str, float] = field(default_factory=dict)
    """``moe/*`` of the step over every rank (MoE only)."""

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.keys_by_rank for k in keys]


@dataclass
class RunOutcome:
    """What :meth:`Trainer.train` leaves besides its records (rank 0's view)."""

    ranks: int
    precision: str
    """``bf16`` or ``fp32``: what ``train.precision`` resolved to on this device."""
    chance: float
    """Accuracy by guessing on the questions asked (nan without questions)."""
    chance_by_kind: dict[str, float]
    ran: dict[str, str] = field(default_factory=dict)
    """What trained (:meth:`Trainer.what_ran`)."""


class Trainer:
    """Trains one run (packing on or off) from the prepared dataset and processor dir."""

    def __init__(
        self,
        model,
        *,
        settings: TrainerSettings,
        dataset_path: Path,
        processor_dir: Path,
        run_dir: Path,
        flops_model: FlopsModel,
        image_token_id: int,
        pad_token_id: int,
        evaluator: Evaluator | None = None,
        video_token_id: int | None = None,
        tracker: Tracker | None = None,
        device_name: str = "cpu",
        layout: ParallelLayout | None = None,
        engine: Engine | None = None,
        eval_model=None,
        eval_memo: EvalMemo | None = None,
    ):
        self.s = settings
        self.run_dir = Path(run_dir)
        self.rank, self.world = rank_world()
        self.layout = layout or ParallelLayout(world=self.world)
        if self.layout.world != self.world:
            raise ValueError(f"a layout of {self.layout.world} ranks on {self.world} ranks")
        problems = self.layout.problems(rows_per_step=settings.global_batch_size)
        if problems:
            raise ValueError("; ".join(problems))
        self.coords = self.layout.coords(self.rank)
        self.rows_per_rank = settings.global_batch_size // self.layout.data
        self.flops_model = flops_model
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.pad_token_id = pad_token_id
        self.evaluator = evaluator
        self.tracker = tracker or Tracker.disabled()
        self.device_name = device_name
        self.device = next(p for p in model.parameters() if p.requires_grad).device
        self.bf16 = use_bf16(settings.precision, self.device)
        self.engine = engine or DataParallelEngine(
            model,
            self.layout,
            rank=self.rank,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
            bf16=self.bf16,
            aux_loss_coef=settings.moe_aux_loss_coef,
            loss_chunk_tokens=settings.loss_chunk_tokens,
            per_sample=settings.per_sample,
        )
        self.model = self.engine.model
        self.params = self.engine.params
        self.eval_model = eval_model
        """Rank 0's one-process model for evaluation and export when the training model is
        split over ranks (EP, PP); None when every rank holds the whole model."""
        self.eval_memo = eval_memo
        """Where the step-0 evaluation is kept for a run that starts from the same weights."""
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_lambda(step, warmup=settings.warmup_steps, total=settings.max_steps),
        )
        self.stream = TrainStream(
            settings.stream,
            dataset_path=dataset_path,
            processor_dir=processor_dir,
            rank=self.coords.d,
            world=self.layout.data,
        )
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep_last=settings.keep_last)
        self._vision_seconds = 0.0
        self._router = None
        self._time_vision(self.model)
        self.step = 0
        self.counters = RunningCounters.fresh()
        self.chance_by_kind: dict[str, float] = {}
        """Per question kind, the accuracy of guessing (set by :meth:`begin`)."""
        self._start = 0  # the step begin() resumed at
        self._chance = float("nan")  # guessing accuracy on the questions (begin() on rank 0)

    @property
    def lead(self) -> bool:
        """Rank 0: evaluates, logs and writes the records."""
        return self.rank == 0

    @property
    def precision(self) -> str:
        """``bf16`` or ``fp32``: what ``train.precision`` resolved to on this device."""
        return "bf16" if self.bf16 else "fp32"

    def what_ran(self) -> dict[str, str]:
        """What this run trains with, as the run summary, the model card and MLflow's params
        (``ran.*``) say it: the attention kernel ``model.attention`` chose, the dtypes of the
        frozen base and of the adapters, activation checkpointing, and the sharding."""
        from packline.qwen.attention import text_attention

        frozen = next((p for p in self.model.parameters() if not p.requires_grad), None)
        layout = self.layout
        if layout.pipeline > 1:
            sharding = f"pipeline parallel {layout.pipeline} stages"
        elif layout.expert > 1:
            sharding = f"expert parallel {layout.expert}"
        elif layout.fsdp:
            sharding = f"fsdp2 over {layout.data} ranks"
        else:
            sharding = f"data parallel {layout.data}" if layout.data > 1 else "none"
        checkpointed = any(
            getattr(m, "gradient_checkpointing", False) for m in self.model.modules()
        )
        return {
            "attention": text_attention(self.model),
            "base_dtype": str(frozen.dtype).removeprefix("torch.") if frozen is not None else "",
            "adapter_dtype": str(self.params[0].dtype).removeprefix("torch."),
            "compute": self.precision,
            "activation_checkpointing": str(checkpointed).lower(),
            "sharding": sharding,
        }

    @property
    def ledger(self) -> Ledger:
        """This rank's ledger of the samples its stream read."""
        return self.stream.ledger

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

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> RunOutcome:
        """Train to ``max_steps``, resuming from the latest complete checkpoint if any;
        evaluate at the start, every ``eval_every`` steps and at the end. Every rank calls
        this."""
        self.begin()
        name = "packed" if self.s.packed else "unpacked"
        with progress(disable=not self.lead) as bar:
            task = bar.add_task(f"train {name}", total=self.s.max_steps, completed=self.step)

            def shown(r: StepResult) -> None:
                bar.update(task, completed=r.step, description=f"train {name} loss {r.loss:.3f}")

            self.advance(self.s.max_steps, on_step=shown)
        return self.finish()

    def begin(self) -> None:
        """What comes before the first step: resume, the guessing chance of the questions,
        and (from step 0) the first evaluation. :meth:`train` is ``begin``, ``advance`` to
        ``max_steps``, ``finish``; ``packline bench train`` advances two trainers in turn."""
        s = self.s
        self._start = self.resume()
        if self.lead:  # a kill in the middle of a record left a fragment: the next starts clean
            for torn in (self.run_dir / METRICS_LOG, self.run_dir / EVAL_LOG):
                drop_torn_tail(torn)
        self._chance = float("nan")
        if self.lead and s.eval_samples and self.evaluator is not None:
            self._chance, self.chance_by_kind = self.evaluator.chance()
            self.tracker.log_metrics({names.EVAL_ACCURACY_CHANCE: self._chance}, step=self._start)
        if self._start == 0:
            self.evaluate()

    def advance(self, steps: int, on_step: Callable[[StepResult], None] | None = None) -> None:
        """Up to ``steps`` optimizer steps (never past ``max_steps``), each logged, with the
        checkpoints and evaluations due on the way."""
        s = self.s
        log = self.run_dir / METRICS_LOG
        for _ in range(min(steps, s.max_steps - self.step)):
            r = self.train_step()
            metrics = self.step_metrics(r)  # a collective: every rank
            if self.lead:
                self._log_step(r, metrics, log)
            if on_step is not None:
                on_step(r)
            if s.save_every and r.step % s.save_every == 0:
                self.save_checkpoint()
            if s.eval_every and r.step % s.eval_every == 0 and r.step < s.max_steps:
                self.evaluate()

    def finish(self) -> RunOutcome:
        """After the last step: its checkpoint, unless a ``save_every`` step wrote it or the
        run resumed at ``max_steps`` (a rerun of a finished run: that checkpoint is the one it
        loaded), and the last evaluation."""
        if self.step > self._start and self.step % max(self.s.save_every, 1):
            self.save_checkpoint()
        self.evaluate()
        return RunOutcome(
            ranks=self.world,
            precision=self.precision,
            chance=self._chance,
            chance_by_kind=self.chance_by_kind,
            ran=self.what_ran(),
        )

    def summary(self, outcome: RunOutcome, *, window_steps: int | None = None) -> RunSummary:
        """The run's :class:`~packline.report.summary.RunSummary` from its step and eval
        records in ``run_dir`` (rank 0 writes them) and what :meth:`finish` returned;
        ``window_steps``: the steps per window of its throughput spread."""
        return summarize_run(
            read_records(self.run_dir / METRICS_LOG),  # a resumed run re-logs replayed steps
            read_records(self.run_dir / EVAL_LOG),
            run="packed" if self.s.packed else "unpacked",
            seq_length=self.s.packing.seq_length,
            precision=outcome.precision,
            ranks=outcome.ranks,
            chance=outcome.chance,
            chance_by_kind=outcome.chance_by_kind,
            ran=outcome.ran,
            window_steps=window_steps,
        )

    def whole_model(self):
        """Rank 0's model holding every adapter of the run: the training model itself when
        every rank holds the whole model, else the one-process ``eval_model`` loaded with the
        adapters gathered from every rank (every rank calls this; the others get None)."""
        if self.engine.owns_whole_state:
            return self.model if self.lead else None
        full = self.engine.full_adapter_state()
        if not self.lead:
            return None
        with torch.no_grad():
            named = dict(self.eval_model.named_parameters())
            missing = [n for n, p in named.items() if p.requires_grad and n not in full]
            if missing:
                raise RuntimeError(f"gathered adapter state lacks {missing[:3]} ...")
            for n, t in full.items():
                named[n].copy_(t)
        return self.eval_model

    def evaluate(self) -> EvalResult | None:
        """Rank 0 evaluates, logs and records; the others wait for it (and get None). At
        step 0, with an ``eval_memo``, weights another run already evaluated there (packing on
        and off start alike) are not evaluated again: its result is logged and recorded, with
        the run that evaluated it."""
        result = None
        model = self.whole_model() if self.evaluator is not None else None
        if self.lead and self.evaluator is not None:
            memo = self.eval_memo if self.step == 0 else None
            digest = weights_digest(model) if memo is not None else ""
            kept = memo.get(digest) if memo is not None else None
            if kept is not None:
                result, evaluated_in = kept
            else:
                with self.engine.evaluating(model):
                    result = self.evaluator.evaluate(model)
                if memo is not None:
                    memo.put(digest, result, self.run_dir.name)
            metrics = {
                names.EVAL_LOSS: result.loss,
                names.EVAL_TOKEN_ACCURACY: result.token_accuracy,
                names.EVAL_ACCURACY: result.accuracy,
                names.EVAL_QUESTIONS: float(result.questions),
            }
            by_kind = {
                kind: {**v, "chance": self.chance_by_kind.get(kind)}
                for kind, v in result.by_kind.items()
            }
            self.tracker.log_metrics({**metrics, **names.by_kind_metrics(by_kind)}, step=self.step)
            record = {"step": self.step, **metrics, names.EVAL_BY_KIND: result.by_kind}
            record[names.EVAL_ANSWERS] = result.answers
            if kept is not None:
                record[names.EVAL_EVALUATED_IN] = evaluated_in
            append_record(self.run_dir / EVAL_LOG, record)
        barrier()
        return result

    def _log_step(self, r: StepResult, metrics: dict[str, float], log: Path) -> None:
        self.tracker.log_metrics(metrics, step=r.step)
        # One value per laid-out row (the pack-fill histogram of `packline compare`); its
        # step is the row's index in the run, resume-exact.
        laid_out = self.counters.total.rows  # packed rows, or padded rows (one per conversation)
        self.tracker.log_series(
            names.PACK_ROW_FILL,
            row_fills(r.row_real_tokens, self.s.packing.seq_length),
            first_step=laid_out - len(r.row_real_tokens) + 1,
        )
        record = {"step": r.step, **metrics, "keys": r.keys}
        record[names.RECORD_ROW_REAL_TOKENS] = r.row_real_tokens
        if self.world > 1:
            record["keys_by_rank"] = r.keys_by_rank
            record["weights_checksums"] = r.weights_checksums
        append_record(log, record)

    def step_metrics(self, r: StepResult) -> dict[str, float]:
        """The logged metrics of one optimizer step (counts summed over ranks; every rank
        calls this, the ledger is gathered)."""
        c = self.counters.total
        metrics = {
            names.TRAIN_LOSS: r.loss,
            names.TRAIN_LR: r.lr,
            names.TRAIN_GRAD_NORM: r.grad_norm,
            names.TRAIN_STEP_SECONDS: r.seconds,
            names.TRAIN_CPU_SECONDS: r.cpu_seconds,
            names.TRAIN_DATA_SECONDS: r.data_seconds,
            names.TRAIN_VISION_SECONDS: r.vision_seconds,
            **r.counts.to_metrics("train"),
            **{names.cumulative(k): v for k, v in c.to_metrics("train").items()},
            names.THROUGHPUT_REAL_TOKENS_PER_S: r.counts.tokens_real / r.seconds,
            names.FLOPS_TFLOPS_PER_S: r.counts.flops_useful / r.seconds / 1e12,
            names.TRAIN_TOKENS_REAL_RANK_SPREAD: float(
                max(r.rank_real_tokens) - min(r.rank_real_tokens)
            ),
            names.FLOPS_USEFUL_RANK_SPREAD: float(max(r.rank_flops) - min(r.rank_flops)),
            **self.ledger_metrics(),
            **r.router,
        }
        metrics.update(
            layout_metrics(
                r.row_real_tokens,
                conversations=r.counts.conversations,
                padded_tokens=r.counts.padded_tokens,
                seq_length=self.s.packing.seq_length,
            )
        )
        util = mfu(r.counts.flops_useful / r.seconds / self.world, self.device_name)
        if util is not None:  # a GPU with a known peak; on CPU: TFLOP/s only
            metrics[names.FLOPS_MFU] = util
        return metrics

    # -- one optimizer step -----------------------------------------------------------------

    def step_rows(self) -> list[PackedBatch]:
        """This rank's rows of the next optimizer step, read from the training stream."""
        return self.stream.next_rows(self.rows_per_rank)

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
        """Backward of the step's loss over ``micro`` (all ranks): Σ token loss ÷ the global
        target count, or (``train.loss: sample``) Σ of each conversation's mean token loss ÷
        the global count of conversations with a target; gradients summed across ranks.
        Returns (that loss, the global target tokens)."""
        conversations = sum(conversation_weights(m)[1] for m in micro) if self.s.per_sample else 0
        local = [sum(m.num_loss_tokens for m in micro), len(micro), conversations]
        global_targets, global_micro, global_conversations = (
            int(v) for v in count_once(torch.tensor(local, dtype=torch.float64), *self._once)
        )
        divisor = global_conversations if self.s.per_sample else global_targets
        out = self.engine.forward_backward(
            micro, packed=self.s.packed, global_targets=divisor, global_micro=global_micro
        )
        self.engine.reduce_gradients()  # sum, never average: the loss is divided globally
        self._router = out.router
        loss_total = count_once(torch.tensor([out.loss_sum], dtype=torch.float64), *self._once)
        return float(loss_total.item() / divisor), global_targets

    @property
    def _once(self) -> tuple[ParallelLayout, int]:
        return self.layout, self.rank

    def train_step(self) -> StepResult:
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.model.train()
        self._vision_seconds = 0.0
        rows = self.step_rows()
        data_seconds = time.perf_counter() - t0
        micro = self.micro_batches(rows)
        counts = layout_counts(
            rows,
            micro,
            flops_model=self.flops_model,
            seq_length=self.s.packing.seq_length,
            packed=self.s.packed,
        )
        loss, _ = self.accumulate_gradients(micro)
        grad_norm = self.engine.clip(self.s.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        cpu_seconds = time.process_time() - cpu0
        gathered = all_gather_object(
            (
                cpu_seconds,
                self.coords.stage,
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
        cpu_seconds = sum(g[0] for g in gathered)  # every rank's process works
        gathered = [g[2:] for g in gathered if g[1] == 0]  # a pipeline's rows count once
        checksums = self.engine.check_replicas(step=self.step)
        total = _sum_counts(counts, *self._once)
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
            cpu_seconds=cpu_seconds,
            router=router_metrics(self._router, self.layout),
        )

    def ledger_metrics(self) -> dict[str, float]:
        """``data/*`` of all data-parallel ranks together (a pipeline's stages read the same
        rows: stage 0's ledger counts them)."""
        merged = Ledger()
        for stage, led in all_gather_object((self.coords.stage, self.ledger)):
            if stage == 0:
                merged = merged.merge(led)
        return merged.to_metrics()

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Checkpoint the run at this step, layout-free (every rank calls this; see
        :mod:`packline.train.checkpoint`)."""
        return self.checkpointer.save(self.step, self.checkpoint_state())

    def checkpoint_state(self, saved: dict | None = None) -> dict[str, Stateful]:
        """What a checkpoint holds, as :class:`Stateful` objects by name: the adapters and
        optimizer state this rank holds, the scheduler, the run (step, counters, layout),
        this data-parallel index's stream and this rank's RNG. ``saved``: the names of the
        checkpoint to load (a fresh optimizer learns from them what it loads)."""
        lay = self.layout
        return {
            "adapter": AdapterState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer, saved),
            "scheduler": Pickled(self.scheduler.state_dict, self.scheduler.load_state_dict),
            "run": Pickled(self._run_state, self._restore_run),
            _stream_name(self.coords.d, lay.data): Pickled(self.stream.state, self.stream.restore),
            _rng_name(self.rank, self.world): Pickled(_rng_state, _set_rng_state),
        }

    def _run_state(self) -> dict:
        return {
            "step": self.step,
            "counters": self.counters.state_dict(),
            "layout": self.layout_record(),
        }

    def _restore_run(self, run: dict) -> None:
        self.step = run["step"]
        self.counters.load_state_dict(run["counters"])

    def layout_record(self) -> dict:
        """The layout a checkpoint was written under."""
        lay = self.layout
        return {
            "world": lay.world,
            "data": lay.data,
            "pipeline": lay.pipeline,
            "expert": lay.expert,
            "fsdp": lay.fsdp,
        }

    def resume(self) -> int:
        """Load the latest complete checkpoint, if any; returns its step (0 when fresh).
        Any layout loads any other's checkpoint. With the same number of data-parallel
        ranks each stream continues exactly where it stood; otherwise the streams start
        again and skip, once each, the conversations the saved run trained (one warning
        line; the ledger counts them as ``data/skipped_on_resume``). Each rank takes its
        own RNG state, or rank 0's when the number of ranks changed."""
        path = self.checkpointer.latest()
        if path is None:
            return 0
        ck, lay = self.checkpointer, self.layout
        run = ck.read(path, "run")["run"]
        written = run["layout"]
        state = self.checkpoint_state(ck.names(path))
        del state["run"]  # read above
        rng = state.pop(_rng_name(self.rank, self.world))
        same_world = written["world"] == self.world
        state[_rng_name(self.rank if same_world else 0, written["world"])] = rng
        if written["data"] != lay.data:
            del state[_stream_name(self.coords.d, lay.data)]
        ck.load(path, state)
        self._restore_run(run)
        if written["data"] != lay.data:
            streams = [_stream_name(d, written["data"]) for d in range(written["data"])]
            every = list(ck.read(path, *streams).values())
            trained = self.stream.continue_after(every, counts_ledger=self.coords.d == 0)
            if self.lead:
                console.log(
                    f"[yellow]warning:[/] {path.name} was written by {written['data']} "
                    f"data-parallel rank(s), this run has {lay.data}: the loaders' positions "
                    f"cannot carry over rank for rank, so the stream starts again and skips "
                    f"the {trained} conversation(s) trained before, once each "
                    "(data/skipped_on_resume)"
                )
        return self.step


def _stream_name(d: int, data: int) -> str:
    """A checkpoint's name for data-parallel index ``d``'s stream of ``data``."""
    return f"stream/d{d:03d}of{data:03d}"


def _rng_name(rank: int, world: int) -> str:
    return f"rng/rank{rank:03d}of{world:03d}"


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
