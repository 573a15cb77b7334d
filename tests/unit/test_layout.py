"""The parallel layout's arithmetic and the rules validate applies to it, before anything
starts (the equivalence of each layout with one process is in tests/integration)."""

from __future__ import annotations

import pytest

from schemas.config import load_config
from schemas.errors import UserError
from schemas.layout import Coords, ParallelLayout


def test_ranks_are_stage_major_and_experts_split_within_a_stage():
    lay = ParallelLayout(world=8, pipeline=2, expert=2)
    assert lay.data == 4 and lay.expert_data == 2
    coords = [lay.coords(r) for r in range(8)]
    assert [c.stage for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [c.d for c in coords] == [0, 1, 2, 3] * 2
    assert [c.ep_rank for c in coords] == [0, 1, 0, 1] * 2
    assert coords[7] == Coords(stage=1, d=3, ep_rank=1, expert_copy=1)
    assert all(lay.rank_of(stage=c.stage, d=c.d) == r for r, c in enumerate(coords))


def test_ep_without_pp_implies_fsdp_as_transformers_engine_needs():
    cfg = load_config(
        None,
        [
            "model.moe=true",
            "train.nproc_per_node=2",
            "train.parallel.expert_parallel=2",
            "packing.pad_to_max_length=true",
        ],
    )
    assert ParallelLayout.from_config(cfg.train.parallel, 2).fsdp
    assert not ParallelLayout.from_config(cfg.train.parallel, 2).is_data_parallel
    assert ParallelLayout(world=4).is_data_parallel


def test_a_layout_the_engines_cannot_run_is_refused_with_every_reason_at_once():
    with pytest.raises(UserError) as info:
        load_config(
            None,
            [
                "train.nproc_per_node=6",
                "train.parallel.pipeline_parallel=4",
                "train.parallel.fsdp=true",
                "train.global_batch_size=4",
                "train.moe_aux_loss_coef=0.01",
            ],
        )
    text = "\n".join(info.value.problems)
    assert "6 ranks do not split into 4 pipeline stages" in text
    assert "fsdp with pipeline_parallel > 1" in text
    assert "pipeline_parallel > 1 trains packed rows only" in text  # compare_packing is on
    assert "moe_aux_loss_coef 0.01 with pipeline_parallel > 1" in text
    assert "EP > 1 or PP > 1 needs every packed row padded" in text  # packing.fixed_width
    layout = [p for p in info.value.problems if p.startswith("train.parallel: ")]
    assert len(layout) == 4 and len(info.value.problems) == 5
    assert all(p.endswith("(docs/parallel.md)") for p in layout)


def test_rows_stages_and_schedule_must_split_evenly():
    base = ParallelLayout(world=4, pipeline=2, expert=2, schedule="1f1b")
    assert base.problems(rows_per_step=4, fixed_width=True, micro_batch_size=1) == []
    assert base.problems(rows_per_step=2) == [  # 1 micro-batch per pipeline for 2 stages
        "1F1B needs at least 2 micro-batches per pipeline, train.global_batch_size 2 gives 1 "
        "per data-parallel rank"
    ]
    gpipe = ParallelLayout(world=4, pipeline=2, schedule="gpipe")
    assert gpipe.problems(rows_per_step=2) == []
    assert gpipe.problems(rows_per_step=3) == [
        "train.global_batch_size 3 is not divisible by the 2 data-parallel ranks"
    ]
    assert ParallelLayout(world=4, expert=3).problems() == [
        "expert_parallel 3 does not divide the 4 data-parallel ranks of a stage (experts are "
        "split over a stage's data-parallel ranks)"
    ]
    assert base.problems(fixed_width=False, micro_batch_size=2) == [
        "expert or pipeline parallelism needs fixed-width rows (packing.pad_to_max_length: true)",
        "micro_batch_size 2: expert or pipeline parallelism needs one packed row per micro-batch",
    ]


def test_the_model_must_split_into_whole_stages_and_even_expert_slices():
    lay = ParallelLayout(world=8, pipeline=4, expert=2)
    assert lay.model_problems(num_layers=8, num_experts=8) == []
    assert lay.model_problems(num_layers=6, num_experts=None) == [
        "pipeline_parallel 4 does not divide the 6 decoder layers",
        "expert_parallel 2 needs an MoE model (model.moe: true or an MoE path)",
    ]
    assert ParallelLayout(world=6, expert=3).model_problems(num_layers=2, num_experts=8) == [
        "expert_parallel 3 does not divide the 8 experts"
    ]


def test_on_slurm_the_train_jobs_ranks_are_what_the_layout_splits(tmp_path):
    from pipelines.executors import slurm_problems

    cfg = load_config(
        None,
        [
            f"work_dir={tmp_path}",
            "executor.kind=slurm",
            "executor.slurm.account=a",
            "executor.slurm.partition=p",
            "executor.slurm.gpus_per_node=8",
            "model.moe=true",
            "packing.pad_to_max_length=true",
            "train.compare_packing=false",
            "train.global_batch_size=8",
            "train.parallel.expert_parallel=8",
        ],
    )
    assert slurm_problems(cfg) == []
    cfg.train.parallel.pipeline_parallel = 2  # 4 data ranks per stage: EP 8 cannot split them
    assert slurm_problems(cfg) == [
        "train.parallel: expert_parallel 8 does not divide the 4 data-parallel ranks of a "
        "stage (experts are split over a stage's data-parallel ranks) (the SLURM train job's "
        "8 ranks: nodes 1 × nproc_per_node 8; pipeline_parallel 2, expert_parallel 8): "
        "change train.parallel, "
        "executor.slurm.nproc_per_node or train.global_batch_size (docs/parallel.md)"
    ]
