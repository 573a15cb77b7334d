"""Per-step counters of packed rows, and the FLOPs each row costs.

Two FLOPs figures per row, both exact (:func:`packline.flops.step_flops`):

- **useful**: over the real tokens — linear layers on Σ len, attention Σ len², images and
  videos once (a video per temporal group of 2 frames, an odd frame padded as the model
  pads it);
  this is the work the model must do whatever the layout, and what TFLOP/s and MFU use;
- **executed**: over the physical layout — alignment gaps and tail padding run through the
  linear layers, each padded segment attends over its padded length;
and the **nominal** 6·N·capacity that other stacks report, for contrast.

:class:`RunningCounters` sums them; its state goes into training checkpoints so the
cumulative figures stay exact across a resume.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from packline import metrics as names
from packline.flops import LORA_TARGETS_ALL, PackShape, nominal_flops, step_flops
from packline.packing.thd import PackedBatch


@dataclass(frozen=True, kw_only=True)
class FlopsModel:
    """The model and training mode FLOPs are counted for."""

    config: object
    """HF Qwen3VLConfig / Qwen3VLMoeConfig."""
    mode: str = "lora"
    """``lora`` (frozen base, adapters) or ``full``."""
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = LORA_TARGETS_ALL

    def _flops(self, shape: PackShape) -> int:
        return step_flops(
            self.config,
            shape,
            mode=self.mode,
            lora_rank=self.lora_rank if self.mode == "lora" else 0,
            lora_targets=self.lora_targets,
        ).total

    def useful(
        self, seq_lens, image_grids, padded_len: int, loss_tokens: int = 0, video_grids=()
    ) -> int:
        if not seq_lens:
            return 0
        return self._flops(
            PackShape(
                seq_lens=tuple(seq_lens),
                image_grids=tuple(image_grids),
                video_grids=tuple(video_grids),
                padded_len=padded_len,
                loss_tokens=loss_tokens,
            )
        )

    def executed(self, segment_lens, image_grids, loss_tokens: int = 0, video_grids=()) -> int:
        """Padding counted as tokens: each segment at its physical length."""
        if not segment_lens:
            return 0
        return self._flops(
            PackShape(
                seq_lens=tuple(segment_lens),
                image_grids=tuple(image_grids),
                video_grids=tuple(video_grids),
                padded_len=sum(segment_lens),
                loss_tokens=loss_tokens,
            )
        )

    def nominal(self, capacity_tokens: int) -> int:
        return nominal_flops(self.config, capacity_tokens)

    def per_call_flops(self) -> float:
        """What one forward/backward call costs whatever its tokens (the LoRA fold of MoE
        experts, ``W + s·B·A``; 0 for a dense model): two segments in one call minus each
        alone."""
        return float(2 * self.executed([1024], []) - self.executed([1024, 1024], []))

    def sample_flops(self, rows) -> list[float]:
        """Executed FLOPs of each sample alone, for ``rows`` of ``(length, image_grids,
        video_grids)`` (length as laid out, aligned): what the sample adds to any pack it is
        in, since a pack's FLOPs are the sum over its segments (linear layers per token,
        attention per segment, the vision tower per image and per video). Fast for many
        samples: the language model's FLOPs of one segment are a quadratic in its length,
        fitted exactly on three lengths, and each distinct grid's vision FLOPs are computed
        once. A pack's FLOPs are the sum of its samples' plus a per-call term, the MoE
        experts' LoRA fold (``per_call_flops``), which no sample carries."""
        probes = (1024, 2048, 4096)
        at = [float(self.executed([n], [])) - self.per_call_flops() for n in probes]
        # Newton's divided differences through the three probes: f(n) = a + b·n + c·n².
        (x0, x1, x2), (y0, y1, y2) = probes, at
        d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        c = (d12 - d01) / (x2 - x0)
        b = d01 - c * (x0 + x1)
        a = y0 - b * x0 - c * x0 * x0
        vision: dict[tuple, float] = {}

        def tower(grid, video: bool) -> float:
            key = (grid, video)
            if key not in vision:
                merge = self.config.vision_config.spatial_merge_size
                n = max(grid[0] * grid[1] * grid[2] // merge**2, 1)
                images, videos = ((), (grid,)) if video else ((grid,), ())
                alone = self.executed([n], list(images), video_grids=list(videos))
                vision[key] = float(alone - self.executed([n], []))  # the fold cancels
            return vision[key]

        return [
            a + b * n + c * n * n
            + sum(tower(tuple(g), False) for g in grids)
            + sum(tower(tuple(g), True) for g in video_grids)
            for n, grids, video_grids in rows
        ]  # fmt: skip


def _rows(grid_thw) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [tuple(int(v) for v in row) for row in grid_thw.tolist()]


def _grids(batch) -> list[tuple[int, int, int]]:
    """``image_grid_thw`` rows of a packed (or padded) batch."""
    return _rows(batch.image_grid_thw)


def _video_grids(batch) -> list[tuple[int, int, int]]:
    """``video_grid_thw`` rows of a packed (or padded) batch: t temporal groups, h, w."""
    return _rows(batch.video_grid_thw)


@dataclass
class PackCounts:
    """The counters of one row (or the sum of many)."""

    rows: int = 0
    tokens_real: int = 0
    padded_tokens: int = 0
    loss_tokens: int = 0
    conversations: int = 0
    images: int = 0
    image_tokens: int = 0
    videos: int = 0
    video_tokens: int = 0
    video_frames: int = 0
    """Frames sampled from the videos, before an odd count is padded to a whole group."""
    flops_useful: int = 0
    flops_executed: int = 0
    flops_nominal: int = 0

    @classmethod
    def of(cls, batch: PackedBatch, model: FlopsModel, capacity: int) -> PackCounts:
        if batch.num_conversations == 0:  # a row that only carries ledger entries
            return cls()
        grids, video_grids = _grids(batch), _video_grids(batch)
        segments = (batch.cu_seqlens_padded[1:] - batch.cu_seqlens_padded[:-1]).tolist()
        return cls(
            rows=1,
            tokens_real=batch.num_real_tokens,
            padded_tokens=batch.num_padded_tokens,
            loss_tokens=batch.num_loss_tokens,
            conversations=batch.num_conversations,
            images=batch.num_images,
            image_tokens=batch.num_image_tokens,
            videos=batch.num_videos,
            video_tokens=batch.num_video_tokens,
            video_frames=batch.num_video_frames,
            flops_useful=model.useful(
                batch.seq_lens,
                grids,
                batch.input_ids.shape[1],
                batch.num_loss_tokens,
                video_grids=video_grids,
            ),
            flops_executed=model.executed(
                segments, grids, batch.num_loss_tokens, video_grids=video_grids
            ),
            flops_nominal=model.nominal(capacity),
        )

    def __add__(self, other: PackCounts) -> PackCounts:
        return PackCounts(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def to_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in asdict(self).items()}


@dataclass
class RunningCounters:
    """Cumulative counters of a training run; saved and restored with its checkpoints."""

    total: PackCounts

    @classmethod
    def fresh(cls) -> RunningCounters:
        return cls(PackCounts())

    def add(self, counts: PackCounts) -> None:
        self.total = self.total + counts

    def state_dict(self) -> dict[str, int]:
        return asdict(self.total)

    def load_state_dict(self, state: dict[str, int]) -> None:
        state = dict(state)
        if "real_tokens" in state:  # checkpoints before the DESIGN name train/tokens_real
            state["tokens_real"] = state.pop("real_tokens")
        self.total = PackCounts(**state)


def layout_counts(
    rows: list[PackedBatch], micro: list, *, flops_model: FlopsModel, seq_length: int, packed: bool
) -> PackCounts:
    """The counters of one step's ``rows`` as laid out in ``micro`` (its micro-batches).

    Packed, the micro-batches are the rows themselves. Packing off lays the same
    conversations out padded (:func:`packline.packing.thd.build_padded_batch`), which
    executes (and wastes) more: one row per conversation, padding to the longest of each
    micro-batch, and the nominal and executed FLOPs of those physical slots rather than of
    the packed rows the conversations were read from.
    """
    counts = PackCounts()
    for row in rows:
        counts = counts + PackCounts.of(row, flops_model, seq_length)
    if packed:
        return counts
    counts.rows = sum(m.input_ids.shape[0] for m in micro)  # one per conversation
    counts.padded_tokens = sum(m.num_padded_tokens for m in micro)
    counts.flops_nominal = sum(flops_model.nominal(m.input_ids.numel()) for m in micro)
    counts.flops_executed = sum(
        flops_model.executed(
            [m.input_ids.shape[1]] * m.input_ids.shape[0],
            _grids(m),
            video_grids=_video_grids(m),
        )
        for m in micro
    )
    return counts


def flops_model_for(cfg, processor) -> FlopsModel:
    """FLOPs model of the configured model: the tiny one, a real config by name
    (``qwen3-vl-8b`` ...), or the ``config.json`` of ``model.path``; LoRA on the configured
    targets."""
    from packline.qwen.model import tiny_config
    from packline.qwen.real_configs import real_config

    if cfg.model.path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model.dir, local_files_only=True)
    elif cfg.model.name == "tiny":
        config = tiny_config(processor, moe=cfg.model.moe)
    else:
        config = real_config(cfg.model.name)
    targets = tuple(cfg.lora.target_modules) + tuple(cfg.lora.target_parameters)
    return FlopsModel(config=config, mode="lora", lora_rank=cfg.lora.rank, lora_targets=targets)


def layout_metrics(
    row_real_tokens: list[int], *, conversations: int, padded_tokens: int, seq_length: int
) -> dict[str, float]:
    """``pack/*`` figures of one step's rows as laid out: packed rows, or (packing off) one
    row per conversation.

    ``pack/fill`` is real tokens over the rows' capacity (rows × ``seq_length``), the figure
    connect forecasts; ``pack/padding_fraction`` is the share of the executed tokens that are
    padding (alignment gaps when packed, padding to the longest in a micro-batch when not).

    >>> layout_metrics([1536, 1024], conversations=6, padded_tokens=0, seq_length=2048)
    {'pack/rows': 2.0, 'pack/fill': 0.625, 'pack/conversations_per_pack': 3.0, \
'pack/padding_tokens': 0.0, 'pack/padding_fraction': 0.0}
    """
    rows = len(row_real_tokens)
    real = sum(row_real_tokens)
    return {
        names.PACK_ROWS: float(rows),
        names.PACK_FILL: real / (rows * seq_length) if rows else 0.0,
        names.PACK_CONVERSATIONS_PER_PACK: conversations / rows if rows else 0.0,
        names.PACK_PADDING_TOKENS: float(padded_tokens),
        names.PACK_PADDING_FRACTION: padded_tokens / (real + padded_tokens) if real else 0.0,
    }


def row_fills(row_real_tokens: list[int], seq_length: int) -> list[float]:
    """Fill of each laid-out row: its real tokens over ``seq_length``."""
    return [n / seq_length for n in row_real_tokens]
