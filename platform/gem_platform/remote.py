"""Remote submission through the Ray Jobs API (the dashboard's HTTP server, port 8265).

A remote job uploads the project folder as the job's ``working_dir`` and runs ``gemctl`` there
(``python -m gemctl.main submit RECIPE ...``); inside the job ``RAY_ADDRESS`` points at the
cluster, so the usual Ray Train path runs on the cluster's nodes. The project's packages also
travel as ``py_modules``, so the driver and every Ray worker import the uploaded code, not
whatever version the cluster image has installed.

Ray's client waits on sockets without a timeout, so every entry point first checks the address
in seconds and turns failures into :class:`ClusterError` (problem + fix, no traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gem_platform.errors import ClusterError, RecipeError
from gem_platform.net import default_port, parse_url, redact, require_reachable
from gem_platform.provenance import code_version

DEFAULT_JOBS_ADDRESS = "http://127.0.0.1:8265"
JOBS_SCHEMES = ("http", "https")
# Never uploaded: environments, data, local run stores (Ray also honours .gitignore).
EXCLUDES = [".venv", "gem_data", "gem_runs", "mlruns", "*.parquet", ".git",
            "mlflow.db", "mlartifacts", "__pycache__", ".pytest_cache", ".ruff_cache",
            ".hypothesis", "ray_results", "bench_results", "*.egg-info"]
# Source roots inside the project; each package travels as a py_module.
PACKAGES = ("gemctl", "platform/gem_platform", "kernels/gem_kernels")
# Environment a remote job inherits from the submitting shell when set there. Never secrets
# (refuse_credentials): a job's runtime_env is readable by everyone who can reach the dashboard.
PASSED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass(frozen=True)
class JobView:
    """What `gemctl status` shows about one job."""

    job_id: str
    status: str
    entrypoint: str
    message: str | None
    start_time: datetime | None
    end_time: datetime | None
    metadata: dict[str, str]

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def is_jobs_address(address: str | None) -> bool:
    """True for a Ray Jobs API (dashboard) address: http(s)://HEAD:PORT."""
    return bool(address) and address.partition("://")[0].lower() in JOBS_SCHEMES


def jobs_address_for_submit(address: str | None, local: bool) -> str | None:
    """The Jobs API address a `gemctl submit` goes to, or None for an in-process/Ray-driver run.

    An explicit ``--address http://...`` always means a remote job (with ``--local`` the job
    trains in one process on the head node). RAY_ADDRESS counts only without ``--local``, the
    same rule the driver path uses.
    """
    if is_jobs_address(address):
        return address
    env = os.environ.get("RAY_ADDRESS")
    if address is None and not local and is_jobs_address(env):
        return env
    return None


def resolve_jobs_address(address: str | None) -> str:
    """--address, else RAY_ADDRESS when it is a Jobs API URL, else RAY_API_SERVER_ADDRESS,
    else the local default (the order Ray's own job CLI uses, minus GCS addresses)."""
    if address:
        candidate = address
    elif is_jobs_address(os.environ.get("RAY_ADDRESS")):
        candidate = os.environ["RAY_ADDRESS"]
    else:
        candidate = os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_JOBS_ADDRESS
    if not is_jobs_address(candidate):
        raise ClusterError(
            f"{candidate!r} is not a Ray Jobs API address.",
            "Pass the head node's dashboard URL, e.g. --address http://HEAD:8265 "
            "(`ray start --head --dashboard-host 0.0.0.0` serves it).",
        )
    return candidate.rstrip("/")


def check_jobs_server(address: str, timeout: float = 5.0) -> str:
    """Fail in seconds when no Ray Jobs server answers at ``address``; return its
    authentication mode ("token" or "disabled")."""
    parsed = parse_url(address, "Ray Jobs address", "Use http://HEAD:8265.", ClusterError)
    if not parsed.hostname:
        raise ClusterError(f"Ray Jobs address {address!r} has no host.",
                           "Use http://HEAD:8265.")
    require_reachable(
        parsed.hostname, default_port(parsed), f"Ray Jobs server at {address}",
        "Check that the head node runs with its dashboard (`ray start --head "
        "--dashboard-host 0.0.0.0`, port 8265 by default), that the port is reachable "
        "(e.g. `kubectl port-forward svc/HEAD-svc 8265:8265`), and the --address.",
        ClusterError, timeout)
    try:
        # Public endpoint (no token needed); Ray < 2.52 has none and no token auth either.
        with urllib.request.urlopen(f"{address}/api/authentication_mode",
                                    timeout=timeout) as r:
            return str(json.loads(r.read().decode()).get("authentication_mode", "disabled"))
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return "disabled"
        raise _not_jobs_server(address, err) from None
    except (OSError, ValueError) as err:
        raise _not_jobs_server(address, err) from None


def _not_jobs_server(address: str, err: Exception) -> ClusterError:
    return ClusterError(
        f"{address} accepts connections but is not a Ray Jobs server ({err}).",
        "Point --address at the Ray dashboard port (8265 by default), not the GCS (6379) "
        "or Ray Client (10001) port; the head needs Ray installed with its 'default' extra.",
    )


def auth_token() -> str | None:
    """The Ray cluster token, looked up where Ray itself looks: RAY_AUTH_TOKEN, the file at
    RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _client(address: str) -> Any:
    """A JobSubmissionClient for a checked address, carrying the token when the cluster
    requires one."""
    mode = check_jobs_server(address)
    headers = None
    if mode == "token":
        token = auth_token()
        if not token:
            raise ClusterError(
                f"The Ray cluster at {address} requires an authentication token and none is "
                "set here.",
                "Set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on the head "
                "node prints it) or put it in ~/.ray/auth_token.",
            )
        headers = {"Authorization": f"Bearer {token}"}
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError, AuthenticationError) as err:
        first = str(err).splitlines()[0]
        if isinstance(err, AuthenticationError):
            raise ClusterError(f"The Ray cluster at {address} rejected the token ({first}).",
                               "Set RAY_AUTH_TOKEN to the token of that cluster "
                               "(`ray get-auth-token` on its head node).") from None
        raise ClusterError(f"Ray Jobs server at {address}: {first}",
                           "Check the address and that the cluster runs Ray >= 2.0.") from None


def _job_call(address: str, job_id: str, call: Callable[[], Any]) -> Any:
    """Run one client request, mapping 'no such job' and server errors to ClusterError."""
    try:
        return call()
    except RuntimeError as err:
        if "404" in str(err) or "does not exist" in str(err):
            raise ClusterError(f"No job {job_id!r} on the Ray cluster at {address}.",
                               "List the cluster's jobs with `gemctl status --address "
                               f"{address}`.") from None
        raise ClusterError(f"Ray Jobs server at {address} failed: {err}",
                           "Retry; if it persists, check the head node's dashboard log "
                           "(/tmp/ray/session_latest/logs/dashboard.log).") from None
    except ConnectionError as err:
        raise ClusterError(f"Lost the Ray Jobs server at {address} ({err}).",
                           "Check that the head node is still running.") from None


def find_project_root(start: Path | None = None) -> Path:
    """The folder holding this project's pyproject.toml: cwd or a parent, else the install."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "gemctl").is_dir():
            return folder
    installed = Path(__file__).resolve().parents[2]
    if (installed / "pyproject.toml").is_file():
        return installed
    raise ClusterError(f"No GEM project folder (pyproject.toml with gemctl/) at or above {here}.",
                       "Run gemctl from the project checkout: that folder is what a remote "
                       "job uploads.")


def runtime_env(working_dir: Path, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """working_dir = the project (recipes, configs), py_modules = its packages, the tracking
    settings of the submitting shell, and the uploaded code's commit (GEM_GIT_COMMIT) and
    whether the tree differs from it (GEM_GIT_DIRTY), where known: .git does not travel, so
    without them the job's runs would record their code as unknown."""
    env = {k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}
    env.update(_code_env(working_dir))
    env.update(env_vars or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    modules = [str(working_dir / p) for p in PACKAGES if (working_dir / p).is_dir()]
    return {"working_dir": str(working_dir), "py_modules": modules, "excludes": list(EXCLUDES),
            "env_vars": env}


def _code_env(working_dir: Path) -> dict[str, str]:
    code = code_version(working_dir)
    if not code["commit"]:
        return {}
    dirty = {} if code["dirty"] is None else {"GEM_GIT_DIRTY": "1" if code["dirty"] else "0"}
    return {"GEM_GIT_COMMIT": code["commit"], **dirty}


@contextlib.contextmanager
def _quiet_ray_logs() -> Iterator[None]:
    """Ray logs every packaging step, each default exclude and the log stream's websocket at
    INFO/WARNING; the CLI prints its own summary, so only errors get through meanwhile."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # Ray's loggers carry their own levels and handlers
    try:
        yield
    finally:
        logging.disable(previous)


def new_job_id(label: str) -> str:
    """Readable, unique submission id: gem-<label>-<utc time>-<random>."""
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:40] or "job"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"gem-{slug}-{stamp}-{secrets.token_hex(2)}"


def entrypoint(entrypoint_args: Sequence[str]) -> str:
    """The shell command a job runs: this project's CLI with the given arguments."""
    return "python -m gemctl.main " + shlex.join(list(entrypoint_args))


CREDENTIAL_FIX = ("Keep the password on the cluster: set MLFLOW_TRACKING_URI, password and all, "
                  "in the environment of the cluster's nodes (e.g. from a Kubernetes secret) "
                  "and submit without it (no --tracking-uri, tracking.uri or "
                  "MLFLOW_TRACKING_URI here); for an MLflow server, MLflow also reads "
                  "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD there.")


def refuse_credentials(entrypoint_args: Sequence[str], env: dict[str, str]) -> None:
    """A job's command line and environment are shown to everyone who can reach the
    cluster's dashboard (the command line also to `ps` on the head): a password or token in
    either is refused before anything is sent (ClusterError, credentials masked)."""
    shown = [("The job's command line", arg) for arg in entrypoint_args]
    shown += [(f"The job's environment ({key})", value) for key, value in env.items()]
    _refuse_secrets(shown, "a Ray job's command line and environment are shown to everyone "
                    "who can reach the cluster's dashboard.")


def _refuse_secrets(shown: list[tuple[str, str]], why: str) -> None:
    """ClusterError (masked) for the first ``(where, value)`` whose value holds a credential."""
    for where, value in shown:
        if redact(value) != value:
            raise ClusterError(f"{where} would carry a password or token to the cluster "
                               f"({redact(value).strip()[:200]}): {why}", CREDENTIAL_FIX)


def refuse_credentials_in_file(path: Path) -> None:
    """A job uploads the project folder, the recipe with it, to the cluster's package store,
    readable by the cluster's users: a recipe holding a password or token is refused before
    anything is sent (ClusterError, credentials masked)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return  # a recipe that can't be read is refused where it is loaded
    _refuse_secrets([(f"The recipe {path}", line) for line in text.splitlines()],
                    "a job uploads the project folder, this file with it, to the cluster's "
                    "package store.")


def submit_job(entrypoint_args: list[str], address: str, *, working_dir: str | Path,
               job_id: str | None = None, env_vars: dict[str, str] | None = None,
               metadata: dict[str, str] | None = None, label: str | None = None) -> str:
    """Submit ``gemctl <entrypoint_args>`` as a Ray job on the cluster at ``address``.

    ``entrypoint_args`` are gemctl arguments relative to ``working_dir`` (e.g.
    ``["sweep", "recipes/ablations/attention.yaml"]``). Returns the job id.
    """
    if not entrypoint_args:
        raise ClusterError("A remote job needs gemctl arguments (e.g. submit RECIPE).")
    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise ClusterError(f"working_dir {root} is not a folder.",
                           "Pass the project folder (the one holding pyproject.toml).")
    env = runtime_env(root, env_vars)
    refuse_credentials(entrypoint_args, env["env_vars"])
    address = resolve_jobs_address(address)
    client = _client(address)
    job_id = job_id or new_job_id(label or entrypoint_args[0])
    meta = {"gem.command": " ".join(entrypoint_args[:2])[:200], **(metadata or {})}
    try:
        with _quiet_ray_logs():
            return client.submit_job(entrypoint=entrypoint(entrypoint_args),
                                     submission_id=job_id,
                                     runtime_env=env, metadata=meta)
    except (RuntimeError, ValueError) as err:
        raise ClusterError(f"Ray Jobs server at {address} refused the job: {err}",
                           "Check the message; a too-large working_dir means files to add "
                           "to .gitignore.") from None


def recipe_entrypoint_args(recipe: Path, sets: Sequence[str], root: Path,
                           command: str = "submit", local: bool = False,
                           extra_args: Sequence[str] = ()) -> list[str]:
    """gemctl arguments that run ``recipe`` (a recipe or sweep spec) from the uploaded copy of
    ``root``; ``extra_args`` are further options of ``command`` (e.g. ``["--new"]``)."""
    path = recipe.resolve()
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise RecipeError(f"Recipe {recipe} is outside the project folder {root}, which is "
                          "all a remote job can see.",
                          "Move or copy the recipe under the project (e.g. recipes/).") from None
    args = [command, rel.as_posix()]
    for item in sets:
        args += ["--set", item]
    if local:
        args.append("--local")
    return args + list(extra_args)


def submit_recipe(recipe: Path, sets: Sequence[str], address: str, *, local: bool = False,
                  command: str = "submit", extra_args: Sequence[str] = (),
                  root: Path | None = None) -> str:
    """Submit ``gemctl <command> RECIPE --set ...`` for a recipe or sweep spec of this project
    (``command="sweep"`` for ``gemctl sweep --address http://...``). Returns the job id."""
    root = root or find_project_root()
    args = recipe_entrypoint_args(recipe, sets, root, command=command, local=local,
                                  extra_args=extra_args)
    refuse_credentials_in_file(recipe)
    return submit_job(args, address, working_dir=root, label=f"{command}-{recipe.stem}"
                      if command != "submit" else recipe.stem)


def _when(ms: int | None) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc) if ms else None


def _view(info: Any) -> JobView:
    return JobView(job_id=info.submission_id or info.job_id or "?", status=str(info.status),
                   entrypoint=info.entrypoint, message=info.message,
                   start_time=_when(info.start_time), end_time=_when(info.end_time),
                   metadata=dict(info.metadata or {}))


def job_status(job_id: str, address: str | None = None) -> JobView:
    """Status, times and message of one job."""
    address = resolve_jobs_address(address)
    client = _client(address)
    return _view(_job_call(address, job_id, lambda: client.get_job_info(job_id)))


def list_jobs(address: str | None = None) -> list[JobView]:
    """Jobs submitted through the Jobs API, newest first."""
    address = resolve_jobs_address(address)
    client = _client(address)
    jobs = [_view(j) for j in _job_call(address, "*", client.list_jobs)
            if j.submission_id]
    far_past = datetime.min.replace(tzinfo=timezone.utc)
    return sorted(jobs, key=lambda j: j.start_time or far_past, reverse=True)


def job_logs(job_id: str, address: str | None = None) -> str:
    """Everything the job's driver has printed so far."""
    address = resolve_jobs_address(address)
    client = _client(address)
    return _job_call(address, job_id, lambda: client.get_job_logs(job_id))


def follow_logs(job_id: str, address: str | None = None) -> Iterator[str]:
    """Chunks of the job's output as it runs, until the job ends."""
    address = resolve_jobs_address(address)
    client = _client(address)
    _job_call(address, job_id, lambda: client.get_job_status(job_id))

    from aiohttp import ClientError  # the Jobs SDK streams logs over an aiohttp websocket

    # tail_job_logs is an async generator; drive it one chunk at a time from sync code.
    stream = client.tail_job_logs(job_id)

    async def next_chunk() -> str:
        return await stream.__anext__()

    loop = asyncio.new_event_loop()
    with _quiet_ray_logs():
        try:
            while True:
                task = loop.create_task(next_chunk())
                try:
                    chunk = loop.run_until_complete(task)
                except StopAsyncIteration:
                    return
                except (RuntimeError, OSError, ClientError) as err:
                    raise ClusterError(f"Following job {job_id} at {address} broke off: {err}",
                                       f"Rerun `gemctl logs {job_id} --follow`.") from None
                except BaseException:
                    # Ctrl-C / SIGTERM: cancel the pending read so the stream closes its
                    # websocket cleanly; the job itself keeps running.
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        loop.run_until_complete(task)
                    raise
                yield chunk
        finally:
            with contextlib.suppress(BaseException):
                loop.run_until_complete(stream.aclose())
            loop.close()


def stop_job(job_id: str, address: str | None = None, wait_s: float = 30.0) -> JobView:
    """Ask the job to stop (SIGTERM, then SIGKILL after Ray's grace period); wait until it
    is terminal or ``wait_s`` passes, and return its last status."""
    address = resolve_jobs_address(address)
    client = _client(address)
    _job_call(address, job_id, lambda: client.stop_job(job_id))
    deadline = time.monotonic() + wait_s
    while True:
        view = _view(_job_call(address, job_id, lambda: client.get_job_info(job_id)))
        if view.terminal or time.monotonic() > deadline:
            return view
        time.sleep(0.5)

