"""Every manifest in deploy/ parses and carries what its CRD or Kubernetes kind requires; the
images are pinned; the zone labels the placement code reads are on every GPU worker group; and
the GPU image pins the same versions as the CPU stack the tests run on."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
ZONE_LABEL = "gem.zone"  # gem_platform.topology's default parallel.zone_label
IMAGE_PROJECT = "/home/ray/gem"  # WORKDIR of deploy/Dockerfile

# Fields of the KubeRay v1 CRDs these manifests may use (KubeRay 1.6); a typo in a field name
# would otherwise be dropped silently by the API server.
RAYCLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
                   "autoscalerOptions", "headServiceAnnotations", "suspend", "managedBy",
                   "gcsFaultToleranceOptions", "authOptions", "upgradeStrategy"}
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template",
              "labels", "resources"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
                "numOfHosts", "rayStartParams", "template", "scaleStrategy", "suspend", "labels",
                "resources"}
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate",
               "metadata", "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy",
               "entrypoint", "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources",
               "entrypointNumCpus", "entrypointNumGpus", "ttlSecondsAfterFinished",
               "shutdownAfterJobFinishes", "suspend"}
RAYCRONJOB_SPEC = {"schedule", "jobTemplate", "suspend"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
CRON_FIELD = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*$")
CRON_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]


SWEEPS = DEPLOY / "sweeps"  # sweep specs the jobs run, not Kubernetes manifests


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if SWEEPS in path.parents:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path, doc


DOCS = list(documents())


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every pod spec inside a manifest, wherever the kind nests it."""
    if isinstance(doc, dict):
        if "containers" in doc and isinstance(doc["containers"], list):
            yield doc
        for value in doc.values():
            yield from pod_specs(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from pod_specs(item)


def check_cron(schedule: str) -> None:
    fields = schedule.split()
    assert len(fields) == 5, f"cron schedule {schedule!r} needs 5 fields"
    for field, (low, high) in zip(fields, CRON_RANGES, strict=True):
        assert CRON_FIELD.match(field), f"bad cron field {field!r}"
        for number in re.findall(r"\d+", field.split("/")[0]):
            assert low <= int(number) <= high, f"{field!r} outside {low}-{high}"


def check_cluster_spec(spec: dict[str, Any]) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert spec["rayVersion"] == pinned("requirements/cpu.txt")["ray"]
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP, set(head) - HEAD_GROUP
    assert head["template"]["spec"]["containers"], "head needs a container"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # in-pod; Service stays internal
    groups = spec["workerGroupSpecs"]
    assert groups, "no worker groups"
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names), "worker group names must be unique"
    zones = set()
    for group in groups:
        assert set(group) <= WORKER_GROUP, set(group) - WORKER_GROUP
        assert isinstance(group["replicas"], int)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert "rayStartParams" in group
        containers = group["template"]["spec"]["containers"]
        assert containers
        zone = group["labels"][ZONE_LABEL]
        assert group["template"]["metadata"]["labels"][ZONE_LABEL] == zone
        zones.add(zone)
        for c in containers:
            limits, requests = c["resources"]["limits"], c["resources"]["requests"]
            assert int(limits["nvidia.com/gpu"]) >= 1, f"{group['groupName']} has no GPUs"
            assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"]
    assert len(zones) >= 2, f"worker groups span one zone only: {zones}"
    assert spec["authOptions"]["mode"] == "token"


def pinned(path: str) -> dict[str, str]:
    """name -> version for the `name==version` lines of a requirements file."""
    pins = {}
    for line in (REPO / path).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;#]+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def test_every_manifest_parses_with_identity() -> None:
    assert len(DOCS) >= 9
    for path, doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind"), path
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


@pytest.mark.parametrize("path, doc", DOCS, ids=[f"{p.name}:{d['kind']}" for p, d in DOCS])
def test_containers_pinned_and_bounded(path: Path, doc: dict[str, Any]) -> None:
    for spec in pod_specs(doc):
        for c in spec["containers"]:
            image = c["image"]
            tag = image.rsplit("/", 1)[-1]
            assert ":" in tag and not tag.endswith(":latest"), f"{path}: unpinned {image}"
            assert c["resources"]["limits"].get("memory"), f"{path}: {c['name']} memory limit"
            assert c["resources"]["limits"].get("cpu"), f"{path}: {c['name']} cpu limit"


def test_raycluster() -> None:
    (cluster,) = of_kind("RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    check_cluster_spec(cluster["spec"])
    claims = {v["persistentVolumeClaim"]["claimName"]
              for spec in pod_specs(cluster) for v in spec.get("volumes", [])
              if "persistentVolumeClaim" in v}
    declared = {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}
    assert claims <= declared, claims - declared


def cluster_gpus(spec: dict[str, Any]) -> int:
    """GPUs a RayCluster spec's worker groups request in all."""
    return sum(g["replicas"] * int(c["resources"]["requests"]["nvidia.com/gpu"])
               for g in spec["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])


def shared_mounts(spec: dict[str, Any]) -> set[str]:
    """Paths every pod of a RayCluster spec mounts from the same persistent volume claim."""
    per_pod = []
    for pod in pod_specs(spec):
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        per_pod.append({(m["mountPath"], claims[m["name"]]) for c in pod["containers"]
                        for m in c.get("volumeMounts", []) if m["name"] in claims})
    common = set.intersection(*per_pod) if per_pod else set()
    return {path for path, _ in common}


def check_gpu_sweep(spec_path: str, cluster: dict[str, Any]) -> None:
    """A job's sweep spec trains on GPUs, its concurrent trials use exactly the GPUs the
    job's cluster requests, and its checkpoints go to storage every pod sees."""
    from gem_platform.sweep.config import load_sweep

    plan = load_sweep(REPO / spec_path)
    gpus = cluster_gpus(cluster)
    for arm in plan.arms:
        r = arm.recipe
        assert r.parallel.use_gpu, f"{spec_path}: arm {arm.name} does not use GPUs"
        assert r.parallel.workers * plan.max_concurrent == gpus, (
            f"{spec_path}: {plan.max_concurrent} trials x {r.parallel.workers} workers on a "
            f"cluster of {gpus} GPUs")
        storage = r.train.storage
        assert storage, f"{spec_path}: arm {arm.name} keeps checkpoints on the driver only"
        assert "://" in storage or any(
            storage.startswith(m.rstrip("/") + "/") for m in shared_mounts(cluster)), (
            f"{spec_path}: train.storage {storage} is not on a volume every pod mounts")


def test_rayjob_runs_the_attention_sweep() -> None:
    (job,) = of_kind("RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    cd, command = spec["entrypoint"].split(" && ")
    assert cd == f"cd {IMAGE_PROJECT}"
    assert command == "gemctl sweep deploy/sweeps/attention_gpu.yaml"
    check_gpu_sweep(command.split()[-1], spec["rayClusterSpec"])
    assert spec["submissionMode"] in SUBMISSION_MODES
    assert spec["shutdownAfterJobFinishes"] is True
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http://mlflow.")
    check_cluster_spec(spec["rayClusterSpec"])


def test_raycronjob_runs_the_nightly_ablations_and_gate() -> None:
    (cron,) = of_kind("RayCronJob")
    assert cron["apiVersion"] == "ray.io/v1"
    spec = cron["spec"]
    assert set(spec) <= RAYCRONJOB_SPEC and {"schedule", "jobTemplate"} <= set(spec)
    check_cron(spec["schedule"])
    template = spec["jobTemplate"]
    assert set(template) <= RAYJOB_SPEC, set(template) - RAYJOB_SPEC
    cd, command = template["entrypoint"].split(" && ")
    assert cd == f"cd {IMAGE_PROJECT}"
    words = shlex.split(command)
    assert words[:3] == ["MAX_NE_REGRESSION=0.1%", "bash", "deploy/scripts/nightly-ablations.sh"]
    specs = words[3:]
    assert {Path(s).stem for s in specs} == {"attention_gpu", "precision_gpu", "loader_gpu",
                                               "activations_gpu", "recall_gpu"}
    for s in specs:
        check_gpu_sweep(s, template["rayClusterSpec"])
    assert "COPY --chown=ray:users deploy/sweeps" in (DEPLOY / "Dockerfile").read_text()
    script = (REPO / words[2]).read_text()
    assert 'gemctl sweep --new "${spec}"' in script
    assert 'gemctl compare "${id}" --max-ne-regression "${gate}"' in script
    assert "COPY --chown=ray:users deploy/scripts" in (DEPLOY / "Dockerfile").read_text()
    check_cluster_spec(template["rayClusterSpec"])


def test_nightly_script_reads_sweep_id_and_verdicts_as_json(tmp_path: Path) -> None:
    """The sweep id comes from `gemctl sweep --json`'s document and the verdicts from the
    real `gemctl compare --json` on a results file, not from either command's text."""
    from gem_platform.sweep.results import TrialRun, write_results
    from tests.conftest import gemctl_in_process

    script = DEPLOY / "scripts" / "nightly-ablations.sh"

    def call(function: str, *args: str) -> str:
        quoted = " ".join(shlex.quote(a) for a in args)
        return subprocess.run(["bash", "-c", f'source "{script}"; {function} {quoted}'],
                              capture_output=True, text=True, check=True).stdout.strip()

    sweep_doc = tmp_path / "sweep.json"
    sweep_doc.write_text('{"sweep_id": "attention-20260101-020000", "status": "FINISHED"}')
    assert call("json_field", str(sweep_doc), "sweep_id") == "attention-20260101-020000"
    (tmp_path / "log.txt").write_text("sweep x FINISHED: not JSON\n")
    assert call("json_field", str(tmp_path / "log.txt"), "sweep_id") == ""
    trials = [TrialRun(f"{arm}{s}", arm, str(s), {"eval/ne_ctr": ne * (1 + d * s)})
              for s in range(3) for arm, ne, d in (("base", 0.9, 0.0), ("arm", 0.9, 0.004))]
    write_results(tmp_path / "r.json", {"sweep": "r", "baseline": "base"}, trials)
    proc = gemctl_in_process("compare", "r.json", "--max-ne-regression", "0.1%", "--no-plot",
                             "--json", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr  # inconclusive: the interval straddles 0.1%
    (tmp_path / "cmp.json").write_text(proc.stdout)
    assert call("json_field", str(tmp_path / "cmp.json"), "exit_code") == "3"
    doc = json.loads(proc.stdout)
    (v,) = doc["verdicts"]
    assert v["seeds_needed_closer"] > v["seeds_needed"]
    assert call("verdicts", str(tmp_path / "cmp.json")) == (
        f"arm eval/ne_ctr INCONCLUSIVE needs ~{v['seeds_needed']} seeds "
        f"(~{v['seeds_needed_closer']} if the mean moves 1 SE closer)")
    (tmp_path / "long.json").write_text(json.dumps({**doc, "past_one_epoch": {"arm": 2.4}}))
    assert call("verdicts", str(tmp_path / "long.json")).endswith(
        "warning: arm trained 2.4 epochs of its training split: its NE can measure memorization")
    assert [call("worse", *p) for p in (("0", "3"), ("3", "1"), ("0", "0"))] == ["3", "1", "0"]
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_the_nightly_positive_control_is_the_one_gpu_control() -> None:
    """deploy/sweeps/recall_gpu.yaml trains the one-GPU control's arms (recall_h200.yaml) with
    the same data, model and schedule, spread over 8 ranks at the same global batch, and keeps
    its expected verdicts and 0.2% gate, which the nightly script takes over its default."""
    from gem_platform.sweep.config import load_sweep

    nightly = load_sweep(SWEEPS / "recall_gpu.yaml")
    control = load_sweep(REPO / "recipes/ablations/recall_h200.yaml")
    assert nightly.baseline == control.baseline and nightly.seeds == control.seeds
    assert nightly.gates.expect == control.gates.expect
    assert nightly.gates.max_ne_regression_pct == control.gates.max_ne_regression_pct == 0.2
    assert {e.arm for e in nightly.gates.expect} | {nightly.baseline} == {
        a.name for a in nightly.arms}
    for arm in nightly.arms:
        ours, theirs = (r.model_dump(mode="json", exclude={"parallel", "loader", "tracking"})
                        for r in (arm.recipe, control.arm(arm.name).recipe))
        for tree in (ours, theirs):
            for key in ("storage", "checkpoint_every"):
                tree["train"].pop(key)
        assert ours == theirs, arm.name
        assert arm.recipe.loader.local_batch_size * arm.recipe.parallel.workers == \
            control.arm(arm.name).recipe.loader.local_batch_size
    script = DEPLOY / "scripts" / "nightly-ablations.sh"
    gate = {spec: subprocess.run(
        ["bash", "-c", f'source "{script}"; spec_gate "{SWEEPS / spec}" 0.1%'],
        capture_output=True, text=True, check=True).stdout.strip()
        for spec in ("recall_gpu.yaml", "attention_gpu.yaml")}
    assert gate == {"recall_gpu.yaml": "0.2%", "attention_gpu.yaml": "0.1%"}


@pytest.mark.parametrize("bad", ["0 2 * *", "61 2 * * *", "0 24 * * *", "x 2 * * *"])
def test_cron_check_rejects_bad_schedules(bad: str) -> None:
    with pytest.raises(AssertionError):
        check_cron(bad)


def test_mlflow_server_binds_and_exposes_sanely() -> None:
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    (pg,) = of_kind("StatefulSet")
    server = deployments["mlflow"]
    pod = server["spec"]["template"]
    assert server["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(args["--port"]) == ports["http"]
    assert args["--backend-store-uri"].startswith("postgresql://")
    assert "$(DB_HOST)" in args["--backend-store-uri"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DB_HOST"]["value"] in services  # the PostgreSQL Service by name
    assert env["DB_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "gem-mlflow-db"
    assert "--serve-artifacts" in container["args"]
    assert args["--artifacts-destination"] == "$(MLFLOW_ARTIFACTS_DESTINATION)"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["artifacts"] == env["MLFLOW_ARTIFACTS_DESTINATION"]["value"]
    assert "mlflow.*:*" in args["--allowed-hosts"].split(",")  # in-cluster DNS names

    svc = services["mlflow"]
    assert svc["spec"]["type"] == "ClusterIP", "keep the tracking server internal"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] in ("http", ports["http"])

    pg_svc = services[env["DB_HOST"]["value"]]
    assert pg_svc["spec"]["type"] == "ClusterIP"
    pg_labels = pg["spec"]["template"]["metadata"]["labels"]
    assert pg_svc["spec"]["selector"].items() <= pg_labels.items()
    assert pg["spec"]["volumeClaimTemplates"], "the database needs its own volume"
    for spec in (pod["spec"], pg["spec"]["template"]["spec"]):
        assert spec["securityContext"]["runAsNonRoot"] is True

    # Jobs reach the server at the Service's in-cluster name and port.
    uris = {yaml.safe_load(j["spec"]["runtimeEnvYAML"])["env_vars"]["MLFLOW_TRACKING_URI"]
            for j in of_kind("RayJob")}
    assert uris == {f"http://mlflow.gem.svc.cluster.local:{svc['spec']['ports'][0]['port']}"}


def test_gpu_image_pins_match_the_cpu_stack() -> None:
    cpu = pinned("requirements/cpu.txt")
    gpu = pinned("deploy/requirements-cuda.txt")
    cpu["fbgemm-gpu"] = cpu.pop("fbgemm-gpu-cpu")  # the same release, CUDA build
    shared = set(cpu) & set(gpu)
    assert {"torch", "ray", "mlflow", "triton", "fbgemm-gpu"} <= shared
    assert {name: gpu[name] for name in shared} == {name: cpu[name] for name in shared}

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    assert base.startswith(f"rayproject/ray:{cpu['ray']}-"), base
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(cpu['torch'])}$", dockerfile, re.M)
    assert re.search(rf"^ARG FBGEMM_VERSION={re.escape(cpu['fbgemm-gpu'])}$", dockerfile, re.M)
    assert "requirements/no-deps.txt" in dockerfile  # torchrec, --no-deps
    assert re.search(r"^USER ray$", dockerfile, re.M), "the image must not run as root"
    assert re.search(rf"^WORKDIR {IMAGE_PROJECT}$", dockerfile, re.M)
    assert "pip install --no-deps -e ." in dockerfile
    # the image has no .git: the build names its code, and every run from it records that
    for name in ("GEM_GIT_COMMIT", "GEM_GIT_DIRTY"):
        assert re.search(rf'^ARG {name}=""$', dockerfile, re.M), name
        assert re.search(rf"{name}=\$\{{{name}\}}", dockerfile), name
    for doc in (dockerfile, (DEPLOY / "README.md").read_text()):
        assert "--build-arg GEM_GIT_COMMIT=$(git rev-parse HEAD)" in doc
        assert "--build-arg GEM_GIT_DIRTY=" in doc

    mlflow_image = (DEPLOY / "mlflow" / "Dockerfile").read_text()
    assert f'"mlflow=={cpu["mlflow"]}"' in mlflow_image
    assert re.search(r"^USER (?!root)\w+$", mlflow_image, re.M)
    (server,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "mlflow"]
    image = server["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith(f":{cpu['mlflow']}")


def test_readme_covers_every_manifest() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.sh"), DEPLOY / "Dockerfile",
                 DEPLOY / "mlflow" / "Dockerfile"]:
        assert str(path.relative_to(REPO)) in readme, f"README does not mention {path}"
