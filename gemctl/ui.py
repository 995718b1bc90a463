"""gemctl ui: the MLflow UI over this project's runs. The server it starts lives exactly as
long as the command: Ctrl-C, SIGTERM or the end of gemctl stop it (and its workers)."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Annotated, TextIO

import typer

from gem_platform.net import redact
from gemctl import render
from gemctl.errors import user_errors
from gemctl.options import TrackingOpt, epilog

STOP_GRACE_S = 10.0
STORE_ENV = "MLFLOW_BACKEND_STORE_URI"  # what `mlflow ui/server --backend-store-uri` reads
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


def _pump(source: IO[bytes], sink: TextIO) -> None:
    """Copy the server's output to ``sink`` line by line, credentials masked."""
    for raw in iter(source.readline, b""):
        sink.write(redact(raw.decode("utf-8", "replace")))
        sink.flush()


def serve(cmd: list[str], env: dict[str, str]) -> int:
    """Run a server command in its own session until it exits or gemctl is interrupted;
    returns its exit code (130 after an interrupt). The server never outlives gemctl; its
    output reaches the terminal with credentials masked."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, sys.stderr), daemon=True,
                            name="ui-output")
    pump.start()
    try:
        return proc.wait()
    finally:
        stop_server(proc)
        pump.join(timeout=5)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on (the server would report it and exit 0)
    or one this user may not bind, before the server starts."""
    from gem_platform.errors import GemError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise GemError(f"--host {host!r} is not an address of this machine ({err}).",
                       "Pass --host 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                       "interface).") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(address)
        except OSError as err:
            busy = err.errno == errno.EADDRINUSE
            raise GemError(
                f"Port {port} on {host} is {'already in use' if busy else 'not available'} "
                f"({err.strerror}): the MLflow UI can't listen there.",
                "Pass a free port (--port 5001), or stop what listens there (`ss -ltnp "
                f"'sport = :{port}'` names it)." if busy else
                "Pass a port above 1023 (--port 5001) or an address of this machine.") from None


def refuse_a_server_store(uri: str) -> None:
    """An MLflow tracking server (http/https) serves its own UI and is no store an MLflow
    server can read: refuse it with the address to open (its credentials left out)."""
    from urllib.parse import urlsplit

    from gem_platform.errors import GemError

    parts = urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https"):
        return
    address = f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path or '/'}"
    raise GemError(
        f"{redact(uri)} is an MLflow tracking server, which serves the UI itself; gemctl ui "
        "starts one over a store it reads directly (a sqlite file or a database).",
        f"Open {address} in a browser (it asks for the user and password when the server "
        "needs them), or pass --tracking-uri sqlite:///FILE or a database URI.")


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
    refuse_a_server_store(uri)
    check_reachable(uri)
    check_port_free(host, port)
    render.console.print(f"MLflow UI on http://{render.esc(host)}:{port} over "
                         f"{render.esc(uri)} (Ctrl-C stops it)", highlight=False)
    # The store URI (it may hold a password) goes through the environment, which only this
    # user can read (/proc/PID/environ), never on the command line that `ps` shows everyone.
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", host, "--port", str(port)]
    code = serve(cmd, {**os.environ, STORE_ENV: uri})
    raise typer.Exit(code if code >= 0 else 128 - code)


def register(app: typer.Typer) -> None:
    app.command("ui", epilog=epilog("gemctl ui", "gemctl ui --port 5001 --tracking-uri "
                                    "sqlite:///gem_runs/mlflow.db"))(user_errors(ui))
