"""gemctl ui: the MLflow UI over this project's runs. The server it starts lives exactly as
long as the command: Ctrl-C, SIGTERM or the end of gemctl stop it (and its workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Annotated

import typer

from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import TrackingOpt, epilog

STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: the kernel sends the server SIGTERM if gemctl dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc`` and every process of its session: SIGTERM, then SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            # Workers of the server (same session) may outlive it by a moment: signal them too.
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def serve(cmd: list[str]) -> int:
    """Run a server command in its own session until it exits or gemctl is interrupted;
    returns its exit code (130 after an interrupt). The server never outlives gemctl."""
    proc = subprocess.Popen(cmd, env=dict(os.environ), start_new_session=True,
                            preexec_fn=_die_with_parent)
    try:
        return proc.wait()
    finally:
        stop_server(proc)


def ui(
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 5000,
    host: Annotated[str, typer.Option(help="Bind address; keep 127.0.0.1 unless you mean to "
                                      "expose it.")] = "127.0.0.1",
    tracking_uri: TrackingOpt = None,
    backend_store_uri: Annotated[str | None, typer.Option(
        "--backend-store-uri", hidden=True, help="Old spelling of --tracking-uri.")] = None,
) -> None:
    """Open the MLflow UI over this project's runs (binds 127.0.0.1 by default)."""
    from gem_platform.tracking import check_reachable, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri or backend_store_uri)
    check_reachable(uri)
    render.console.print(f"MLflow UI on http://{render.esc(host)}:{port} over "
                         f"{render.esc(uri)} (Ctrl-C stops it)", highlight=False)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", host, "--port", str(port),
           "--backend-store-uri", uri]
    code = serve(cmd)
    raise typer.Exit(code if code >= 0 else 128 - code)


def register(app: typer.Typer) -> None:
    app.command("ui", epilog=epilog("gemctl ui", "gemctl ui --port 5001 --tracking-uri "
                                    "sqlite:///gem_runs/mlflow.db"))(user_errors(ui))
