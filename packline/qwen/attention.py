"""Attention of HF Qwen3-VL's language model on packed (THD) rows, chosen per device.

HF isolates the conversations of a packed row with ``sdpa`` by building a dense
block-diagonal causal mask of T×T: every row then pays attention over all T positions,
exactly as if it held one conversation of length T, and wastes most of it on masked-out
blocks. packline registers two kernels with HF's attention interfaces that cost Σ lᵢ²
instead (what :mod:`packline.flops` counts), and ``model.attention`` picks one:

- ``varlen`` (``packline_varlen``): PyTorch's own variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``, causal, GQA) over the whole row at once, fed
  the row's ``cu_seqlens_padded`` and ``max_seqlen`` as the packer made them: no search of
  the positions, no device sync per layer. CUDA only (flash kernels: Ampere or later).
- ``thd`` (``packline_thd``): causal ``sdpa`` once per conversation of the row, a loop in
  Python: the CPU's choice (one kernel per conversation is no cost there).
- ``flex``: HF's own ``flex_attention`` with the document block mask HF builds once per
  forward from the restarting text positions. On CPU, PyTorch's FlexAttention has no
  backward (it raises ``NotImplementedError``): there it evaluates, it does not train.
- ``auto`` (the default): ``varlen`` on a CUDA device that runs it, else ``thd``
  (:func:`resolve_attention`).

A packed row's boundaries reach the attention as the ``packline_row`` keyword of the model's
forward (:class:`PackedRow`; HF hands its keyword arguments down to every attention call,
through activation checkpointing's recompute too), set by
:func:`packline.qwen.forward.packed_forward`, the one way packline runs a packed row, which
checks before the model runs that the row's text positions restart exactly at those
boundaries. Without it (a direct call of the model) the conversations are found the way HF
finds them: a new one starts wherever the text position does not continue the previous one
by +1, searched once per forward (on a GPU each search is a device-to-host sync): every
layer of a forward gets the same ``position_ids`` tensor, and the bounds are reused only for
that very tensor, unmodified. Anything else — a padding mask, a KV cache, batches of several
rows, the vision tower — is handed to HF's ``sdpa`` unchanged, so padded (packing off)
batches and generation behave exactly as with ``sdpa``.

>>> import torch
>>> positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
>>> conversation_bounds(positions)
[(0, 3), (3, 5), (5, 6)]
>>> PackedRow(torch.tensor([0, 3, 5, 6], dtype=torch.int32), max_seqlen=3).bounds()
[(0, 3), (3, 5), (5, 6)]
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

THD_ATTENTION = "packline_thd"
VARLEN_ATTENTION = "packline_varlen"
ROW_KWARG = "packline_row"
"""The keyword of the model's forward that carries a packed row's :class:`PackedRow`."""


@dataclass
class PackedRow:
    """A packed row's conversation boundaries as the packer made them: ``cu_seqlens``
    ``(n+1,)`` int32 on the row's device (``cu_seqlens_padded``: each conversation with its
    alignment gap, the last one to the row's end) and the longest of them, a host int."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    _bounds: list[tuple[int, int]] | None = field(default=None, repr=False)

    def bounds(self) -> list[tuple[int, int]]:
        """[(start, end)] of each non-empty conversation (read from the device once)."""
        if self._bounds is None:
            edges = self.cu_seqlens.tolist()
            self._bounds = [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
        return self._bounds


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


def _row_of(position_ids: torch.Tensor, row: PackedRow | None) -> PackedRow:
    """The row's boundaries: the packer's when the forward was given them, else found from
    the text positions (once per forward)."""
    if row is not None:
        return row
    bounds = _bounds_of(position_ids)
    edges = [0, *(end for _, end in bounds)]
    cu = torch.tensor(edges, dtype=torch.int32, device=position_ids.device)
    return PackedRow(cu, max((e - s for s, e in bounds), default=0), bounds)


def _is_packed_row(query, key, attention_mask, position_ids, kwargs) -> bool:
    """One row, no mask, causal, as long as its keys: a packed row (or one conversation)."""
    return (
        attention_mask is None
        and (position_ids is not None or kwargs.get(ROW_KWARG) is not None)
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2]
        and kwargs.get("is_causal", True) is not False
    )


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, position_ids, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != ROW_KWARG}
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
    if not _is_packed_row(query, key, attention_mask, position_ids, kwargs):
        args = (attention_mask, dropout, scaling, position_ids, kwargs)
        return _sdpa(module, query, key, value, *args)
    row = kwargs.pop(ROW_KWARG, None)
    kwargs.pop("is_causal", None)
    bounds = row.bounds() if row is not None else _bounds_of(position_ids)
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
        for s, e in bounds
    ]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


@functools.cache
def _varlen_kernel():
    """``(varlen_attn, its keyword for causal attention, whether it takes GQA, whether it
    takes a scale)``: PyTorch's API differs between releases (2.10 takes ``is_causal``;
    2.11 and later a ``window_size`` where ``(-1, 0)`` is causal, and ``enable_gqa``); None
    without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


def varlen_problem(device: torch.device | str) -> str | None:
    """Why ``varlen`` cannot run on ``device`` (None when it can): PyTorch's varlen flash
    kernel needs CUDA on Ampere (sm80) or later, and a PyTorch that has it."""
    device = torch.device(device)
    if _varlen_kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if device.type != "cuda":
        return f"its flash kernel runs on CUDA only, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"its flash kernel needs compute capability 8.0 or later (this GPU: {major}.{minor})"
    return None


def varlen_inputs(query, key, value, row: PackedRow):
    """The kernel's inputs from HF's ``[1, H, T, D]`` query, key and value: ``[T, H, D]``
    each (key and value repeated to the query's heads when the kernel takes no GQA), the
    row's ``cu_seqlens`` and ``max_seqlen`` for queries and keys alike, and the kernel's own
    keyword arguments."""
    kernel = _varlen_kernel()
    gqa = kernel is not None and kernel[2]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra = {
        **(kernel[1] if kernel else {}),
        **({"enable_gqa": True} if gqa and groups > 1 else {}),
    }
    return q, k, v, row.cu_seqlens, row.max_seqlen, extra


def varlen_attention_forward(
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
    """Causal varlen flash attention over a whole packed row ([1, H, T, D] → [1, T, H, D]);
    every other call goes to HF's ``sdpa_attention_forward`` as is."""
    if not _is_packed_row(query, key, attention_mask, position_ids, kwargs):
        args = (attention_mask, dropout, scaling, position_ids, kwargs)
        return _sdpa(module, query, key, value, *args)
    if dropout:
        raise ValueError(f"varlen attention runs without dropout, got {dropout}")
    row = _row_of(position_ids, kwargs.get(ROW_KWARG))
    q, k, v, cu, longest, extra = varlen_inputs(query, key, value, row)
    varlen_attn, _, _, takes_scale = _varlen_kernel()
    if takes_scale:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn takes no scale, and {scaling} is not 1/√d")
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **extra)
    return out.unsqueeze(0), None


def thd_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask where the attention needs none (no padding: conversations come from the
    row's boundaries); HF's ``sdpa`` mask wherever there is padding."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


for _name, _forward in ((THD_ATTENTION, thd_attention_forward),
                        (VARLEN_ATTENTION, varlen_attention_forward)):  # fmt: skip
    AttentionInterface.register(_name, _forward)
    AttentionMaskInterface.register(_name, thd_mask)


HF_ATTENTION = {
    "varlen": VARLEN_ATTENTION,
    "thd": THD_ATTENTION,
    "flex": "flex_attention",
    "sdpa": "sdpa",
    "eager": "eager",
}
"""``model.attention`` values (but ``auto``) → HF attention implementation names."""


def resolve_attention(attention: str, device: torch.device | str) -> str:
    """``model.attention`` for a model on ``device``: ``auto`` is ``varlen`` where it runs
    (:func:`varlen_problem`), else ``thd``; any other choice as it is.

    >>> resolve_attention("auto", "cpu"), resolve_attention("flex", "cpu")
    ('thd', 'flex')
    """
    if attention != "auto":
        return attention
    return "varlen" if varlen_problem(device) is None else "thd"


def set_text_attention(
    model: torch.nn.Module, attention: str = "auto", device: torch.device | str | None = None
) -> torch.nn.Module:
    """Switch the language model of ``model`` (a Qwen3-VL, plain or PEFT-wrapped) to
    ``attention`` (``auto`` or a key of :data:`HF_ATTENTION`; ``auto`` resolved for
    ``device``, by default where the model's parameters are); the vision tower keeps its own."""
    if device is None:
        device = next(model.parameters()).device
    attention = resolve_attention(attention, device)
    if attention not in HF_ATTENTION:
        raise ValueError(
            f"unknown attention {attention!r}; expected auto or one of {sorted(HF_ATTENTION)}"
        )
    text = getattr(model.config, "text_config", None)
    if text is None:
        raise ValueError(f"{type(model).__name__} has no text_config: not a Qwen3-VL model")
    text._attn_implementation = HF_ATTENTION[attention]
    return model


def text_attention(model: torch.nn.Module) -> str:
    """The ``model.attention`` choice the language model of ``model`` runs (``varlen``,
    ``thd``, ...): what a run reports it trained with."""
    name = model.config.text_config._attn_implementation
    return next((k for k, v in HF_ATTENTION.items() if v == name), name)
