"""``packline bench gpu`` cannot rot: its ``--smoke`` run is the very code of the GPU run, on
the CPU at tiny sizes, in a subprocess that starts from a bare checkout
(``python -m packline.bench.gpu``) with nothing of packline's orchestration importable
beyond what torch, transformers and peft bring: every figure is printed, measured (the
kernels that do not exist on a CPU are reported skipped, with the reason, never filled in),
and the packed row's loss and gradients agree with the conversations run alone within the
noise floor the run measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from schemas.config import PROJECT_ROOT

#: Modules the GPU machine may not have: importing any of them would break the bench there.
ORCHESTRATION = ("omegaconf", "mlflow", "nemo_run", "megatron", "rich", "pandera", "pandas")

_PROBE = f"""
import contextlib, io, json, sys
sys.modules.update({{name: None for name in {ORCHESTRATION!r}}})  # any import of them fails
from packline.bench.gpu import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["--smoke", "--json"])
print(out.getvalue())
"""


def test_bench_gpu_smoke_prints_every_figure_without_packlines_orchestration(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,  # a bare checkout: packline imports from the working directory
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (model,) = json.loads(result.stdout)
    assert model["model"] == "smoke" and model["device"] == "cpu"
    assert model["attention_auto"] == "thd"  # varlen runs on CUDA only
    assert "CUDA only" in model["varlen"]
    variants = model["variants"]
    assert set(variants) == {"packed-auto", "packed-flex", "unpacked"}
    assert "FlexAttention has no CPU backward" in variants["packed-flex"]["skipped"]
    for name in ("packed-auto", "unpacked"):
        figures = variants[name]
        assert figures["real_tokens_per_s"] > 0 and figures["seconds"] > 0
        assert figures["useful_tflops_per_s"] > 0 and figures["forecast_memory_gib"] > 0
        assert figures["mfu"] is None and figures["peak_memory_gib"] is None  # a CPU has none
    assert model["speedup_real_tokens_per_s"] > 0
    assert 0 < model["padded_flops_removed"] < 1 and model["useful_share_packed"] == 1.0
    assert model["real_tokens"] > 0 and model["packed_rows"] < model["padded_micro_batches"]
    agreement = model["agreement"]
    assert agreement["conversations"] >= 2 and agreement["within_floor"] is True
    assert agreement["loss_rel"] <= 1e-6 and agreement["grad_rel"] <= 1e-5  # fp32 on a CPU


def test_packline_bench_gpu_is_the_same_command(capsys):
    from pipelines.cli import main

    assert main(["bench", "gpu", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smoke · cpu · float32 · rows of 512")
    assert "packed vs unpacked:" in out and "within the floor" in out
