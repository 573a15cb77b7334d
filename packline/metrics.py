"""The names of every metric a training run logs and the reports read: the one home of them.

The train stage logs these names (to MLflow and, per step and per evaluation, to
``metrics.jsonl`` / ``eval.jsonl``); :mod:`packline.report` reads them back. Neither side
spells a name as a string literal, so a rename here renames both, and a test checks that
every name the report reads is one a real run writes.

A constant is its name in upper case, the group first (``train/step_seconds`` →
``TRAIN_STEP_SECONDS``). Names that carry a variable part are built by the helpers below
(:func:`cumulative`, :func:`dropped`, :func:`eval_kind`, :func:`compare`).

Groups:

- ``train/*``: one optimizer step (summed over data-parallel ranks), and ``train/cum_*``
  the same counters summed over the run so far;
- ``throughput/*``, ``flops/*``: rates of the step;
- ``pack/*``: the step's rows as laid out (packed rows, or one row per conversation when
  packing is off); ``pack/row_fill`` is one value per row, its step the row's index;
- ``data/*``: the ledger of source samples (seen, packed, dropped by reason);
- ``eval/*``: at each evaluation (step 0, every ``train.eval_every`` steps, the end);
- ``moe/*``: an MoE model's router over the step's real tokens (:mod:`packline.qwen.moe`);
- ``compare/*``: the train stage's own run, packing on against off.

>>> cumulative(TRAIN_TOKENS_REAL), dropped("overlength")
('train/cum_tokens_real', 'data/dropped_overlength')
>>> eval_kind("count", "accuracy")
'eval/by_kind/count/accuracy'
>>> compare("packed", "real_tokens_per_s")
'compare/packed_real_tokens_per_s'
"""

from __future__ import annotations

from typing import Any

# -- train/*: one optimizer step -------------------------------------------------------------

TRAIN_LOSS = "train/loss"
"""Mean token loss of the step's global batch."""
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_STEP_SECONDS = "train/step_seconds"
"""Wall time of the step: data, forward, backward, update."""
TRAIN_CPU_SECONDS = "train/cpu_seconds"
"""CPU time of the step, every thread of every rank's process (``time.process_time``): what
the step cost the machine's cores, which a neighbour's load does not stretch the way it
stretches the wall time (loader worker processes are not in it)."""
TRAIN_DATA_SECONDS = "train/data_seconds"
"""Of the step seconds on rank 0: waiting for the step's rows."""
TRAIN_VISION_SECONDS = "train/vision_seconds"
"""Of the step seconds on rank 0: the vision tower's forwards."""
TRAIN_TOKENS_REAL_RANK_SPREAD = "train/tokens_real_rank_spread"
"""max − min real tokens over the data-parallel ranks."""

# The step's counters, one per field of packline.counters.PackCounts (to_metrics("train")).
TRAIN_ROWS = "train/rows"
TRAIN_TOKENS_REAL = "train/tokens_real"
TRAIN_PADDED_TOKENS = "train/padded_tokens"
TRAIN_LOSS_TOKENS = "train/loss_tokens"
TRAIN_CONVERSATIONS = "train/conversations"
TRAIN_IMAGES = "train/images"
TRAIN_IMAGE_TOKENS = "train/image_tokens"
TRAIN_VIDEOS = "train/videos"
TRAIN_VIDEO_TOKENS = "train/video_tokens"
"""``<|video_pad|>`` tokens: one per merged group of patches of every temporal group."""
TRAIN_VIDEO_FRAMES = "train/video_frames"
"""Frames sampled from the videos (before an odd count is padded to a whole group)."""
TRAIN_FLOPS_USEFUL = "train/flops_useful"
"""Exact FLOPs over the real tokens (the work whatever the layout)."""
TRAIN_FLOPS_EXECUTED = "train/flops_executed"
"""Exact FLOPs of the layout as run, padding included."""
TRAIN_FLOPS_NOMINAL = "train/flops_nominal"
"""6·N·capacity, as other stacks report it."""
TRAIN_COUNTERS = (
    TRAIN_ROWS,
    TRAIN_TOKENS_REAL,
    TRAIN_PADDED_TOKENS,
    TRAIN_LOSS_TOKENS,
    TRAIN_CONVERSATIONS,
    TRAIN_IMAGES,
    TRAIN_IMAGE_TOKENS,
    TRAIN_VIDEOS,
    TRAIN_VIDEO_TOKENS,
    TRAIN_VIDEO_FRAMES,
    TRAIN_FLOPS_USEFUL,
    TRAIN_FLOPS_EXECUTED,
    TRAIN_FLOPS_NOMINAL,
)
"""The per-step counters, in ``PackCounts`` field order; each also as :func:`cumulative`."""


def cumulative(name: str) -> str:
    """The run-so-far name of a per-step counter: ``train/x`` → ``train/cum_x``."""
    group, sep, rest = name.partition("/")
    if group != "train" or not sep or name not in TRAIN_COUNTERS:
        raise ValueError(f"{name!r} is not a train/* counter (one of {TRAIN_COUNTERS})")
    return f"train/cum_{rest}"


# -- throughput/*, flops/* ---------------------------------------------------------------------

THROUGHPUT_REAL_TOKENS_PER_S = "throughput/real_tokens_per_s"
FLOPS_TFLOPS_PER_S = "flops/tflops_per_s"
"""Useful TFLOPs of the step / its seconds."""
FLOPS_MFU = "flops/mfu"
"""Model FLOPs utilization per rank; logged only on a GPU with a known peak."""
FLOPS_USEFUL_RANK_SPREAD = "flops/useful_rank_spread"

# -- pack/*: the step's rows as laid out ---------------------------------------------------------

PACK_ROWS = "pack/rows"
PACK_FILL = "pack/fill"
"""Real tokens / (rows × seq_length) of the step."""
PACK_CONVERSATIONS_PER_PACK = "pack/conversations_per_pack"
PACK_PADDING_TOKENS = "pack/padding_tokens"
PACK_PADDING_FRACTION = "pack/padding_fraction"
PACK_ROW_FILL = "pack/row_fill"
"""One value per laid-out row (its step is the row's index in the run)."""

# -- data/*: the ledger ---------------------------------------------------------------------------

DATA_SEEN = "data/seen"
DATA_PACKED = "data/packed"
DATA_DROPPED = "data/dropped"
DATA_SKIPPED_ON_RESUME = "data/skipped_on_resume"
"""Conversations a resume under another data-parallel layout skipped because the run before
it trained them (logged only when there are some)."""


def dropped(reason: str) -> str:
    """The ledger's count of samples dropped for ``reason`` (``overlength``, ...)."""
    return f"data/dropped_{reason}"


# -- eval/* -----------------------------------------------------------------------------------

EVAL_LOSS = "eval/loss"
"""Mean token loss over the whole val split."""
EVAL_ACCURACY = "eval/accuracy"
"""Share of the checkable val questions answered correctly."""
EVAL_TOKEN_ACCURACY = "eval/token_accuracy"
"""Share of the val split's target (reply) tokens that are the model's top prediction, fed
the conversation up to them (teacher-forced, over the same packed rows as the loss)."""
EVAL_QUESTIONS = "eval/questions"
EVAL_ACCURACY_CHANCE = "eval/accuracy_chance"
"""Accuracy of guessing among each question kind's answers (logged once per run)."""
KIND_FIGURES = ("questions", "accuracy", "chance")
"""What :func:`eval_kind` names per question kind."""


def eval_kind(kind: str, figure: str) -> str:
    """The metric of one question kind's ``figure`` (one of :data:`KIND_FIGURES`)."""
    if figure not in KIND_FIGURES:
        raise ValueError(f"unknown per-kind figure {figure!r}: use one of {KIND_FIGURES}")
    if not kind or "/" in kind:
        raise ValueError(f"question kind {kind!r} must be a non-empty name without '/'")
    return f"eval/by_kind/{kind}/{figure}"


def by_kind_metrics(by_kind: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per question kind figures (``{kind: {questions, accuracy[, chance]}}``, as
    ``eval_accuracy`` returns them) as MLflow metrics; ``None`` values are left out.

    >>> by_kind_metrics({"count": {"questions": 3, "accuracy": 0.5, "chance": None}})
    {'eval/by_kind/count/questions': 3.0, 'eval/by_kind/count/accuracy': 0.5}
    """
    return {
        eval_kind(kind, figure): float(v[figure])
        for kind, v in by_kind.items()
        for figure in KIND_FIGURES
        if v.get(figure) is not None
    }


def by_kind_from_metrics(metrics: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The inverse of :func:`by_kind_metrics` over any dict of metrics (others ignored);
    ``questions`` back as int.

    >>> by_kind_from_metrics({"eval/loss": 2.0, "eval/by_kind/count/questions": 3.0,
    ...                       "eval/by_kind/count/accuracy": 0.5})
    {'count': {'questions': 3, 'accuracy': 0.5}}
    """
    out: dict[str, dict[str, Any]] = {}
    for name, value in metrics.items():
        parts = name.split("/")
        if len(parts) == 4 and parts[:2] == ["eval", "by_kind"] and parts[3] in KIND_FIGURES:
            out.setdefault(parts[2], {})[parts[3]] = (
                int(value) if parts[3] == "questions" else value
            )
    return dict(sorted(out.items()))


# -- moe/*: the router of an MoE model, over real tokens only -------------------------------

MOE_AUX_LOSS = "moe/aux_loss"
"""HF's load-balancing loss over the step's real tokens (padding and alignment gaps left out),
from router stats summed over micro-batches, stages and ranks: the loss of their union."""
MOE_EXPERT_LOAD_MAX = "moe/expert_load_max"
"""Top-k assignments of the busiest expert / the mean over experts (1.0: balanced)."""
MOE_EXPERT_LOAD_MIN = "moe/expert_load_min"
"""Top-k assignments of the idlest expert / the mean over experts."""
MOE_METRICS = (MOE_AUX_LOSS, MOE_EXPERT_LOAD_MAX, MOE_EXPERT_LOAD_MIN)
"""What an MoE model's step logs besides :data:`STEP_METRICS`."""

# -- compare/*: the train stage's own run ------------------------------------------------------

COMPARE_SPEEDUP_REAL_TOKENS_PER_S = "compare/speedup_real_tokens_per_s"
"""Packed real tokens/s ÷ unpacked real tokens/s."""
COMPARE_SPEEDUP_PER_CPU_S = "compare/speedup_per_cpu_s"
"""Packed ÷ unpacked real tokens per CPU-second (``train/cpu_seconds``)."""
COMPARE_FIGURES = (
    "real_tokens_per_s",
    "real_tokens_per_cpu_s",
    "eval_loss",
    "eval_token_accuracy",
    "eval_accuracy",
    "final_train_loss",
    "train_seconds",
)
"""The figures of each run the stage logs as :func:`compare` metrics."""


def compare(run: str, figure: str) -> str:
    """The train stage's metric of one run's figure (``packed`` / ``unpacked``)."""
    if run not in ("packed", "unpacked"):
        raise ValueError(f"run {run!r} must be 'packed' or 'unpacked'")
    return f"compare/{run}_{figure}"


# -- fields of the records that are not metrics ---------------------------------------------

RECORD_ROW_REAL_TOKENS = "row_real_tokens"
"""Of a ``metrics.jsonl`` record: the real tokens of each row as laid out."""
EVAL_BY_KIND = "by_kind"
"""Of an ``eval.jsonl`` record: per question kind ``{questions, accuracy}``."""
EVAL_ANSWERS = "answers"
"""Of an ``eval.jsonl`` record: every question asked, ``{key, kind, question, expected,
reply, right}`` (:func:`packline.train.evaluate.eval_accuracy`)."""
EVAL_EVALUATED_IN = "evaluated_in"
"""Of an ``eval.jsonl`` record read from the start-evaluation memo instead of evaluated
again: the run that evaluated the very same weights (:class:`packline.train.evaluate.EvalMemo`)."""

# -- MLflow tags of the train stage's runs ------------------------------------------------

TAG_STAGE = "packline.stage"
"""The stage a run belongs to (``train`` on the stage run and on its training runs)."""
TAG_PACKING = "packline.packing"
"""``true`` / ``false`` on a training run (the stage run has none)."""
TAG_PRECISION = "packline.precision"
"""On a training run: what ``train.precision`` resolved to (``bf16`` / ``fp32``)."""
TAG_RANKS = "packline.ranks"
"""On a training run: the data-parallel ranks it trained on."""


def defines(name: str) -> bool:
    """Whether ``name`` is a metric of this module: a constant, or built by a helper.

    >>> defines(TRAIN_LOSS), defines("train/cum_loss_tokens"), defines("train/step_secs")
    (True, True, False)
    """
    constants = {v for k, v in globals().items() if k.isupper() and isinstance(v, str) and "/" in v}
    group, _, rest = name.partition("/")
    parts = name.split("/")
    return (
        name in constants
        or name in {cumulative(n) for n in TRAIN_COUNTERS}
        or (group == "data" and rest.startswith("dropped_") and len(rest) > len("dropped_"))
        or (len(parts) == 4 and parts[:2] == ["eval", "by_kind"] and parts[3] in KIND_FIGURES)
        or name in {compare(run, f) for run in ("packed", "unpacked") for f in COMPARE_FIGURES}
    )


STEP_METRICS = (
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_GRAD_NORM,
    TRAIN_STEP_SECONDS,
    TRAIN_CPU_SECONDS,
    TRAIN_DATA_SECONDS,
    TRAIN_VISION_SECONDS,
    *TRAIN_COUNTERS,
    *(cumulative(n) for n in TRAIN_COUNTERS),
    THROUGHPUT_REAL_TOKENS_PER_S,
    FLOPS_TFLOPS_PER_S,
    TRAIN_TOKENS_REAL_RANK_SPREAD,
    FLOPS_USEFUL_RANK_SPREAD,
    DATA_SEEN,
    DATA_PACKED,
    DATA_DROPPED,
    PACK_ROWS,
    PACK_FILL,
    PACK_CONVERSATIONS_PER_PACK,
    PACK_PADDING_TOKENS,
    PACK_PADDING_FRACTION,
)
"""What every optimizer step logs (besides ``data/dropped_<reason>`` and, on a known GPU,
``flops/mfu``)."""
EVAL_METRICS = (EVAL_LOSS, EVAL_TOKEN_ACCURACY, EVAL_ACCURACY, EVAL_QUESTIONS)
"""What every evaluation logs (besides :func:`eval_kind` per question kind)."""
