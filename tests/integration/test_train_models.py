"""The local train backend on the other models it takes: the tiny Qwen3-VL-MoE with LoRA on
its experts (``lora.target_parameters``), and a Qwen3-VL checkpoint dir (``model.path``)."""

from __future__ import annotations

import torch

from packline.qwen.model import build_tiny_model
from packline.qwen.processor import load_processor
from stages.base import processor_dir
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL, trainer_for

MOE_LORA = (
    "model.moe=true",
    "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
)


def test_moe_lora_on_experts_learns_the_same_packed_and_unpacked(work, tmp_path):
    cfg = make_config(work, *SMALL, *MOE_LORA)
    packed = trainer_for(cfg, True, tmp_path / "p")
    unpacked = trainer_for(cfg, False, tmp_path / "u")
    rows = packed.step_rows()
    loss_p, n_p = packed.accumulate_gradients(packed.micro_batches(rows))
    loss_u, n_u = unpacked.accumulate_gradients(unpacked.micro_batches(rows))
    assert n_p == n_u and abs(loss_p - loss_u) <= 1e-6
    trainable = {n: p for n, p in packed.model.named_parameters() if p.requires_grad}
    experts = {n: p for n, p in trainable.items() if ".experts." in n}
    layers = packed.model.get_base_model().config.text_config.num_hidden_layers
    assert len(experts) == 2 * 2 * layers  # lora A and B of gate_up_proj and down_proj
    for name, p in experts.items():  # the router sends tokens to them: they learn (A only
        # once B has moved: LoRA starts with B = 0, so A's first gradient is zero)
        if ".lora_B." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    gp = torch.cat([p.grad.flatten() for p in packed.params])
    gu = torch.cat([p.grad.flatten() for p in unpacked.params])
    cosine = torch.nn.functional.cosine_similarity(gp.double(), gu.double(), dim=0).item()
    assert cosine >= 0.99999, cosine


def test_trains_a_local_checkpoint_dir_as_it_trains_the_built_model(work, tmp_path):
    """``model.path`` pointing at a saved Qwen3-VL (config.json + safetensors) trains exactly
    like the model it holds: the same first-step loss, bitwise, on the same rows."""
    cfg = make_config(work, *SMALL)
    processor = load_processor(processor_dir(cfg))
    checkpoint = tmp_path / "checkpoint"
    build_tiny_model(processor, seed=cfg.train.seed).save_pretrained(checkpoint)
    assert (checkpoint / "config.json").is_file()
    built = trainer_for(cfg, True, tmp_path / "built")
    loaded = trainer_for(
        make_config(work, *SMALL, f"model.path={checkpoint}"), True, tmp_path / "l"
    )
    a, b = built.train_step(), loaded.train_step()
    assert a.keys == b.keys
    assert a.loss == b.loss  # LoRA B starts at zero: step 1 is the base model's loss
    assert b.grad_norm > 0
