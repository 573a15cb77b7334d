"""FSDP2 for a dense model on the local backend (``train.parallel.fsdp`` with EP 1 and PP 1):
torch's own ``fully_shard`` splits the frozen base and the LoRA adapters over the ranks, so a
GPU holds 1/N of the weights.

How a rank builds its shard (:func:`shard_model`), so that host RAM never holds more than
one full copy of the model:

- every rank makes the model's modules on the meta device (no memory), PEFT's adapters
  included, and shards them: each decoder layer, each vision block, then the root
  (:func:`fsdp_units`);
- every rank allocates its shards only (``to_empty`` on its device);
- rank 0 builds the one-process model (the checkpoint read once, or the tiny model's seeded
  init, and PEFT's seeded adapters: the only full copy, which rank 0 keeps to evaluate and
  export with, as the split layouts do) and ``set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)`` hands every rank its shards of it, one tensor at a time; the
  buffers (RoPE's frequencies) are broadcast likewise.

Gradients: FSDP2 reduce-scatters them in the backward, summed (a divide factor of 1: the
loss is already divided by the global batch's target tokens, so a mean would divide twice).
Clipping runs on the sharded gradients (torch's ``clip_grad_norm_`` reduces the norm over
the shards). Checkpoints save the sharded adapters and AdamW's state through DCP under their
one-process names, so a run saved on N ranks resumes on one and the other way round
(:mod:`packline.train.checkpoint`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one: the language model's decoder layers, each gathered
    for its forward and freed after. Everything else (embeddings, final norm, LM head, the
    whole vision tower) belongs to the root (:class:`LossRoot`): the vision tower runs once,
    twice or not at all in a micro-batch (images, video, neither), which differs between
    ranks, and a sharded unit must run as often on every rank (its gathers are
    collectives)."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(hf.model.language_model.layers)


class LossRoot(torch.nn.Module):
    """The FSDP2 root: its forward is a micro-batch's chunked loss
    (:func:`~packline.qwen.forward.packed_loss` / ``padded_loss``), which calls the model's
    body and LM head directly, so the weights no decoder layer holds (embeddings, which the
    LM head may share, the final norm, the vision tower) are gathered by this root's forward
    and their gradients reduced after its backward.

    Every trainable weight of the root takes part in every forward (times zero where the
    micro-batch does not use it: the vision tower's adapters, when a rank's rows hold no
    image), so every rank reduces the same gradients: FSDP2 reduces only the weights that
    have one, and ranks that disagree on that deadlock or exchange garbage."""

    def __init__(self, model: torch.nn.Module, own_trainable: list[str]):
        super().__init__()
        self.model = model
        self.own_trainable = own_trainable

    def forward(self, batch, *, packed: bool, **kwargs):
        from packline.qwen.forward import packed_loss, padded_loss

        loss, targets, hits = (packed_loss if packed else padded_loss)(self.model, batch, **kwargs)
        if torch.is_grad_enabled() and self.own_trainable:
            anchor = sum(self.model.get_parameter(n).sum() for n in self.own_trainable)
            loss = loss + 0.0 * anchor
        return loss, targets, hits


def shard_model(
    meta_model: torch.nn.Module, whole: torch.nn.Module | None, device
) -> tuple[torch.nn.Module, LossRoot]:
    """Shard ``meta_model`` (built on the meta device, LoRA included) over every rank of the
    default process group, allocate this rank's shards on ``device`` and fill them from
    ``whole``, rank 0's one-process model (None on the other ranks). Returns the model (its
    parameters now DTensors, its names those of one process) and the FSDP2 root to run it
    through."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    units = fsdp_units(meta_model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    own = [n for n, p in meta_model.named_parameters() if p.requires_grad and id(p) not in in_units]
    root = LossRoot(meta_model, own)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(root, mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # summed: the loss is divided globally
            # a plain SUM (NCCL's PREMUL_SUM, which a custom factor would use, has no gloo)
            module.set_force_sum_reduction_for_comms(True)
    root.to_empty(device=device)
    model = root.model
    full = whole.state_dict() if whole is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    source = dict(whole.named_buffers()) if whole is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if dist.get_rank() == 0:
                buffer.copy_(source[name])
            dist.broadcast(buffer, src=0)
    return model, root


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable weight of ``model`` whole (a DTensor gathered from its shards: every
    rank calls this together), by its one-process name, on the CPU."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
