"""The local train backend on the other models it takes: the tiny Qwen3-VL-MoE with LoRA on
its experts (``lora.target_parameters``), and a Qwen3-VL checkpoint dir (``model.path``)."""

from __future__ import annotations

import torch

from packline.catalog import processor_dir
from packline.qwen.model import build_tiny_model
from packline.qwen.processor import load_processor
from tests.conftest import make_config
from tests.integration.train_helpers import SMALL, trainer_for

MOE_LORA = (
    "model.moe=true",
    "model.path=null",  # the tiny MoE at random init (the shipped base is dense)
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
    cfg = make_config(work, *SMALL, "model.path=null")  # built here, from the seed
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


def test_router_statistics_are_the_same_packed_and_unpacked_and_the_aux_term_trains(work, tmp_path):
    """``moe/*`` is HF's load-balancing formula over the step's real tokens: the same
    conversations packed or padded give the same statistics (the pads and alignment gaps do
    not count). ``train.moe_aux_loss_coef`` adds HF's term per micro-batch: the gradient
    grows by exactly coef × ∇(Σ aux over the micro-batches / their number)."""
    from packline.qwen.forward import packed_forward, token_loss_sum
    from packline.qwen.moe import RouterRecorder, aux_loss
    from packline.train.engine import router_metrics

    cfg = make_config(work, *SMALL, *MOE_LORA, "packing.pad_to_max_length=true")
    packed = trainer_for(cfg, True, tmp_path / "p")
    unpacked = trainer_for(cfg, False, tmp_path / "u")
    rows = packed.step_rows()
    packed.accumulate_gradients(packed.micro_batches(rows))
    unpacked.accumulate_gradients(unpacked.micro_batches(rows))
    mp = router_metrics(packed._router, packed.layout)
    mu = router_metrics(unpacked._router, unpacked.layout)
    assert sorted(mp) == ["moe/aux_loss", "moe/expert_load_max", "moe/expert_load_min"]
    for k in mp:
        assert abs(mp[k] - mu[k]) <= 1e-6 * abs(mu[k]), (k, mp[k], mu[k])
    assert mp["moe/expert_load_min"] < 1.0 < mp["moe/expert_load_max"]

    coef = 0.5
    trained = trainer_for(
        make_config(work, *SMALL, *MOE_LORA, "packing.pad_to_max_length=true",
                    f"train.moe_aux_loss_coef={coef}"),
        True,
        tmp_path / "c",
    )  # fmt: skip
    # B = 0 at the start hides the aux term's effect on A: move B off zero in both models
    with torch.no_grad():
        for model in (packed.model, trained.model):
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if p.requires_grad and ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 1e-2)
    for t in (packed, trained):
        t.optimizer.zero_grad(set_to_none=True)
        t.accumulate_gradients(t.micro_batches(rows))
    # the reference: Σ token loss / targets + coef × HF's loss over each row's real tokens
    # averaged over the rows, in one backward per row
    targets = sum(row.num_loss_tokens for row in rows)
    reference = [torch.zeros_like(p) for p in trained.params]
    recorder = RouterRecorder(trained.model)
    with recorder:
        for row in rows:
            recorder.clear()
            logits = packed_forward(
                trained.model,
                row,
                image_token_id=trained.image_token_id,
                video_token_id=trained.video_token_id,
            )
            mask = row.real_token_mask()
            k, n = recorder.top_k, recorder.num_experts
            term = aux_loss(recorder.logits, mask, num_experts=n, top_k=k)
            loss = token_loss_sum(logits, row.labels)[0] / targets + coef * term / len(rows)
            grads = torch.autograd.grad(loss, trained.params, allow_unused=True)
            for acc, g in zip(reference, grads, strict=True):
                if g is not None:
                    acc += g
    worst = max(
        float((q.grad - r).abs().max() / r.abs().max().clamp_min(1e-30))
        for q, r in zip(trained.params, reference, strict=True)
    )
    effect = max(
        float((q.grad - p.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))
        for p, q in zip(packed.params, trained.params, strict=True)
    )
    assert worst <= 1e-5, worst  # the trained gradient is CE + the aux term ...
    assert effect > 1e-3, effect  # ... and the term changes it
