"""The packed forward of HF Qwen3-VL, and the guard against silent contamination.

HF Qwen3-VL isolates the conversations of a packed row only when it gets 4-row
``position_ids`` (row 0 = text positions restarting per conversation), no 2-D attention
mask and no KV cache: it then builds a block-diagonal causal mask from the position
resets (so does ``packline_thd``, :mod:`packline.qwen.attention`). A 2-D mask, 3-row
(M-RoPE only) positions or an enabled cache make every conversation attend to the ones
before it, and text positions that do not restart exactly at the row's
``cu_seqlens_padded`` boundaries join or split its conversations — all with no error.
:func:`check_packed_inputs` turns each of those into a ``ValueError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from packline.packing.thd import IGNORE_INDEX, PackedBatch, check_text_positions
from packline.qwen.attention import ROW_KWARG, PackedRow


def check_packed_inputs(
    *,
    position_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    attention_mask: torch.Tensor | None,
    use_cache: bool | None,
) -> None:
    """Refuse the inputs under which HF Qwen3-VL silently attends across conversations,
    including row-0 positions that do not restart at the ``cu_seqlens_padded`` boundaries
    (:func:`~packline.packing.thd.check_text_positions`: one device sync)."""
    problems = []
    if attention_mask is not None:
        problems.append(
            f"attention_mask of shape {tuple(attention_mask.shape)} given: a packed row must "
            "pass attention_mask=None (a 2-D mask disables per-conversation isolation)"
        )
    if position_ids.dim() != 3 or position_ids.shape[0] != 4:
        problems.append(
            f"position_ids of shape {tuple(position_ids.shape)}: a packed row needs (4, 1, T) "
            "— row 0 text positions restarting per conversation, rows 1-3 M-RoPE (3-row "
            "positions hide the conversation boundaries)"
        )
    if use_cache is not False:
        problems.append(
            f"use_cache={use_cache!r}: a packed forward must pass use_cache=False (a KV cache "
            "disables packed-sequence detection)"
        )
    if problems:
        raise ValueError("unsafe packed forward: " + "; ".join(problems))
    try:
        check_text_positions(position_ids[0], cu_seqlens_padded)
    except ValueError as err:
        raise ValueError(f"unsafe packed forward: {err}") from None


def packed_forward(
    model,
    batch: PackedBatch,
    *,
    image_token_id: int,
    video_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool | None = False,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (1, T, V) of a packed row; every conversation sees only itself."""
    position_ids = batch.position_ids if position_ids is None else position_ids
    check_packed_inputs(
        position_ids=position_ids,
        cu_seqlens_padded=batch.cu_seqlens_padded,
        attention_mask=attention_mask,
        use_cache=use_cache,
    )
    return model(**packed_inputs(batch, image_token_id, video_token_id, position_ids)).logits


def packed_inputs(
    batch: PackedBatch,
    image_token_id: int,
    video_token_id: int | None,
    position_ids: torch.Tensor | None = None,
) -> dict:
    """The HF model's inputs for a packed row (checked by :func:`check_packed_inputs`
    first): its tokens and media, its M-RoPE ``position_ids`` (the batch's by default), no
    mask, no cache, and the packer's boundaries for the varlen kernels
    (:mod:`packline.qwen.attention`)."""
    return {
        **_media_inputs(batch, image_token_id, video_token_id),
        "position_ids": batch.position_ids if position_ids is None else position_ids,
        "attention_mask": None,
        "use_cache": False,
        ROW_KWARG: PackedRow(batch.cu_seqlens_padded, batch.max_seqlen),
    }


def padded_inputs(batch, image_token_id: int, video_token_id: int | None) -> dict:
    """The HF model's inputs for right-padded rows: the 2-D mask marks padding and HF
    computes each row's M-RoPE itself."""
    return {
        **_media_inputs(batch, image_token_id, video_token_id),
        "attention_mask": batch.attention_mask,
        "use_cache": False,
    }


def _media_inputs(batch, image_token_id: int, video_token_id: int | None) -> dict:
    """A batch's tokens, images and videos as the HF Qwen3-VL model takes them."""
    return {
        "input_ids": batch.input_ids,
        "pixel_values": batch.pixel_values,
        "image_grid_thw": batch.image_grid_thw,
        "pixel_values_videos": batch.pixel_values_videos,
        "video_grid_thw": batch.video_grid_thw,
        "mm_token_type_ids": batch.token_type_ids(image_token_id, video_token_id),
    }


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """(Σ token cross-entropy, number of target tokens): labels are already shifted, so
    no shift happens here. Per-token losses are summed in float64, so the sum does not
    depend on how the tokens were laid out. Divide by the global target count, never
    average per row. ``weights`` (labels' shape, float64: :func:`conversation_weights`)
    weigh each token's loss in the sum."""
    flat = labels.reshape(-1)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        flat,
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).double()
    if weights is not None:
        per_token = per_token * weights.reshape(-1)
    return per_token.sum(), int((flat != IGNORE_INDEX).sum())


def conversation_weights(batch) -> tuple[torch.Tensor, int]:
    """(each label's weight in the loss sum, the conversations with a target) for
    ``train.loss: sample``: 1/n on each of a conversation's n target tokens, 0 elsewhere, so
    Σ weight × token loss is the sum of the conversations' mean token losses; divided by the
    global batch's conversations it is their mean. A packed row's conversations are found
    from its ``cu_seqlens_padded``, a padded batch holds one per row: the weights of a
    conversation do not depend on the layout. On the batch's device (float64).

    >>> from packline.packing.thd import EncodedConversation, build_packed_batch
    >>> convs = [EncodedConversation(key=k, input_ids=torch.arange(n), target_mask=torch.ones(
    ...     n, dtype=torch.bool), mrope=torch.arange(n).expand(3, n)) for k, n in
    ...     (("a", 3), ("b", 5))]
    >>> w, n = conversation_weights(build_packed_batch(convs, seq_length=8))
    >>> [round(x, 2) for x in w[0].tolist()], n  # shifted labels: 2 and 4 targets
    ([0.5, 0.5, 0.0, 0.25, 0.25, 0.25, 0.25, 0.0], 2)
    """
    labels = batch.labels
    target = labels != IGNORE_INDEX
    bounds = getattr(batch, "cu_seqlens_padded", None)
    if bounds is None:  # padded: one conversation per row
        counts = target.sum(dim=-1, keepdim=True)
        weights = target / counts.clamp(min=1).to(torch.float64)
        return weights.to(torch.float64), int((counts > 0).sum())
    bounds = bounds.to(device=labels.device, dtype=torch.long)
    n = max(len(bounds) - 1, 1)
    offsets = torch.arange(labels.shape[-1], device=labels.device)
    segment = torch.searchsorted(bounds[1:], offsets, right=True).clamp(max=n - 1)
    counts = torch.bincount(segment[target.reshape(-1)], minlength=n)
    per_token = 1.0 / counts.clamp(min=1).to(torch.float64)
    weights = torch.where(target.reshape(-1), per_token[segment], 0.0).view_as(labels)
    return weights, int((counts > 0).sum())


def token_hits(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """How many target tokens (labels already shifted, as :func:`token_loss_sum`) are the
    logits' top prediction.

    >>> logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])
    >>> token_hits(logits, torch.tensor([[1, 1, IGNORE_INDEX]]))  # right, wrong, not a target
    1
    """
    flat = labels.reshape(-1)
    keep = flat != IGNORE_INDEX
    return int((logits.reshape(-1, logits.shape[-1])[keep].argmax(-1) == flat[keep]).sum())


def padded_forward(
    model, batch, *, image_token_id: int, video_token_id: int | None = None
) -> torch.Tensor:
    """Logits (k, Lmax, V) of right-padded rows (packing off): the 2-D mask marks padding
    and HF computes each row's M-RoPE itself."""
    return model(**padded_inputs(batch, image_token_id, video_token_id)).logits


# --- the loss without the full logits --------------------------------------------------------

LOSS_CHUNK_TOKENS = 1024
"""Row positions whose logits exist at once in the chunked loss (``train.loss_chunk_tokens``'
default): Qwen3-VL's 151,936-token vocabulary makes that 0.6 GB of fp32 logits, where a whole
4,096-token row would be 2.5 GB."""


def _hf_parts(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model without its LM head, the LM head) of a Qwen3-VL, plain or PEFT-wrapped."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf.model, hf.lm_head


def _chunk_loss(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
):
    """Σ token cross-entropy (float64, each token's ``weights`` if given) of one chunk: its
    logits in fp32 live only here."""
    logits = lm_head(hidden).float()
    per_token = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    per_token = per_token.double()
    return (per_token if weights is None else per_token * weights).sum()


def chunked_token_loss(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    with_hits: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, int]:
    """(Σ token cross-entropy in float64, target tokens, top-1 hits when ``with_hits``) of
    ``hidden`` [..., H] (the final norm's output) under ``lm_head``, ``chunk_tokens``
    positions at a time: no [T, vocab] tensor exists, and with gradients each chunk's logits
    are recomputed in the backward (a non-reentrant checkpoint) instead of kept. The same
    sum as :func:`token_loss_sum` of the whole logits (labels already shifted), with the
    same ``weights``."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1)
    flat_w = None if weights is None else weights.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    hits = 0
    for start in range(0, flat_y.numel(), chunk_tokens):
        h, y = flat_h[start : start + chunk_tokens], flat_y[start : start + chunk_tokens]
        w = None if flat_w is None else flat_w[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_chunk_loss, lm_head, h, y, w, use_reentrant=False)
        else:
            total = total + _chunk_loss(lm_head, h, y, w)
        if with_hits:
            with torch.no_grad():
                hits += token_hits(lm_head(h).unsqueeze(0), y.unsqueeze(0))
    return total, int((flat_y != IGNORE_INDEX).sum()), hits


def _batch_loss(
    model, batch, inputs: dict, chunk_tokens: int, with_hits: bool, per_sample: bool
) -> tuple[torch.Tensor, int, int]:
    """:func:`chunked_token_loss` of ``batch`` run on ``inputs`` through the model's body,
    the LM head chunk by chunk (``per_sample``: weighed by :func:`conversation_weights`)."""
    body, lm_head = _hf_parts(model)
    hidden = body(**inputs).last_hidden_state
    return chunked_token_loss(
        lm_head,
        hidden,
        batch.labels,
        chunk_tokens=chunk_tokens,
        with_hits=with_hits,
        weights=conversation_weights(batch)[0] if per_sample else None,
    )


def packed_loss(
    model,
    batch: PackedBatch,
    *,
    image_token_id: int,
    video_token_id: int | None = None,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    with_hits: bool = False,
    per_sample: bool = False,
) -> tuple[torch.Tensor, int, int]:
    """:func:`chunked_token_loss` of a packed row, its conversations isolated as in
    :func:`packed_forward` (same checks, same inputs), the LM head applied chunk by chunk;
    ``per_sample``: each conversation's tokens weighed by :func:`conversation_weights`."""
    check_packed_inputs(
        position_ids=batch.position_ids,
        cu_seqlens_padded=batch.cu_seqlens_padded,
        attention_mask=None,
        use_cache=False,
    )
    inputs = packed_inputs(batch, image_token_id, video_token_id)
    return _batch_loss(model, batch, inputs, chunk_tokens, with_hits, per_sample)


def padded_loss(
    model,
    batch,
    *,
    image_token_id: int,
    video_token_id: int | None = None,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    with_hits: bool = False,
    per_sample: bool = False,
) -> tuple[torch.Tensor, int, int]:
    """:func:`chunked_token_loss` of right-padded rows (packing off), as
    :func:`padded_forward` runs them (``per_sample`` as in :func:`packed_loss`)."""
    inputs = padded_inputs(batch, image_token_id, video_token_id)
    return _batch_loss(model, batch, inputs, chunk_tokens, with_hits, per_sample)
