"""Expert parallelism against one process, on every rank of a torchrun launch.

Run by ``tests/integration/test_expert_parallel.py`` as ``python -m torch.distributed.run
--standalone --nproc-per-node=N -m tests.integration.ep_check WORK OUT.json E [E ...]``:
one case per expert-parallel size E (FSDP over all N ranks, transformers' engine; E = 1 is
FSDP alone), all in this one launch. Rank 0 runs the one-process reference (the ordinary
PEFT model with ``target_modules`` + ``target_parameters``) over every rank's rows of the
step, with the same adapter values, and writes the comparison:

- loss and every LoRA gradient (dense and expert, after the reductions), packed rows;
- the same conversations padded (unpacked) under EP, against EP's packed run
  (``--unpacked-reference``: and the same on one rank);
- the initial adapters (same seed as PEFT), their names and order, the full-state round
  trip, the clipped norm and the weights after one AdamW step;
- per router call, the (token, expert) pairs each expert-parallel rank's experts received;
  ``--no-tokens``: a step in which routing never picks the last EP rank's experts;
- ``--stage-mesh`` (4 ranks): the pipeline layout's split (2 stages × EP 2, no FSDP);
- ``--inference``: a no-grad forward and ``generate()`` under EP (every rank together).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from packline.catalog import processor_dir
from packline.qwen.forward import packed_forward
from packline.qwen.processor import load_processor
from packline.train import expert_parallel as ep
from packline.train.checkpoint import AdapterState
from packline.train.distributed import all_gather_object, all_reduce_sum, init_from_env, shutdown
from packline.train.layout import LayoutGroups
from packline.train.setup import apply_lora, build_model
from schemas.layout import ParallelLayout
from tests.integration.parallel_rows import (
    one_process_step,
    padded_micro_batches,
    parallel_config,
    seeded_adapter_state,
    step_rows,
)

UNPACKED_MICRO = 8  # conversations per padded micro-batch (the trainer's default)


def _diff(got: dict, want: dict) -> dict:
    """Max |Δ| and max |Δ| / max |want| over the tensors of ``want`` (and ``got`` has the
    same names)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    abs_, rel = 0.0, 0.0
    worst = ""
    for k, w in want.items():
        d = (got[k].double() - w.double()).abs().max().item()
        scale = w.double().abs().max().item()
        r = d / scale if scale else d
        abs_ = max(abs_, d)
        if r >= rel:
            rel, worst = r, k
    return {"max_abs": abs_, "max_rel": rel, "worst": worst}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _values(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Routing:
    """Forward hooks on every MoE router: count the (token, expert) pairs each EP rank's
    experts get, and optionally route around a set of experts (as if its router never
    picked them; the same on every model)."""

    def __init__(self, model, num_experts: int, ep_size: int, avoid: set[int] = frozenset()):
        self.num_experts, self.ep_size, self.avoid = num_experts, ep_size, sorted(avoid)
        self.counts: list[list[int]] = []
        self.handles = [
            m.register_forward_hook(self._hook)
            for n, m in model.named_modules()
            if type(m).__name__.endswith("TopKRouter")
        ]

    def _hook(self, module, args, out):
        logits, scores, indices = out
        if self.avoid:
            masked = logits.float().clone()
            masked[:, self.avoid] = float("-inf")
            probs = torch.softmax(masked, dim=-1)
            top, indices = torch.topk(probs, module.top_k, dim=-1)
            scores = (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)
        per_rank = indices.reshape(-1) // (self.num_experts // self.ep_size)
        self.counts.append(torch.bincount(per_rank, minlength=self.ep_size).tolist())
        return logits, scores, indices

    def remove(self):
        for h in self.handles:
            h.remove()


def _equal_count_step(model, micro: list, *, num_targets: int, kw: dict, packed: bool) -> float:
    """:func:`one_process_step` on this rank's micro-batches, padded with zero-weighted
    repeats to the largest count on any rank (every rank must run the experts' all-to-all
    the same number of times)."""
    most = max(all_gather_object(len(micro)))
    loss, _ = one_process_step(model, micro, num_targets=num_targets, packed=packed, **kw)
    if len(micro) < most:
        extra = [micro[0]] * (most - len(micro))
        # zero-weighted: forward + backward run (their collectives too), adding nothing
        one_process_step(model, extra, num_targets=float("inf"), packed=packed, **kw)
    return loss


def run_case(E: int, ctx: dict, *, unpacked: bool) -> dict:
    cfg, proc, rows, kw, full = ctx["cfg"], ctx["proc"], ctx["rows"], ctx["kw"], ctx["full"]
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    layout = ParallelLayout(world=world, expert=E, fsdp=True)
    groups = LayoutGroups(layout)
    torch.manual_seed(cfg.train.seed)
    default_group = dist.distributed_c10d._get_default_group()
    model = ep.distribute_experts(build_model(cfg, proc), layout, groups)
    model = ep.apply_lora_ep(model, cfg.lora, layout, groups)
    out: dict = {
        "E": E,
        "world": world,
        "same_default_group": dist.distributed_c10d._get_default_group() is default_group,
        # each expert stack's local part is a copy of its own, not a view of the whole stack
        "expert_local_bytes": sorted(
            {
                (p.to_local().untyped_storage().nbytes(), p.to_local().numel() * p.element_size())
                for n, p in model.named_parameters()
                if ".experts." in n and hasattr(p, "to_local")
            }
        ),
    }
    initial = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model)))
    ep.load_full_adapter_state(model, full)
    roundtrip = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model)))
    own = AdapterState(model).state_dict()  # what a checkpoint holds of this rank
    dense, expert = ep.adapter_params(model)
    with torch.no_grad():
        for p in dense + expert:
            p.zero_()
    AdapterState(model).load_state_dict(own)  # a rank's own part back (resume)
    local_roundtrip = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model)))
    params = dense + expert
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    num_targets = ctx["num_targets"]

    # packed rows, with the tokens each EP rank's experts receive
    routing = Routing(model, ctx["num_experts"], E)
    loss_p = one_process_step(model, rows, num_targets=num_targets, **kw)[0]
    routing.remove()
    ep.reduce_adapter_grads(model, groups)
    grads_p = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model, grads=True)))
    sent = all_gather_object(routing.counts)  # [rank][layer][ep rank]
    loss_p = float(all_reduce_sum(torch.tensor([loss_p], dtype=torch.float64)).item())
    kept = [p.grad.clone() for p in params]

    # the same conversations, padded (unpacked)
    if unpacked:
        for p in params:
            p.grad = None
        micro = padded_micro_batches(rows, pad_token_id=ctx["pad"], size=ctx["micro"])
        loss_u = _equal_count_step(model, micro, num_targets=num_targets, kw=kw, packed=False)
        ep.reduce_adapter_grads(model, groups)
        parts = all_gather_object(ep.local_adapter_state(model, grads=True))
        grads_u = ep.merge_adapter_states(parts)
        loss_u = float(all_reduce_sum(torch.tensor([loss_u], dtype=torch.float64)).item())

    # clip over both meshes, one AdamW step
    for p, g in zip(params, kept, strict=True):
        p.grad = g
    norm = float(ep.clip_adapter_grads(model, layout, cfg.train.grad_clip))
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    opt.step()
    stepped = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model)))
    seconds = time.perf_counter() - t0

    if rank == 0:
        ref = ctx["ref"]
        tokens = [
            [sum(sent[r][layer][k] for r in _ep_group(layout, g)) for k in range(E)]
            for g in range(layout.expert_data)
            for layer in range(len(sent[0]))
        ]
        if unpacked:
            out.update(
                loss_unpacked=loss_u,
                grads_unpacked_vs_packed=_diff(grads_u, grads_p),
            )
        same_grads_norm, same_grads_step = _adamw_step(full, grads_p, cfg)
        out.update(
            names_in_peft_order=names == list(ctx["peft_initial"]),
            initial_equals_peft=_equal_states(initial, ctx["peft_initial"]),
            roundtrip_exact=_equal_states(roundtrip, full) and _equal_states(local_roundtrip, full),
            loss_packed=loss_p,
            loss_reference=ref["loss"],
            grads_packed_vs_reference=_diff(grads_p, ref["grads"]),
            grad_norm=norm,
            grad_norm_reference=ref["norm"],
            grad_norm_same_grads=same_grads_norm,
            # one process stepping EP's own (merged) gradients: the sliced step is that step
            weights_after_step_same_grads=_diff(stepped, same_grads_step),
            # the reference's own step: AdamW's first step is lr * g / (|g| + eps), so
            # gradients near zero turn their rounding into visible weight differences
            weights_after_step=_diff(stepped, ref["stepped"]),
            update_size=max(
                (ref["stepped"][k] - full[k]).abs().max().item() for k in ref["stepped"]
            ),
            tokens_per_ep_rank=tokens,
            min_tokens_per_ep_rank=min(min(t) for t in tokens),
            num_expert_params=len(expert),
            num_dense_params=len(dense),
            dense_params_dtensor=any(hasattr(p, "to_local") for p in dense),
            seconds=seconds,
        )
    if E > 1 and "model" not in ctx:  # the first EP case serves the checks below
        ctx["model"], ctx["layout"], ctx["groups"] = model, layout, groups
    return out


def _adamw_step(values: dict, grads: dict, cfg) -> tuple[float, dict]:
    """One process: clip ``grads`` and take one AdamW step from ``values``."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in values.items()}
    for k, p in params.items():
        p.grad = grads[k].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.train.grad_clip))
    opt = torch.optim.AdamW(
        list(params.values()), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    opt.step()
    return norm, {k: p.detach() for k, p in params.items()}


def _ep_group(layout: ParallelLayout, copy: int) -> list[int]:
    return [copy * layout.expert + e for e in range(layout.expert)]


def _equal_states(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def no_tokens_case(ctx: dict) -> dict:
    """A packed step in which no token is routed to the last EP rank's experts."""
    model, layout, groups = ctx["model"], ctx["layout"], ctx["groups"]
    rank, E, n = dist.get_rank(), layout.expert, ctx["num_experts"]
    avoid = set(range(n - n // E, n))
    ep.load_full_adapter_state(model, ctx["full"])
    dense, expert = ep.adapter_params(model)
    for p in dense + expert:
        p.grad = None
    routing = Routing(model, n, E, avoid)
    loss = one_process_step(model, ctx["rows"], num_targets=ctx["num_targets"], **ctx["kw"])[0]
    routing.remove()
    local_none = [p.grad is None for p in expert]
    ep.reduce_adapter_grads(model, groups)
    grads = ep.merge_adapter_states(all_gather_object(ep.local_adapter_state(model, grads=True)))
    loss = float(all_reduce_sum(torch.tensor([loss], dtype=torch.float64)).item())
    sent = all_gather_object(routing.counts)
    none_by_rank = all_gather_object(any(local_none))
    out = {}
    if rank == 0:
        ref = ctx["ref_model"]
        ep.load_full_adapter_state(ref, ctx["full"])
        ref.zero_grad(set_to_none=True)
        ref_routing = Routing(ref, n, E, avoid)
        ref_loss = one_process_step(ref, ctx["all_rows"], **ctx["kw"])[0]
        ref_routing.remove()
        last = E - 1
        out = {
            "tokens_to_last_ep_rank": sum(c[last] for r in sent for c in r),
            "loss": loss,
            "loss_reference": ref_loss,
            "grads_vs_reference": _diff(grads, _grads(ref)),
            "expert_grads_none_before_reduce": none_by_rank,
        }
    return out


def stage_mesh_case(ctx: dict) -> dict:
    """The ``pipeline > 1`` split (4 ranks: 2 stages × EP 2, no FSDP) without a pipeline:
    each rank runs the whole model, the stages on the same rows (data ranks 0 and 1's), so
    the EP sub-meshes {0,1} and {2,3} each equal one process over those rows."""
    cfg, proc, kw = ctx["cfg"], ctx["proc"], ctx["kw"]
    rank = dist.get_rank()
    layout = ParallelLayout(world=4, pipeline=2, expert=2)
    groups = LayoutGroups(layout)
    torch.manual_seed(cfg.train.seed)
    model = ep.distribute_experts(build_model(cfg, proc), layout, groups)
    model = ep.apply_lora_ep(model, cfg.lora, layout, groups)
    ep.load_full_adapter_state(model, ctx["full"])
    rows = ctx["rows_by_rank"][layout.coords(rank).d]
    pipeline_rows = [r for d in range(layout.data) for r in ctx["rows_by_rank"][d]]
    num_targets = sum(r.num_loss_tokens for r in pipeline_rows)
    loss = one_process_step(model, rows, num_targets=num_targets, **kw)[0]
    ep.reduce_adapter_grads(model, groups)
    parts = all_gather_object(ep.local_adapter_state(model, grads=True))
    losses = all_gather_object(loss)
    out = {}
    if rank == 0:
        grads = ep.merge_adapter_states(parts)  # also: stage 1's copies equal stage 0's
        ref = ctx["ref_model"]
        ep.load_full_adapter_state(ref, ctx["full"])
        ref.zero_grad(set_to_none=True)
        ref_loss = one_process_step(ref, pipeline_rows, **kw)[0]
        out = {
            "loss_by_stage": [sum(losses[:2]), sum(losses[2:])],
            "loss_reference": ref_loss,
            "grads_vs_reference": _diff(grads, _grads(ref)),
            "expert_param_is_dtensor": hasattr(
                model.get_submodule(
                    "base_model.model.model.language_model.layers.0.mlp.experts.base_layer.base_layer"
                ).gate_up_proj,
                "to_local",
            ),
        }
    return out


def inference_case(ctx: dict) -> dict:
    """No-grad packed forward and greedy ``generate()`` under EP (all ranks), against the
    reference on rank 0."""
    model, rank = ctx["model"], dist.get_rank()
    ep.load_full_adapter_state(model, ctx["full"])
    model.eval()
    with torch.no_grad():
        logits = packed_forward(model, ctx["rows"][0], **ctx["kw"])
    prompt = ctx["proc"].tokenizer("a red circle and a blue square", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(
            **prompt, max_new_tokens=4, do_sample=False, use_cache=False
        ).tolist()
    out = {}
    if rank == 0:
        ref = ctx["ref_model"]
        ep.load_full_adapter_state(ref, ctx["full"])
        ref.eval()
        with torch.no_grad():
            want = packed_forward(ref, ctx["rows"][0], **ctx["kw"])
            want_gen = ref.generate(
                **prompt, max_new_tokens=4, do_sample=False, use_cache=False
            ).tolist()
        out = {
            "no_grad_logits_max_abs": (logits - want).abs().max().item(),
            "generated": generated,
            "generated_reference": want_gen,
        }
    gens = all_gather_object(generated)
    if rank == 0:
        out["generated_equal_across_ranks"] = all(g == gens[0] for g in gens)
    return out


def reference(ctx: dict, *, unpacked: bool = False) -> None:
    """Rank 0: the one-process PEFT model over all ranks' rows (packed), clipped and
    stepped like the EP model."""
    cfg, proc = ctx["cfg"], ctx["proc"]
    torch.manual_seed(cfg.train.seed)
    ref = apply_lora(build_model(cfg, proc), cfg.lora)
    ctx["peft_initial"] = _values(ref)
    ctx["full"] = full = seeded_adapter_state(ref)
    ctx["ref_model"] = ref
    if dist.get_rank() != 0:
        return
    ep.load_full_adapter_state(ref, full)
    t0 = time.perf_counter()
    loss, _ = one_process_step(ref, ctx["all_rows"], **ctx["kw"])
    grads = _grads(ref)
    params = [p for p in ref.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip))
    torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay).step()
    ctx["ref"] = {
        "loss": loss,
        "grads": grads,
        "norm": norm,
        "stepped": _values(ref),
        "seconds": time.perf_counter() - t0,
    }
    if unpacked:  # packed vs padded on one rank: the baseline of the same check under EP
        ep.load_full_adapter_state(ref, full)
        ref.zero_grad(set_to_none=True)
        micro = padded_micro_batches(ctx["all_rows"], pad_token_id=ctx["pad"], size=ctx["micro"])
        loss_u, _ = one_process_step(ref, micro, packed=False, **ctx["kw"])
        ctx["ref"]["unpacked"] = {
            "loss_packed": loss,
            "loss_unpacked": loss_u,
            "grads_unpacked_vs_packed": _diff(_grads(ref), grads),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("experts", type=int, nargs="+")
    ap.add_argument("--rows-per-rank", type=int, default=1)
    ap.add_argument(
        "--unpacked",
        type=int,
        nargs="*",
        default=None,
        help="cases (E) with the padded check; default all",
    )
    ap.add_argument(
        "--unpacked-reference", action="store_true", help="packed vs padded on one rank too"
    )
    ap.add_argument("--seq-length", type=int, default=None)
    ap.add_argument(
        "--micro", type=int, default=UNPACKED_MICRO, help="conversations per padded batch"
    )
    ap.add_argument("--no-tokens", action="store_true")
    ap.add_argument("--inference", action="store_true")
    ap.add_argument("--stage-mesh", action="store_true", help="4 ranks: the PP 2 x EP 2 split")
    args = ap.parse_args()
    init_from_env()
    try:
        t0 = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        overrides = [f"train.global_batch_size={world * args.rows_per_rank}"]
        if args.seq_length:
            overrides.append(f"packing.seq_length={args.seq_length}")
        cfg = parallel_config(args.work, *overrides)
        proc = load_processor(processor_dir(cfg))
        rows = step_rows(cfg, d=rank, data=world)[0]
        rows_by_rank = all_gather_object(rows)
        all_rows = [r for part in rows_by_rank for r in part]
        ctx = {
            "cfg": cfg,
            "proc": proc,
            "rows": rows,
            "rows_by_rank": rows_by_rank,
            "all_rows": all_rows,
            "num_targets": sum(r.num_loss_tokens for r in all_rows),
            "pad": int(proc.tokenizer.pad_token_id),
            "micro": args.micro,
            "kw": {
                "image_token_id": int(proc.image_token_id),
                "video_token_id": int(proc.video_token_id),
            },
        }
        reference(ctx, unpacked=args.unpacked_reference)
        ctx["num_experts"] = ctx["ref_model"].config.text_config.num_experts
        result = {
            "world": world,
            "rows": [r.num_conversations for r in all_rows],
            "row_width": int(rows[0].input_ids.shape[1]),
            "cases": [
                run_case(E, ctx, unpacked=args.unpacked is None or E in args.unpacked)
                for E in args.experts
            ],
        }
        if args.no_tokens:
            result["no_tokens"] = no_tokens_case(ctx)
        if args.stage_mesh:
            result["stage_mesh"] = stage_mesh_case(ctx)
        if args.inference:
            result["inference"] = inference_case(ctx)
        if rank == 0:
            result["reference_seconds"] = ctx["ref"]["seconds"]
            result["one_rank"] = ctx["ref"].get("unpacked")
            result["seconds"] = time.perf_counter() - t0
            Path(args.out).write_text(json.dumps(result, indent=1))
        dist.barrier()
    finally:
        shutdown()


if __name__ == "__main__":
    main()
