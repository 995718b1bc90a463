"""A password in the tracking URI never reaches the log file under gem_runs/logs/ nor the
terminal with --verbose: MLflow's own "View run ... at: URL" line, library log records (from
handlers made before or after the mask) and their tracebacks are masked. `gemctl ui` hands
the store URI to the server through the environment (not the command line `ps` shows), and a
busy port is refused with exit code 2."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from gemctl import render
from gemctl.quiet import LibraryOutput
from tests.cli.conftest import clean_exit
from tests.conftest import free_port, run_gemctl

SECRET = "pa55-w0rd"


def _library_lines(uri_with_password: str, store: str) -> None:
    """What libraries do with a URI while a command runs: MLflow writes its run link to
    sys.stdout (as MlflowClient.set_terminated does for a server), loggers (one made before,
    one after the mask) log it, one with a traceback; a print."""
    early = logging.getLogger("early.lib")
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("secrets"))
    client.set_terminated(run.info.run_id)
    sys.stdout.write(f"\U0001f3c3 View run {run.info.run_name} at: {uri_with_password}/#/"
                     f"experiments/1/runs/{run.info.run_id}\n")
    early.warning("connecting to %s", uri_with_password)
    late = logging.getLogger("late.lib")
    late.addHandler(logging.StreamHandler(sys.stderr))
    late.propagate = False
    late.error(f"retrying {uri_with_password}?token={SECRET}")
    try:
        raise ConnectionError(f"refused: {uri_with_password}")
    except ConnectionError:
        early.exception("request failed")
    print(f"plain print of {uri_with_password}")


def test_log_file_holds_no_password(tmp_path, monkeypatch, capfd):
    """(A handler made before the command holds the stream the test runner gave it, so its
    lines land there rather than in the file: both are checked.)"""
    monkeypatch.chdir(tmp_path)
    logging.getLogger("early.lib").addHandler(logging.StreamHandler(sys.stderr))
    uri = f"http://alice:{SECRET}@127.0.0.1:{free_port()}"
    with LibraryOutput("secrets") as lib:
        _library_lines(uri, f"sqlite:///{tmp_path / 'm.db'}")
    text = Path(lib.path).read_text()
    assert "View run" in text and "plain print" in text and "retrying" in text
    assert SECRET not in text and "alice:***@127.0.0.1" in text
    out, err = capfd.readouterr()
    assert "request failed" in out + err and "ConnectionError: refused" in out + err
    assert SECRET not in out + err


def test_verbose_terminal_holds_no_password(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    uri = f"https://bob:{SECRET}@mlflow.example:443"
    with LibraryOutput("secrets", verbose=True):
        logging.getLogger("early.lib").addHandler(logging.StreamHandler(sys.stderr))
        _library_lines(uri, f"sqlite:///{tmp_path / 'm.db'}")
        render.console.print("our own console still prints", highlight=False)
    out, err = capfd.readouterr()
    assert "View run" in out + err and "our own console still prints" in out
    assert SECRET not in out + err and "bob:***@mlflow.example" in out + err
    assert not (tmp_path / "gem_runs").exists()


@pytest.mark.slow
def test_submit_with_a_password_in_the_uri(tmp_path, mlflow_server):
    """The issue's case end to end: a live server, its URI with a password, with and without
    --verbose."""
    from tests.sweep.test_spec import BASE

    (tmp_path / "base.yaml").write_text(
        BASE + "loader: {local_batch_size: 64, base_batch_size: 16}\n")
    uri = mlflow_server.replace("http://", f"http://carol:{SECRET}@")
    for flags in ([], ["--verbose"]):
        proc = run_gemctl("submit", "base.yaml", "--local", "--tracking-uri", uri, *flags,
                          cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert SECRET not in proc.stdout + proc.stderr
        assert "carol:***@" in proc.stdout + proc.stderr
    logs = list((tmp_path / "gem_runs" / "logs").glob("*.log"))
    assert logs and any("View run" in p.read_text() for p in logs)
    assert not any(SECRET in p.read_text() for p in logs)


def _ui(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, "-m", "gemctl.main", "ui", *args], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                                 **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_ui_store_uri_is_not_on_any_command_line(tmp_path):
    store = f"sqlite:///{tmp_path / 'secret-store-name.db'}"
    proc = _ui(["--port", str(free_port())], tmp_path, {"MLFLOW_TRACKING_URI": store})
    try:
        deadline = time.time() + 120
        children: list[psutil.Process] = []
        while not children:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the MLflow UI did not start"
            time.sleep(0.5)
            children = psutil.Process(proc.pid).children(recursive=True)
        time.sleep(2)  # let the server start its workers too
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode(errors="replace")
            assert "secret-store-name" not in cmdline, cmdline
        environ = Path(f"/proc/{children[0].pid}/environ").read_bytes().decode(errors="replace")
        assert f"MLFLOW_BACKEND_STORE_URI={store}" in environ
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()


def test_ui_on_a_busy_port(gemctl, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = gemctl("ui", "--port", str(port), "--tracking-uri",
                        f"sqlite:///{tmp_path / 'm.db'}")
    clean_exit(result, 2)
    text = " ".join(result.stderr.split())
    assert f"Port {port} on 127.0.0.1 is already in use" in text and "--port" in text


def test_ui_on_a_host_that_is_not_here(gemctl, tmp_path):
    result = gemctl("ui", "--host", "no-such-host.invalid", "--tracking-uri",
                    f"sqlite:///{tmp_path / 'm.db'}")
    clean_exit(result, 2)
    assert "--host" in result.stderr


def test_one_line_stream_masks_for_the_terminal_and_the_log():
    """The --verbose terminal stream and the log-file stream are the same MaskedLines: lines
    masked whole across writes; for the log, colour codes dropped."""
    import io

    from gem_platform.log_mask import MaskedLines

    for strip, colour in ((False, "\x1b[32m"), (True, "")):
        sink = io.StringIO()
        stream = MaskedLines(sink, strip_ansi=strip)
        stream.write(f"\x1b[32mView run at http://bob:{SECRET}")
        stream.write("@host:5000\n")
        stream.write("prompt: ")
        stream.flush()
        assert sink.getvalue() == f"{colour}View run at http://bob:***@host:5000\nprompt: "


def test_masked_stream_answers_isatty_after_its_sink_closed(tmp_path):
    # Ray's colorama asks its wrapped stdout isatty() at interpreter exit, after gemctl closed
    # the log file under it: that must be False, not a traceback at the end of the output.
    from gem_platform.log_mask import MaskedLines

    sink = open(tmp_path / "log.txt", "w")  # noqa: SIM115 (closed below, on purpose)
    stream = MaskedLines(sink)
    stream.write("user:secret@host line\n")
    sink.close()
    assert stream.isatty() is False


def print_and_log_a_credential(uri: str) -> None:
    """What a child process's libraries do with a store URI: MLflow's run link on
    sys.stdout, a log record through logging's last-resort handler, a print."""
    sys.stdout.write(f"\U0001f3c3 View run child at: {uri}/#/experiments/1/runs/abc\n")
    logging.getLogger("child.lib").warning("connecting to %s", uri)
    print(f"retrying {uri}?token={SECRET}", flush=True)


def test_a_child_process_masks_its_own_output(capfd):
    """A spawned child (a sweep trial, a benchmark arm) writes to the same file descriptors
    as gemctl (the log file, or the terminal with --verbose) but not through gemctl's
    masked streams: it masks its own lines."""
    from gem_platform.fresh_process import call_in_fresh_process

    call_in_fresh_process(print_and_log_a_credential, f"http://dana:{SECRET}@127.0.0.1:5000",
                          echo=lambda event: None)
    out, err = capfd.readouterr()
    assert "View run child" in out and "connecting to" in err and "retrying" in out
    assert SECRET not in out + err and "dana:***@127.0.0.1" in out + err


@pytest.mark.parametrize("where", ["flag", "set", "env"])
def test_a_remote_job_is_never_handed_a_password(where):
    """A Ray job's command line and environment are shown to everyone who can reach the
    cluster's dashboard (and its command line to `ps` on the head): a tracking URI with a
    password is refused before anything is sent, with MLflow's own way to pass one."""
    from tests.conftest import REPO

    uri = f"http://erin:{SECRET}@127.0.0.1:{free_port()}"
    args = ["submit", "recipes/demo.yaml", "--address", f"http://127.0.0.1:{free_port()}"]
    env = {"MLFLOW_TRACKING_URI": uri if where == "env" else ""}
    extra = {"flag": ["--tracking-uri", uri], "set": ["--set", f"tracking.uri={uri}"],
             "env": []}[where]
    proc = run_gemctl(*args, *extra, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = " ".join(proc.stderr.split())
    assert "MLFLOW_TRACKING_PASSWORD" in text and "erin:***@" in text, text
    assert SECRET not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_colour_codes_inside_a_uri_do_not_hide_its_password():
    """Rich highlights a URI in pieces (the query's key, '=' and value, the scheme's slashes,
    the user), so the terminal stream (colours kept) must mask what the plain line shows."""
    import io

    from rich.console import Console

    from gem_platform.log_mask import MaskedLines

    coloured = io.StringIO()
    Console(file=coloured, force_terminal=True, width=300).print(
        f"refused http://u:{SECRET}@host:5000/api?token={SECRET} and "
        f"postgresql://app:{SECRET}@db:5432/ml")
    sink = io.StringIO()
    stream = MaskedLines(sink)
    stream.write(coloured.getvalue())
    stream.flush()
    assert SECRET not in sink.getvalue()
    assert "app:***@db:5432" in sink.getvalue() and "token=***" in sink.getvalue()


def test_a_traceback_that_escapes_every_handler_is_masked(capfd, monkeypatch):
    """An exception no handler caught ends the process through sys.excepthook (typer's, or
    Python's) on the real stderr, after gemctl's streams are gone; one in a thread through
    threading.excepthook. (Python's own hooks here: pytest puts its own in place of the
    thread hook while a test runs.)"""
    import threading

    from gem_platform import log_mask

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    log_mask.install()
    try:
        raise ConnectionError(f"refused http://frank:{SECRET}@127.0.0.1:5000")
    except ConnectionError as err:
        sys.excepthook(type(err), err, err.__traceback__)

    def fails() -> None:
        raise ConnectionError(f"thread refused http://frank:{SECRET}@127.0.0.1:5000")

    thread = threading.Thread(target=fails)
    thread.start()
    thread.join()
    _, err = capfd.readouterr()
    assert "ConnectionError: refused" in err and "thread refused" in err
    assert SECRET not in err and "frank:***@127.0.0.1" in err


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_ui_over_a_tracking_server_points_at_its_own_ui(gemctl, scheme):
    """An MLflow server (http/https store) serves its UI itself: `gemctl ui` over it says
    where to open it (no password) and exits 2, instead of starting a server that can't read
    from another server and dies with MLflow's traceback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = gemctl("ui", "--port", str(free_port()), "--tracking-uri",
                        f"{scheme}://gina:{SECRET}@127.0.0.1:{port}/")
    clean_exit(result, 2)
    text = " ".join(result.stderr.split())
    assert f"Open {scheme}://127.0.0.1:{port}/ in a browser" in text, text
    assert SECRET not in result.output + result.stderr


def test_a_recipe_holding_a_password_is_not_uploaded(tmp_path):
    """The job's working folder (the recipe in it) is uploaded to the cluster's package store:
    a recipe whose tracking.uri holds a password is refused before anything is sent."""
    from tests.conftest import REPO

    recipe = REPO / "recipes" / f".secret-{free_port()}.yaml"
    text = (REPO / "recipes" / "demo.yaml").read_text()
    recipe.write_text(text.replace("tracking:\n", f"tracking:\n  uri: http://erin:{SECRET}"
                                   f"@127.0.0.1:{free_port()}\n", 1))
    try:
        proc = run_gemctl("submit", str(recipe.relative_to(REPO)), "--address",
                          f"http://127.0.0.1:{free_port()}", cwd=REPO, timeout=120)
    finally:
        recipe.unlink()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = " ".join(proc.stderr.split())
    assert "package store" in text and "erin:***@" in text, text
    assert SECRET not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
