"""packline.report as library code: a run's summary from its records (file or MLflow
shaped, the same figures), the pair's ratios and targets, the JSON round trip, and the one
table. The real store is read in tests/integration/test_compare.py."""

from __future__ import annotations

import doctest
import json
import math

import pytest
from rich.console import Console

from packline import metrics as M
from packline.report import mlflow_store, summary
from packline.report.mlflow_store import records_from_histories
from packline.report.summary import (
    STEP_INPUTS,
    PackingComparison,
    RunSummary,
    compare_metrics,
    comparison_record,
    summarize_run,
)
from packline.report.table import summary_table, target_lines

SEQ = 100
# Two steps of four conversations each: 150 real tokens per step either way. Packed: two
# rows per step, no padding; unpacked: one row per conversation, 50 padded tokens a step.
SECONDS = {"packed": [2.0, 2.0], "unpacked": [4.0, 4.0]}
CPU_SECONDS = {"packed": [3.0, 3.0], "unpacked": [6.0, 9.0]}  # both threads, more or less busy
DATA, VISION = 0.5, 0.25  # per step, the same work in both runs


def _steps(run: str) -> list[dict]:
    packed = run == "packed"
    return [
        {
            "step": n,
            M.TRAIN_LOSS: 5.0 - n,
            M.TRAIN_STEP_SECONDS: SECONDS[run][n - 1],
            M.TRAIN_CPU_SECONDS: CPU_SECONDS[run][n - 1],
            M.TRAIN_DATA_SECONDS: DATA,
            M.TRAIN_VISION_SECONDS: VISION,
            M.TRAIN_TOKENS_REAL: 150,
            M.TRAIN_PADDED_TOKENS: 0 if packed else 50,
            M.TRAIN_CONVERSATIONS: 4,
            M.TRAIN_FLOPS_USEFUL: 1e12,
            M.TRAIN_FLOPS_EXECUTED: 1e12 if packed else 1.5e12,
            M.PACK_ROWS: 2 if packed else 4,
            M.RECORD_ROW_REAL_TOKENS: [75, 75] if packed else [30, 40, 40, 40],
        }
        for n in (1, 2)
    ]


def _eval_figures(loss: float, token_accuracy: float, accuracy: float) -> dict:
    return {
        M.EVAL_LOSS: loss,
        M.EVAL_TOKEN_ACCURACY: token_accuracy,
        M.EVAL_ACCURACY: accuracy,
        M.EVAL_QUESTIONS: 4,
    }


def _evals(final_loss: float = 3.0) -> list[dict]:
    return [
        {"step": 0, **_eval_figures(6.0, 0.1, 0.0)},
        {"step": 1, **_eval_figures(4.0, 0.3, 0.25)},
        {
            "step": 2,
            M.EVAL_LOSS: final_loss,
            M.EVAL_TOKEN_ACCURACY: 0.4,
            M.EVAL_ACCURACY: 0.5,
            M.EVAL_QUESTIONS: 4,
            M.EVAL_BY_KIND: {
                "color": {"questions": 1, "accuracy": 0.0},
                "count": {"questions": 3, "accuracy": 2 / 3},
            },
        },
    ]


def _summary(run: str, **kw) -> RunSummary:
    return summarize_run(
        _steps(run),
        kw.pop("evals", _evals()),
        run=run,
        seq_length=SEQ,
        precision="fp32",
        chance=0.3,
        chance_by_kind={"color": 0.125, "count": 0.2},
        **kw,
    )


@pytest.mark.parametrize("module", [summary, mlflow_store])
def test_docstrings_have_worked_examples(module):  # pytest --doctest-modules runs them
    assert any(t.examples for t in doctest.DocTestFinder().find(module))


def test_summary_sums_the_records_once():
    on, off = _summary("packed"), _summary("unpacked")
    assert (on.steps, on.first_step, on.last_step) == (2, 1, 2)
    assert on.real_tokens == off.real_tokens == 300
    assert (on.padded_tokens, off.padded_tokens) == (0, 100)
    assert on.real_tokens_per_s == 75.0 and off.real_tokens_per_s == 37.5
    assert off.padding_fraction == pytest.approx(100 / 400)
    # fill is Σ real / (Σ rows × seq_length): the mean fill of the laid-out rows
    for s, run in ((on, "packed"), (off, "unpacked")):
        rows = [n for r in _steps(run) for n in r[M.RECORD_ROW_REAL_TOKENS]]
        assert s.fill == pytest.approx(sum(n / SEQ for n in rows) / len(rows))
    assert (on.conversations_per_row, off.conversations_per_row) == (2.0, 1.0)
    assert on.final_train_loss == 3.0
    assert (on.eval_loss_start, on.eval_loss) == (6.0, 3.0)
    assert (on.eval_token_accuracy_start, on.eval_token_accuracy) == (0.1, 0.4)
    assert (on.eval_accuracy_start, on.eval_accuracy, on.eval_questions) == (0.0, 0.5, 4)
    assert on.eval_by_kind == {
        "color": {"questions": 1, "accuracy": 0.0, "chance": 0.125},
        "count": {"questions": 3, "accuracy": 2 / 3, "chance": 0.2},
    }
    assert on.tflops_useful == 2.0 and off.tflops_executed == 3.0 and on.tflops_per_s == 0.5
    assert (on.data_seconds, on.vision_seconds, on.other_seconds) == (1.0, 0.5, 2.5)
    assert [(e.step, e.train_seconds) for e in off.evals] == [(0, 0.0), (1, 4.0), (2, 8.0)]
    assert on.wall_seconds is None and on.run_id is None


def test_a_resumed_run_places_its_evaluations_after_the_checkpoint():
    steps = [dict(r, step=r["step"] + 10) for r in _steps("packed")]
    evals = [dict(e, step=e["step"] + 10) for e in _evals()[1:]]
    s = summarize_run(steps, evals, run="packed", seq_length=SEQ, precision="bf16")
    assert (s.steps, s.first_step, s.last_step) == (2, 11, 12)
    assert s.eval_loss_start is None and s.eval_accuracy_chance is None
    assert [(e.step, e.train_seconds) for e in s.evals] == [(11, 2.0), (12, 4.0)]
    assert s.eval_by_kind["count"]["chance"] is None


def test_a_renamed_or_missing_metric_fails_loudly_instead_of_counting_zero():
    steps = _steps("packed")
    steps[1]["train/step_secs"] = steps[1].pop(M.TRAIN_STEP_SECONDS)
    with pytest.raises(ValueError, match="lack \\['train/step_seconds'\\]"):
        summarize_run(steps, _evals(), run="packed", seq_length=SEQ, precision="fp32")
    evals = _evals()
    del evals[0][M.EVAL_QUESTIONS]
    with pytest.raises(ValueError, match="eval records of the packed run lack"):
        summarize_run(_steps("packed"), evals, run="packed", seq_length=SEQ, precision="fp32")
    with pytest.raises(ValueError, match="no step records"):
        summarize_run([], [], run="packed", seq_length=SEQ, precision="fp32")


def test_the_mlflow_shaped_records_give_the_same_summary_as_the_files():
    """Metric histories (one list of (step, value) per name, eval metrics at the eval steps,
    per-kind accuracy as eval/by_kind/* names) back to records: the same summary."""
    hist: dict[str, list[tuple[int, float]]] = {}
    for r in _steps("packed"):
        for name in STEP_INPUTS:
            hist.setdefault(name, []).append((r["step"], float(r[name])))
    for e in _evals():
        for name in M.EVAL_METRICS:
            hist.setdefault(name, []).append((e["step"], float(e[name])))
        for name, v in M.by_kind_metrics(e.get(M.EVAL_BY_KIND, {})).items():
            hist.setdefault(name, []).append((e["step"], v))
    hist[M.PACK_ROW_FILL] = [(i, 0.75) for i in range(1, 5)]  # per row: not a step record
    hist[M.EVAL_ACCURACY_CHANCE] = [(0, 0.3)]
    steps, evals = records_from_histories(hist)
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 1, 2]
    kw = {"run": "packed", "seq_length": SEQ, "precision": "fp32", "chance": 0.3}
    kw["chance_by_kind"] = {"color": 0.125, "count": 0.2}
    from_store = summarize_run(steps, evals, **kw)
    from_files = summarize_run(_steps("packed"), _evals(), **kw)
    assert from_store == from_files


def test_summary_round_trips_through_json_and_rejects_other_dicts():
    s = _summary("unpacked", wall_seconds=12.5, run_id="abc")
    back = RunSummary.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    old = {"run": "packed", "seconds": 1.0, "real_tokens_per_s": 2.0}  # a pre-summary result
    with pytest.raises(ValueError, match="unknown keys \\['seconds'\\]"):
        RunSummary.from_dict(old)


def test_the_pair_ratios_and_targets():
    pair = PackingComparison.of([_summary("unpacked"), _summary("packed")])
    assert pair.speedup == 2.0
    assert pair.speedup_without_data == pytest.approx((8.0 - 1.0) / (4.0 - 1.0))
    assert pair.speedup_without_data_and_vision == pytest.approx(6.5 / 2.5)
    assert pair.flops_executed_ratio == 1.5
    assert pair.target_eval_loss == 3.0
    assert pair.seconds_to_eval_loss == {"packed": 4.0, "unpacked": 8.0}
    assert pair.seconds_to_eval_loss_ratio == 2.0
    targets = pair.targets()
    assert targets["speedup"].held and targets["equal_accuracy"].held
    assert targets["equal_accuracy"].value == 0.0
    # the higher final loss is the target: the run that ends lower reaches it earlier
    slow = PackingComparison(
        packed=_summary("packed", evals=_evals(final_loss=3.5)), unpacked=_summary("unpacked")
    )
    assert slow.target_eval_loss == 3.5
    assert slow.seconds_to_eval_loss == {"packed": 4.0, "unpacked": 8.0}
    with pytest.raises(ValueError, match="one packed and one unpacked"):
        PackingComparison.of([_summary("packed"), _summary("packed")])


def test_a_pair_without_any_padding_cost_misses_the_speedup_target():
    twin = _summary("packed")
    twin.run = "unpacked"
    pair = PackingComparison(packed=_summary("packed"), unpacked=twin)
    assert pair.speedup == 1.0 and not pair.targets()["speedup"].held
    twin.eval_accuracy = 0.25
    equal = pair.targets()["equal_accuracy"]
    assert not equal.held and equal.value == 0.25


def test_side_by_side_holds_the_bench_train_json_keys():
    out = PackingComparison.of([_summary("packed"), _summary("unpacked")]).side_by_side()
    per_run = {"real_tokens_per_s", "train_seconds", "real_tokens", "padded_tokens"}
    per_run |= {"eval_loss", "eval_token_accuracy", "eval_accuracy", "eval_questions"}
    per_run |= {"eval_by_kind"}
    per_run |= {"seconds_to_eval_loss", "data_seconds", "vision_seconds", "other_seconds"}
    per_run |= {"tflops_executed"}
    for key in per_run:
        assert set(out[key]) == {"packed", "unpacked"}, key
    assert out["speedup"] == 2.0 and out["seconds_to_eval_loss_ratio"] == 2.0
    assert out["targets"]["speedup"] == {"held": True, "value": 2.0, "rule": ">= 2x real tokens/s"}
    json.dumps(out)  # plain data


def test_throughput_per_cpu_second_and_window_by_window():
    """Per CPU-second beside wall-clock; a window's ratio compares the same steps of both."""
    pair = PackingComparison.of([_summary("packed"), _summary("unpacked")])
    assert pair.packed.cpu_seconds == 6.0 and pair.unpacked.cpu_seconds == 15.0
    assert pair.packed.real_tokens_per_cpu_s == 50.0 and pair.unpacked.real_tokens_per_cpu_s == 20.0
    assert pair.speedup_per_cpu_s == 2.5 and pair.speedup == 2.0
    assert pair.packed.window_steps == 1  # two steps: fewer than summary.WINDOWS windows
    assert pair.unpacked.window_tokens_per_s == [37.5, 37.5]
    assert pair.window_speedups() == [2.0, 2.0]
    assert pair.window_speedups(per_cpu_s=True) == [2.0, 3.0]
    assert pair.unpacked.window_spread == (37.5, 37.5)
    one_window = summarize_run(
        _steps("unpacked"), _evals(), run="unpacked", seq_length=SEQ, precision="fp32",
        window_steps=2,
    )  # fmt: skip
    assert one_window.window_tokens_per_cpu_s == [20.0]
    # windows of other lengths do not pair up
    assert PackingComparison(packed=pair.packed, unpacked=one_window).window_speedups() == []
    out = pair.side_by_side()
    assert out["speedup_per_cpu_s"] == 2.5 and out["window_speedups_per_cpu_s"] == [2.0, 3.0]
    text = _text(summary_table(pair.runs))
    assert "real tokens per CPU-second" in text and "2.50x" in text
    assert "38 – 38 (2 × 1 steps)" in text  # unpacked: 37.5 tokens/s in each window
    assert (
        "window by window 2.00x (2.00x – 2.00x); per CPU-second 2.50x, window by window "
        "2.50x (2.00x – 3.00x)" in " ".join(text.split())
    )


def test_the_stage_figures_come_from_the_summaries():
    runs = [_summary("packed"), _summary("unpacked")]
    metrics = compare_metrics(runs)
    assert metrics[M.COMPARE_SPEEDUP_REAL_TOKENS_PER_S] == 2.0
    assert metrics[M.compare("unpacked", "train_seconds")] == 8.0
    assert metrics[M.COMPARE_SPEEDUP_PER_CPU_S] == 2.5
    assert len(metrics) == 2 * len(M.COMPARE_FIGURES) + 2
    record = comparison_record(runs)
    assert [r["run"] for r in record["runs"]] == ["packed", "unpacked"]
    assert record["speedup_real_tokens_per_s"] == 2.0
    assert "speedup_real_tokens_per_s" not in comparison_record(runs[:1])


def _text(t) -> str:
    console = Console(record=True, width=220)
    console.print(t)
    return console.export_text()


def test_one_table_renders_a_pair_with_ratios_per_kind_rows_and_seconds_to_loss():
    runs = [_summary("packed", run_id="0123456789ab"), _summary("unpacked", run_id="ba98")]
    text = _text(summary_table(runs, title="the pair", source="from /work/train"))
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "train-packed 01234567" in lines["MLflow run"]
    assert "75" in lines["real tokens/s"] and "2.00x" in lines["real tokens/s"]
    assert "0.50x" in lines["train seconds (Σ steps)"]
    assert "0.000 → 0.500" in lines["eval accuracy (start → end)"]
    assert "0.667" in lines["count (3 q, chance 0.20)"]
    assert "4.0" in lines["seconds to eval loss 3.0000"]
    assert "run wall time s (+ eval, ckpt)" not in lines  # unknown for both
    assert "the pair" in text and "from /work/train" in text
    assert "without data and vision 2.60x" in " ".join(text.split())  # the caption wraps
    assert "2 TFLOP" in lines["useful FLOPs (exact)"] and "3 TFLOP" in text  # SI prefixes


def test_one_table_renders_a_single_run_without_a_ratio_column():
    s = _summary("packed", wall_seconds=20.0)
    s.eval_by_kind = None
    s.eval_accuracy_chance = math.nan
    text = _text(summary_table([s]))
    assert "train run packed" in text and "÷" not in text and "MLflow run" not in text
    assert "chance" not in text.split("accuracy by chance")[0]  # no per-kind rows
    assert "n/a" in text.split("accuracy by chance")[1].splitlines()[0]
    assert "20.0" in text
    with pytest.raises(ValueError, match="one or two runs"):
        summary_table([s, s, s])


def test_target_lines_say_held_or_missed():
    pair = PackingComparison.of([_summary("packed"), _summary("unpacked")])
    assert target_lines(pair.targets())[0] == "speedup: 2.0000 (>= 2x real tokens/s) [green]held[/]"


def test_the_forecast_marks_the_fill_the_run_packs_with():
    """With carry-over on, the configured buffer's mark sits in the "fill" column (what the
    run packs with), not in "fill without carry-over"; without carry-over there is one fill."""
    from packline.report.forecast import forecast_table

    buffers = {"16": {"packs": 5, "fill": 0.95, "fill_without_carry": 0.90},
               "64": {"packs": 4, "fill": 0.997, "fill_without_carry": 0.932}}  # fmt: skip
    forecast = {"samples": 10, "tokens": 3988, "capacity": 1000, "max_carry_rounds": 4,
                "buffers": buffers, "unpacked": {"rows": 10, "fill": 0.4},
                "lower_bound": {"packs": 4, "fill": 0.997}}  # fmt: skip
    console = Console(width=120, record=True)
    console.print(forecast_table(forecast, 64))
    row = next(line for line in console.export_text().splitlines() if "0.932" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells == ["64", "4", "0.997 ← packing_buffer_size", "0.932"], cells
    del forecast["max_carry_rounds"]
    console = Console(width=120, record=True)
    console.print(forecast_table(forecast, 16))
    text = console.export_text()
    assert "without carry-over" not in text and "0.950 ← packing_buffer_size" in text
