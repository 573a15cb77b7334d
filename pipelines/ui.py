"""``packline ui``: the MLflow UI on 127.0.0.1 for the config's store.

Starts ``mlflow server`` (one worker, job execution off: no huey consumers) in its own
process group on the sqlite store and artifact dir of the config, waits until ``/health``
answers, prints the page comparing the newest ``train-packed`` and ``train-unpacked`` runs,
and on Ctrl-C or SIGTERM stops the whole process group (TERM, then KILL after a grace
period), so no server process outlives the command.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from packline.report.mlflow_store import compare_url, find_training_pair, open_store
from packline.tracking import experiment_name, sqlite_path, tracking_uri
from schemas.config import PipelineConfig
from schemas.errors import UserError

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
LOG_NAME = "mlflow-server.log"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def server_command(cfg: PipelineConfig, port: int) -> list[str]:
    """``mlflow server`` on the config's sqlite store, bound to 127.0.0.1, one worker."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking_uri(cfg),
        "--default-artifact-root",
        (cfg.work_path / "mlartifacts").as_uri(),
        # Runs keep their own file:// artifact URIs; nothing to proxy (and no ./mlartifacts
        # created in the working directory).
        "--no-serve-artifacts",
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def server_env() -> dict[str, str]:
    return {
        **os.environ,
        # mlflow 3.x starts huey job consumers by default (~7 processes, 2x startup time).
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


def wait_healthy(
    proc: subprocess.Popen, base: str, log: Path, timeout: float, stopped=lambda: False
) -> bool:
    """Poll ``/health`` until it answers OK (True) or ``stopped()`` (False); RuntimeError
    with the log's tail when the server exits or does not answer in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopped():
            return False
        if proc.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited with code {proc.returncode}:\n{_tail(log)}\n(log: {log})"
            )
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"mlflow server did not answer in {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path, n: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """TERM the server's process group, KILL it after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:  # workers may outlive the group leader for a moment
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _pages(cfg: PipelineConfig, base: str, experiment: str) -> list[tuple[str, str]]:
    """(label, URL) of the pages worth opening: the on/off comparison, else the experiment."""
    client = open_store(cfg)
    try:
        pair = find_training_pair(client, experiment)
    except UserError as exc:
        exp = client.get_experiment_by_name(experiment)
        note = exc.problems[0]
        if exp is None:
            return [("no comparison yet", note)]
        return [("experiment", f"{base}/#/experiments/{exp.experiment_id}"), ("note", note)]
    ids = [pair.packed.info.run_id, pair.unpacked.info.run_id]
    return [
        ("packing on vs off", compare_url(base, pair.experiment_id, ids)),
        ("experiment", f"{base}/#/experiments/{pair.experiment_id}"),
    ]


def serve_ui(cfg: PipelineConfig, *, port: int = 5000, experiment: str | None = None) -> int:
    """Run the MLflow UI until Ctrl-C / SIGTERM; returns the exit code."""
    uri = tracking_uri(cfg)
    if sqlite_path(uri) is None:
        raise UserError(
            [f"mlflow.tracking_uri is {uri}: packline ui serves a local sqlite store only"],
            "cannot start the UI",
        )
    open_store(cfg, "cannot start the UI")  # the store must exist (UserError otherwise)
    if port == 0:
        port = free_port()
    elif _port_in_use(port):
        raise UserError(
            [f"port {port} on {HOST} is in use: pass --port N, or --port 0 for a free one"],
            "cannot start the UI",
        )
    base = f"http://{HOST}:{port}"
    log_dir = cfg.work_path / "ui"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / LOG_NAME
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    with log.open("w") as log_file:
        # Own session and process group: a terminal's Ctrl-C reaches only this process,
        # which then stops the whole server group itself.
        proc = subprocess.Popen(
            server_command(cfg, port),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(),
            start_new_session=True,
        )
    try:
        print(f"starting mlflow server on {base} (store {uri}; log {log})", flush=True)
        if wait_healthy(proc, base, log, STARTUP_TIMEOUT_S, lambda: stop["signal"] is not None):
            print(f"MLflow UI: {base}/", flush=True)
            for label, url in _pages(cfg, base, experiment or experiment_name(cfg)):
                print(f"{label}: {url}", flush=True)
            print(f"server pid {proc.pid}; Ctrl-C to stop", flush=True)
        while stop["signal"] is None:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with code {proc.returncode}:\n{_tail(log)}"
                )
            time.sleep(0.2)
    finally:
        stop_group(proc)
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("mlflow server stopped", flush=True)
    return 0
