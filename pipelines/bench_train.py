"""``packline bench train``: training throughput with packing on and off, side by side in
one run on the default set, and the seconds each needs to reach the same eval loss.

Both runs train the same conversations per optimizer step (packing off lays them out
padded, ``train.unpacked_micro_batch_size`` per micro-batch), so their loss curves agree
step for step and the comparison is cost alone:

- ``real_tokens_per_s.packed`` / ``.unpacked`` and ``speedup`` (their ratio), over the
  training steps only (evaluation excluded);
- ``seconds_to_eval_loss``: training seconds until each run's eval loss first reaches the
  higher of the two final eval losses (evaluated every ``eval_every`` steps);
- final eval loss and answer accuracy of both (equal accuracy is part of the target);
- where the time goes: ``data_seconds`` (waiting for rows: reading, packing, image decoding
  and processing) and ``vision_seconds`` (vision tower forwards) are the same work in both
  runs, so they dilute the speedup. ``speedup_without_data`` is the ratio with the data
  wait taken out: what a machine sees whose loader workers keep up on cores of their own
  (on 2 cores they cannot: a worker competes with the two compute threads).
  ``speedup_without_data_and_vision`` is the ratio of what is left after the vision tower
  too (language model forward and backward, optimizer), and
  ``flops_executed_ratio`` the ratio of executed FLOPs (padding included): the speedup of a
  device whose time follows FLOPs.

Target: ``speedup`` ≥ 2 with equal accuracy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from packline.progress import console, stdout_to_stderr
from packline.train.records import read_records

SPEEDUP_TARGET = 2.0


def seconds_to_loss(steps: list[dict], evals: list[dict], target: float) -> float | None:
    """Training seconds until the first evaluation at or below ``target`` (None: never).

    >>> steps = [{"step": 1, "train/step_seconds": 2.0}, {"step": 2, "train/step_seconds": 3.0}]
    >>> seconds_to_loss(steps, [{"step": 0, "eval/loss": 9.0}, {"step": 2, "eval/loss": 7.0}], 7.5)
    5.0
    """
    elapsed = {0: 0.0}
    total = 0.0
    for s in steps:
        total += s["train/step_seconds"]
        elapsed[s["step"]] = total
    for e in evals:
        if e["eval/loss"] <= target + 1e-12:
            return elapsed[e["step"]]
    return None


def summarize(train_dir: Path) -> dict[str, Any]:
    """The benchmark's figures from a finished train stage's run dirs."""
    runs = {}
    for name in ("packed", "unpacked"):
        run = train_dir / name
        runs[name] = {
            "steps": read_records(run / "metrics.jsonl"),
            "evals": read_records(run / "eval.jsonl"),
            "result": json.loads((run / "result.json").read_text()),
        }
    target = max(r["evals"][-1]["eval/loss"] for r in runs.values())
    out: dict[str, Any] = {
        "real_tokens_per_s": {n: r["result"]["real_tokens_per_s"] for n, r in runs.items()},
        "train_seconds": {n: r["result"]["seconds"] for n, r in runs.items()},
        "real_tokens": {n: r["result"]["real_tokens"] for n, r in runs.items()},
        "padded_tokens": {n: r["result"]["padded_tokens"] for n, r in runs.items()},
        "eval_loss": {n: r["evals"][-1]["eval/loss"] for n, r in runs.items()},
        "eval_accuracy": {n: r["evals"][-1]["eval/accuracy"] for n, r in runs.items()},
        "eval_questions": {n: int(r["evals"][-1]["eval/questions"]) for n, r in runs.items()},
        "eval_by_kind": {n: r["result"]["eval_by_kind"] for n, r in runs.items()},
        "target_eval_loss": target,
        "seconds_to_eval_loss": {
            n: seconds_to_loss(r["steps"], r["evals"], target) for n, r in runs.items()
        },
    }
    for key in ("data_seconds", "vision_seconds", "tflops_executed"):
        out[key] = {n: r["result"][key] for n, r in runs.items()}
    rest = {
        n: out["train_seconds"][n] - out["data_seconds"][n] - out["vision_seconds"][n] for n in runs
    }
    out["other_seconds"] = rest
    rate = out["real_tokens_per_s"]
    out["speedup"] = rate["packed"] / rate["unpacked"]
    no_data = {n: out["train_seconds"][n] - out["data_seconds"][n] for n in runs}
    out["speedup_without_data"] = no_data["unpacked"] / no_data["packed"]
    out["speedup_without_data_and_vision"] = rest["unpacked"] / rest["packed"]
    flops = out["tflops_executed"]
    out["flops_executed_ratio"] = flops["unpacked"] / flops["packed"]
    reach = out["seconds_to_eval_loss"]
    if reach["packed"] and reach["unpacked"]:
        out["seconds_to_eval_loss_ratio"] = reach["unpacked"] / reach["packed"]
    acc = out["eval_accuracy"]
    out["targets"] = {
        "speedup": {
            "held": out["speedup"] >= SPEEDUP_TARGET,
            "value": out["speedup"],
            "rule": f">= {SPEEDUP_TARGET:g}x real tokens/s",
        },
        "equal_accuracy": {
            "held": acc["packed"] == acc["unpacked"],
            "value": acc["packed"] - acc["unpacked"],
            "rule": "packed - unpacked eval accuracy == 0 (same conversations per step)",
        },
    }
    return out


def bench_train(
    *,
    as_json: bool = False,
    work_dir: str | Path | None = None,
    config: str | Path | None = None,
    eval_every: int = 10,
) -> dict[str, Any]:
    """Train packing on and off from scratch on the default set (``config``, default
    ``configs/tiny_cpu.yaml``; work dir ``runs/bench``) and print the comparison."""
    from schemas.config import load_config
    from stages.runner import available_stages, run_stage

    work_dir = Path(work_dir) if work_dir is not None else Path("runs") / "bench"
    cfg = load_config(
        config,
        [
            f"work_dir={work_dir}",
            "mlflow.enabled=false",
            "train.compare_packing=true",
            f"train.eval_every={eval_every}",
        ],
    )
    with stdout_to_stderr(as_json):  # --json: stdout holds the JSON object only
        for stage in available_stages():  # the inputs of train, skipped when up to date
            if stage != "train":
                run_stage(cfg, stage)
        shutil.rmtree(cfg.work_path / "train", ignore_errors=True)  # from scratch, no resume
        console.log("bench train: packing on, then off, from scratch")
        run_stage(cfg, "train", force=True)
    result = summarize(cfg.work_path / "train")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return result


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench train: packing on vs off, same conversations per step")
    table.add_column("what")
    table.add_column("packed", justify="right")
    table.add_column("unpacked", justify="right")
    rows = [
        ("real tokens/s", "real_tokens_per_s", "{:.0f}"),
        ("train seconds", "train_seconds", "{:.1f}"),
        ("  of which data (same work)", "data_seconds", "{:.1f}"),
        ("  of which vision tower (same work)", "vision_seconds", "{:.1f}"),
        ("  of which the rest (LM, optimizer)", "other_seconds", "{:.1f}"),
        ("executed TFLOPs", "tflops_executed", "{:.2f}"),
        ("padded tokens", "padded_tokens", "{:,.0f}"),
        ("final eval loss", "eval_loss", "{:.4f}"),
        ("eval accuracy", "eval_accuracy", "{:.3f}"),
        (
            f"seconds to eval loss {result['target_eval_loss']:.4f}",
            "seconds_to_eval_loss",
            "{:.1f}",
        ),
    ]
    for label, key, fmt in rows:
        values = result[key]
        table.add_row(
            label,
            *(
                fmt.format(values[n]) if values[n] is not None else "-"
                for n in ("packed", "unpacked")
            ),
        )
        if key == "eval_accuracy":  # then per question kind, against its chance
            by_kind = result["eval_by_kind"]
            for kind, k in by_kind["packed"].items():
                table.add_row(
                    f"  {kind} ({k['questions']} q, chance {k['chance']:.2f})",
                    *(f"{by_kind[n][kind]['accuracy']:.3f}" for n in ("packed", "unpacked")),
                )
    out = Console()
    out.print(table)
    out.print(
        f"speedup {result['speedup']:.2f}x; without data {result['speedup_without_data']:.2f}x; "
        f"without data and vision "
        f"{result['speedup_without_data_and_vision']:.2f}x; executed FLOPs ratio "
        f"{result['flops_executed_ratio']:.2f}x"
    )
    for name, t in result["targets"].items():
        held = "[green]held[/]" if t["held"] else "[red]missed[/]"
        out.print(f"{name}: {t['value']:.4f} ({t['rule']}) {held}")
