"""The model against the data: the processor against the model's config, and the LoRA
targets against the model's modules and parameters (the ``model`` rules of validate). The
model is built on the meta device from its config: no weight is read."""

from __future__ import annotations

import difflib

import torch

from packline.backends import backend
from packline.qwen.attention import resolve_attention, varlen_problem
from packline.qwen.processor import processor_geometry, special_token_ids
from packline.rules.inputs import Inputs
from packline.train.distributed import rank_device
from packline.train.memory import GIB, StepShape, forecast_peak
from packline.train.setup import lora_target_matches
from schemas.config import (
    ExecutorKind,
)
from schemas.rules import (
    Finding,
    RuleBook,
    error,
    train_world,
)

# --- model against data (processor vs model config; LoRA targets) ---------------------------

MODEL_RULES = RuleBook()


@MODEL_RULES.rule("model.config", "model", "the model's config loads as a Qwen3-VL config")
def _model_config(x: Inputs) -> list[Finding]:
    if x.model_config_problem is None:
        x.facts["model"] = {
            "type": x.model_config.model_type,
            "source": x.cfg.model.path or f"tiny (moe={x.cfg.model.moe})",
        }
        return []
    return [
        error(
            "model.path",
            f"model.path {x.cfg.model.path!r}: {x.model_config_problem}",
            "point model.path at a local Hugging Face Qwen3-VL checkpoint dir (its "
            "config.json is all validate reads)",
        )
    ]


@MODEL_RULES.rule(
    "model.moe", "model", "model.moe says what model.path's checkpoint is (dense or MoE)"
)
def _moe_flag(x: Inputs) -> list[Finding] | None:
    if not x.model_ok or not x.cfg.model.path:
        return None
    is_moe = x.model_config.model_type == "qwen3_vl_moe"
    if is_moe == x.cfg.model.moe:
        return []
    what = "an MoE (qwen3_vl_moe)" if is_moe else "a dense (qwen3_vl)"
    fix = (
        "set model.moe=true"
        if is_moe
        else "set model.path=null to build the tiny MoE at random, or point model.path at an "
        "MoE checkpoint"
    )
    return [
        error(
            "model.moe",
            f"model.moe is {str(x.cfg.model.moe).lower()} but model.path {x.cfg.model.path!r} "
            f"holds {what} model: the MoE settings (experts, EP, the router's loss) would "
            "not apply to what trains",
            fix,
        )
    ]


#: processor token → model config attribute that must hold the same id
TOKEN_ID_FIELDS = (
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("vision_start_token_id", "<|vision_start|>"),
    ("vision_end_token_id", "<|vision_end|>"),
)


@MODEL_RULES.rule(
    "model.token_ids",
    "model",
    "the processor's special-token ids equal the model config's",
)
def _token_ids(x: Inputs) -> list[Finding] | None:
    if not x.model_ok:
        return None
    ids = special_token_ids(x.processor)
    out, seen = [], {}
    for name, token in TOKEN_ID_FIELDS:
        ours, theirs = ids[name], getattr(x.model_config, name, None)
        seen[name] = {"processor": ours, "model": theirs}
        if theirs is not None and int(theirs) != int(ours):
            out.append(
                error(
                    "processor.path",
                    f"the processor's {name} is {ours} ({token}) but the model config's is "
                    f"{theirs}: the model would not find the processor's {token} tokens",
                    "use the processor and the model of the same checkpoint (processor.path, "
                    "model.path)",
                )
            )
    x.facts["token_ids"] = seen
    return out


@MODEL_RULES.rule(
    "model.vocab", "model", "every processor token id is inside the model's vocabulary"
)
def _vocab(x: Inputs) -> list[Finding] | None:
    if not x.model_ok:
        return None
    ours, theirs = len(x.processor.tokenizer), int(x.model_config.text_config.vocab_size)
    x.facts["vocab"] = {"processor": ours, "model": theirs}
    if ours <= theirs:
        return []
    return [
        error(
            "processor.path",
            f"the processor has {ours} token ids but the model's text_config.vocab_size is "
            f"{theirs}: ids from {theirs} on index past the embedding",
            "use the processor and the model of the same checkpoint (processor.path, model.path)",
        )
    ]


@MODEL_RULES.rule(
    "model.vision_geometry",
    "model",
    "the processor's patch, temporal patch and merge sizes equal the vision tower's",
)
def _vision_geometry(x: Inputs) -> list[Finding] | None:
    if not x.model_ok:
        return None
    g = processor_geometry(x.processor)
    vision = x.model_config.vision_config
    out, seen = [], {}
    for ours_name, ours, theirs_name in (
        ("patch_size", g.patch_size, "patch_size"),
        ("temporal_patch_size", g.temporal_patch_size, "temporal_patch_size"),
        ("merge_size", g.merge_size, "spatial_merge_size"),
    ):
        theirs = int(getattr(vision, theirs_name))
        seen[ours_name] = {"processor": ours, "model": theirs}
        if ours != theirs:
            out.append(
                error(
                    "processor.path",
                    f"the processor's {ours_name} is {ours} but the model's "
                    f"vision_config.{theirs_name} is {theirs}: image patches would not match "
                    "the vision tower",
                    "use the processor and the model of the same checkpoint (processor.path, "
                    "model.path)",
                )
            )
    x.facts["vision_geometry"] = seen
    return out


@MODEL_RULES.rule(
    "model.vision_text_width",
    "model",
    "the vision tower's output width equals the language model's hidden size",
)
def _vision_text_width(x: Inputs) -> list[Finding] | None:
    if not x.model_ok:
        return None
    out_width = int(x.model_config.vision_config.out_hidden_size)
    hidden = int(x.model_config.text_config.hidden_size)
    if out_width == hidden:
        return []
    return [
        error(
            "model.path",
            f"the model's vision_config.out_hidden_size is {out_width} but its "
            f"text_config.hidden_size is {hidden}: merged image features cannot enter the "
            "language model",
            "use a consistent Qwen3-VL config.json",
        )
    ]


@MODEL_RULES.rule(
    "model.parallel",
    "model",
    "train.parallel splits the model's decoder layers into whole stages and its experts evenly",
)
def _model_parallel(x: Inputs) -> list[Finding] | None:
    if not x.model_ok or not backend(x.cfg).trains_here:
        return None  # Bridge splits the model itself (megatron rules)
    from schemas.layout import ParallelLayout

    text = getattr(x.model_config, "text_config", x.model_config)
    par = x.cfg.train.parallel
    layout = ParallelLayout.from_config(par, train_world(x.cfg))
    found = layout.model_problems(
        num_layers=text.num_hidden_layers, num_experts=getattr(text, "num_experts", None)
    )
    x.facts["parallel"] = {
        "ranks": layout.world,
        "pipeline_parallel": layout.pipeline,
        "expert_parallel": layout.expert,
        "data_parallel": layout.data,
        "fsdp": layout.fsdp,
    }
    # the rest of the layout's problems are config rules (train.parallel / slurm.parallel)
    return [
        error(
            "train.parallel",
            f"train.parallel: {problem} ({x.cfg.model.path or 'the tiny model'}: "
            f"{text.num_hidden_layers} layers, {getattr(text, 'num_experts', 0) or 'no'} experts)",
            "change train.parallel.pipeline_parallel / expert_parallel",
        )
        for problem in found
    ]


@MODEL_RULES.rule(
    "model.attention",
    "model",
    "model.attention runs on the device that trains (varlen: CUDA, Ampere or later; flex: "
    "trains on CUDA only)",
)
def _attention_device(x: Inputs) -> list[Finding] | None:
    cfg = x.cfg
    if not backend(cfg).trains_here or cfg.executor.kind is ExecutorKind.slurm:
        return None  # the train node's device is not this machine's
    device = rank_device()
    chosen = resolve_attention(cfg.model.attention.value, device)
    x.facts["attention"] = {"configured": cfg.model.attention.value, "runs": chosen}
    problem = None
    if chosen == "varlen":
        problem = varlen_problem(device)
    elif chosen == "flex" and device.type != "cuda":
        problem = f"torch {torch.__version__}'s FlexAttention has no backward on {device.type}"
    if problem is None:
        return []
    return [
        error(
            "model.attention",
            f"model.attention {chosen} cannot train here: {problem}",
            "set model.attention=auto (varlen where it runs, thd elsewhere)",
        )
    ]


@MODEL_RULES.rule(
    "lora.targets",
    "lora",
    "every LoRA target matches at least one module (or parameter) of the model",
)
def _lora_targets(x: Inputs) -> list[Finding] | None:
    if not x.model_ok:
        return None
    lora = x.cfg.lora
    model = x.model
    matches = lora_target_matches(model, list(lora.target_modules), list(lora.target_parameters))
    x.facts["lora_targets"] = {f"{m.kind}:{m.target}": len(m.matched) for m in matches}
    experts = [n for n, p in model.named_parameters() if p.dim() == 3]
    expert_suffixes = sorted({".".join(n.split(".")[-3:]) for n in experts})
    leaves = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if _wraps(mod)})
    out = []
    for m in matches:
        if m.matched:
            continue
        if m.kind == "parameter":
            hint = f" (3-D parameters: {', '.join(expert_suffixes)})" if experts else ""
            out.append(
                error(
                    "lora.target_parameters",
                    f"lora.target_parameters entry {m.target!r} matches no parameter of the model",
                    f"remove it, or name a parameter by its path{hint}",
                )
            )
        elif m.unsupported:
            example = m.unsupported[0]
            kind = type(model.get_submodule(example)).__name__
            out.append(
                error(
                    "lora.target_modules",
                    f"lora.target_modules entry {m.target!r} matches only modules LoRA cannot "
                    f"wrap ({kind}, e.g. {example})",
                    "target the linear layers inside it by name",
                )
            )
        elif experts and _names_an_mlp_projection(m.target, experts):
            out.append(
                error(
                    "lora.target_modules",
                    f"lora.target_modules entry {m.target!r} matches no module of the model: "
                    "its MoE experts are 3-D parameters, which target_modules never match, so "
                    "the adapter would silently not train them",
                    f"remove {m.target!r} from lora.target_modules and set "
                    f"lora.target_parameters=[{','.join(expert_suffixes)}]",
                )
            )
        else:
            close = difflib.get_close_matches(m.target, leaves, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(
                error(
                    "lora.target_modules",
                    f"lora.target_modules entry {m.target!r} matches no module of the model",
                    f"remove it, or name a linear layer of the model{hint}",
                )
            )
    return out


#: names of dense-MLP projections, which MoE models keep only as 3-D expert parameters
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3")


def _names_an_mlp_projection(target: str, expert_params: list[str]) -> bool:
    leaf = target.rsplit(".", 1)[-1]
    return leaf in MLP_PROJECTIONS or any(p.endswith(leaf) for p in expert_params)


def _wraps(module: torch.nn.Module) -> bool:
    from packline.train.setup import LORA_MODULE_TYPES

    return isinstance(module, LORA_MODULE_TYPES)


def step_shapes(x: Inputs) -> list[StepShape]:
    """The widest forward of each run the train stage runs, from connect's lengths: a packed
    row of ``packing.seq_length`` (its images in the proportion of the sample richest in
    them), and without packing a padded micro-batch of ``train.unpacked_micro_batch_size``
    of the longest samples."""
    cfg, lengths = x.cfg, x.lengths
    visual = lengths["image_tokens"] + lengths["video_tokens"]
    shapes = []
    if cfg.trains_packed:
        share = float((visual / lengths["total_tokens"]).max()) if len(lengths) else 0.0
        tokens = cfg.packing.seq_length
        visual_tokens = int(share * tokens)
        shapes.append(StepShape(tokens, 4 * visual_tokens, visual_tokens))
    if not cfg.packing.enabled or cfg.train.compare_packing:
        rows = cfg.train.unpacked_micro_batch_size
        longest = int(lengths["total_tokens"].max()) if len(lengths) else 0
        visual_tokens = rows * (int(visual.max()) if len(lengths) else 0)
        shapes.append(StepShape(rows * longest, 4 * visual_tokens, visual_tokens))
    return shapes


@MODEL_RULES.rule(
    "train.memory",
    "train",
    "the per-GPU forecast of a training step's peak fits the GPU's memory",
)
def _memory(x: Inputs) -> list[Finding] | None:
    cfg = x.cfg
    if not x.model_ok or not backend(cfg).trains_here:
        return None  # Bridge sizes its own runs
    slurm = cfg.executor.kind is ExecutorKind.slurm
    device = rank_device()
    gpu = device.type == "cuda" or (slurm and cfg.executor.slurm.gpus_per_node > 0)
    bf16 = cfg.train.precision.value == "bf16" or (cfg.train.precision.value == "auto" and gpu)
    par = cfg.train.parallel
    shards = train_world(cfg) // par.pipeline_parallel if par.fsdp else 1
    split = max(par.expert_parallel, par.pipeline_parallel)
    forecasts = [
        forecast_peak(
            x.model_config,
            shape,
            base_bytes=2 if bf16 else 4,
            compute_bytes=2 if bf16 else 4,
            lora_rank=cfg.lora.rank,
            lora_targets=list(cfg.lora.target_modules),
            lora_expert_targets=list(cfg.lora.target_parameters),
            checkpointing=cfg.train.activation_checkpointing,
            # EP's and PP's engines run the whole logits
            loss_chunk_tokens=cfg.train.loss_chunk_tokens if split == 1 else shape.tokens,
            shards=shards,
            sharded_adapters=par.expert_parallel == 1,  # packline's FSDP2 splits them too
        )
        for shape in step_shapes(x)
    ]
    if not forecasts:
        return None
    worst = max(forecasts, key=lambda f: f.total)
    x.facts["memory"] = {**worst.parts_gib(), "line": worst.line()}
    limit = cfg.train.gpu_memory_gib
    if limit is None and device.type == "cuda" and not slurm:
        limit = torch.cuda.get_device_properties(device).total_memory / GIB
    if limit is None or worst.total / GIB <= limit:
        return []
    fixes = [] if cfg.train.activation_checkpointing else ["train.activation_checkpointing=true"]
    fixes += ["a smaller packing.seq_length or train.unpacked_micro_batch_size"]
    if not par.fsdp:
        fixes.append("train.parallel.fsdp=true over several GPUs")
    return [
        error(
            "train.gpu_memory_gib",
            f"a training step needs about {worst.line()}; the GPU has {limit:.1f} GiB",
            "set " + ", or ".join(fixes),
        )
    ]
