"""Varlen (THD) attention for the language model of HF Qwen3-VL on any device.

HF isolates the conversations of a packed row with ``sdpa`` by building a dense
block-diagonal causal mask of T×T: every row then pays attention over all T positions,
exactly as if it held one conversation of length T, and wastes most of it on masked-out
blocks. Flash-attention's varlen kernel (what Megatron's THD layout runs on GPUs) is not
available on CPUs, so this module registers ``packline_thd`` with HF's attention
interfaces: attention runs once per conversation of the row (causal ``sdpa`` on its own
slice), so a row costs Σ lᵢ² instead of T² — what :mod:`packline.flops` counts.

Conversations are found the way HF finds them: a new one starts wherever the text
position does not continue the previous one by +1 (row 0 of the packed ``position_ids``
restarts per conversation); :func:`packline.qwen.forward.packed_forward`, the one way
packline runs a packed row, checks before the model runs that these restarts are exactly
the row's ``cu_seqlens_padded`` boundaries. They are found once per forward, not once per
layer (on a GPU each search is a device-to-host sync): every layer of a forward gets the
same ``position_ids`` tensor, and the bounds are reused only for that very tensor,
unmodified.
Anything else — a padding mask, a KV cache, batches of several rows, the vision tower — is
handed to HF's ``sdpa`` unchanged, so padded (packing off) batches and generation behave
exactly as with ``sdpa``.

>>> import torch
>>> positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
>>> conversation_bounds(positions)
[(0, 3), (3, 5), (5, 6)]
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

THD_ATTENTION = "packline_thd"


def conversation_bounds(text_positions: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each conversation in a one-row ``text_positions`` [1, T]: a new one
    starts wherever the position does not continue the previous one by +1."""
    pos = text_positions.reshape(-1)
    if pos.numel() == 0:
        return []
    starts = torch.nonzero(pos[1:] - pos[:-1] != 1).flatten().add(1).tolist()
    edges = [0, *starts, int(pos.numel())]
    return list(zip(edges[:-1], edges[1:], strict=True))


_last_bounds: list = [None, -1, []]  # weakref to the position tensor, its version, bounds


def _bounds_of(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """:func:`conversation_bounds`, reused across the layers of one forward: only for the
    same live tensor (a weakref, so a new tensor at a reused address never matches) at the
    same version (an in-place change invalidates)."""
    ref, version, bounds = _last_bounds
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return bounds
    bounds = conversation_bounds(position_ids)
    _last_bounds[:] = [weakref.ref(position_ids), position_ids._version, bounds]
    return bounds


def thd_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention per conversation of a packed row ([1, H, T, D] → [1, T, H, D]); every
    other call goes to HF's ``sdpa_attention_forward`` as is."""
    packed_row = (
        attention_mask is None
        and position_ids is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2]
        and kwargs.get("is_causal", True) is not False
    )
    if not packed_row:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            position_ids=position_ids,
            **kwargs,
        )
    kwargs.pop("is_causal", None)
    outs = [
        sdpa_attention_forward(
            module,
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )[0]
        for s, e in _bounds_of(position_ids)
    ]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def thd_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask where the attention needs none (no padding: conversations come from the
    positions); HF's ``sdpa`` mask wherever there is padding."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(THD_ATTENTION, thd_attention_forward)
AttentionMaskInterface.register(THD_ATTENTION, thd_mask)


HF_ATTENTION = {"thd": THD_ATTENTION, "sdpa": "sdpa", "eager": "eager"}
"""``model.attention`` values → HF attention implementation names."""


def set_text_attention(model: torch.nn.Module, attention: str = "thd") -> torch.nn.Module:
    """Switch the language model of ``model`` (a Qwen3-VL, plain or PEFT-wrapped) to
    ``attention`` (a key of :data:`HF_ATTENTION`); the vision tower keeps its own."""
    if attention not in HF_ATTENTION:
        raise ValueError(f"unknown attention {attention!r}; expected one of {sorted(HF_ATTENTION)}")
    text = getattr(model.config, "text_config", None)
    if text is None:
        raise ValueError(f"{type(model).__name__} has no text_config: not a Qwen3-VL model")
    text._attn_implementation = HF_ATTENTION[attention]
    return model
