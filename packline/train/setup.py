"""Model, LoRA adapters and the trainer of one run, from the pipeline config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from transformers.pytorch_utils import Conv1D

from packline.catalog import dataset_path, lengths_path, processor_dir
from packline.counters import flops_model_for
from packline.qwen.attention import set_text_attention
from packline.qwen.model import build_tiny_model, tiny_config
from packline.shapes.answers import SHAPES_SCORER
from packline.tracking import Tracker
from packline.train.data import TrainStream
from packline.train.distributed import broadcast_object, rank_device, rank_world
from packline.train.evaluate import EvalMemo, Evaluator
from packline.train.layout import LayoutGroups
from packline.train.lora import peft_wrap
from packline.train.trainer import Trainer, TrainerSettings, use_bf16
from schemas.layout import ParallelLayout

#: Module types PEFT's LoRA wraps (a name match on any other type fails in get_peft_model).
LORA_MODULE_TYPES = (
    torch.nn.Linear,
    torch.nn.Embedding,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.MultiheadAttention,
    Conv1D,
)


def model_config(cfg, processor):
    """The configured model's HF config, no weights: the tiny one matching ``processor``, or
    the ``config.json`` of ``model.path``."""
    if cfg.model.path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model.dir, local_files_only=True)
        # An enabled cache breaks packed isolation (a non-VL config has no text_config).
        getattr(config, "text_config", config).use_cache = False
        return config
    return tiny_config(processor, moe=cfg.model.moe)


def base_dtype(cfg, device: torch.device | None = None) -> torch.dtype:
    """The frozen base's dtype on ``device`` (this rank's by default): bf16 when the run's
    forwards are bf16 (``train.precision``, :func:`~packline.train.trainer.use_bf16`), else
    fp32. The LoRA adapters stay fp32 either way (PEFT upcasts them)."""
    bf16 = use_bf16(cfg.train.precision.value, device or rank_device())
    return torch.bfloat16 if bf16 else torch.float32


def meta_model(cfg, processor):
    """The configured model with its LoRA adapters, every module made on the meta device
    (no memory, no weights read): what FSDP2 shards before a rank allocates its part
    (:mod:`packline.train.sharded`)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            model_config(cfg, processor), dtype=base_dtype(cfg)
        )
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    model = set_text_attention(model, cfg.model.attention.value, device=rank_device())
    return apply_lora(model, cfg.lora)


def enable_activation_checkpointing(model) -> None:
    """Checkpoint every decoder layer and vision block of a HF model with torch's
    non-reentrant checkpoint (transformers 5.24 names it ``activation_checkpointing_enable``,
    earlier releases ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_model(cfg, processor, *, dtype: torch.dtype | None = None):
    """The configured Qwen3-VL: the tiny one (seeded), or a local checkpoint dir, loaded
    straight in ``dtype`` (:func:`base_dtype` by default: a bf16 run never holds an fp32
    copy of the checkpoint), its language model on ``model.attention`` and, with
    ``train.activation_checkpointing``, every decoder layer and vision block checkpointed."""
    dtype = dtype or base_dtype(cfg)
    if cfg.model.path:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(
            cfg.model.dir,  # a dir, or a Hub repo's cached snapshot
            config=model_config(cfg, processor),
            local_files_only=True,
            dtype=dtype,
        )
    else:  # random init in fp32 (the same weights for any dtype), then cast: it is tiny
        model = build_tiny_model(processor, moe=cfg.model.moe, seed=cfg.train.seed).to(dtype)
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    return set_text_attention(model, cfg.model.attention.value, device=rank_device())


@dataclass
class LoraTargetMatch:
    """What one entry of ``lora.target_modules`` / ``lora.target_parameters`` matches."""

    target: str
    kind: str
    """``module`` or ``parameter``."""
    matched: list[str] = field(default_factory=list)
    """Names PEFT would wrap with an adapter."""
    unsupported: list[str] = field(default_factory=list)
    """Modules the name matches whose type LoRA cannot wrap (PEFT raises on them)."""


def lora_target_matches(
    model: torch.nn.Module, target_modules: list[str], target_parameters: list[str]
) -> list[LoraTargetMatch]:
    """Each LoRA target's matches in ``model`` (which may live on the meta device), by PEFT's
    own rules: a module matches when its name is the target or ends in ``.<target>``; a
    parameter when ``<module>.<param>`` is the target or ends in ``.<target>``, looking only
    at a module's own parameters. PEFT fails only when *no* target matches; a single target
    matching nothing (``gate_proj`` on MoE experts, which are 3-D parameters) is silent."""
    out: list[LoraTargetMatch] = []
    named = list(model.named_modules())
    for target in target_modules:
        match = LoraTargetMatch(target, "module")
        probe = LoraConfig(target_modules=[target])
        for name, module in named:
            if name and check_target_module_exists(probe, name):
                kind = isinstance(module, LORA_MODULE_TYPES)
                (match.matched if kind else match.unsupported).append(name)
        out.append(match)
    for target in target_parameters:
        match = LoraTargetMatch(target, "parameter")
        for name, module in named:
            for param_name, _ in module.named_parameters(recurse=False):
                key = f"{name}.{param_name}" if name else param_name
                if key == target or key.endswith(f".{target}"):
                    match.matched.append(key)
        out.append(match)
    return out


def apply_lora(model, lora_cfg):
    """PEFT LoRA on the language model; MoE experts need ``target_parameters``."""
    config = LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        target_parameters=list(lora_cfg.target_parameters) or None,
    )
    model = peft_wrap(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ValueError(
            f"LoRA targets {list(lora_cfg.target_modules)} / {list(lora_cfg.target_parameters)} "
            "match nothing in the model"
        )
    return model


def build_trainer(
    cfg,
    processor,
    *,
    packed: bool,
    dataset_path: Path,
    processor_dir: Path,
    lengths_path: Path,
    run_dir: Path,
    device: torch.device | None = None,
    tracker: Tracker | None = None,
    eval_memo: EvalMemo | None = None,
) -> Trainer:
    """A :class:`Trainer` for one run of ``cfg`` (packing on or off) over the prepared
    dataset in ``dataset_path``, the processor in ``processor_dir`` and connect's lengths
    table in ``lengths_path`` (the stage hands them over from the catalog): the configured model
    with LoRA (seeded by ``train.seed``) on ``device``, its evaluator, logging to
    ``tracker`` and writing to ``run_dir``; ``eval_memo``: where the start evaluation is
    shared with the other run of a comparison."""
    settings = TrainerSettings.from_config(cfg, packed=packed, lengths_path=lengths_path)
    image_token_id = int(processor.image_token_id)
    video_token_id = int(processor.video_token_id)
    layout = ParallelLayout.from_config(cfg.train.parallel, rank_world()[1])
    engine = eval_model = None
    if layout.is_data_parallel:
        torch.manual_seed(cfg.train.seed)
        model = apply_lora(build_model(cfg, processor), cfg.lora)
        if device is not None:
            model = model.to(device)
    else:
        engine, eval_model = build_split_engine(
            cfg,
            processor,
            layout,
            packed=packed,
            device=device,
            ids={
                "image_token_id": image_token_id,
                "video_token_id": video_token_id,
                "bf16": use_bf16(cfg.train.precision.value, device or torch.device("cpu")),
            },
        )
        model = engine.model
    evaluator = (
        None
        if not cfg.train.eval
        else Evaluator(
            dataset_path=dataset_path,
            processor_dir=processor_dir,
            processor=processor,
            packing=settings.packing,
            packing_buffer_size=settings.stream.packing_buffer_size,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
            eval_samples=settings.eval_samples,
            scorer=SHAPES_SCORER,  # the built-in set's grading of the answers its samples ask
        )
    )
    device = device or torch.device("cpu")
    return Trainer(
        model,
        settings=settings,
        dataset_path=dataset_path,
        processor_dir=processor_dir,
        run_dir=run_dir,
        flops_model=flops_model_for(cfg, processor),
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        pad_token_id=int(processor.tokenizer.pad_token_id),
        evaluator=evaluator,
        tracker=tracker,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        layout=layout,
        engine=engine,
        eval_model=eval_model,
        eval_memo=eval_memo,
    )


def build_split_engine(cfg, processor, layout: ParallelLayout, *, packed: bool, device, ids):
    """The engine of a split layout (FSDP2, EP and/or PP) on this rank, and rank 0's one-process
    model for evaluation and export (None elsewhere). Every rank builds the same seeded
    model; rank 0 also builds the one-process PEFT model, whose adapters it broadcasts as the
    initial values, so a split run starts exactly where one process starts."""
    from packline.train.engine import ExpertParallelEngine, PipelineEngine
    from packline.train.expert_parallel import (
        apply_lora_ep,
        distribute_experts,
        load_full_adapter_state,
    )
    from packline.train.pipeline import PipelineRunner

    rank = rank_world()[0]
    groups = LayoutGroups(layout)
    text = model_config(cfg, processor).get_text_config()
    problems = layout.problems(  # validate refused these already; a launch of its own may not
        num_layers=text.num_hidden_layers,
        num_experts=getattr(text, "num_experts", None),
        rows_per_step=cfg.train.global_batch_size,
        fixed_width=cfg.packing.pad_to_max_length if packed else None,
        micro_batch_size=cfg.train.micro_batch_size,
        packed_only=packed,
    )
    if problems:
        raise ValueError("train.parallel cannot run: " + "; ".join(problems))
    common = {"rank": rank, "groups": groups, "per_sample": cfg.train.loss.value == "sample", **ids}
    if layout.fsdp and layout.expert == 1 and layout.pipeline == 1:  # FSDP2 alone
        return _sharded_engine(cfg, processor, layout, device, common)
    whole = initial = None
    if rank == 0:  # the one-process model: its adapters are where the split run starts
        torch.manual_seed(cfg.train.seed)
        whole = apply_lora(build_model(cfg, processor), cfg.lora)
        initial = {n: p.detach().clone() for n, p in whole.named_parameters() if p.requires_grad}
    initial = broadcast_object(initial)
    torch.manual_seed(cfg.train.seed)
    if layout.expert > 1:
        model = distribute_experts(build_model(cfg, processor), layout, groups)
        model = apply_lora_ep(model, cfg.lora, layout, groups)
    else:
        model = apply_lora(build_model(cfg, processor), cfg.lora)
    if device is not None:
        model = model.to(device)
    load_full_adapter_state(model, initial)  # sliced to this rank's experts
    if layout.pipeline == 1:
        engine = ExpertParallelEngine(
            model,
            layout,
            aux_loss_coef=cfg.train.moe_aux_loss_coef,
            loss_chunk_tokens=cfg.train.loss_chunk_tokens,
            **common,
        )
    else:
        runner = PipelineRunner(
            model,  # stripped to this rank's stage
            layout,
            groups,
            seq_length=cfg.packing.seq_length,
            n_microbatches=cfg.train.global_batch_size // layout.data,
            image_token_id=ids["image_token_id"],
            video_token_id=ids["video_token_id"],
            device=device,
            bf16=ids["bf16"],
            per_sample=common["per_sample"],
        )
        engine = PipelineEngine(runner, layout, **common)
    return engine, whole  # in host RAM: the engine takes it to the GPU to evaluate


def _sharded_engine(cfg, processor, layout: ParallelLayout, device, common: dict):
    """FSDP2 without EP or PP (:mod:`packline.train.sharded`): rank 0 builds the one-process
    model (the only full copy, kept in host RAM to evaluate and export with), every rank
    its shards of the same model built on the meta device, filled from rank 0's."""
    from packline.train.distributed import init_from_env
    from packline.train.engine import ShardedEngine
    from packline.train.sharded import shard_model

    init_from_env()
    whole = None
    if common["rank"] == 0:
        torch.manual_seed(cfg.train.seed)
        whole = apply_lora(build_model(cfg, processor), cfg.lora)
    model, root = shard_model(meta_model(cfg, processor), whole, device or rank_device())
    engine = ShardedEngine(
        model,
        layout,
        root=root,
        aux_loss_coef=cfg.train.moe_aux_loss_coef,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        **common,
    )
    return engine, whole


def training_stream(cfg, *, rank: int = 0, world: int = 1) -> TrainStream:
    """The packed rows a local train run of ``cfg`` reads on data-parallel rank ``rank`` of
    ``world``, in training order, from the prepared dataset (connect must have run): to
    inspect exactly what the trainer will see.

    ``for row in training_stream(cfg).rows(): print(row.keys, row.cu_seqlens.tolist())``
    """
    return TrainStream(
        TrainerSettings.from_config(cfg, packed=True, lengths_path=lengths_path(cfg)).stream,
        dataset_path=dataset_path(cfg),
        processor_dir=processor_dir(cfg),
        rank=rank,
        world=world,
    )
