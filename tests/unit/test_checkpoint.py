"""Layout-free checkpoints through torch.distributed.checkpoint, on one process: what a
fresh model and optimizer load is bitwise what was saved, and training goes on as if it had
never stopped."""

from __future__ import annotations

import torch

from packline.train.checkpoint import AdapterState, Checkpointer, OptimizerState, Pickled


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)  # frozen: not an adapter, not saved
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler, x: torch.Tensor) -> None:
    model(x).square().sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_a_fresh_model_and_optimizer_load_the_checkpoint_bitwise_and_train_on(tmp_path):
    x = torch.randn(5, 4)
    model, optimizer, scheduler = _model_and_optimizer(0)
    for _ in range(3):
        _step(model, optimizer, scheduler, x)
    ckpt = Checkpointer(tmp_path, keep_last=1)
    path = ckpt.save(
        3,
        {
            "adapter": AdapterState(model),
            "optimizer": OptimizerState(model, optimizer),
            "scheduler": Pickled(scheduler.state_dict, scheduler.load_state_dict),
        },
    )
    names = ckpt.names(path)
    assert "adapter.0.weight" not in names  # frozen
    assert {"adapter.1.weight", "optimizer.1.weight:exp_avg", "optimizer.1.weight:step"} <= set(
        names
    )

    fresh, fresh_opt, fresh_sched = _model_and_optimizer(1)  # other weights, no state
    fresh[0].weight.data.copy_(model[0].weight)  # the frozen base is the same
    ckpt.load(
        path,
        {
            "adapter": AdapterState(fresh),
            "optimizer": OptimizerState(fresh, fresh_opt, names),
            "scheduler": Pickled(fresh_sched.state_dict, fresh_sched.load_state_dict),
        },
    )
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    saved_params, loaded_params = (o.param_groups[0]["params"] for o in (optimizer, fresh_opt))
    for p, q in zip(saved_params, loaded_params, strict=True):
        s, t = optimizer.state[p], fresh_opt.state[q]
        assert set(s) == set(t) and all(torch.equal(s[k], t[k]) for k in s)
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh_sched.state_dict() == scheduler.state_dict()

    _step(model, optimizer, scheduler, x)  # the run that never stopped ...
    _step(fresh, fresh_opt, fresh_sched, x)  # ... and the resumed one
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_torn_write_is_not_a_checkpoint(tmp_path):
    """A write killed before DCP commits its metadata leaves a dir that is never resumed."""
    ckpt = Checkpointer(tmp_path, keep_last=2)
    ckpt.save(1, {"w": torch.ones(2)})
    torn = tmp_path / "step_000002"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert [p.name for p in ckpt.complete()] == ["step_000001"]
