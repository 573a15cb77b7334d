"""Pipeline parallelism (packline.train.pipeline) against one process, on real packed
fixed-width rows of the built-in set (images, videos and several conversations per row).

In one process: the stage modules chained by hand equal the packed forward bitwise, and a
stage given a row without its boundaries raises. Under torchrun over gloo
(tests/integration/pp_check.py, one launch per world size): on 2 ranks PP 2 with GPipe and
1F1B, dense and MoE, and a 4-layer model whose carried deepstack feature has a layer after
it (vision LoRA); on 4 ranks PP 4 (middle stages) and PP 2 × EP 2 (the tiny MoE with expert
LoRA, packline.train.expert_parallel), each against one process on the same rows and
adapter values.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from packline.catalog import processor_dir
from packline.qwen.forward import packed_forward, token_loss_sum
from packline.qwen.processor import load_processor
from packline.train.distributed import torchrun_command
from packline.train.setup import training_stream
from packline.train.stage_split import StageModule, StagePlan
from tests.conftest import make_config
from tests.integration.pp_check import (
    CASES,
    FOUR_RANK_CASES,
    PP_EP_CASES,
    VISION_LORA,
    seeded_lora_model,
)
from tests.integration.train_helpers import SMALL

ROOT = Path(__file__).resolve().parents[2]
SEQ_LENGTH = 512
"""Short fixed-width rows: still 2-7 conversations with images and videos each."""
NUM_ROWS = 4
TOLERANCE = 1e-6


def _pp_config(work: Path, *overrides: str):
    return make_config(
        work,
        *SMALL,
        "packing.pad_to_max_length=true",
        f"packing.seq_length={SEQ_LENGTH}",
        "train.num_workers=0",
        *overrides,
    )


@pytest.fixture(scope="session")
def pp_rows(work, tmp_path_factory) -> Path:
    """The first rows of the training stream at fixed width, saved for every rank to read."""
    rows = training_stream(_pp_config(work)).next_rows(NUM_ROWS)
    path = tmp_path_factory.mktemp("pp") / "rows.pt"
    torch.save(rows, path)
    return path


def _rows(pp_rows: Path):
    return torch.load(pp_rows, weights_only=False)


def _stage_inputs(row) -> dict:
    return dict(position_ids=row.position_ids, cu_seqlens_padded=row.cu_seqlens_padded)


def _media(row) -> dict:
    return dict(
        pixel_values=row.pixel_values,
        image_grid_thw=row.image_grid_thw,
        pixel_values_videos=row.pixel_values_videos,
        video_grid_thw=row.video_grid_thw,
    )


def test_rows_hold_conversations_images_and_videos(pp_rows):
    rows = _rows(pp_rows)
    assert {tuple(r.input_ids.shape) for r in rows} == {(1, SEQ_LENGTH)}
    assert all(r.num_conversations > 1 for r in rows)
    assert sum(r.num_images for r in rows) and sum(r.num_videos for r in rows)
    assert any(r.num_images and r.num_videos for r in rows)  # HF's joint deepstack path


@pytest.mark.parametrize(
    "overrides, deep, bf16",
    [
        ([], False, False),
        (["model.moe=true", "model.path=null"], False, False),
        ([VISION_LORA], True, False),
        ([], False, True),
    ],
    ids=["dense", "moe", "deep_vision_lora", "dense_bf16"],
)
def test_chained_stages_equal_the_packed_forward(work, pp_rows, overrides, deep, bf16):
    """Stage 0 then stage 1 in one process (activations detached in between, gradients
    handed back by hand, as the schedule does): loss and every gradient bitwise those of
    ``packed_forward`` on the whole model."""
    cfg = _pp_config(work, *overrides)
    processor = load_processor(processor_dir(cfg))
    rows = _rows(pp_rows)
    targets = sum(r.num_loss_tokens for r in rows)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    whole = seeded_lora_model(cfg, processor, deep=deep)
    ref_sums = []
    for row in rows:
        with autocast:
            logits = packed_forward(
                whole,
                row,
                image_token_id=processor.image_token_id,
                video_token_id=processor.video_token_id,
            )
        loss_sum, _ = token_loss_sum(logits, row.labels)
        (loss_sum / targets).backward()
        ref_sums.append(float(loss_sum.detach()))
    ref = {n: p.grad for n, p in whole.named_parameters() if p.requires_grad}

    parts = [seeded_lora_model(cfg, processor, deep=deep) for _ in range(2)]
    stages = [StageModule(m, stage=s, num_stages=2) for s, m in enumerate(parts)]
    for stage in stages:
        stage.bf16 = bf16
    if deep:
        assert (stages[0].plan.carried_out, list(stages[1].plan.layers)) == (1, [2, 3])
    sums = []
    for row in rows:
        sent = stages[0](row.input_ids, **_stage_inputs(row), **_media(row))
        sent = sent if isinstance(sent, tuple) else (sent,)
        assert all(t.dtype == torch.float32 for t in sent)
        received = tuple(t.detach().requires_grad_(t.requires_grad) for t in sent)
        loss_sum, _ = token_loss_sum(stages[1](*received, **_stage_inputs(row)), row.labels)
        (loss_sum / targets).backward()
        back = [(t, r.grad) for t, r in zip(sent, received, strict=True) if t.requires_grad]
        torch.autograd.backward([t for t, _ in back], [g for _, g in back])
        sums.append(float(loss_sum.detach()))
    assert sums == ref_sums
    got = {n: p.grad for m in parts for n, p in m.named_parameters() if p.requires_grad}
    assert set(got) == set(ref)  # the stages' parameters are the whole model's, by name
    for name, grad in ref.items():
        assert grad is not None and grad.abs().max() > 0, name
        assert torch.equal(got[name], grad), name


def test_a_stage_given_a_row_without_its_boundaries_raises(work, pp_rows):
    cfg = _pp_config(work)
    processor = load_processor(processor_dir(cfg))
    stage = StageModule(seeded_lora_model(cfg, processor), stage=1, num_stages=2)
    row = _rows(pp_rows)[1]
    hidden = torch.zeros(1, SEQ_LENGTH, 128)
    carried = torch.zeros(1, 1, SEQ_LENGTH, 128)
    with pytest.raises(ValueError, match="pipeline stage 1: micro-batch without cu_seqlens_padded"):
        stage(hidden, carried, position_ids=row.position_ids)
    with pytest.raises(ValueError, match="without position_ids and cu_seqlens_padded"):
        stage(hidden, carried)
    shifted = row.cu_seqlens_padded.clone()
    shifted[1] += 1
    with pytest.raises(ValueError, match="pipeline stage 1: unsafe packed forward: row 0 of "):
        stage(hidden, carried, position_ids=row.position_ids, cu_seqlens_padded=shifted)
    flat = row.position_ids.clone()
    flat[0, 0] = torch.arange(SEQ_LENGTH)  # text positions that never restart
    with pytest.raises(ValueError, match="does not restart at the cu_seqlens_padded"):
        stage(hidden, carried, position_ids=flat, cu_seqlens_padded=row.cu_seqlens_padded)
    with pytest.raises(ValueError, match="position_ids of shape"):
        stage(hidden, carried, position_ids=row.position_ids[1:], cu_seqlens_padded=shifted)
    other = replace(row, position_ids=row.position_ids[..., :256])
    with pytest.raises(ValueError, match="metadata belongs to another row"):
        stage(hidden, carried, **_stage_inputs(other))


def test_stage_plan_splits_layers_and_carries_deepstack():
    plans = [StagePlan(stage=s, num_stages=4, num_layers=4, num_deepstack=3) for s in range(4)]
    assert [list(p.layers) for p in plans] == [[0], [1], [2], [3]]
    assert [(p.carried_in, p.carried_out) for p in plans] == [(0, 2), (2, 1), (1, 0), (0, 0)]
    with pytest.raises(ValueError, match="does not divide the 2 decoder layers"):
        StagePlan(stage=0, num_stages=4, num_layers=2, num_deepstack=2)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def two_stage_results(work, pp_rows, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pp2") / "pp2.json"
    cmd = torchrun_command(
        2, "tests.integration.pp_check", [str(work), str(pp_rows), str(out), *CASES]
    )
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=600)
    result = json.loads(out.read_text())
    result["seconds"] = time.perf_counter() - t0
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_stages_equal_one_process(two_stage_results, case):
    assert two_stage_results["world"] == 2
    by_stage = {r["stage"]: r for rank in two_stage_results["by_rank"] for r in rank
                if r["case"] == case}  # fmt: skip
    assert sorted(by_stage) == [0, 1]
    names = set()
    for r in by_stage.values():
        assert abs(r["loss_sum"] - r["ref_loss_sum"]) <= TOLERANCE * max(1.0, r["ref_loss_sum"])
        assert r["names_subset"]
        assert r["grads"]["max_rel"] <= TOLERANCE, r["grads"]
        assert not r["grads"]["zero_reference_grads"]
        names |= set(r["names"])
        if "router_stats_max_abs" in r:  # MoE: the stages' stats add to one process's
            assert r["router_stats_max_abs"] <= TOLERANCE
            assert r["router_tokens"] == 2 * r["router_real_tokens"]  # 2 MoE layers, no pads
    assert len(names) == sum(len(r["names"]) for r in by_stage.values())  # no name twice
    first, last = by_stage[0], by_stage[1]
    assert first["carried_out"] == last["carried_in"] == 1  # a deepstack feature crossed


@pytest.mark.slow
def test_two_stages_refuse_rows_without_boundaries_on_every_stage(two_stage_results):
    by_stage = {r["stage"]: r for rank in two_stage_results["by_rank"] for r in rank
                if r["case"] == "dense_gpipe"}  # fmt: skip
    s0, s1 = by_stage[0], by_stage[1]
    # stage 1 was given a boundary its positions do not restart at: it says so; stage 0 too
    assert s1["refusal_shifted_boundary"].startswith("row 1: pipeline stage 1: unsafe packed")
    assert "another stage refused" in s0["refusal_shifted_boundary"]
    assert "row 1: pipeline stage 1" in s0["refusal_shifted_boundary"]
    assert "without cu_seqlens_padded" in s1["refusal_missing_boundaries"]
    assert "another stage refused" in s0["refusal_missing_boundaries"]
    assert s0["refusal_positions_not_restarting"].startswith("row 0: pipeline stage 0")
    assert "another stage refused" in s1["refusal_positions_not_restarting"]
    for r in (s0, s1):
        # forward-only on 3 rows, the same step again and after the refusals: unchanged
        assert r["eval_loss_sum"] == pytest.approx(r["ref_eval_loss_sum"], abs=TOLERANCE)
        assert r["second_step_loss_sum"] == r["loss_sum"] == r["after_refusals_loss_sum"]
        assert r["second_step_grads"]["max_rel"] <= TOLERANCE


@pytest.fixture(scope="module")
def four_rank_results(work, pp_rows, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pp4") / "pp4.json"
    args = [str(work), str(pp_rows), str(out), *FOUR_RANK_CASES, *PP_EP_CASES]
    cmd = torchrun_command(4, "tests.integration.pp_check", args)
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=600)
    return json.loads(out.read_text())


def _by_rank(results: dict, case: str) -> list[dict]:
    return [r for rank in results["by_rank"] for r in rank if r["case"] == case]


@pytest.mark.slow
def test_four_stages_equal_one_process(four_rank_results):
    """P = 4: two middle stages, each receiving and passing on deepstack features."""
    rs = sorted(_by_rank(four_rank_results, "pp4_deep_vision_lora_1f1b"), key=lambda r: r["stage"])
    assert [r["stage"] for r in rs] == [0, 1, 2, 3]
    assert [(r["carried_in"], r["carried_out"]) for r in rs] == [(0, 2), (2, 1), (1, 0), (0, 0)]
    for r in rs:
        assert abs(r["loss_sum"] - r["ref_loss_sum"]) <= TOLERANCE * max(1.0, r["ref_loss_sum"])
        assert r["grads"]["max_rel"] <= TOLERANCE, r["grads"]
        assert not r["grads"]["zero_reference_grads"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PP_EP_CASES))
def test_two_stages_by_two_expert_ranks_equal_one_process(four_rank_results, case):
    """PP 2 × EP 2: two pipelines read two rows each; in each stage the experts are split
    over the two pipelines' ranks (tokens cross between them in every MoE layer)."""
    rs = _by_rank(four_rank_results, case)
    assert sorted((r["stage"], r["d"], r["ep_rank"]) for r in rs) == [
        (0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)
    ]  # fmt: skip
    assert all(r["rows"] == NUM_ROWS // 2 for r in rs)
    targets = rs[0]["targets"]
    for r in rs:
        # the mean token loss, as the trainer reports it (Σ over both pipelines / targets)
        assert abs(r["loss_sum"] - r["ref_loss_sum"]) / targets <= TOLERANCE
        assert r["router_stats_max_abs"] <= TOLERANCE
        assert r["expert_names"] and set(r["expert_names"]) <= set(r["names"])
    grads = next(r["grads"] for r in rs if r["rank"] == 0)  # merged from every rank's part
    assert grads["max_rel"] <= TOLERANCE, grads
    assert not grads["zero_reference_grads"]
    assert any(".experts." in n for r in rs for n in r["expert_names"])
