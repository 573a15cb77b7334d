"""Small-set settings and a trainer factory shared by the train tests (and by the
torchrun script they launch)."""

from __future__ import annotations

from pathlib import Path

from packline.catalog import dataset_path, lengths_path, processor_dir
from packline.qwen.processor import load_processor
from packline.train.setup import build_trainer
from packline.train.trainer import Trainer

SMALL = (
    "data.num_train=120",
    "data.num_val=8",
    "train.global_batch_size=2",
    "train.eval_samples=0",
)


def trainer_for(cfg, packed: bool, run_dir: Path) -> Trainer:
    """The stage's trainer for ``cfg``: the seeded tiny model with LoRA, packing on or off."""
    processor = load_processor(processor_dir(cfg))
    return build_trainer(
        cfg,
        processor,
        packed=packed,
        dataset_path=dataset_path(cfg),
        processor_dir=processor_dir(cfg),
        lengths_path=lengths_path(cfg),
        run_dir=run_dir,
    )


def check_resume_on_one_process(
    work: Path, overrides: list[str], *, step: int, more: int, capsys, restarts_stream=True
) -> list:
    """The packed run's last checkpoint (``step``, written under another layout) loads on
    one process (``overrides``: the same run's settings with one rank): the adapters equal
    the saved run's exported adapter bitwise, every AdamW value and the scheduler equal
    what the checkpoint holds bitwise, and one warning line says the loaders restart
    (``restarts_stream``: the saved run had several data-parallel ranks; else no warning).
    Then it trains ``more`` steps on. Returns the run's step records."""
    import pickle
    import tempfile

    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from packline.train.expert_parallel import expert_factor_slices, expert_views
    from packline.train.records import read_records
    from tests.conftest import make_config

    run_dir = work / "train" / "packed"
    cfg = make_config(work, *overrides, f"train.max_steps={step}")
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    flat_file = Path(tempfile.mkdtemp()) / f"step_{step}.pt"
    dcp_to_torch_save(ckpt, flat_file)  # torch's own reader, every value of the checkpoint
    saved = torch.load(flat_file, weights_only=False)
    optimizer = saved["optimizer"]
    before = sorted(p.name for p in ckpt.iterdir())

    capsys.readouterr()
    trainer = trainer_for(cfg, True, run_dir)
    assert trainer.resume() == step
    # rich wraps the line at the terminal width and puts its source at the right
    warning = " ".join(
        w for w in capsys.readouterr().err.split() if not w.startswith("trainer.py:")
    )
    if restarts_stream:
        assert f"step_{step:06d} was written by 2 data-parallel rank(s), this run has 1" in warning
        assert "cannot carry over rank for rank" in warning, warning
    else:
        assert "cannot carry over" not in warning, warning

    exported = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(trainer.model, save_embedding_layers=False)
    assert sorted(loaded) == sorted(exported)
    for name, t in loaded.items():
        assert torch.equal(t, exported[name]), name  # bitwise

    slices = expert_factor_slices(trainer.model)
    held = 0
    for name, p in trainer.model.named_parameters():
        if not p.requires_grad:
            continue
        state = trainer.optimizer.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, name
        assert torch.equal(state["step"], optimizer[f"{name}:step"])
        for field in ("exp_avg", "exp_avg_sq"):
            if name in slices:
                for e, view in expert_views(state[field], *slices[name]).items():
                    assert torch.equal(view, optimizer[f"{name}@expert{e:03d}:{field}"])
            else:
                assert torch.equal(state[field], optimizer[f"{name}:{field}"]), name
        held += 1
    assert held == len(trainer.params) > 0
    groups = pickle.loads(optimizer["param_groups"])
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [g["lr"] for g in groups]
    assert trainer.scheduler.state_dict() == pickle.loads(saved["scheduler"]["state"])
    assert trainer.scheduler.last_epoch == step
    assert sorted(p.name for p in ckpt.iterdir()) == before  # read, never rewritten

    cfg = make_config(work, *overrides, f"train.max_steps={step + more}")
    trainer = trainer_for(cfg, True, run_dir)
    trainer.train()
    records = read_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, step + more + 1))
    return records
