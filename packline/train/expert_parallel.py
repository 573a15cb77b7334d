"""Expert parallelism on the local backend: transformers' own engine splits the experts,
PEFT adapts the dense layers, and packline's own LoRA adapts each rank's experts.

What runs where (every rank of the job calls each function, in the same order):

- :func:`distribute_experts` — the seeded, identical full model on every rank is split by
  transformers' engine. ``layout.pipeline == 1``: ``DistributedConfig(fsdp_size=data,
  ep_size=E)`` through the model class's ``prepare_distribute_model`` /
  ``maybe_distribute_model`` — of the n experts of every MoE layer each rank keeps
  ``ep_rank·n/E … (ep_rank + 1)·n/E - 1`` (``ep_rank = d % E``,
  :class:`~schemas.layout.ParallelLayout`), tokens reach them by all-to-all, and
  FSDP2 shards the frozen rest over the stage's ranks (experts over their ``data / E``
  copies; one unit per decoder layer, see :func:`_vl_fsdp_plan`). ``layout.pipeline > 1``
  (transformers refuses FSDP and token dispatch with its own PP):
  ``apply_expert_parallelism`` alone on this stage's expert-parallel sub-mesh, no FSDP.
  The process group is torchrun's (:func:`~packline.train.distributed.init_from_env`,
  joined first, so transformers does not start a second one).
- :func:`apply_lora_ep` — dense LoRA is PEFT's (``target_modules``, applied after the
  split, so FSDP2 manages none of the adapters); each ``target_parameters`` entry that names
  an experts parameter gets a :class:`ExpertLora` holding the A/B factors of this rank's
  experts only. PEFT's own ``target_parameters`` cannot run here (its parametrization mixes
  the DTensor expert stack with plain tensors). The experts' forward adds
  ``alpha / r · B_e A_e`` to each local expert weight ``W_e`` (one ``baddbmm``, as PEFT's
  ``_LoraFactorsProxy``) just before the experts' own kernel runs, on the local slices
  transformers hands it.
- Names and layouts are PEFT's: the :class:`ExpertLora` wrappers nest like PEFT's
  ``ParamWrapper`` (the experts' first parameter innermost), so ``named_parameters()`` of the
  returned model lists exactly the names of a one-process PEFT model with ``target_modules``
  + ``target_parameters``; an expert factor holds this rank's slice of PEFT's tensor
  (``lora_A.weight`` ``(r·E, in)``: expert ``e`` owns rows ``e·r … e·r + r``; ``lora_B.weight``
  ``(out, r·E)`` read as ``(out, r, E)``: expert ``e`` owns the *strided* columns
  ``e, E + e, …``). The initial values equal PEFT's for the same seed: the full factors are
  drawn exactly as PEFT draws them, then sliced.
- :func:`load_full_adapter_state` / :func:`local_adapter_state` /
  :func:`merge_adapter_states` — the full one-process PEFT adapter state, gathered on rank 0
  to evaluate and export; checkpoints instead save each rank's part under layout-free names
  (:func:`expert_factor_slices` / :func:`expert_views`, :mod:`packline.train.checkpoint`).
- :func:`adapter_params` splits the trainable parameters for the gradient sums (dense over
  ``groups.stage_data``, experts over ``groups.expert_copies``: :func:`reduce_adapter_grads`)
  and the clipping over both meshes (:func:`clip_adapter_grads`). FSDP2 manages none of them
  (they are added after it; :func:`adapter_params` refuses a DTensor adapter).

Measured (CPU, gloo, 2 cores; torch 2.14, transformers 5.24, peft 0.21; the tiny
Qwen3-VL-MoE, 8 experts top-2, on real fixed-width packed rows of 2,048 tokens;
tests/integration/test_expert_parallel.py): EP 2 / FSDP 2, FSDP 2 alone, EP 4 / FSDP 4,
EP 2 / FSDP 4 and the pipeline layout's split (2 stages × EP 2, no FSDP: ``ep_check
--stage-mesh``; with real stages in tests/integration/pp_check.py) equal one process:
loss |Δ| 0, every LoRA gradient within 8e-7 of its largest value (fp32 rounding: an expert's
gradient sums all ranks' tokens in one GEMM); the initial adapters equal PEFT's bitwise;
padded rows equal packed ones under EP as on one rank (~1e-6); clipping and one AdamW step
equal one process stepping the same gradients (8e-8); a rank whose experts get no token
trains (zero gradients, still reduced); a no-grad forward and ``generate()`` (all ranks
together) give one process's logits and tokens. Untested: GPU / nccl (nothing hard-codes
gloo: the group is torchrun's, the meshes use this rank's accelerator, every weight but the
expert stacks is moved to it before the split and each stack visits it once, whole, to leave
this rank's slice: :func:`place_but_experts`), bf16 autocast, and PEFT's ``save_pretrained``
of this model (it does not know the expert adapters: export through a one-process model
loaded with :func:`merge_adapter_states`; rank 0 keeps that one in host RAM and takes it to
the GPU only to evaluate).

Rules for callers: every forward (and backward) under EP is a collective — all ranks of an
expert-parallel group run the same number of them, so a padded (unpacked) step whose ranks
hold different numbers of micro-batches must add zero-weighted ones, and evaluation on one
rank needs a separate one-process model. Like PEFT's, the adapted expert stack
``W + s·BA`` of each layer is materialized per forward and kept for its backward (memory:
one local expert stack per adapted parameter and layer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from packline.train.layout import clip_grad_norm
from schemas.layout import ParallelLayout

ADAPTER = "default"
"""PEFT's adapter name (``lora_A.<adapter>.weight``)."""
EXPERTS_IMPLEMENTATION = "packline_expert_lora"
"""The name under which the adapted experts' forward is registered in transformers'
``ALL_EXPERTS_FUNCTIONS``."""
EXPERT_SLICES = "__packline_expert_slices__"
"""Key of a local adapter state holding, per expert factor, which slice this rank holds."""

_ADAPTERS = "_packline_expert_lora"  # on an experts module: its ExpertLora wrappers, inner first
_BASE_IMPL = "_packline_base_experts_impl"  # on an experts module: its implementation before


# -- the split ------------------------------------------------------------------------------


def distribute_experts(model: nn.Module, layout: ParallelLayout, groups=None) -> nn.Module:
    """Split ``model`` (the plain HF MoE model, the same weights on every rank) over the
    ranks as ``layout`` says and return it (FSDP2 may change its class). Every rank calls
    this together. ``groups`` (:class:`~packline.train.layout.LayoutGroups`): its device
    mesh splits a pipeline stage's experts (built here when None); without a pipeline,
    transformers' engine builds its own mesh over the same ranks."""
    from packline.train.distributed import init_from_env

    if layout.expert == 1 and not layout.fsdp:
        return model  # nothing to split: every rank keeps the whole model
    if layout.fsdp and layout.pipeline > 1:
        raise ValueError("fsdp with pipeline_parallel > 1: transformers' engine cannot do both")
    init_from_env()  # torchrun's group; transformers then uses it instead of starting one
    if dist.get_world_size() != layout.world:
        raise ValueError(
            f"layout is for {layout.world} ranks but the process group has {dist.get_world_size()}"
        )
    plan = _vl_fsdp_plan(model)
    if plan is not None:  # before any plan is resolved (transformers warns of its default's)
        model.fsdp_plan = plan
    place_but_experts(model, _device(), expert_stacks(model, layout))
    if layout.pipeline == 1:
        return _distribute_with_engine(model, layout)
    if groups is None:
        from packline.train.layout import LayoutGroups

        groups = LayoutGroups(layout)
    return _distribute_stage_experts(model, layout, groups.mesh)


def expert_stacks(model: nn.Module, layout: ParallelLayout) -> set[str]:
    """Names of the 3-D expert parameters transformers' EP plan splits over ``layout.expert``
    ranks (empty without EP)."""
    if layout.expert == 1:
        return set()
    params = {n for n, _ in model.named_parameters()}
    return {name for name in _ep_plan(model, layout) if name in params}


def _ep_plan(model: nn.Module, layout: ParallelLayout) -> dict[str, str]:
    """The model's resolved EP plan for ``layout.expert`` ranks (its own DistributedConfig
    mesh is never built), limited to the modules and parameters ``model`` holds."""
    from transformers.distributed import DistributedConfig

    _, ep_plan, _ = model._resolve_parallel_plans(
        DistributedConfig(fsdp_size=layout.expert, ep_size=layout.expert)
    )
    present = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    return {name: style for name, style in ep_plan.items() if name in present}


def place_but_experts(model: nn.Module, device: torch.device, experts: set[str]) -> None:
    """Move every parameter and buffer of ``model`` to ``device`` except the expert stacks
    named in ``experts``, which stay in host RAM: the split then takes each stack to the
    device one at a time (``distribute_tensor`` moves it whole, keeps this rank's slice as a
    copy of its own and frees the rest), so a GPU holds its own experts, never all of them
    (Qwen3-VL-30B-A3B's experts are ~95 % of its weights)."""
    moved: dict[int, nn.Parameter] = {}  # a tied weight stays one parameter
    with torch.no_grad():
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, param in list(module._parameters.items()):
                if param is None or prefix + name in experts or param.device == device:
                    continue
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(
                        param.to(device), requires_grad=param.requires_grad
                    )
                module._parameters[name] = moved[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distribute_with_engine(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """``layout.pipeline == 1``: transformers' DistributedConfig path, FSDP over the
    data-parallel ranks, experts over ``layout.expert`` of them."""
    from transformers.distributed import DistributedConfig

    cls = type(model)
    config = DistributedConfig(
        fsdp_size=layout.data, ep_size=layout.expert if layout.expert > 1 else None
    )
    config, _, mesh_manager = cls.prepare_distribute_model(config)
    return cls.maybe_distribute_model(model, config, mesh_manager)


def _vl_fsdp_plan(model: nn.Module) -> dict[str, str] | None:
    """FSDP units for a Qwen3-VL(-MoE): transformers' default plan names ``model.layers.*``,
    ``model.norm``…, which a VL model (``model.language_model.layers.*``, ``model.visual``)
    does not have, so everything but the experts would be one unit. None for other models.
    """
    names = {n for n, _ in model.named_modules()}
    if "model.language_model" not in names:
        return None
    # The vision tower stays in the root unit: a rank whose rows hold no image skips it, and
    # a unit of its own would then all-gather on some ranks only (a collective mismatch).
    return {
        "model.language_model.embed_tokens": "free_full_weight",
        "model.language_model.layers.*": "free_full_weight",
        "model.language_model.norm": "keep_full_weight",
        "lm_head": "keep_full_weight",
    }


def _distribute_stage_experts(model: nn.Module, layout: ParallelLayout, mesh) -> nn.Module:
    """``layout.pipeline > 1``: ``apply_expert_parallelism`` on the expert-parallel group of
    this rank's stage (``mesh["ep"]``, the layout's mesh: ranks ``stage·data + copy·E + e``,
    e = 0..E-1), no FSDP."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    if layout.expert == 1:
        return model
    return apply_expert_parallelism(model, mesh["ep"], mesh["tp"], _ep_plan(model, layout))


# -- the experts' LoRA ----------------------------------------------------------------------


class ExpertLora(nn.Module):
    """LoRA on one 3-D experts parameter, for this rank's experts only, laid out as PEFT's
    ``ParamWrapper`` (a slice of it): ``lora_A[ADAPTER].weight`` ``(r·El, in)``,
    ``lora_B[ADAPTER].weight`` ``(out, r·El)`` read as ``(out, r, El)``, El =
    ``num_experts / ep_size`` local experts starting at global expert ``first_expert``.

    The module sits where PEFT's wrapper would (``base_layer`` is the experts module or the
    next wrapper) and only forwards; the update is added to the local expert weights inside
    the experts' forward (:func:`_experts_with_lora`)."""

    def __init__(
        self,
        base_layer: nn.Module,
        parameter_name: str,
        *,
        shape: tuple[int, int, int],
        transposed: bool,
        r: int,
        alpha: float,
        ep_rank: int,
        ep_size: int,
    ):
        super().__init__()
        num_experts, d1, d2 = shape
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over {ep_size} ranks")
        self.base_layer = base_layer
        self.parameter_name = parameter_name
        # PEFT: (experts, out, in) unless the experts say they are stored transposed
        self.transposed = transposed
        self.in_features, self.out_features = (d1, d2) if transposed else (d2, d1)
        self.r = r
        self.scaling = alpha / r
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        # PEFT's draws, in its order, on the full factors (the same seed gives PEFT's values)
        full_a = nn.Linear(self.in_features, r * num_experts, bias=False)
        full_b = nn.Linear(r * num_experts, self.out_features, bias=False)
        nn.init.kaiming_uniform_(full_a.weight, a=math.sqrt(5))
        nn.init.zeros_(full_b.weight)
        self.lora_A = nn.ModuleDict({ADAPTER: _linear(self.slice_a(full_a.weight.detach()))})
        self.lora_B = nn.ModuleDict({ADAPTER: _linear(self.slice_b(full_b.weight.detach()))})

    def forward(self, *args, **kwargs):
        return self.base_layer(*args, **kwargs)

    # slices of PEFT's full factors <-> this rank's

    def slice_a(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of PEFT's ``lora_A.weight`` ``(r·E, in)``."""
        r, lo = self.r, self.first_expert
        return full[lo * r : (lo + self.num_local_experts) * r]

    def slice_b(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's (strided) columns of PEFT's ``lora_B.weight`` ``(out, r·E)``."""
        lo, n = self.first_expert, self.num_local_experts
        view = full.reshape(full.shape[0], self.r, self.num_experts)[:, :, lo : lo + n]
        return view.reshape(full.shape[0], self.r * n)

    def fold(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (this rank's expert stack) plus ``alpha/r · B_e A_e`` per expert, as
        PEFT's ``get_delta_factors`` + ``_LoraFactorsProxy`` (one baddbmm, no autocast)."""
        n = self.num_local_experts
        if weight.shape[0] != n or isinstance(weight, _dtensor_type()):
            raise RuntimeError(
                f"expert LoRA on {self.parameter_name}: expected this rank's {n} local experts "
                f"as a plain tensor, got {type(weight).__name__} {tuple(weight.shape)}"
            )
        a = self.lora_A[ADAPTER].weight.reshape(n, self.r, self.in_features)  # (El, r, in)
        b = self.lora_B[ADAPTER].weight.reshape(self.out_features, self.r, n).permute(2, 0, 1)
        lhs, rhs = (a.transpose(-2, -1), b.transpose(-2, -1)) if self.transposed else (b, a)
        with torch.autocast(device_type=weight.device.type, enabled=False):
            return torch.baddbmm(
                weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=self.scaling
            )


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (no random draw)."""
    out_features, in_features = weight.shape
    layer = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False)
    layer.weight = nn.Parameter(weight.clone().contiguous())
    return layer


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _experts_with_lora(self, hidden_states, top_k_index, top_k_weights, **kwargs):
    """The experts' forward with each :class:`ExpertLora` update added to the local expert
    weights, then the experts' own implementation (registered under
    :data:`EXPERTS_IMPLEMENTATION`; under EP transformers calls it with this rank's local
    slices in ``_parameters``)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    base = ALL_EXPERTS_FUNCTIONS.get_interface(
        self.__dict__[_BASE_IMPL], type(self).forward.__wrapped__
    )
    saved = {}
    try:
        for lora in self.__dict__.get(_ADAPTERS, ()):
            name = lora.parameter_name
            saved[name] = self._parameters[name]
            self._parameters[name] = lora.fold(saved[name])
        return base(self, hidden_states, top_k_index, top_k_weights, **kwargs)
    finally:
        self._parameters.update(saved)


def _matches(key: str, targets: Iterable[str]) -> bool:
    """PEFT's rule for ``target_parameters``: the name or a ``.``-suffix of it."""
    return any(key == t or key.endswith(f".{t}") for t in targets)


def apply_lora_ep(model: nn.Module, lora_cfg, layout: ParallelLayout, groups=None):
    """LoRA on the distributed ``model`` (after :func:`distribute_experts`): PEFT on the
    dense ``lora.target_modules``, :class:`ExpertLora` on every experts parameter a
    ``lora.target_parameters`` entry names (this rank's experts only). Returns the PEFT
    model to train. Call on every rank after the same seeding as one process: the adapters
    then start from the values PEFT gives the one-process model.

    ``lora_cfg``: ``schemas.config.LoraConfig`` (rank, alpha, dropout, target_modules,
    target_parameters)."""
    from peft import LoraConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from packline.train.lora import peft_wrap

    targets = list(lora_cfg.target_parameters)
    if targets and lora_cfg.dropout:
        raise ValueError(
            f"lora.dropout {lora_cfg.dropout}: LoRA on experts needs dropout 0 (as PEFT's "
            "target_parameters: the input of B·A cannot be dropped per token)"
        )
    if not lora_cfg.target_modules:
        raise ValueError("expert parallelism needs lora.target_modules for the dense layers")
    rank = dist.get_rank() if dist.is_initialized() else 0
    ep_rank = layout.coords(rank).ep_rank
    peft_model = peft_wrap(
        model,
        LoraConfig(
            r=lora_cfg.rank,
            lora_alpha=lora_cfg.alpha,
            lora_dropout=lora_cfg.dropout,
            target_modules=list(lora_cfg.target_modules),
        ),
    )
    # every experts module a target names, in module order (PEFT's draw order)
    found: list[tuple[str, nn.Module, list[str]]] = []
    for name, module in peft_model.named_modules():
        params = [
            p for p, _ in module.named_parameters(recurse=False) if _matches(f"{name}.{p}", targets)
        ]
        if params:
            found.append((name, module, params))
    for name, experts, params in found:
        if experts.__dict__.get(_ADAPTERS):
            raise ValueError(f"{name} already has expert LoRA")
        if not hasattr(experts, "config") or not hasattr(type(experts).forward, "__wrapped__"):
            raise ValueError(
                f"{name} ({type(experts).__name__}) is not a transformers experts module "
                "(use_experts_implementation): expert LoRA cannot adapt it"
            )
        local = getattr(experts, "num_experts", None)
        parent_name, _, child = name.rpartition(".")
        parent = peft_model.get_submodule(parent_name)
        wrappers: list[ExpertLora] = []
        outer: nn.Module = experts
        for p in params:
            param = experts._parameters[p]
            shape = tuple(param.shape)  # a DTensor's is the global shape
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
                if mesh.get_local_rank("ep") != ep_rank:
                    raise RuntimeError(
                        f"{name}.{p}: this rank holds expert slice {mesh.get_local_rank('ep')} "
                        f"but the layout gives it {ep_rank}"
                    )
            if len(shape) != 3:
                raise ValueError(f"{name}.{p} is not a 3-D experts parameter: {shape}")
            if local is not None and local * layout.expert != shape[0]:
                raise ValueError(
                    f"{name} holds {local} of {shape[0]} experts, expected 1/{layout.expert}: "
                    "call distribute_experts before apply_lora_ep"
                )
            outer = ExpertLora(
                outer,
                p,
                shape=shape,
                transposed=bool(getattr(experts, "is_transposed", False)),
                r=lora_cfg.rank,
                alpha=lora_cfg.alpha,
                ep_rank=ep_rank,
                ep_size=layout.expert,
            ).to(param.device)
            wrappers.append(outer)
        setattr(parent, child, outer)
        experts.__dict__[_ADAPTERS] = wrappers
        experts.__dict__[_BASE_IMPL] = experts.config._experts_implementation
    if found:
        ALL_EXPERTS_FUNCTIONS[EXPERTS_IMPLEMENTATION] = _experts_with_lora
        for _, experts, _ in found:  # the config may be shared: set after reading them all
            experts.config._experts_implementation = EXPERTS_IMPLEMENTATION
    elif targets:
        raise ValueError(f"lora.target_parameters {targets} match no experts parameter")
    return peft_model


# -- the adapters' parameters and gradients -------------------------------------------------


def _expert_factors(model: nn.Module) -> dict[str, tuple[ExpertLora, str]]:
    """``{parameter name: (its ExpertLora, "A" | "B")}``."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertLora):
            out[f"{name}.lora_A.{ADAPTER}.weight"] = (module, "A")
            out[f"{name}.lora_B.{ADAPTER}.weight"] = (module, "B")
    return out


def adapter_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters: (dense adapters — replicated over a stage's data ranks,
    gradients summed over ``groups.stage_data``; expert adapters — replicated over the
    copies of this rank's experts, gradients summed over ``groups.expert_copies``)."""
    experts = _expert_factors(model)
    dense, expert = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if isinstance(p, _dtensor_type()):
            raise RuntimeError(f"adapter {name} is managed by FSDP2 (a DTensor): add LoRA after")
        (expert if name in experts else dense).append(p)
    return dense, expert


def reduce_adapter_grads(model: nn.Module, groups) -> None:
    """Sum the adapter gradients over the ranks holding a copy (dense over
    ``groups.stage_data``, experts over ``groups.expert_copies``); a missing gradient counts
    as zeros, so every rank sends the same shapes."""
    from packline.train.distributed import sum_grads_over_ranks

    dense, expert = adapter_params(model)
    for params, group in ((dense, groups.stage_data), (expert, groups.expert_copies)):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if group is not None:
            sum_grads_over_ranks(params, group=group)


def clip_adapter_grads(model: nn.Module, layout: ParallelLayout, max_norm: float) -> torch.Tensor:
    """Clip by the global norm over both meshes (after :func:`reduce_adapter_grads`); every
    rank calls it and gets the norm. With ``pipeline > 1`` each stage's parameters count once
    per stage, as :func:`~packline.train.layout.clip_grad_norm` expects."""
    dense, expert = adapter_params(model)
    replicas = [layout.data] * len(dense) + [layout.expert_data] * len(expert)
    return clip_grad_norm(dense + expert, replicas, max_norm)


# -- adapter states: the full one-process PEFT state <-> this rank's part ------------------


def load_full_adapter_state(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Copy a full one-process PEFT adapter state (``{name: tensor}`` of a model with
    ``target_modules`` + ``target_parameters``) into this rank's adapters: dense names as
    they are, expert factors sliced to this rank's experts. Names this rank does not hold
    (other pipeline stages' layers) are ignored; a name this rank holds and the state lacks
    raises ``KeyError``."""
    experts = _expert_factors(model)
    missing = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name not in full_state:
                missing.append(name)
                continue
            value = full_state[name]
            if name in experts:
                lora, factor = experts[name]
                value = lora.slice_a(value) if factor == "A" else lora.slice_b(value)
            if value.shape != p.shape:
                raise ValueError(
                    f"{name}: state {tuple(value.shape)} vs this rank {tuple(p.shape)}"
                )
            p.copy_(value)
    if missing:
        raise KeyError(f"the adapter state lacks {len(missing)} names, e.g. {missing[:3]}")


def local_adapter_state(model: nn.Module, *, grads: bool = False) -> dict:
    """This rank's adapters (or, with ``grads``, their gradients; zeros where None) as
    ``{PEFT name: CPU tensor}``, expert factors as this rank's slices, plus
    ``EXPERT_SLICES: {name: {"factor", "first_expert", "num_local_experts",
    "num_experts", "r"}}`` for :func:`merge_adapter_states`. Picklable."""
    experts = _expert_factors(model)
    out: dict = {}
    slices = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.grad if grads else p
        t = torch.zeros_like(p) if t is None else t
        out[name] = t.detach().cpu().clone()
        if name in experts:
            lora, factor = experts[name]
            slices[name] = {
                "factor": factor,
                "first_expert": lora.first_expert,
                "num_local_experts": lora.num_local_experts,
                "num_experts": lora.num_experts,
                "r": lora.r,
            }
    out[EXPERT_SLICES] = slices
    return out


def merge_adapter_states(parts: list[dict]) -> dict[str, torch.Tensor]:
    """All ranks' :func:`local_adapter_state` parts → the full one-process PEFT state: the
    union of the names (pipeline stages hold different layers), each expert factor assembled
    from its slices (every expert exactly once). Copies of the same tensor on several ranks
    must be equal (``ValueError`` otherwise: replicas diverged)."""
    full: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, tuple[dict, torch.Tensor]]] = {}
    for part in parts:
        slices = part.get(EXPERT_SLICES, {})
        for name, t in part.items():
            if name == EXPERT_SLICES:
                continue
            if name in slices:
                info = slices[name]
                seen = pieces.setdefault(name, {})
                first = info["first_expert"]
                if first in seen:
                    _same(name, seen[first][1], t)
                else:
                    seen[first] = (info, t)
            elif name in full:
                _same(name, full[name], t)
            else:
                full[name] = t
    for name, seen in pieces.items():
        infos = [seen[k][0] for k in sorted(seen)]
        tensors = [seen[k][1] for k in sorted(seen)]
        num_experts, r = infos[0]["num_experts"], infos[0]["r"]
        covered = [
            e
            for i in infos
            for e in range(i["first_expert"], i["first_expert"] + i["num_local_experts"])
        ]
        if covered != list(range(num_experts)):
            raise ValueError(f"{name}: the parts hold experts {covered}, not 0..{num_experts - 1}")
        if infos[0]["factor"] == "A":
            full[name] = torch.cat(tensors, dim=0)
        else:
            out = tensors[0].shape[0]
            views = [t.reshape(out, r, -1) for t in tensors]
            full[name] = torch.cat(views, dim=2).reshape(out, r * num_experts)
    return full


def _same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.equal(a, b):
        raise ValueError(
            f"{name} differs between ranks holding a copy of it (max |diff| "
            f"{(a.double() - b.double()).abs().max().item():.3g}): replicas diverged"
        )


def expert_factor_slices(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Every expert adapter factor this rank holds, as ``{PEFT name: (factor "A" | "B",
    first expert, number of experts held)}``: an EP rank's :class:`ExpertLora` slices, or a
    one-process PEFT model's whole stacks (its ``ParamWrapper`` on an experts parameter).
    :func:`expert_views` splits them by expert: the layout-free checkpoint's currency."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {
        n: (f, m.first_expert, m.num_local_experts) for n, (m, f) in _expert_factors(model).items()
    }
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper) and getattr(module, "num_experts", 1) > 1:
            for factor in ("A", "B"):
                out[f"{name}.lora_{factor}.{ADAPTER}.weight"] = (factor, 0, module.num_experts)
    return out


def expert_views(t: torch.Tensor, factor: str, first: int, count: int) -> dict[int, torch.Tensor]:
    """``{global expert: its view of t}`` for a factor holding ``count`` experts from
    ``first`` on: rows ``i·r … i·r + r`` of ``lora_A`` ``(r·n, in)``, the strided columns
    ``[:, :, i]`` of ``lora_B`` ``(out, r·n)`` read as ``(out, r, n)``. Views: writing them
    writes ``t``.

    >>> a = torch.arange(8.0).reshape(4, 2)  # r = 2, two experts from expert 6 on
    >>> {e: v.tolist() for e, v in expert_views(a, "A", 6, 2).items()}
    {6: [[0.0, 1.0], [2.0, 3.0]], 7: [[4.0, 5.0], [6.0, 7.0]]}
    >>> b = torch.arange(4.0).reshape(1, 4)  # (out 1, r 2 × 2 experts): expert i at i, 2 + i
    >>> {e: v.tolist() for e, v in expert_views(b, "B", 0, 2).items()}
    {0: [[0.0, 2.0]], 1: [[1.0, 3.0]]}
    """
    if factor == "A":
        r = t.shape[0] // count
        return {first + i: t[i * r : (i + 1) * r] for i in range(count)}
    r = t.shape[1] // count
    grid = t.view(t.shape[0], r, count)
    return {first + i: grid[:, :, i] for i in range(count)}


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The PEFT names of this rank's expert adapter factors."""
    return list(_expert_factors(model))
