"""``packline`` command line.

    packline run [CONFIG] [key=value ...] [--executor local|slurm] [--from STAGE] [--dryrun]
                 [--wait] [-v]
    packline stage NAME [CONFIG] [key=value ...] [--force] [--wait]
    packline bench {packing,loader,train,data,cluster-memory,gpu} [key=value ...] [--json]
                   [--config PATH] [--work-dir DIR] [--samples N] [--small-samples N]
                   [--bridge-path DIR] [--smoke] [--models LIST] [--noise] [--window N]
    packline compare [CONFIG] [key=value ...] [--experiment NAME] [--run RUN_ID]
    packline ui [CONFIG] [key=value ...] [--port N]
    packline chat [CONFIG] [key=value ...] [--image PATH | --video PATH] ["prompt" | --sample KEY]
    packline export [CONFIG] [key=value ...] --to DIR [--merge]

One packline writes a work dir at a time: ``run`` and ``stage`` hold its lock
(:mod:`packline.workdir`); a second one exits 2 naming the first, or waits with ``--wait``.
Exit codes: 0 ok; 2 invalid config or input (every problem listed); 1 other failure.
Tracebacks only for unexpected failures (always with PACKLINE_DEBUG=1); a crash on a user's
file prints one line naming the file and sample, its traceback going to the stage's log.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from pathlib import Path

import packline
from packline.workdir import hold
from pipelines import options as opt
from schemas.config import STAGES, load_config
from schemas.errors import InputCrash, UserError


def _split_config(args: list[str]) -> tuple[str | None, list[str]]:
    """First positional without ``=`` is the config file; the rest are overrides."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


_WORK: list[Path] = []  # the loaded config's work dir: where a fault naming no file happened


def _load(args: list[str], extra: list[str] | None = None):
    config, overrides = _split_config(args)
    cfg = load_config(config, overrides + (extra or []))
    _WORK[:] = [cfg.work_path]
    return cfg


def _command() -> str:
    """This invocation as the lock file names it."""
    return shlex.join(["packline", *sys.argv[1:]])


def cmd_run(ns: argparse.Namespace) -> int:
    extra = [f"executor.kind={ns.executor}"] if ns.executor else []
    cfg = _load(ns.args, extra)  # first: a refused config costs no heavy import
    from pipelines.experiment import pipeline_stages, run_pipeline

    if ns.from_stage and ns.from_stage not in pipeline_stages():
        have = ", ".join(pipeline_stages())
        raise UserError([f"--from {ns.from_stage}: not a stage of this pipeline ({have})"])
    with hold(cfg.work_path, wait=ns.wait, command=_command()):
        run_pipeline(cfg, from_stage=ns.from_stage, dryrun=ns.dryrun, verbose=ns.verbose)
    if not ns.dryrun:  # the stages' own output is in <work_dir>/logs/<stage>/ (-v shows it)
        from pipelines.outcome import print_next_steps

        print_next_steps(cfg, ns.args)
    return 0


def cmd_stage(ns: argparse.Namespace) -> int:
    if ns.name not in STAGES:
        raise UserError([f"unknown stage {ns.name!r}; stages: {', '.join(STAGES)}"])
    cfg = _load(ns.args)  # first: a refused config costs no heavy import
    from stages.runner import run_stage

    with hold(cfg.work_path, wait=ns.wait, command=_command()):
        run_stage(cfg, ns.name, force=ns.force)
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    opt.refuse_misplaced_bench_options(ns)
    common = dict(as_json=ns.json, config=ns.config, work_dir=ns.work_dir, overrides=ns.overrides)
    if ns.what == "packing":
        from pipelines.bench import bench_packing

        bench_packing(**common)
    elif ns.what == "loader":
        from pipelines.bench import bench_loader

        bench_loader(**common)
    elif ns.what == "cluster-memory":
        from pipelines.bench import bench_cluster_memory

        bench_cluster_memory(**common, bridge_path=ns.bridge_path)
    elif ns.what == "data":
        from pipelines.bench_data import bench_data

        bench_data(**common, **opt.data_bench_sizes(ns))
    elif ns.what == "gpu":  # runs alone, on torch/transformers/peft: packline/bench/gpu.py
        from packline.bench.gpu import main as bench_gpu

        return bench_gpu(opt.gpu_bench_argv(ns))
    else:
        from pipelines.bench_train import bench_train

        bench_train(**common, **opt.train_bench_options(ns))
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    """The resolved config as YAML, then the values not left at their defaults and where
    each came from (the config file or an override)."""
    from rich.table import Table

    from packline.progress import wide_console
    from schemas.config import value_sources

    config, overrides = _split_config(ns.args)
    print(load_config(config, overrides).to_yaml(), end="")
    table = Table(title="set by the config file or an override (every other value: its default)")
    for col in ("key", "value", "from"):
        table.add_column(col, overflow="fold")
    for key, (value, source) in value_sources(config, overrides).items():
        if source != "default":
            table.add_row(key, str(value), source)
    wide_console().print(table)
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    from pipelines.compare import compare_runs

    compare_runs(_load(ns.args), experiment=ns.experiment, run_id=ns.run)
    return 0


def cmd_ui(ns: argparse.Namespace) -> int:
    from pipelines.ui import serve_ui

    return serve_ui(_load(ns.args), port=ns.port, experiment=ns.experiment)


def cmd_chat(ns: argparse.Namespace) -> int:
    from packline.serving.chat import chat, split_prompt

    prompt, args = split_prompt(ns.args)
    chat(_load(args), prompt, image=ns.image, video=ns.video, sample=ns.sample,
         max_new_tokens=ns.max_new_tokens)  # fmt: skip
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from packline.backends import export_run

    done = export_run(_load(ns.args), ns.to, merge=ns.merge)
    print(f"exported to {done}" if not isinstance(done, str) else f"run in the container:\n{done}")
    return 0


WAIT_HELP = "when another packline writes the work dir, wait for it instead of exiting 2"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="packline",
        description="Qwen3-VL LoRA with Energon-native online sequence packing.",
    )
    p.add_argument("--version", action="version", version=f"packline {packline.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run the pipeline as NeMo-Run tasks (skips up-to-date stages)")
    r.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]", help="config + overrides")
    r.add_argument("--executor", choices=["local", "slurm"], help="override executor.kind")
    r.add_argument("--from", dest="from_stage", choices=STAGES, help="force this stage and after")
    r.add_argument("--dryrun", action="store_true", help="print the tasks, run nothing")
    r.add_argument("-v", "--verbose", action="store_true", help="show each stage's own output")
    r.add_argument("--wait", action="store_true", help=WAIT_HELP)
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("stage", help="run one stage in this process")
    s.add_argument("name", help="stage name: " + ", ".join(STAGES))
    s.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    s.add_argument("--force", action="store_true", help="rerun even when up to date")
    s.add_argument("--wait", action="store_true", help=WAIT_HELP)
    s.set_defaults(fn=cmd_stage)

    b = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    b.add_argument(
        "what",
        choices=["packing", "loader", "train", "data", "cluster-memory", "gpu"],
        help="packing: fill, loader, selection; loader: the real loader's memory, throughput "
        "and overhead alone; train: training packing on vs off; data: prepare and connect "
        "samples/s with 1 and 2 workers, their memory at two dataset sizes; cluster-memory: "
        "a loader worker's memory with Bridge's own encoder and with packline's in Bridge "
        "(needs Bridge's data path: make bench WHAT=cluster-memory); gpu: packing on one GPU, "
        "real Qwen3-VL sizes (also python -m packline.bench.gpu; docs/gpu.md)",
    )
    b.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides of the set it runs on, e.g. data.video_share=1.0",
    )
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument("--config", help="pipeline config of the default set (default: tiny_cpu)")
    b.add_argument("--work-dir", help="where the benchmark prepares and runs (default: runs/bench)")
    opt.add_bench_only_options(b)
    b.set_defaults(fn=cmd_bench)

    g = sub.add_parser("config", help="the resolved config (YAML) and where each value came from")
    g.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]", help="config + overrides")
    g.set_defaults(fn=cmd_config)

    c = sub.add_parser("compare", help="packing on vs off from MLflow: table + plots")
    c.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    c.add_argument("--experiment", help="MLflow experiment (default: the config's)")
    c.add_argument("--run", help="a pipeline or train-stage run id (default: the newest)")
    c.set_defaults(fn=cmd_compare)

    u = sub.add_parser("ui", help="MLflow UI on 127.0.0.1 for this config's store")
    u.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    u.add_argument("--port", type=opt.int_in(0, 65535), default=5000, help="port (0: any free one)")
    u.add_argument("--experiment", help="MLflow experiment (default: the config's)")
    u.set_defaults(fn=cmd_ui)
    h = sub.add_parser("chat", help="the trained adapter answers a prompt, or replays a sample")
    h.add_argument("args", nargs="*", metavar='[CONFIG] [key=value] ["prompt"]')
    h.add_argument("--image", help="an image file the prompt is about")
    h.add_argument("--video", help="a video file the prompt is about")
    h.add_argument("--sample", help="replay this prepared sample's question (default: 1st val)")
    h.add_argument("--max-new-tokens", type=opt.int_in(1), default=64, help="answer length limit")
    h.set_defaults(fn=cmd_chat)

    e = sub.add_parser("export", help="the trained adapter (PEFT), or merged into the base (HF)")
    e.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    e.add_argument("--to", help="output dir: new, empty or an earlier export (default: "
                   "<work_dir>/export/merged or /adapter)")  # fmt: skip
    e.add_argument("--merge", action="store_true", help="one HF checkpoint: base + adapter")
    e.set_defaults(fn=cmd_export)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides may come before or after options
    (``run CONFIG --dryrun a=1`` as well as ``run --executor slurm a=1``).

    argparse ends a ``nargs="*"`` positional at the first option, so overrides after an
    option come back unparsed; they are appended to the command's overrides in order.
    """
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(ns, "args") or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        ns.args = [*ns.args, *extra]
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    debug = os.environ.get("PACKLINE_DEBUG") == "1"
    try:
        return ns.fn(ns)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence of the CLI
        from packline.faults import machine_fault

        # a full disk, a read-only mount...: a reason (exit 2), not a bug
        known = exc if isinstance(exc, (UserError, InputCrash)) else None
        known = known or machine_fault(exc, _WORK[0] if _WORK else None)
        if known is None or debug:
            traceback.print_exc()
        if known is None:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(f"error: {known}", file=sys.stderr)
        return 1 if isinstance(known, InputCrash) else 2


if __name__ == "__main__":
    sys.exit(main())
