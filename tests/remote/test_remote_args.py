"""How a remote job is put together, without a cluster: which address a command uses, what the
job runs, what it uploads and which token it presents."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from gem_platform import remote
from gem_platform.errors import ClusterError, RecipeError
from tests.conftest import REPO


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                *remote.PASSED_ENV):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_submit_routes_only_jobs_addresses(clean_env: pytest.MonkeyPatch) -> None:
    assert remote.jobs_address_for_submit("http://head:8265", local=False) == "http://head:8265"
    assert remote.jobs_address_for_submit("https://head:443", local=True) == "https://head:443"
    assert remote.jobs_address_for_submit("ray://head:10001", local=False) is None
    assert remote.jobs_address_for_submit(None, local=False) is None
    clean_env.setenv("RAY_ADDRESS", "http://env-head:8265")
    assert remote.jobs_address_for_submit(None, local=False) == "http://env-head:8265"
    assert remote.jobs_address_for_submit(None, local=True) is None  # --local stays local
    assert remote.jobs_address_for_submit("head:6379", local=False) is None


def test_status_address_order(clean_env: pytest.MonkeyPatch) -> None:
    assert remote.resolve_jobs_address(None) == remote.DEFAULT_JOBS_ADDRESS
    clean_env.setenv("RAY_API_SERVER_ADDRESS", "http://api:8265/")
    assert remote.resolve_jobs_address(None) == "http://api:8265"
    clean_env.setenv("RAY_ADDRESS", "head:6379")  # a GCS address is skipped, not used
    assert remote.resolve_jobs_address(None) == "http://api:8265"
    clean_env.setenv("RAY_ADDRESS", "http://ray-address:8265")
    assert remote.resolve_jobs_address(None) == "http://ray-address:8265"
    assert remote.resolve_jobs_address("http://flag:1") == "http://flag:1"
    with pytest.raises(ClusterError, match="not a Ray Jobs API address"):
        remote.resolve_jobs_address("ray://head:10001")


def test_recipe_arguments_are_relative_to_the_project() -> None:
    args = remote.recipe_entrypoint_args(REPO / "recipes" / "demo.yaml",
                                         ["train.steps=5", "model.attention=block64"], REPO,
                                         local=True)
    assert args == ["submit", "recipes/demo.yaml", "--set", "train.steps=5",
                    "--set", "model.attention=block64", "--local"]
    sweep = remote.recipe_entrypoint_args(Path("recipes/ablations/attention.yaml"), [], REPO,
                                          command="sweep", extra_args=["--new"])
    assert sweep == ["sweep", "recipes/ablations/attention.yaml", "--new"]


def test_recipe_outside_the_project_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "r.yaml"
    outside.write_text("name: x\n")
    with pytest.raises(RecipeError, match="outside the project folder"):
        remote.recipe_entrypoint_args(outside, [], REPO)


def test_entrypoint_quotes_overrides() -> None:
    cmd = remote.entrypoint(["submit", "recipes/demo.yaml", "--set", "tracking.run_name=a b;rm"])
    assert cmd.startswith("python -m gemctl.main ")
    assert shlex.split(cmd)[-1] == "tracking.run_name=a b;rm"


def test_runtime_env_uploads_code_not_data(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MLFLOW_TRACKING_URI", "http://mlflow.gem:5000")
    clean_env.delenv("GEM_GIT_COMMIT", raising=False)
    env = remote.runtime_env(REPO, {"EXTRA": "1"})
    assert env["working_dir"] == str(REPO)
    assert {".venv", "gem_data", "gem_runs", "mlruns", "*.parquet", ".git"} <= set(env["excludes"])
    assert sorted(Path(p).name for p in env["py_modules"]) == ["gem_kernels", "gem_platform",
                                                               "gemctl"]
    assert all(Path(p).is_dir() for p in env["py_modules"])
    code = env["env_vars"].pop("GEM_GIT_COMMIT"), env["env_vars"].pop("GEM_GIT_DIRTY")
    assert env["env_vars"] == {"MLFLOW_TRACKING_URI": "http://mlflow.gem:5000", "EXTRA": "1",
                               "PYTHONUNBUFFERED": "1"}
    # .git stays behind, so the job learns the uploaded code's commit from its environment
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert code[0] == head and code[1] in ("0", "1")


def test_runtime_env_outside_a_checkout_names_no_commit(clean_env: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    clean_env.delenv("GEM_GIT_COMMIT", raising=False)
    assert "GEM_GIT_COMMIT" not in remote.runtime_env(tmp_path)["env_vars"]


def test_job_ids_are_readable_and_unique() -> None:
    a, b = remote.new_job_id("Attention Sweep!"), remote.new_job_id("Attention Sweep!")
    assert re.fullmatch(r"gem-attention-sweep-\d{8}-\d{6}-[0-9a-f]{4}", a), a
    assert a != b


def test_project_root_from_a_subfolder() -> None:
    assert remote.find_project_root(REPO / "recipes") == REPO


def test_token_lookup_follows_ray(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HOME", str(tmp_path))
    assert remote.auth_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert remote.auth_token() == "from-home"
    (tmp_path / "tok").write_text("from-path")
    clean_env.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert remote.auth_token() == "from-path"
    clean_env.setenv("RAY_AUTH_TOKEN", "from-env")
    assert remote.auth_token() == "from-env"
