"""The parallel layout of a local training run, as arithmetic: which rank holds which part of
the model and reads which rows, and every reason a layout cannot run. Plain data, no torch:
the config's rules (``schemas/rules.py``) and validate check a layout before anything
starts; :mod:`packline.train.layout` builds its process groups.

``train.parallel`` (schemas/config.py) names the layout: ``pipeline_parallel`` P stages,
``expert_parallel`` E (MoE experts split E ways inside each stage), ``fsdp`` (the model
sharded over a stage's data-parallel ranks with FSDP2: packline's with EP 1, transformers'
engine with EP > 1).
``world`` ranks are arranged like transformers' and torch's device meshes, pipeline outermost:

    rank = stage * data + d          d = 0 .. data - 1, data = world / P

so the ``data`` ranks of a stage read distinct rows (data-parallel index ``d``; every stage
of pipeline ``d`` reads the same rows). Inside a stage the experts are split over
consecutive groups of E ranks: rank ``d`` holds expert slice ``d % E``, so the ranks with
the same ``d % E`` hold the same experts (``expert_data`` = data / E copies of each expert,
whose adapter gradients are summed over them). :meth:`ParallelLayout.problems` lists every
reason a layout cannot run (validate lists them all before anything starts; the trainer
refuses the same ones).

>>> lay = ParallelLayout(world=8, pipeline=2, expert=2)
>>> lay.data, lay.expert_data, lay.coords(5)
(4, 2, Coords(stage=1, d=1, ep_rank=1, expert_copy=0))
>>> ParallelLayout(world=4).is_data_parallel
True
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in the layout."""

    stage: int
    """Pipeline stage (0 .. P-1): which decoder layers it holds."""
    d: int
    """Data-parallel index: which rows it reads (the same on every stage of a pipeline)."""
    ep_rank: int
    """Which slice of the experts it holds (0 .. E-1)."""
    expert_copy: int
    """Which copy of its experts it is (0 .. data/E - 1)."""


@dataclass(frozen=True)
class ParallelLayout:
    """``world`` ranks split into ``pipeline`` stages of ``world / pipeline`` data-parallel
    ranks each, experts split ``expert`` ways inside a stage."""

    world: int = 1
    pipeline: int = 1
    expert: int = 1
    fsdp: bool = False
    schedule: str = "1f1b"

    @classmethod
    def from_config(cls, parallel, world: int) -> ParallelLayout:
        """The layout of ``train.parallel`` (a :class:`schemas.config.ParallelConfig`) on
        ``world`` ranks."""
        return cls(
            world=world,
            pipeline=parallel.pipeline_parallel,
            expert=parallel.expert_parallel,
            # transformers' engine splits the experts over FSDP ranks: EP without PP implies it
            fsdp=parallel.fsdp
            or (parallel.expert_parallel > 1 and parallel.pipeline_parallel == 1),
            schedule=getattr(parallel.schedule, "value", parallel.schedule),
        )

    # -- sizes and coordinates --------------------------------------------------------------

    @property
    def data(self) -> int:
        """Data-parallel ranks per stage: distinct rows per step are read by this many."""
        return self.world // self.pipeline

    @property
    def expert_data(self) -> int:
        """Copies of each expert inside a stage (ranks whose expert adapters are summed)."""
        return self.data // self.expert

    @property
    def is_data_parallel(self) -> bool:
        """Every rank holds the whole model (plain data parallelism or one process)."""
        return self.pipeline == 1 and self.expert == 1 and not self.fsdp

    def coords(self, rank: int) -> Coords:
        stage, d = divmod(rank, self.data)
        return Coords(stage=stage, d=d, ep_rank=d % self.expert, expert_copy=d // self.expert)

    def rank_of(self, *, stage: int, d: int) -> int:
        return stage * self.data + d

    # -- what can run -------------------------------------------------------------------------

    def problems(
        self,
        *,
        num_layers: int | None = None,
        num_experts: int | None = None,
        rows_per_step: int | None = None,
        fixed_width: bool | None = None,
        micro_batch_size: int | None = None,
        packed_only: bool | None = None,
    ) -> list[str]:
        """Every reason this layout cannot train (empty: it can). Arguments left None are
        not checked: ``num_layers`` (decoder layers: P must divide them), ``num_experts``
        (None for a dense model: E must be 1), ``rows_per_step`` (the global batch: the
        data-parallel ranks must divide it, and 1F1B needs at least P micro-batches per
        pipeline), ``fixed_width`` (whether packed rows are padded to the sequence length:
        needed with E > 1 or P > 1), ``micro_batch_size`` (must be 1 with E > 1 or P > 1),
        ``packed_only`` (False when an unpacked run is asked for, which P > 1 cannot run).

        >>> for p in ParallelLayout(world=6, pipeline=4, expert=3).problems(
        ...     num_layers=2, num_experts=8
        ... ):
        ...     print(p)
        6 ranks do not split into 4 pipeline stages
        pipeline_parallel 4 does not divide the 2 decoder layers
        expert_parallel 3 does not divide the 8 experts
        """
        out: list[str] = []
        P, E = self.pipeline, self.expert
        if P < 1 or E < 1:
            return [f"pipeline_parallel {P} and expert_parallel {E} must be >= 1"]
        if self.schedule not in SCHEDULES:
            out.append(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.world % P:
            out.append(f"{self.world} ranks do not split into {P} pipeline stages")
        elif self.data % E:
            out.append(
                f"expert_parallel {E} does not divide the {self.data} data-parallel ranks of "
                "a stage (experts are split over a stage's data-parallel ranks)"
            )
        if num_layers is not None:
            out += self.model_problems(num_layers=num_layers, num_experts=num_experts)
        if self.fsdp and P > 1:
            out.append(
                "fsdp with pipeline_parallel > 1: transformers' engine cannot combine FSDP "
                "with pipeline parallelism (use fsdp: false; experts still split with EP)"
            )
        if rows_per_step is not None and self.world % P == 0:
            if rows_per_step % self.data:
                out.append(
                    f"train.global_batch_size {rows_per_step} is not divisible by the "
                    f"{self.data} data-parallel ranks"
                )
            elif P > 1 and self.schedule == "1f1b" and rows_per_step // self.data < P:
                out.append(
                    f"1F1B needs at least {P} micro-batches per pipeline, "
                    f"train.global_batch_size {rows_per_step} gives {rows_per_step // self.data} "
                    "per data-parallel rank"
                )
        if (E > 1 or P > 1) and fixed_width is False:
            out.append(
                "expert or pipeline parallelism needs fixed-width rows "
                "(packing.pad_to_max_length: true)"
            )
        if (E > 1 or P > 1) and micro_batch_size not in (None, 1):
            out.append(
                f"micro_batch_size {micro_batch_size}: expert or pipeline parallelism needs one "
                "packed row per micro-batch"
            )
        if P > 1 and packed_only is False:
            out.append(
                "pipeline_parallel > 1 trains packed rows only: padded micro-batches change "
                "shape from step to step (train.compare_packing: false, packing.enabled: true)"
            )
        return out

    def model_problems(self, *, num_layers: int, num_experts: int | None) -> list[str]:
        """Why the model cannot be split so: P must divide its ``num_layers`` decoder layers,
        E its ``num_experts`` (None: a dense model, which E must leave whole)."""
        P, E = self.pipeline, self.expert
        out = []
        if num_layers % P:
            out.append(f"pipeline_parallel {P} does not divide the {num_layers} decoder layers")
        if E > 1 and num_experts is None:
            out.append(f"expert_parallel {E} needs an MoE model (model.moe: true or an MoE path)")
        elif num_experts is not None and num_experts % E:
            out.append(f"expert_parallel {E} does not divide the {num_experts} experts")
        return out
