"""THD rows: several conversations in one physical row, each attending only to itself.

Shape legend: ``L`` one conversation's tokens, ``T`` the row's physical length (aligned
conversations + tail padding), ``n`` conversations, ``P`` image patches, ``D`` patch dim.

A row is the packed micro-batch of DESIGN.md (MBS 1)::

    input_ids     (1, T)      conversations back to back, pad_token_id in the gaps
    labels        (1, T)      next token inside each conversation on assistant targets,
                              -100 elsewhere: at each conversation's last token and in gaps
    loss_mask     (1, T)      labels != -100
    position_ids  (4, 1, T)   row 0: text positions, restarting at 0 per conversation;
                              rows 1-3: that conversation's own M-RoPE rows
    cu_seqlens          (n+1,)  boundaries of the real tokens
    cu_seqlens_padded   (n+1,)  boundaries of the aligned segments
    max_seqlen          int     longest aligned segment
    pixel_values   (P, D)     every image's patches, in order of appearance
    image_grid_thw (k, 3)     one row per image, same order
    pixel_values_videos (Pv, D)  every video's patches (temporal groups of 2 frames), in
                              order of appearance
    video_grid_thw      (v, 3)   one row per video, same order (t = temporal groups)

Worked example (m = 4, seq_length 12, pad_to_max_length): conversations of 5 and 4 tokens
→ segments 8 and 4 → ``cu_seqlens [0, 5, 9]``, ``cu_seqlens_padded [0, 8, 12]``,
``max_seqlen 8``, T = 12 (Megatron-Bridge gives the same for this case).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from packline.packing.selection import align_up

IGNORE_INDEX = -100


@dataclass(kw_only=True)
class EncodedConversation:
    """One conversation ready to be placed in a row."""

    key: str
    input_ids: torch.Tensor  # (L,) int64
    target_mask: torch.Tensor  # (L,) bool: tokens trained on (assistant replies + <|im_end|>)
    mrope: torch.Tensor  # (3, L) int64: this conversation's own M-RoPE positions
    pixel_values: torch.Tensor | None = None  # (P_i, D)
    image_grid_thw: torch.Tensor | None = None  # (k_i, 3) int64
    pixel_values_videos: torch.Tensor | None = None  # (Pv_i, D)
    video_grid_thw: torch.Tensor | None = None  # (v_i, 3) int64
    video_frames: int = 0
    """Frames sampled from this conversation's videos (before an odd count is padded)."""

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])


@dataclass(kw_only=True)
class PackedBatch:
    """One packed row plus its counters and its ledger entries."""

    input_ids: torch.Tensor  # (1, T)
    labels: torch.Tensor  # (1, T)
    loss_mask: torch.Tensor  # (1, T) bool
    position_ids: torch.Tensor  # (4, 1, T)
    cu_seqlens: torch.Tensor  # (n+1,) int32
    cu_seqlens_padded: torch.Tensor  # (n+1,) int32
    max_seqlen: int
    pixel_values: torch.Tensor | None  # (P, D)
    image_grid_thw: torch.Tensor | None  # (k, 3)
    pixel_values_videos: torch.Tensor | None = None  # (Pv, D)
    video_grid_thw: torch.Tensor | None = None  # (v, 3)
    keys: list[str] = field(default_factory=list)
    """Keys of the conversations in this row, in row order."""
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Ledger entries that travel with this row: reason → keys dropped since the last row."""
    seen: int = 0
    """Ledger: source samples the loader worker read since its previous row."""
    num_real_tokens: int = 0
    num_padded_tokens: int = 0
    num_conversations: int = 0
    num_images: int = 0
    num_image_tokens: int = 0
    num_loss_tokens: int = 0
    num_videos: int = 0
    num_video_tokens: int = 0
    num_video_frames: int = 0
    """Frames sampled from the row's videos (before odd counts are padded)."""
    images_per_conversation: list[int] = field(default_factory=list)
    videos_per_conversation: list[int] = field(default_factory=list)
    frames_per_conversation: list[int] = field(default_factory=list)

    @property
    def seq_lens(self) -> list[int]:
        """Real tokens of each conversation."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def token_type_ids(self, image_token_id: int, video_token_id: int | None = None):
        """(1, T) HF ``mm_token_type_ids`` (:func:`mm_token_type_ids`)."""
        return mm_token_type_ids(self.input_ids, image_token_id, video_token_id)

    def real_token_mask(self) -> torch.Tensor:
        """(1, T) bool: True on the conversations' own tokens, ``[cu_seqlens_padded[i],
        cu_seqlens_padded[i] + len_i)``; False in the alignment gaps and the
        ``pad_to_max_length`` tail. On the row's device, no device sync.

        >>> row = build_packed_batch(
        ...     [EncodedConversation(key=k, input_ids=torch.arange(n), target_mask=torch.ones(
        ...         n, dtype=torch.bool), mrope=torch.arange(n).expand(3, n)) for k, n in
        ...      (("a", 3), ("b", 2))], seq_length=8, alignment=4, pad_to_max_length=True)
        >>> row.real_token_mask().int().tolist()
        [[1, 1, 1, 0, 1, 1, 0, 0]]
        """
        length = self.input_ids.shape[1]
        bounds = self.cu_seqlens_padded.to(device=self.input_ids.device, dtype=torch.long)
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(bounds)
        offsets = torch.arange(length, device=bounds.device)
        # Each token's segment: the last one starting at or before it (empty ones skipped).
        segment = torch.searchsorted(bounds[1:], offsets, right=True).clamp(max=len(lens) - 1)
        return ((offsets - bounds[segment]) < lens[segment]).view(1, length)

    def conversations(self) -> list[EncodedConversation]:
        """The row's conversations back as separate, unpadded conversations (for the
        packing-off baseline, which lays the very same conversations out padded)."""
        out = []
        starts = self.cu_seqlens_padded.tolist()
        images = _split_media(self.pixel_values, self.image_grid_thw, self.images_per_conversation)
        videos = _split_media(
            self.pixel_values_videos,
            self.video_grid_thw,
            self.videos_per_conversation or [0] * len(self.keys),
        )
        frames = self.frames_per_conversation or [0] * len(self.keys)
        for key, start, n, (pixels, grid), (vpixels, vgrid), nframes in zip(
            self.keys, starts, self.seq_lens, images, videos, frames, strict=False
        ):
            ids = self.input_ids[0, start : start + n]
            labels = self.labels[0, start : start + n]
            target = torch.cat([torch.zeros(1, dtype=torch.bool), labels[:-1] != IGNORE_INDEX])
            out.append(
                EncodedConversation(
                    key=key,
                    input_ids=ids,
                    target_mask=target,
                    mrope=self.position_ids[1:, 0, start : start + n],
                    pixel_values=pixels,
                    image_grid_thw=grid,
                    pixel_values_videos=vpixels,
                    video_grid_thw=vgrid,
                    video_frames=nframes,
                )
            )
        return out


def mm_token_type_ids(
    input_ids: torch.Tensor, image_token_id: int, video_token_id: int | None = None
) -> torch.Tensor:
    """HF's ``mm_token_type_ids`` of ``input_ids`` (int32, same shape): 1 on image
    placeholder tokens, 2 on video placeholder tokens, 0 elsewhere.

    >>> mm_token_type_ids(torch.tensor([5, 1, 1, 5, 2, 5]), 1, 2).tolist()
    [0, 1, 1, 0, 2, 0]
    """
    types = (input_ids == image_token_id).to(torch.int32)
    if video_token_id is not None:
        types = types + 2 * (input_ids == video_token_id).to(torch.int32)
    return types


def _split_media(
    pixels: torch.Tensor | None, grid: torch.Tensor | None, counts: list[int]
) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per-conversation (pixel rows, grid rows) of a row's concatenated media, ``counts``
    items each."""
    out: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    rows = grid.prod(dim=-1).tolist() if grid is not None else []
    item = patch = 0
    for k in counts:
        if not k:
            out.append((None, None))
            continue
        n = sum(rows[item : item + k])
        out.append((pixels[patch : patch + n], grid[item : item + k]))
        item, patch = item + k, patch + n
    return out


def _check_media(key: str, what: str, ids, token_id, pixels, grid, merge_size: int) -> int:
    """Placeholder tokens of one modality == its features, patches == pixel rows; returns
    the number of placeholder tokens."""
    placeholders = int((ids == token_id).sum())
    features = 0
    if grid is not None and len(grid):
        patches = int(grid.prod(dim=-1).sum())
        features = patches // merge_size**2
        if pixels is None or pixels.shape[0] != patches:
            got = None if pixels is None else pixels.shape[0]
            raise ValueError(f"{key}: {patches} {what} patches in the grids, {got} pixel rows")
    if placeholders != features:
        raise ValueError(
            f"{key}: {placeholders} {what} placeholder tokens but {features} {what} features"
        )
    return placeholders


def to_device(batch, device: torch.device | str):
    """A copy of a :class:`PackedBatch` or :class:`PaddedBatch` with its tensors on
    ``device`` (the same object when they already are)."""
    device = torch.device(device)
    if batch.input_ids.device == device:
        return batch
    moved = {
        f.name: getattr(batch, f.name).to(device, non_blocking=True)
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, **moved)


def _concat_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Concatenate pixel rows. A row's patches run to tens of MB; numpy's concatenate
    copies them several times faster than torch.cat on CPU (measured by the packing
    bench), and ``from_numpy`` shares the result without another copy."""
    if not tensors:
        return None
    return torch.from_numpy(np.concatenate([t.numpy() for t in tensors]))


def shifted_labels(input_ids: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Labels of one conversation: position i predicts token i+1 when that token is a
    target; the last position predicts nothing.

    >>> shifted_labels(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 1, 1]).bool()).tolist()
    [-100, 7, 8, -100]
    """
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    nxt = input_ids[1:]
    labels[:-1] = torch.where(target_mask[1:], nxt, torch.full_like(nxt, IGNORE_INDEX))
    return labels


def build_packed_batch(
    convs: list[EncodedConversation],
    *,
    seq_length: int,
    alignment: int = 1,
    pad_to_max_length: bool = False,
    pad_token_id: int = 0,
    image_token_id: int | None = None,
    video_token_id: int | None = None,
    merge_size: int = 2,
    dropped: dict[str, list[str]] | None = None,
    seen: int = 0,
) -> PackedBatch:
    """Lay ``convs`` out in one row (see the module docstring for the layout).

    Raises ``ValueError`` when the aligned conversations do not fit ``seq_length`` or when a
    conversation's image (or video) placeholder tokens disagree with its image (video)
    features, checked per conversation for each modality whose token id is given.
    """
    padded = [align_up(len(c), alignment) for c in convs]
    total = sum(padded)
    if total > seq_length:
        raise ValueError(
            f"conversations of {[len(c) for c in convs]} tokens (aligned {padded}) do not fit "
            f"seq_length {seq_length}"
        )
    if pad_to_max_length and convs:
        padded[-1] += seq_length - total  # Megatron-Bridge puts the tail on the last segment
    ids, labels, pos0, mrope, pixels, grids, vpixels, vgrids = [], [], [], [], [], [], [], []
    num_image_tokens = num_video_tokens = 0
    for conv, width in zip(convs, padded, strict=True):
        n = len(conv)
        gap = width - n
        if image_token_id is not None:
            num_image_tokens += _check_media(
                conv.key,
                "image",
                conv.input_ids,
                image_token_id,
                conv.pixel_values,
                conv.image_grid_thw,
                merge_size,
            )
        if video_token_id is not None:
            num_video_tokens += _check_media(
                conv.key,
                "video",
                conv.input_ids,
                video_token_id,
                conv.pixel_values_videos,
                conv.video_grid_thw,
                merge_size,
            )
        ids.append(torch.cat([conv.input_ids, torch.full((gap,), pad_token_id)]))
        labels.append(
            torch.cat([shifted_labels(conv.input_ids, conv.target_mask), torch.full((gap,), -100)])
        )
        pos0.append(torch.arange(width))
        # Gap tokens continue the conversation's positions; causal attention keeps them
        # from influencing its real tokens.
        start = int(conv.mrope.max()) + 1 if n else 0
        tail = torch.arange(start, start + gap).expand(3, gap)
        mrope.append(torch.cat([conv.mrope, tail], dim=1))
        if conv.pixel_values is not None and conv.num_images:
            pixels.append(conv.pixel_values)
            grids.append(conv.image_grid_thw)
        if conv.pixel_values_videos is not None and conv.num_videos:
            vpixels.append(conv.pixel_values_videos)
            vgrids.append(conv.video_grid_thw)
    lens = [len(c) for c in convs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()] if lens else [0])
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()] if lens else [0])
    input_ids = torch.cat(ids).view(1, -1) if ids else torch.zeros(1, 0, dtype=torch.long)
    label_row = torch.cat(labels).view(1, -1) if labels else torch.zeros(1, 0, dtype=torch.long)
    text_pos = torch.cat(pos0) if pos0 else torch.zeros(0, dtype=torch.long)
    rope = torch.cat(mrope, dim=1) if mrope else torch.zeros(3, 0, dtype=torch.long)
    position_ids = torch.cat([text_pos.view(1, -1), rope], dim=0).view(4, 1, -1)
    loss_mask = label_row != IGNORE_INDEX
    return PackedBatch(
        input_ids=input_ids.long(),
        labels=label_row.long(),
        loss_mask=loss_mask,
        position_ids=position_ids.long(),
        cu_seqlens=cu.to(torch.int32),
        cu_seqlens_padded=cu_padded.to(torch.int32),
        max_seqlen=max(padded, default=0),
        pixel_values=_concat_rows(pixels),
        image_grid_thw=torch.cat(grids).long() if grids else None,
        pixel_values_videos=_concat_rows(vpixels),
        video_grid_thw=torch.cat(vgrids).long() if vgrids else None,
        keys=[c.key for c in convs],
        dropped=dict(dropped or {}),
        seen=seen,
        num_real_tokens=sum(lens),
        num_padded_tokens=sum(padded) - sum(lens),
        num_conversations=len(convs),
        num_images=sum(c.num_images for c in convs),
        num_image_tokens=num_image_tokens,
        num_loss_tokens=int(loss_mask.sum()),
        num_videos=sum(c.num_videos for c in convs),
        num_video_tokens=num_video_tokens,
        num_video_frames=sum(c.video_frames for c in convs),
        images_per_conversation=[c.num_images for c in convs],
        videos_per_conversation=[c.num_videos for c in convs],
        frames_per_conversation=[c.video_frames for c in convs],
    )


@dataclass(kw_only=True)
class PaddedBatch:
    """Packing off: k conversations, one per row, right-padded to the longest.

    ``input_ids``/``attention_mask``/``labels`` are (k, Lmax); labels are shifted inside
    each conversation exactly as in a packed row, so the per-token loss is the same.
    """

    input_ids: torch.Tensor  # (k, Lmax)
    attention_mask: torch.Tensor  # (k, Lmax)
    labels: torch.Tensor  # (k, Lmax)
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    keys: list[str]
    num_real_tokens: int
    num_padded_tokens: int
    num_loss_tokens: int
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def token_type_ids(self, image_token_id: int, video_token_id: int | None = None):
        return mm_token_type_ids(self.input_ids, image_token_id, video_token_id)

    def real_token_mask(self) -> torch.Tensor:
        """(k, Lmax) bool: the conversations' own tokens (the attention mask)."""
        return self.attention_mask.bool()


def expected_text_positions(cu_seqlens_padded: torch.Tensor, length: int) -> torch.Tensor:
    """(T,) row 0 of a packed row's ``position_ids`` as :func:`build_packed_batch` lays it
    out: ``arange`` over each aligned segment of ``cu_seqlens_padded`` (gap tokens and the
    ``pad_to_max_length`` tail continue their segment's count). No device sync.

    >>> expected_text_positions(torch.tensor([0, 8, 12]), 12).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    """
    bounds = cu_seqlens_padded.to(torch.long)
    starts = bounds[:-1].clamp(0, length)  # clamped: a bad offset must not index out of range
    # Each offset's segment start: scatter the starts, carry the latest one forward.
    marker = torch.zeros(length + 1, dtype=torch.long, device=bounds.device)
    marker.scatter_reduce_(0, starts, starts, reduce="amax")
    segment_start = marker[:length].cummax(0).values
    return torch.arange(length, device=bounds.device) - segment_start


def check_text_positions(text_positions: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the text positions (row 0 of ``position_ids``, any shape
    holding T values) restart at 0 exactly at the offsets ``cu_seqlens_padded[:-1]`` and
    count up by 1 everywhere else, over a row of ``cu_seqlens_padded[-1]`` tokens.

    The model finds the conversations of a packed row from where these positions restart,
    not from ``cu_seqlens``: a row whose positions disagree with its boundaries would attend
    across conversations (or cut one in two) with no error. One comparison and one device
    sync on a valid row; the message names the first mismatching offset.
    """
    pos = text_positions.reshape(-1)
    length = pos.numel()
    bounds = cu_seqlens_padded.to(device=pos.device, dtype=torch.long)
    expected = expected_text_positions(bounds, length)
    ok = (
        (pos == expected).all()
        & (bounds[0] == 0)
        & (bounds[-1] == length)
        & (bounds[1:] >= bounds[:-1]).all()
    )
    if bool(ok):  # the one sync
        return
    pos, bounds, expected = pos.cpu(), bounds.cpu(), expected.cpu()
    offsets = bounds.tolist()
    if offsets[0] != 0 or offsets[-1] != length or offsets != sorted(offsets):
        raise ValueError(
            f"cu_seqlens_padded {offsets} does not describe a row of {length} tokens: it must "
            f"start at 0, never decrease and end at {length}"
        )
    i = int(torch.nonzero(pos != expected)[0])
    got, want = int(pos[i]), int(expected[i])
    if want == 0:
        what = f"a conversation starts there but the position is {got}, not 0"
    elif got == 0 or (i > 0 and got != int(pos[i - 1]) + 1):
        what = f"the positions restart there ({got}) inside a conversation (expected {want})"
    else:
        what = f"position {got}, expected {want}"
    raise ValueError(
        f"row 0 of position_ids does not restart at the cu_seqlens_padded boundaries "
        f"{offsets[:-1]}: first mismatch at offset {i}: {what}"
    )


def build_padded_batch(convs: list[EncodedConversation], *, pad_token_id: int = 0) -> PaddedBatch:
    """Right-pad ``convs`` to the longest; images (and videos) concatenated in row order."""
    longest = max(len(c) for c in convs)
    ids = torch.full((len(convs), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(convs), longest), dtype=torch.long)
    labels = torch.full((len(convs), longest), IGNORE_INDEX, dtype=torch.long)
    pixels, grids, vpixels, vgrids = [], [], [], []
    for row, conv in enumerate(convs):
        n = len(conv)
        ids[row, :n] = conv.input_ids
        mask[row, :n] = 1
        labels[row, :n] = shifted_labels(conv.input_ids, conv.target_mask)
        if conv.pixel_values is not None and conv.num_images:
            pixels.append(conv.pixel_values)
            grids.append(conv.image_grid_thw)
        if conv.pixel_values_videos is not None and conv.num_videos:
            vpixels.append(conv.pixel_values_videos)
            vgrids.append(conv.video_grid_thw)
    real = int(mask.sum())
    return PaddedBatch(
        input_ids=ids,
        attention_mask=mask,
        labels=labels,
        pixel_values=_concat_rows(pixels),
        image_grid_thw=torch.cat(grids).long() if grids else None,
        pixel_values_videos=_concat_rows(vpixels),
        video_grid_thw=torch.cat(vgrids).long() if vgrids else None,
        keys=[c.key for c in convs],
        num_real_tokens=real,
        num_padded_tokens=ids.numel() - real,
        num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
    )
