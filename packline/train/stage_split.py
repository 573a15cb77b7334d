"""Pipeline parallelism's stage split for the local backend: which part of the Qwen3-VL
model a stage keeps (:class:`StagePlan`), the stage as a module that runs its layers on a
packed row with the row's packing metadata (:class:`StageModule`), and the check every stage
makes of that metadata (:func:`check_stage_inputs`). The schedule that runs the stages is
:mod:`packline.train.pipeline`'s.

Shape legend: ``T`` tokens of a fixed-width row (``packing.seq_length``), ``H`` text hidden
size, ``V`` vocabulary, ``K`` deepstack features carried across a stage boundary, ``P``
pipeline stages, ``n`` conversations of a row.

Every rank builds the full model with the same seed (and the same LoRA), exactly like one
process; :class:`PipelineRunner` then keeps only its stage (:class:`StagePlan`): the
decoder layers ``[s·L/P, (s+1)·L/P)``, the vision tower and the token embeddings on stage 0,
the final norm and the LM head on the last stage. What one micro-batch (one packed row,
micro-batch size 1) sends from stage ``s`` to ``s + 1``::

    hidden     (1, T, H)      the residual stream after stage s's last layer
    deepstack  (K, 1, T, H)   only when K > 0: the vision tower's deepstack features of the
                              layers beyond stage s, scattered into dense rows (zeros off
                              the visual positions; adding zeros is exact)

Fixed shapes (fixed-width rows) let every stage declare them up front (``PipelineStage``'s
static metadata: no extra metadata forward and backward on the first micro-batch, no router
statistics recorded twice). Qwen3-VL adds deepstack feature ``i`` after decoder layer ``i``
(``len(deepstack_visual_indexes)`` of them, 3 in the released models, 2 in the tiny): with
36 layers and P ≤ 12 all of them are used on stage 0 and K is 0; the tiny model with P = 2
sends feature 1 to stage 1.

Every stage also gets the packing metadata of each row as keyword arguments, from its own
copy of the row (the stages of a pipeline read the same rows; the schedule gets the
micro-batches pre-split, ``kwarg_mbs``, so ``cu_seqlens_padded`` of different lengths need
no padding to chunk), and checks it before its layers run (:func:`check_stage_inputs`: the
packed forward's boundary check, :func:`packline.qwen.forward.check_packed_inputs`): a stage
given no boundaries, or boundaries its positions do not restart at, raises —
Megatron-Bridge #2952 trains middle stages without ``cu_seqlens`` silently across
conversations. Each stage rebuilds the mask
(HF's ``create_causal_mask`` from the text positions, ``attention_mask=None``: the
per-conversation mask, or none under ``packline_thd``) and the M-RoPE embeddings
(``rotary_emb`` of position rows 1-3) exactly as HF's text model does, so attention is per
conversation as in the one-process packed forward.

>>> plan = StagePlan(stage=1, num_stages=2, num_layers=2, num_deepstack=2)
>>> list(plan.layers), plan.carried_in, plan.carried_out
([1], 1, 0)
>>> StagePlan(stage=0, num_stages=2, num_layers=36, num_deepstack=3).carried_out
0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from packline.qwen.forward import check_packed_inputs
from packline.qwen.moe import RouterRecorder, RouterStats


@dataclass(frozen=True)
class StagePlan:
    """Which part of the decoder stage ``stage`` of ``num_stages`` holds, and which deepstack
    features cross its boundaries."""

    stage: int
    num_stages: int
    num_layers: int
    """Decoder layers of the whole model (``num_stages`` must divide them)."""
    num_deepstack: int
    """Deepstack features the vision tower makes (feature i is added after layer i)."""

    def __post_init__(self):
        if self.num_stages < 1 or not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage {self.stage} of {self.num_stages} pipeline stages")
        if self.num_layers % self.num_stages:
            raise ValueError(
                f"pipeline_parallel {self.num_stages} does not divide the {self.num_layers} "
                "decoder layers"
            )

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.num_stages

    @property
    def layers(self) -> range:
        """Indices of this stage's decoder layers in the full model."""
        n = self.layers_per_stage
        return range(self.stage * n, (self.stage + 1) * n)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _carried_after(self, stage: int) -> int:
        return max(0, self.num_deepstack - (stage + 1) * self.layers_per_stage)

    @property
    def carried_in(self) -> int:
        """Deepstack features received from the previous stage (those of layers >= this
        stage's first layer), first feature = this stage's first layer."""
        return 0 if self.is_first else self._carried_after(self.stage - 1)

    @property
    def carried_out(self) -> int:
        """Deepstack features sent to the next stage."""
        return 0 if self.is_last else self._carried_after(self.stage)


class _Dropped(nn.Module):
    """Stands in for a submodule another stage holds (no parameters; the full model's
    parameter names of what this stage keeps do not change)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model lives on another pipeline stage")


def _is_moe(config) -> bool:
    text = getattr(config, "text_config", config)
    return getattr(text, "num_experts", None) is not None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF ``Qwen3VL(Moe)ForConditionalGeneration`` inside a PEFT model (or the model)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if not (hasattr(base, "model") and hasattr(base.model, "language_model")):
        raise ValueError(
            f"{type(base).__name__} is not a Qwen3-VL model (no model.language_model): "
            "pipeline stages split the Qwen3-VL text decoder"
        )
    return base


def check_stage_inputs(
    stage: int,
    *,
    position_ids: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    length: int,
) -> None:
    """Raise ``ValueError`` unless stage ``stage`` got a packed micro-batch's metadata: 4-row
    ``position_ids`` (4, 1, T) over this micro-batch's ``length`` tokens whose text row
    restarts exactly at ``cu_seqlens_padded`` — the packed forward's own check
    (:func:`~packline.qwen.forward.check_packed_inputs`), on every stage."""
    prefix = f"pipeline stage {stage}: "
    if position_ids is None or cu_seqlens_padded is None:
        missing = [
            name
            for name, value in (
                ("position_ids", position_ids),
                ("cu_seqlens_padded", cu_seqlens_padded),
            )
            if value is None
        ]
        raise ValueError(
            prefix + f"micro-batch without {' and '.join(missing)}: every stage needs each "
            "row's conversation boundaries and 4-row positions, or its layers attend across "
            "conversations with no error (Megatron-Bridge #2952)"
        )
    if position_ids.dim() == 3 and position_ids.shape[-1] != length:
        raise ValueError(
            prefix + f"position_ids of {position_ids.shape[-1]} tokens for a micro-batch of "
            f"{length}: the metadata belongs to another row"
        )
    try:
        check_packed_inputs(
            position_ids=position_ids,
            cu_seqlens_padded=cu_seqlens_padded,
            attention_mask=None,
            use_cache=False,
        )
    except ValueError as err:
        raise ValueError(prefix + str(err)) from None


def embed_inputs(vlm: nn.Module, input_ids: torch.Tensor, **media):
    """(inputs_embeds (1, T, H), visual_pos_masks (1, T) | None, deepstack list | None) of a
    row: token embeddings with the vision tower's image and video features scattered in, and
    the deepstack features of the visual positions — the first half of HF's
    ``Qwen3VLModel.forward`` (transformers 5.24), with its own methods."""
    pixel_values = media.get("pixel_values")
    pixel_values_videos = media.get("pixel_values_videos")
    inputs_embeds = vlm.get_input_embeddings()(input_ids)
    image_mask = video_mask = None
    if pixel_values is not None:
        image = vlm.get_image_features(pixel_values, media.get("image_grid_thw"), return_dict=True)
        image_embeds = torch.cat(image.pooler_output, dim=0).to(
            inputs_embeds.device, inputs_embeds.dtype
        )
        image_mask, _ = vlm.get_placeholder_mask(
            input_ids, inputs_embeds=inputs_embeds, image_features=image_embeds
        )
        inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_embeds)
        deepstack_image = image.deepstack_features
    if pixel_values_videos is not None:
        video = vlm.get_video_features(
            pixel_values_videos, media.get("video_grid_thw"), return_dict=True
        )
        video_embeds = torch.cat(video.pooler_output, dim=0).to(
            inputs_embeds.device, inputs_embeds.dtype
        )
        _, video_mask = vlm.get_placeholder_mask(
            input_ids, inputs_embeds=inputs_embeds, video_features=video_embeds
        )
        inputs_embeds = inputs_embeds.masked_scatter(video_mask, video_embeds)
        deepstack_video = video.deepstack_features
    if image_mask is not None and video_mask is not None:
        image_mask, video_mask = image_mask[..., 0], video_mask[..., 0]
        visual = image_mask | video_mask
        image_joint, video_joint = image_mask[visual], video_mask[visual]
        deepstack = []
        for img, vid in zip(deepstack_image, deepstack_video, strict=True):
            img, vid = torch.cat(img, dim=0), torch.cat(vid, dim=0)
            joint = img.new_zeros(visual.sum(), img.shape[-1])
            joint[image_joint, :] = img
            joint[video_joint, :] = vid
            deepstack.append(joint)
        return inputs_embeds, visual, deepstack
    if image_mask is not None:
        return inputs_embeds, image_mask[..., 0], [torch.cat(f, dim=0) for f in deepstack_image]
    if video_mask is not None:
        return inputs_embeds, video_mask[..., 0], [torch.cat(f, dim=0) for f in deepstack_video]
    return inputs_embeds, None, None


class StageModule(nn.Module):
    """One pipeline stage of a Qwen3-VL (dense or MoE) model, PEFT-wrapped or not.

    Building it **strips** ``model`` in place to the stage (:class:`StagePlan`): the other
    stages' decoder layers, and the vision tower, embeddings, final norm and LM head where
    this stage does not run them, are replaced by parameterless stand-ins, so
    ``model.named_parameters()`` lists this stage's parameters under the full model's names.

    ``forward(*activations, position_ids, cu_seqlens_padded, pixel_values=None,
    image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None)``: stage 0 takes
    ``input_ids`` (1, T); later stages take ``hidden`` (1, T, H) and, when
    :attr:`StagePlan.carried_in` > 0, ``deepstack`` (K, 1, T, H). Returns logits (1, T, V) on
    the last stage, else ``hidden`` (and ``deepstack`` when :attr:`StagePlan.carried_out` >
    0). Every call first checks the packing metadata (:func:`check_stage_inputs`).
    """

    def __init__(self, model: nn.Module, *, stage: int, num_stages: int):
        super().__init__()
        base = unwrap_model(model)
        vlm = base.model
        text = vlm.language_model
        self.plan = StagePlan(
            stage=stage,
            num_stages=num_stages,
            num_layers=len(text.layers),
            num_deepstack=len(getattr(base.config.vision_config, "deepstack_visual_indexes", [])),
        )
        plan = self.plan
        self.text_config = text.config
        for i in range(plan.num_layers):
            if i not in plan.layers:
                text.layers[i] = _Dropped()
        if not plan.is_first:
            vlm.visual = _Dropped()
            text.embed_tokens = _Dropped()
        if not plan.is_last:
            text.norm = _Dropped()
            base.lm_head = _Dropped()
        # Not registered as submodules: the stage runs them, the model owns them (one set of
        # parameter names, the full model's).
        self.__dict__["_vlm"] = vlm
        self.__dict__["_text"] = text
        self.__dict__["_lm_head"] = base.lm_head
        # Registered, so that .parameters() / .to() of the stage see exactly what it runs.
        self.layers = nn.ModuleList([text.layers[i] for i in plan.layers])
        self.extras = nn.ModuleList(
            ([vlm.visual, text.embed_tokens] if plan.is_first else [])
            + ([text.norm, base.lm_head] if plan.is_last else [])
        )
        self.rotary_emb = text.rotary_emb
        self.config = base.config  # read by RouterRecorder (experts, top-k)
        self.bf16 = False
        """Run under bf16 autocast (what crosses stages stays float32)."""
        self.recorder = RouterRecorder(self) if _is_moe(base.config) else None
        """The routers of this stage's layers (MoE models), hooked while :attr:`recording`."""
        self.recording = False
        self.router_stats: RouterStats | None = None
        """Router statistics over real tokens of this stage's layers, summed over the
        forwards run while :attr:`recording` (None before the first)."""

    def forward(
        self,
        *activations: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens_padded: torch.Tensor | None = None,
        real_token_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ):
        plan = self.plan
        expected = 1 + (plan.carried_in > 0) if not plan.is_first else 1
        if len(activations) != expected:
            raise ValueError(
                f"pipeline stage {plan.stage} takes {expected} activation tensor(s), got "
                f"{len(activations)}"
            )
        check_stage_inputs(
            plan.stage,
            position_ids=position_ids,
            cu_seqlens_padded=cu_seqlens_padded,
            length=activations[0].shape[1],
        )
        recorder = self.recorder if self.recording else None
        if recorder is not None:
            if real_token_mask is None:
                raise ValueError(
                    f"pipeline stage {plan.stage}: router statistics need the row's "
                    "real_token_mask (padding must not count)"
                )
            recorder.clear()
        device = activations[0].device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self._run(
                activations,
                position_ids,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                pixel_values_videos=pixel_values_videos,
                video_grid_thw=video_grid_thw,
            )
        if recorder is not None:
            stats = RouterStats.from_logits(
                recorder.logits,
                real_token_mask,
                top_k=recorder.top_k,
                num_experts=recorder.num_experts,
            )
            self.router_stats = stats if self.router_stats is None else self.router_stats + stats
            recorder.clear()
        return out

    def _run(self, activations, position_ids, **media):
        plan, text = self.plan, self._text
        carried = visual_mask = deepstack = None
        if plan.is_first:
            hidden, visual_mask, deepstack = embed_inputs(self._vlm, activations[0], **media)
        else:
            hidden = activations[0]
            carried = activations[1] if plan.carried_in else None
        text_positions, mrope = position_ids[0], position_ids[1:]
        # As Qwen3VLTextModel.forward: the mask from the text positions (per conversation),
        # the rotary embeddings from the M-RoPE rows, shared by this stage's layers.
        mask = create_causal_mask(
            config=self.text_config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=text_positions,
        )
        position_embeddings = self.rotary_emb(hidden, mrope)
        first = plan.layers.start
        for i, layer in zip(plan.layers, self.layers, strict=True):
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=text_positions,
                position_embeddings=position_embeddings,
            )
            if deepstack is not None and i < len(deepstack):  # stage 0: HF's own path
                hidden = text._deepstack_process(hidden, visual_mask, deepstack[i])
            elif carried is not None and i - first < carried.shape[0]:
                hidden = hidden + carried[i - first]  # zeros off the visual positions
        if plan.is_last:
            return self._lm_head(text.norm(hidden))
        # What crosses to the next stage is float32 (declared up front); under bf16
        # autocast the residual stream already is.
        hidden = hidden.float()
        if not plan.carried_out:
            return hidden
        if plan.is_first:
            carried = self._dense_deepstack(hidden, visual_mask, deepstack)
        else:
            carried = carried[plan.layers_per_stage :].contiguous()
        return hidden, carried

    def _dense_deepstack(self, hidden, visual_mask, deepstack) -> torch.Tensor:
        """(K, 1, T, H): the deepstack features of the layers after stage 0, each scattered
        into a zero row at the visual positions."""
        plan = self.plan
        k = plan.carried_out
        first = plan.layers_per_stage
        if deepstack is None:
            return hidden.new_zeros((k, *hidden.shape))
        mask = visual_mask.to(hidden.device)[..., None].expand_as(hidden)
        rows = [
            hidden.new_zeros(hidden.shape).masked_scatter(mask, feature.to(hidden.dtype))
            for feature in deepstack[first : first + k]
        ]
        return torch.stack(rows)


def requires_grad_after(model: nn.Module, plans: list[StagePlan]) -> list[bool]:
    """For each stage boundary s -> s+1: whether the hidden state there depends on a
    trainable parameter (of stages 0..s). Read from the full model, before stripping."""
    base = unwrap_model(model)
    vlm, text = base.model, base.model.language_model

    def trainable(module) -> bool:
        return any(p.requires_grad for p in module.parameters())

    upstream = trainable(vlm.visual) or trainable(text.embed_tokens)
    out = []
    for plan in plans:
        upstream = upstream or any(trainable(text.layers[i]) for i in plan.layers)
        out.append(upstream)
    return out
