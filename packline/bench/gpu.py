"""``packline bench gpu``: what packing buys on one GPU, measured side by side in one run.

Runs from a bare checkout (``python -m packline.bench.gpu``) with only torch, transformers
and peft installed (and numpy, which torch brings): it imports none of packline's
orchestration (no NeMo-Run, MLflow, Energon, OmegaConf or rich). For each model — Qwen3-VL-2B
and -8B at their real sizes and Qwen3-VL-30B-A3B cut to a few layers with all 128 experts,
random-initialised, bf16, LoRA as the shipped configs adapt them — it builds a stream of
conversations with the VLM-SFT-like length mix of ``packline bench packing``
(:mod:`packline.bench.lengths`: heavy-tailed text, 0-4 images of 256-1,024 visual tokens, a
real image size's patches) and, step by step, trains the very same conversations:

- **packed** into rows of ``--seq-length`` (4,096) tokens by packline's selection, with
  ``model.attention: auto`` (PyTorch's varlen flash kernel on a GPU) and with ``flex``;
- **unpacked**: padded micro-batches of the same conversations (HF ``sdpa`` with a padding
  mask), as many conversations per micro-batch as fit the same token budget;

the three interleaved within each step (so drift of the machine's load cancels), forward
and backward of every row or micro-batch (the weights are not stepped: each variant does
the same work every step). It reports per variant real tokens/s, MFU from packline's exact
FLOPs (:mod:`packline.flops`) and peak GPU memory against packline's forecast
(:mod:`packline.train.memory`); the fraction of the padded run's executed FLOPs packing
removes; and whether packing changes the math in bf16: the per-token loss and the LoRA
gradients of a packed row against each conversation run alone, judged against a noise
floor measured in the same run (alone under ``sdpa`` against alone under ``eager``).

``--smoke`` runs the same code on the CPU at tiny sizes (the test suite runs it: it cannot
rot), where the varlen kernel and flex's backward do not exist: ``auto`` runs ``thd`` and
flex is reported as skipped, with the reason. Numbers are only ever measured, never filled
in: a figure that could not be taken is ``null`` with its reason.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from packline.bench.lengths import VlmSftShape, vlm_sft_samples
from packline.flops import PackShape, mfu, peak_bf16_flops, step_flops
from packline.packing.selection import select_packs
from packline.packing.thd import EncodedConversation, build_packed_batch, build_padded_batch
from packline.qwen.attention import resolve_attention, set_text_attention, varlen_problem
from packline.qwen.forward import packed_loss, padded_loss
from packline.qwen.rope import RopeIndex
from packline.train.memory import GIB, StepShape, forecast_peak

#: The models of the full run: real-size Qwen3-VL (packline/qwen/real_configs.py), the MoE
#: cut to this many decoder layers (all 128 experts) so that one 80 GB GPU holds it.
MODELS = ("qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b")
MOE_LAYERS = 6
SEQ_LENGTH = 4096
DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA_RANK = 16


@dataclass(frozen=True)
class BenchSettings:
    """One run of the benchmark."""

    models: tuple[str, ...] = MODELS
    seq_length: int = SEQ_LENGTH
    conversations_per_step: int = 24
    """Conversations each step trains (one buffer round of the packer)."""
    warmup_steps: int = 2
    steps: int = 6
    """Measured steps per variant (after the warm-up)."""
    seed: int = 0
    smoke: bool = False

    @classmethod
    def smoke_run(cls) -> BenchSettings:
        return cls(
            models=("smoke",),
            seq_length=512,
            conversations_per_step=8,
            warmup_steps=1,
            steps=2,
            smoke=True,
        )


# --- the model ---------------------------------------------------------------------------


def bench_config(name: str):
    """The HF config benchmarked as ``name``: a real-size Qwen3-VL (the MoE cut to
    :data:`MOE_LAYERS` layers), or ``smoke``, a tiny one of the same architecture."""
    from transformers import Qwen3VLConfig

    from packline.qwen.real_configs import TINY_TEXT, TINY_VISION, real_config

    if name != "smoke":
        config = real_config(name)
        if getattr(config.text_config, "num_experts", None):
            config.text_config.num_hidden_layers = MOE_LAYERS
        return config
    ids = {"image_token_id": 4000, "video_token_id": 4001}
    ids |= {"vision_start_token_id": 4002, "vision_end_token_id": 4003}
    return Qwen3VLConfig(
        text_config={**TINY_TEXT, "vocab_size": 4096},
        vision_config=TINY_VISION,
        tie_word_embeddings=False,
        **ids,
    )


def lora_targets(config) -> tuple[list[str], list[str]]:
    """(module targets, 3-D expert parameter targets): what the shipped configs adapt."""
    if getattr(config.text_config, "num_experts", None):
        return MOE_TARGETS, MOE_EXPERT_TARGETS
    return DENSE_TARGETS, []


def build_bench_model(config, device: torch.device, dtype: torch.dtype, seed: int):
    """The model of ``config``, random-initialised straight on ``device`` in ``dtype``, with
    LoRA adapters (fp32, PEFT's default) on :func:`lora_targets`."""
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText

    from packline.train.lora import peft_wrap

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    modules, experts = lora_targets(config)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=modules,
                      target_parameters=experts or None)  # fmt: skip
    model = peft_wrap(model, lora)
    for p in model.parameters():  # adapters away from zero: every gradient flows
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


# --- the conversations -------------------------------------------------------------------


def _image_grid(tokens: int, merge: int) -> tuple[int, int, int]:
    """A near-square patch grid of ``tokens`` visual tokens (``merge``² patches each)."""
    rows = max(1, int(math.sqrt(tokens)))
    cols = -(-tokens // rows)
    return (1, rows * merge, cols * merge)


def make_conversations(
    config, settings: BenchSettings, device: torch.device, dtype: torch.dtype
) -> list[EncodedConversation]:
    """The stream: :func:`vlm_sft_samples` shaped conversations, each ``<vision_start>
    <image_pad>… <vision_end>`` per image, then its question, then the answer it is trained
    on (the last 60 % of its text), random token ids and pixels, M-RoPE positions from HF's
    own rope index; longer than a row: left out (as overlength)."""
    text, vision = config.text_config, config.vision_config
    merge, patch = vision.spatial_merge_size, vision.patch_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * patch * patch
    shape = VlmSftShape() if not settings.smoke else VlmSftShape(
        text_median=60, text_max=400, image_tokens_min=8, image_tokens_max=48, visual_budget=96
    )  # fmt: skip
    total = settings.conversations_per_step * (settings.warmup_steps + settings.steps) * 2
    rope = RopeIndex(merge)
    rng = random.Random(settings.seed)
    out = []
    for n, (text_tokens, images) in enumerate(
        vlm_sft_samples(total, seed=settings.seed, shape=shape)
    ):
        grids = [_image_grid(t, merge) for t in images]
        visual = [t * h * w // merge**2 for t, h, w in grids]
        length = text_tokens + sum(v + 2 for v in visual)
        if length > settings.seq_length:
            continue
        ids, types = [], []
        for v in visual:
            ids += [
                config.vision_start_token_id,
                *[config.image_token_id] * v,
                config.vision_end_token_id,
            ]
            types += [0, *[1] * v, 0]
        words = [rng.randrange(10, min(text.vocab_size, 3000)) for _ in range(text_tokens)]
        ids += words
        types += [0] * text_tokens
        target = torch.zeros(len(ids), dtype=torch.bool)
        target[len(ids) - int(0.6 * text_tokens) :] = True
        input_ids = torch.tensor(ids, dtype=torch.long)
        image_grid = torch.tensor(grids, dtype=torch.long) if grids else None
        mrope = rope.positions(input_ids, torch.tensor(types), image_grid)
        patches = sum(t * h * w for t, h, w in grids)
        out.append(
            EncodedConversation(
                key=f"c{n}",
                input_ids=input_ids,
                target_mask=target,
                mrope=mrope,
                pixel_values=torch.randn(patches, patch_dim, dtype=dtype) if grids else None,
                image_grid_thw=image_grid,
            )
        )
    return out


# --- one step of each variant --------------------------------------------------------------


@dataclass
class Step:
    """One step's conversations as each variant runs them."""

    convs: list[EncodedConversation]
    packed: list = field(default_factory=list)
    """Packed rows (``PackedBatch``), each as long as what it holds."""
    packed_fixed: list = field(default_factory=list)
    """The same rows padded to ``seq_length`` (one shape: what flex compiles once for)."""
    padded: list = field(default_factory=list)
    """Padded micro-batches (``PaddedBatch``), at most ``seq_length`` tokens each."""

    @property
    def real_tokens(self) -> int:
        return sum(len(c) for c in self.convs)


def make_step(convs: list[EncodedConversation], seq_length: int, config, seed: int) -> Step:
    """The step's packed rows (packline's ``refined`` selection; also padded to
    ``seq_length``, one shape, which flex compiles once for) and its padded micro-batches
    (conversations in stream order, as many as fit ``seq_length`` padded tokens)."""
    step = Step(convs)
    lengths = [len(c) for c in convs]
    for group in select_packs(lengths, capacity=seq_length, algorithm="refined", seed=seed):
        for fixed, rows in ((False, step.packed), (True, step.packed_fixed)):
            rows.append(
                build_packed_batch(
                    [convs[i] for i in group],
                    seq_length=seq_length,
                    pad_to_max_length=fixed,
                    image_token_id=config.image_token_id,
                )
            )
    batch: list[EncodedConversation] = []
    for conv in convs:
        if batch and (len(batch) + 1) * max(len(conv), *map(len, batch)) > seq_length:
            step.padded.append(build_padded_batch(batch))
            batch = []
        batch.append(conv)
    if batch:
        step.padded.append(build_padded_batch(batch))
    return step


def _to(batch, device, dtype):
    from packline.packing.thd import to_device

    moved = to_device(batch, device)
    for name in ("pixel_values", "pixel_values_videos"):
        value = getattr(moved, name, None)
        if value is not None:
            setattr(moved, name, value.to(dtype))
    return moved


def run_variant(model, step: Step, variant: str, config, device, dtype, sync) -> float:
    """Seconds of forward and backward over every row (packed) or micro-batch (unpacked)
    of ``step`` under ``variant`` (``packed-auto``, ``packed-flex``, ``unpacked``)."""
    attention = {"packed-auto": "auto", "packed-flex": "flex", "unpacked": "sdpa"}[variant]
    set_text_attention(model, attention, device=device)
    batches = {"packed-auto": step.packed, "packed-flex": step.packed_fixed}.get(
        variant, step.padded
    )
    loss_of = packed_loss if variant.startswith("packed") else padded_loss
    moved = [_to(b, device, dtype) for b in batches]
    sync()
    t0 = time.perf_counter()
    for b in moved:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _, _ = loss_of(model, b, image_token_id=config.image_token_id)
        loss.backward()
    sync()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


# --- the figures ---------------------------------------------------------------------------


def step_flops_of(config, step: Step, *, packed: bool) -> tuple[float, float]:
    """(useful, executed) FLOPs of ``step``: useful is the conversations' own work; executed
    is what the layout runs (every padded token through the linears; attention over each
    packed segment, or the whole padded square of each unpacked row)."""
    modules, experts = lora_targets(config)
    targets = [*modules, *[t.rsplit(".", 1)[-1] for t in experts]]
    kw = {"mode": "lora", "lora_rank": LORA_RANK, "lora_targets": _flops_targets(targets)}
    useful = 0.0
    for c in step.convs:
        grids = tuple(tuple(g) for g in (c.image_grid_thw.tolist() if c.num_images else []))
        shape = PackShape(seq_lens=(len(c),), image_grids=grids, padded_len=len(c),
                          loss_tokens=int(c.target_mask.sum()))  # fmt: skip
        useful += step_flops(config, shape, **kw).total
    executed = 0.0
    for b in step.packed if packed else step.padded:
        grids = b.image_grid_thw.tolist() if b.image_grid_thw is not None else []
        if packed:  # each segment as run: its alignment gap, the last one the row's tail
            edges = b.cu_seqlens_padded.tolist()
            lens = tuple(e - s for s, e in zip(edges[:-1], edges[1:], strict=True) if e > s)
        else:  # every row padded to the longest, attention over the whole padded square
            rows, width = b.input_ids.shape
            lens = (width,) * rows
        shape = PackShape(seq_lens=lens, image_grids=tuple(map(tuple, grids)),
                          padded_len=sum(lens), loss_tokens=0)  # fmt: skip
        executed += step_flops(config, shape, **kw).total
    return useful, executed


def _flops_targets(targets: list[str]) -> list[str]:
    from packline.flops import LORA_TARGETS_ALL

    return [t for t in targets if t in LORA_TARGETS_ALL] or list(LORA_TARGETS_ALL)


def agreement(model, step: Step, config, device, dtype) -> dict[str, Any]:
    """Packed vs solo, and the noise floor (solo sdpa vs solo eager), on the step's first
    row: relative difference of the summed per-token loss and of the LoRA gradients."""
    row = step.packed[0]
    keys = set(row.keys)
    solo = [c for c in step.convs if c.key in keys]

    def grads(batches, attention, packed) -> tuple[float, torch.Tensor]:
        set_text_attention(model, attention, device=device)
        model.zero_grad(set_to_none=True)
        total = 0.0
        for b in batches:
            b = _to(b, device, dtype)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss, _, _ = (packed_loss if packed else padded_loss)(
                    model, b, image_token_id=config.image_token_id
                )
            loss.backward()
            total += float(loss.detach())
        flat = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
        return total, flat

    alone = [build_padded_batch([c]) for c in solo]
    packed_loss_sum, g_packed = grads([row], "auto", True)
    sdpa_loss, g_sdpa = grads(alone, "sdpa", False)
    eager_loss, g_eager = grads(alone, "eager", False)

    def rel(a, b):
        return (
            float((a - b).norm() / b.norm()) if isinstance(a, torch.Tensor) else abs(a - b) / abs(b)
        )

    out = {
        "conversations": len(solo),
        "loss_rel": rel(packed_loss_sum, sdpa_loss),
        "grad_rel": rel(g_packed, g_sdpa),
        "floor_loss_rel": rel(eager_loss, sdpa_loss),
        "floor_grad_rel": rel(g_eager, g_sdpa),
    }
    # within the floor: packing differs from solo no more than two kernels do (x2, and a
    # minimum of fp32's own rounding when the floor is exactly 0)
    out["within_floor"] = (
        out["loss_rel"] <= 2 * out["floor_loss_rel"] + 1e-6
        and out["grad_rel"] <= 2 * out["floor_grad_rel"] + 1e-6
    )
    return out


def bench_model(name: str, settings: BenchSettings, device: torch.device) -> dict[str, Any]:
    """Every figure of one model (see the module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = bench_config(name)
    t0 = time.perf_counter()
    model = build_bench_model(config, device, dtype, settings.seed)
    build_seconds = time.perf_counter() - t0
    convs = make_conversations(config, settings, device, dtype)
    per = settings.conversations_per_step
    steps = [
        make_step(convs[i : i + per], settings.seq_length, config, settings.seed + i)
        for i in range(0, per * (settings.warmup_steps + settings.steps), per)
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = ["packed-auto", "packed-flex", "unpacked"]
    skipped: dict[str, str] = {}
    if device.type != "cuda":
        skipped["packed-flex"] = f"torch {torch.__version__}'s FlexAttention has no CPU backward"
    run = [v for v in variants if v not in skipped]
    seconds = {v: 0.0 for v in run}
    peaks = {v: 0 for v in run}
    for i, step in enumerate(steps):
        order = run[i % len(run) :] + run[: i % len(run)]  # A/B/C interleaved, rotated
        for v in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            took = run_variant(model, step, v, config, device, dtype, sync)
            if device.type == "cuda":
                peaks[v] = max(peaks[v], torch.cuda.max_memory_allocated(device))
            if i >= settings.warmup_steps:
                seconds[v] += took
    measured = steps[settings.warmup_steps :]
    real = sum(s.real_tokens for s in measured)
    useful = sum(step_flops_of(config, s, packed=True)[0] for s in measured)
    packed_exec = sum(step_flops_of(config, s, packed=True)[1] for s in measured)
    padded_exec = sum(step_flops_of(config, s, packed=False)[1] for s in measured)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    modules, experts = lora_targets(config)
    figures: dict[str, Any] = {}
    for v in variants:
        if v in skipped:
            figures[v] = {"skipped": skipped[v]}
            continue
        widest = _widest(measured, v)
        forecast = forecast_peak(
            config, widest, base_bytes=dtype.itemsize, compute_bytes=dtype.itemsize,
            lora_rank=LORA_RANK, lora_targets=modules, lora_expert_targets=experts,
            checkpointing=False, loss_chunk_tokens=1024,
        )  # fmt: skip
        rate = useful / seconds[v]
        figures[v] = {
            "real_tokens_per_s": real / seconds[v],
            "seconds": seconds[v],
            "mfu": mfu(rate, device_name),
            "useful_tflops_per_s": rate / 1e12,
            "peak_memory_gib": peaks[v] / GIB if device.type == "cuda" else None,
            "forecast_memory_gib": forecast.total / GIB,
        }
    attention = resolve_attention("auto", device)
    fastest_packed = "packed-auto"
    return {
        "model": name,
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "attention_auto": attention,
        "varlen": varlen_problem(device) or "runs",
        "parameters": sum(p.numel() for p in model.parameters()),
        "build_seconds": build_seconds,
        "seq_length": settings.seq_length,
        "measured_steps": len(measured),
        "conversations_per_step": per,
        "real_tokens": real,
        "packed_rows": sum(len(s.packed) for s in measured),
        "padded_micro_batches": sum(len(s.padded) for s in measured),
        "variants": figures,
        "speedup_real_tokens_per_s": figures[fastest_packed]["real_tokens_per_s"]
        / figures["unpacked"]["real_tokens_per_s"],
        "padded_flops_removed": 1 - packed_exec / padded_exec if padded_exec else None,
        "useful_share_packed": useful / packed_exec if packed_exec else None,
        "useful_share_unpacked": useful / padded_exec if padded_exec else None,
        "peak_bf16_tflops": (peak_bf16_flops(device_name) or 0) / 1e12 or None,
        "agreement": agreement(model, measured[0], config, device, dtype),
    }


def _widest(steps: list[Step], variant: str) -> StepShape:
    """The widest forward of ``variant`` over ``steps``: its row or micro-batch of most
    tokens, with its images."""
    of = {"packed-auto": "packed", "packed-flex": "packed_fixed", "unpacked": "padded"}[variant]
    batches = [b for s in steps for b in getattr(s, of)]
    widest = max(batches, key=lambda b: b.input_ids.numel())
    patches = 0 if widest.pixel_values is None else int(widest.pixel_values.shape[0])
    return StepShape(int(widest.input_ids.numel()), patches, patches // 4)


# --- the command ---------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    """The figures as plain text (no rich: this runs where only torch is installed)."""
    lines = []
    for r in results:
        lines.append(
            f"{r['model']} · {r['device']} · {r['dtype']} · rows of {r['seq_length']:,} · "
            f"{r['measured_steps']} steps × {r['conversations_per_step']} conversations · "
            f"auto = {r['attention_auto']}"
        )
        lines.append(
            f"  {'variant':<12} {'real tok/s':>12} {'MFU':>7} {'peak GiB':>9} {'forecast':>9}"
        )
        for v, f in r["variants"].items():
            if "skipped" in f:
                lines.append(f"  {v:<12} skipped: {f['skipped']}")
                continue
            mfu_text = f"{f['mfu']:.3f}" if f["mfu"] is not None else "n/a"
            peak = f"{f['peak_memory_gib']:.2f}" if f["peak_memory_gib"] is not None else "n/a"
            lines.append(
                f"  {v:<12} {f['real_tokens_per_s']:>12,.0f} {mfu_text:>7} {peak:>9} "
                f"{f['forecast_memory_gib']:>9.2f}"
            )
        a = r["agreement"]
        removed = r["padded_flops_removed"]
        lines.append(
            f"  packed vs unpacked: {r['speedup_real_tokens_per_s']:.2f}x real tokens/s; "
            f"packing removes {removed:.1%} of the padded run's executed FLOPs"
        )
        lines.append(
            f"  packed vs solo ({a['conversations']} conversations): loss {a['loss_rel']:.2e}, "
            f"grads {a['grad_rel']:.2e}; noise floor (sdpa vs eager): loss "
            f"{a['floor_loss_rel']:.2e}, grads {a['floor_grad_rel']:.2e} -> "
            f"{'within' if a['within_floor'] else 'OUTSIDE'} the floor"
        )
    return "\n".join(lines)


def run(settings: BenchSettings, *, as_json: bool = False, out=None) -> list[dict[str, Any]]:
    """Benchmark every model of ``settings`` on this machine's GPU (the CPU for a smoke
    run) and print the table, or the JSON."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if not settings.smoke and device.type != "cuda":
        raise SystemExit("packline bench gpu needs a CUDA GPU (--smoke runs its code on the CPU)")
    results = []
    for name in settings.models:
        results.append(bench_model(name, settings, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(results, indent=2) if as_json else table(results), file=out)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packline bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the tests')")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)}")
    ns = p.parse_args(argv)
    settings = BenchSettings.smoke_run() if ns.smoke else BenchSettings()
    if ns.models:
        models = tuple(m.strip() for m in ns.models.split(","))
        unknown = [m for m in models if m not in (*MODELS, "smoke")]
        if unknown:
            p.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
        settings = BenchSettings(**{**settings.__dict__, "models": models})
    run(settings, as_json=ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
