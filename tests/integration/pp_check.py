"""Pipeline-parallel steps against one process, on every rank of a torchrun launch.

Run by ``tests/integration/test_pipeline_parallel.py`` as
``python -m torch.distributed.run --standalone --nproc-per-node=2 -m
tests.integration.pp_check WORK ROWS OUT.json``: ``ROWS`` holds packed fixed-width rows
(a ``torch.save`` list of ``PackedBatch``) that every rank reads. Each case builds the tiny
model with LoRA on every rank (same seed, same random adapter values), computes the
one-process reference on the full model (``packed_forward`` over the rows, Σ token loss /
global targets, backward), then strips it to this rank's pipeline stage and runs one step
of the schedule; rank 0 writes every rank's differences as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

from packline.catalog import processor_dir
from packline.qwen.forward import packed_forward, token_loss_sum
from packline.qwen.moe import RouterRecorder, RouterStats
from packline.qwen.processor import load_processor
from packline.train.distributed import (
    all_gather_object,
    all_reduce_sum,
    init_from_env,
    shutdown,
)
from packline.train.layout import LayoutGroups
from packline.train.pipeline import PipelineRunner
from packline.train.setup import apply_lora, build_model
from schemas.layout import ParallelLayout
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL

VISION_LORA = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head,qkv,linear_fc2]"  # noqa: E501

#: name → (config overrides, schedule, deep); deep: :func:`deep_model` instead of the tiny
CASES = {
    "dense_gpipe": ([], "gpipe", False),
    "dense_1f1b": ([], "1f1b", False),
    "moe_gpipe": (["model.moe=true", "model.path=null"], "gpipe", False),
    "moe_1f1b": (["model.moe=true", "model.path=null"], "1f1b", False),
    # the tiny's last deepstack feature follows its last layer (no gradient reaches it);
    # here a carried feature has a layer after it, on the next stage
    "deep_vision_lora_1f1b": ([VISION_LORA], "1f1b", True),
}
#: cases of a 4-rank launch: P = 4 (two middle stages; the deepstack features of layers 1
#: and 2 cross stage 0's boundary, feature 2 stage 1's too)
FOUR_RANK_CASES = {
    "pp4_deep_vision_lora_1f1b": ([VISION_LORA], "1f1b", True),
}


def deep_model(cfg, processor):
    """The tiny model with 4 decoder layers, 3 vision blocks and 3 deepstack features
    (feature i is added after layer i): with 2 stages feature 2 crosses to stage 1 and
    layer 3 follows it; with 4 stages features 1 and 2 cross stage 0's boundary."""
    from packline.qwen.attention import set_text_attention
    from packline.qwen.model import tiny_config

    config = tiny_config(processor, moe=cfg.model.moe)
    config.text_config.num_hidden_layers = 4
    config.vision_config.depth = 3
    config.vision_config.deepstack_visual_indexes = [0, 1, 2]
    cls = Qwen3VLMoeForConditionalGeneration if cfg.model.moe else Qwen3VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        model = cls(config).float().eval()
    return set_text_attention(model, cfg.model.attention.value)


def seeded_lora_model(cfg, processor, *, deep: bool = False, adapter_seed: int = 1):
    """The configured tiny model with LoRA, its adapters set to seeded random values (PEFT
    starts B at zero, which would make every A gradient zero): the same on every rank."""
    torch.manual_seed(cfg.train.seed)
    base = deep_model(cfg, processor) if deep else build_model(cfg, processor)
    model = apply_lora(base, cfg.lora)
    gen = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def one_process(model, rows, *, global_targets: int, processor):
    """Per-row Σ token loss, the gradients (by name) and (MoE) the router statistics over
    real tokens of one process on ``rows``."""
    sums, stats = [], None
    recorder = RouterRecorder(model) if cfg_is_moe(model) else None
    with recorder if recorder is not None else nullcontext():
        for row in rows:
            if recorder is not None:
                recorder.clear()
            logits = packed_forward(
                model,
                row,
                image_token_id=processor.image_token_id,
                video_token_id=processor.video_token_id,
            )
            loss_sum, _ = token_loss_sum(logits, row.labels)
            (loss_sum / global_targets).backward()
            sums.append(float(loss_sum.detach()))
            if recorder is not None:
                s = RouterStats.from_logits(recorder.logits, row.real_token_mask(), recorder.top_k)
                stats = s if stats is None else stats + s
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return sums, grads, stats


def cfg_is_moe(model) -> bool:
    return getattr(model.config.text_config, "num_experts", None) is not None


def _diffs(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor]) -> dict:
    """Max |Δ| and max relative difference (per tensor |Δ|∞ / |ref|∞) over the tensors of
    ``got`` (a missing gradient counts as zeros), the worst tensor, and the names whose
    reference gradient is zero (a check that would prove nothing there)."""
    worst_abs = worst_rel = 0.0
    worst, zero = "", []
    for name, g in got.items():
        want = ref[name]
        g = torch.zeros_like(want) if g is None else g
        scale = float(want.abs().max())
        if scale == 0.0:
            zero.append(name)
        diff = float((g.double() - want.double()).abs().max())
        rel = diff / scale if scale else diff
        worst_abs = max(worst_abs, diff)
        if rel >= worst_rel:
            worst_rel, worst = rel, name
    return {
        "params": len(got),
        "max_abs": worst_abs,
        "max_rel": worst_rel,
        "worst": worst,
        "zero_reference_grads": zero,
    }


def grad_diffs(runner: PipelineRunner, ref: dict[str, torch.Tensor]) -> dict:
    """:func:`_diffs` of this stage's gradients."""
    return _diffs(dict(zip(runner.param_names, (p.grad for p in runner.params), strict=True)), ref)


def expect_refusal(runner: PipelineRunner, rows, *, global_targets: int) -> str:
    """The message ``runner.step`` raises on ``rows`` ('' if it does not raise)."""
    try:
        runner.step(rows, global_targets=global_targets)
    except ValueError as err:
        return str(err)
    return ""


def run_case(name, work, rows, rank, world) -> dict:
    overrides, schedule, deep = {**CASES, **FOUR_RANK_CASES}[name]
    cfg = make_config(
        Path(work),
        *SMALL,
        "packing.pad_to_max_length=true",
        f"packing.seq_length={rows[0].input_ids.shape[1]}",
        *overrides,
    )
    processor = load_processor(processor_dir(cfg))
    model = seeded_lora_model(cfg, processor, deep=deep)
    targets = sum(r.num_loss_tokens for r in rows)
    t0 = time.perf_counter()
    ref_sums, ref_grads, ref_stats = one_process(
        model, rows, global_targets=targets, processor=processor
    )
    t_ref = time.perf_counter() - t0
    layout = ParallelLayout(world=world, pipeline=world, schedule=schedule)
    groups = LayoutGroups(layout)
    runner = PipelineRunner(
        model,
        layout,
        groups,
        seq_length=rows[0].input_ids.shape[1],
        n_microbatches=len(rows),
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
    )
    t0 = time.perf_counter()
    loss = runner.step(rows, global_targets=targets)
    t_pp = time.perf_counter() - t0
    out = {
        "case": name,
        "rank": rank,
        "stage": runner.plan.stage,
        "layers": list(runner.plan.layers),
        "carried_in": runner.plan.carried_in,
        "carried_out": runner.plan.carried_out,
        "loss_sum": loss,
        "ref_loss_sum": sum(ref_sums),
        "grads": grad_diffs(runner, ref_grads),
        "names_subset": set(runner.param_names) <= set(ref_grads),
        "names": runner.param_names,
        "seconds_reference": t_ref,
        "seconds_pipeline_step": t_pp,
    }
    if ref_stats is not None:
        # stages hold different layers: their sums together are the one-process stats
        total = all_reduce_sum(runner.router_stats.to_tensor().clone(), group=groups.pipeline)
        out["router_stats_max_abs"] = float((total - ref_stats.to_tensor()).abs().max())
        out["router_tokens"] = float(ref_stats.num_layer_tokens)
        out["router_real_tokens"] = sum(r.num_real_tokens for r in rows)
    if name == "dense_gpipe":
        # forward only, on fewer rows than the training schedule's micro-batches
        out["eval_loss_sum"] = runner.eval_loss_sum(rows[:3])
        out["ref_eval_loss_sum"] = sum(ref_sums[:3])
        # the same step again (no update happened): the same loss and gradients
        for p in runner.params:
            p.grad = None
        out["second_step_loss_sum"] = runner.step(rows, global_targets=targets)
        out["second_step_grads"] = grad_diffs(runner, ref_grads)
        # a stage given rows without their boundaries refuses them, and so do the others
        bad = list(rows)
        if runner.plan.stage == 1:
            cu = rows[1].cu_seqlens_padded.clone()
            cu[1] += 1  # a boundary where the positions do not restart
            bad[1] = _with(rows[1], cu_seqlens_padded=cu)
        out["refusal_shifted_boundary"] = expect_refusal(runner, bad, global_targets=targets)
        bad = list(rows)
        if runner.plan.stage == 1:
            bad[2] = _with(rows[2], cu_seqlens_padded=None)
        out["refusal_missing_boundaries"] = expect_refusal(runner, bad, global_targets=targets)
        bad = list(rows)
        if runner.plan.stage == 0:
            pos = rows[0].position_ids.clone()
            pos[0, 0] = torch.arange(pos.shape[-1])  # text positions that never restart
            bad[0] = _with(rows[0], position_ids=pos)
        out["refusal_positions_not_restarting"] = expect_refusal(
            runner, bad, global_targets=targets
        )
        # and the pipeline still works afterwards
        for p in runner.params:
            p.grad = None
        out["after_refusals_loss_sum"] = runner.step(rows, global_targets=targets)
    return out


#: PP 2 x EP 2 on 4 ranks: name -> schedule
PP_EP_CASES = {"pp2_ep2_moe_expert_lora_1f1b": "1f1b", "pp2_ep2_moe_expert_lora_gpipe": "gpipe"}


def run_pp_ep_case(name, work, rows, rank, world) -> dict:
    """PP 2 x EP 2: two pipelines (data-parallel index d reads rows d::2), each stage's
    experts split over its two ranks by transformers' ``apply_expert_parallelism``
    (``expert_parallel.distribute_experts``), expert LoRA by ``apply_lora_ep``; dense adapter
    gradients summed over the stage's data ranks, expert ones over each expert's copies.
    Against one process over all rows (PEFT ``target_parameters``, the same adapters)."""
    from packline.train import expert_parallel as ep
    from tests.integration.parallel_rows import parallel_config, seeded_adapter_state

    schedule = PP_EP_CASES[name]
    cfg = parallel_config(Path(work), f"packing.seq_length={rows[0].input_ids.shape[1]}")
    processor = load_processor(processor_dir(cfg))
    layout = ParallelLayout(world=world, pipeline=2, expert=2, schedule=schedule)
    coords = layout.coords(rank)
    mine = rows[coords.d :: layout.data]
    targets = sum(r.num_loss_tokens for r in rows)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    whole = apply_lora(build_model(cfg, processor), cfg.lora)
    full = seeded_adapter_state(whole)
    with torch.no_grad():
        for n, p in whole.named_parameters():
            if p.requires_grad:
                p.copy_(full[n])
    ref_sums, ref_grads, ref_stats = one_process(
        whole, rows, global_targets=targets, processor=processor
    )
    t_ref = time.perf_counter() - t0
    del whole

    groups = LayoutGroups(layout)
    torch.manual_seed(cfg.train.seed)
    model = ep.distribute_experts(build_model(cfg, processor), layout, groups)
    model = ep.apply_lora_ep(model, cfg.lora, layout, groups)
    ep.load_full_adapter_state(model, full)
    runner = PipelineRunner(
        model,
        layout,
        groups,
        seq_length=rows[0].input_ids.shape[1],
        n_microbatches=len(mine),
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
    )
    t0 = time.perf_counter()
    loss = runner.step(mine, global_targets=targets)
    ep.reduce_adapter_grads(model, groups)
    t_pp = time.perf_counter() - t0
    grads = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model, grads=True)))
    # Σ over the pipelines: stage 0's ranks count their pipeline's loss once
    total = all_reduce_sum(torch.tensor([loss if coords.stage == 0 else 0.0], dtype=torch.float64))
    stats = all_reduce_sum(runner.router_stats.to_tensor().clone())
    out = {
        "case": name,
        "rank": rank,
        "stage": coords.stage,
        "d": coords.d,
        "ep_rank": coords.ep_rank,
        "rows": len(mine),
        "targets": targets,
        "loss_sum": float(total[0]),
        "ref_loss_sum": sum(ref_sums),
        "router_stats_max_abs": float((stats - ref_stats.to_tensor()).abs().max()),
        "names": runner.param_names,
        "expert_names": ep.expert_parameter_names(model),
        "seconds_reference": t_ref,
        "seconds_pipeline_step": t_pp,
    }
    if rank == 0:
        assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))[:4]
        out["grads"] = _diffs(grads, ref_grads)
    return out


def _with(row, **changes):
    from dataclasses import replace

    return replace(row, **changes)


def main(work: str, rows_path: str, out: str, *names: str) -> None:
    init_from_env(timeout_s=180)
    try:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        rows = torch.load(rows_path, weights_only=False)
        results = []
        for name in names or CASES:
            t0 = time.perf_counter()
            if name in PP_EP_CASES:
                r = run_pp_ep_case(name, work, rows, rank, world)
            else:
                r = run_case(name, work, rows, rank, world)
            r["seconds_case"] = time.perf_counter() - t0
            results.append(r)
        gathered = all_gather_object(results)
        if rank == 0:
            Path(out).write_text(json.dumps({"world": world, "by_rank": gathered}))
    finally:
        shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
