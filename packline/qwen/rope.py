"""Qwen3-VL M-RoPE positions of one conversation, computed by the model's own code.

``Qwen3VLModel.get_rope_index`` needs only the vision config's ``spatial_merge_size``; the
loader needs the positions but not the weights, so :class:`RopeIndex` binds the very same
HF methods to that one setting. A test checks it against a real model's method.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel


class RopeIndex:
    """HF Qwen3-VL's rope-index logic, without a model instance."""

    get_rope_index = Qwen3VLModel.get_rope_index
    get_vision_position_ids = Qwen3VLModel.get_vision_position_ids

    def __init__(self, spatial_merge_size: int):
        self.config = SimpleNamespace(
            vision_config=SimpleNamespace(spatial_merge_size=spatial_merge_size)
        )

    def positions(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(3, L) temporal/height/width positions of one conversation (1-D ``input_ids``;
        ``mm_token_type_ids`` 1 on image pads, 2 on video pads). Each temporal group of a
        video is its own run of video pads (timestamp text lies between), positioned as the
        model does: one grid row ``(1, h, w)`` per group."""
        pos, _ = self.get_rope_index(
            input_ids.view(1, -1),
            mm_token_type_ids.view(1, -1),
            image_grid_thw if image_grid_thw is not None and len(image_grid_thw) else None,
            video_grid_thw if video_grid_thw is not None and len(video_grid_thw) else None,
        )
        return pos[:, 0, :]
