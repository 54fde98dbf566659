"""examples/kubernetes/: every manifest validates offline (core kinds against the Kubernetes schemas with
kubernetes-validate --strict; JobSet, PyTorchJob, TrainingRuntime and TrainJob against tests/k8s_crds.py, and the
core objects inside them against the schemas again), and each system's environment, given exactly as it sets
it, gives every pod the right node rank with no topology flags."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from conftest import free_port, script   # noqa: E402
from k8s_crds import MODELS   # noqa: E402

from hyperpodrun.cli import _env_sources, launch   # noqa: E402
from hyperpodrun.errors import ConfigError   # noqa: E402
from hyperpodrun.launch.config import LaunchConfig   # noqa: E402
from hyperpodrun.launch.flags import build_config   # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "kubernetes"
MANIFESTS = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
K8S_VERSION = kubernetes_validate.latest_version()


def _docs(name: str) -> list[dict[str, Any]]:
    with open(EXAMPLES / name) as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def _core(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _as_job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": spec}


def _as_pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod spec in a manifest document (for the checks every pod of the job must pass)."""
    spec = doc.get("spec", {})
    kind = doc["kind"]
    if kind == "Job":
        return [spec["template"]["spec"]]
    if kind == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in spec["replicatedJobs"]]
    if kind == "TrainingRuntime":
        return [r["template"]["spec"]["template"]["spec"] for r in spec["template"]["spec"]["replicatedJobs"]]
    if kind == "PyTorchJob":
        return [r["template"]["spec"] for r in spec["pytorchReplicaSpecs"].values()]
    return []


def test_there_is_a_manifest_for_each_system():
    assert set(MANIFESTS) == {"indexed-job.yaml", "jobset.yaml", "pytorchjob.yaml", "trainjob.yaml"}


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_document_validates(name):
    """Core kinds against the schemas (strict: unknown fields fail); custom resources against their models, and
    the Job specs and pod templates inside them against the schemas."""
    kinds = []
    for doc in _docs(name):
        kinds.append(doc["kind"])
        model = MODELS.get(doc["kind"])
        if model is None:
            _core(doc)
            continue
        model.model_validate(doc)
        spec = doc["spec"]
        if doc["kind"] == "JobSet":
            for rj in spec["replicatedJobs"]:
                _core(_as_job(rj["name"], rj["template"]["spec"]))
        elif doc["kind"] == "TrainingRuntime":
            for rj in spec["template"]["spec"]["replicatedJobs"]:
                _core(_as_job(rj["name"], rj["template"]["spec"]))
        elif doc["kind"] == "PyTorchJob":
            for role, rs in spec["pytorchReplicaSpecs"].items():
                _core(_as_pod_template(role.lower(), rs["template"]))
    assert {"ServiceAccount", "Role", "RoleBinding"} <= set(kinds), f"{name}: the reporter's RBAC is missing"


def test_a_misspelt_field_is_caught():
    """The checks can fail: an unknown field in a pod spec (schema) and in a JobSet (model)."""
    job = next(d for d in _docs("indexed-job.yaml") if d["kind"] == "Job")
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        _core(job)
    jobset = next(d for d in _docs("jobset.yaml") if d["kind"] == "JobSet")
    jobset["spec"]["network"]["publishNotReady"] = True
    with pytest.raises(Exception, match="publishNotReady"):
        MODELS["JobSet"].model_validate(jobset)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_has_what_a_recovery_needs(name):
    """/dev/shm in memory with a size limit, a grace period above --shutdown-timeout, short tolerations of
    unreachable nodes, probes, the metrics port scraped, the service account of the RBAC, the pod's identity."""
    docs = _docs(name)
    pods = [p for d in docs for p in _pod_specs(d)]
    assert pods
    for pod in pods:
        (train,) = [c for c in pod["containers"]]
        args = train["args"]
        shutdown = float(args[args.index("--shutdown-timeout") + 1])
        assert pod["terminationGracePeriodSeconds"] > shutdown
        assert "--k8s-report" in args and args[args.index("--metrics-port") + 1] == "9400"
        assert args[args.index("--metrics-host") + 1] == "0.0.0.0"   # the kubelet's probes come to the pod's IP
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in train["volumeMounts"]
        tol = {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]}
        assert tol["node.kubernetes.io/unreachable"] <= 30
        assert train["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert train["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert pod["serviceAccountName"] == "hyperpodrun"
        fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in train["env"] if "valueFrom" in e}
        assert fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace",
                          "POD_UID": "metadata.uid"}
    role = next(d for d in docs if d["kind"] == "Role")
    assert {(r["resources"][0], tuple(r["verbs"])) for r in role["rules"]} == {("pods", ("get", "patch")),
                                                                              ("events", ("create",))}
    for doc in docs:
        if doc["kind"] == "Service" and doc["spec"].get("clusterIP") == "None":
            assert doc["spec"]["publishNotReadyAddresses"] is True


def test_the_jobset_runs_a_coordinator_that_is_never_doubled():
    docs = _docs("jobset.yaml")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"} and dep["spec"]["replicas"] == 1
    assert any(d["kind"] == "Service" and d["metadata"]["name"] == "hpr-coordinator" for d in docs)
    rj = next(d for d in docs if d["kind"] == "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]
    env = _literal_env(rj["template"]["spec"]["containers"][0])
    assert rj["completionMode"] == "Indexed" and rj["parallelism"] == int(env["PET_NNODES"]) + 1   # a hot spare


# ------------------------------------------------------------------------------------------ node ranks
def _literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _container(name: str, kind: str) -> dict[str, Any]:
    doc = next(d for d in _docs(name) if d["kind"] == kind)
    return _pod_specs(doc)[0]["containers"][0]


def _config(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: Optional[list[str]] = None
            ) -> LaunchConfig:
    """What `hyperpodrun [ARGV] train.py` hands to the agent in a pod with exactly `env`'s topology variables."""
    for key in list(os.environ):
        if key.startswith(("PET_", "HYPERPODRUN_")) or key in ("JOB_COMPLETION_INDEX", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    train = tmp_path / "train.py"
    train.write_text("pass\n")
    with launch.make_context("hyperpodrun", [*(argv or []), str(train)]) as ctx:
        opts = dict(ctx.params)
        entry, args = opts.pop("training_script"), opts.pop("training_script_args")
        return build_config(opts, entry, args, _env_sources(ctx))


def test_jobset_pods_meet_at_the_coordinator(monkeypatch, tmp_path):
    """JobSet: every pod (the spare's index 2 included) goes to the c10d rendezvous at the coordinator's
    Service; node ranks come from the join order, not from JOB_COMPLETION_INDEX."""
    env = _literal_env(_container("jobset.yaml", "JobSet"))
    for index in range(3):
        cfg = _config({**env, "JOB_COMPLETION_INDEX": str(index)}, monkeypatch, tmp_path)
        assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port, cfg.rdzv_id) == ("c10d", "hpr-coordinator", 29400,
                                                                                 "hpr-train")
        assert cfg.node_rank is None and cfg.nnodes == 2 and cfg.nproc_per_node == 8


def test_trainjob_pods_take_the_node_rank_the_trainer_sets(monkeypatch, tmp_path):
    """Kubeflow Trainer v2.0's torch plugin, as it sets a TrainJob's pods: PET_NODE_RANK from the completion index,
    node 0's pod as master."""
    for index in range(2):
        trainer = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": str(index),
                   "PET_MASTER_ADDR": "hpr-trainjob-node-0-0.hpr-trainjob", "PET_MASTER_PORT": "29400",
                   "JOB_COMPLETION_INDEX": str(index)}
        cfg = _config(trainer, monkeypatch, tmp_path)
        assert (cfg.node_rank, cfg.nnodes, cfg.nproc_per_node, cfg.rdzv_backend) == (index, 2, 8, "static")
        assert (cfg.master_addr, cfg.rdzv_port) == ("hpr-trainjob-node-0-0.hpr-trainjob", 29400)


def test_job_completion_index_is_the_node_rank_only_where_none_is_given(monkeypatch, tmp_path):
    base = {"PET_NNODES": "2", "PET_MASTER_ADDR": "a", "PET_MASTER_PORT": "29500"}
    assert _config({**base, "JOB_COMPLETION_INDEX": "1"}, monkeypatch, tmp_path).node_rank == 1
    assert _config({**base, "JOB_COMPLETION_INDEX": "1", "PET_NODE_RANK": "0"}, monkeypatch, tmp_path).node_rank == 0
    assert _config({**base, "JOB_COMPLETION_INDEX": "1"}, monkeypatch, tmp_path, ["--node-rank", "0"]).node_rank == 0
    assert _config({"JOB_COMPLETION_INDEX": "3"}, monkeypatch, tmp_path).node_rank == 0   # one node
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=2 is not a node rank of --nnodes 2"):
        _config({**base, "JOB_COMPLETION_INDEX": "2"}, monkeypatch, tmp_path)


def _run_pods(launcher, tmp_path: Path, pods: list[dict[str, str]], flags: list[str]) -> dict[int, dict[str, str]]:
    """One agent per pod, each with that pod's environment and `flags`, all of them the same command; every
    worker's environment by global rank."""
    out = tmp_path / "env"
    out.mkdir()
    procs = [launcher.start([*flags, script("dump_env.py"), out], env=env) for env in pods]
    for proc in procs:
        res = proc.wait(90)
        assert res.rc == 0, res
    return {int(p.name[4:-5]): json.loads(p.read_text()) for p in out.glob("env_*.json")}


def test_indexed_job_pods_take_their_index(launcher, tmp_path):
    """A plain Indexed Job: the manifest's environment plus the JOB_COMPLETION_INDEX Kubernetes sets; the same
    command on both pods (here with one worker each, and node 0's address on loopback)."""
    env = _literal_env(_container("indexed-job.yaml", "Job"))
    flags = ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    envs = _run_pods(launcher, tmp_path, [{**env, "JOB_COMPLETION_INDEX": str(i)} for i in range(2)], flags)
    assert sorted(envs) == [0, 1]
    for rank, wenv in envs.items():
        assert (wenv["GROUP_RANK"], wenv["WORLD_SIZE"], wenv["RANK"]) == (str(rank), "2", str(rank))


def test_pytorchjob_pods_get_their_node_rank_and_not_the_operators_rank(launcher, tmp_path):
    """A PyTorchJob's pods with the variables the Training Operator v1.9 sets (PET_* and, per pod, RANK = the
    node's index and WORLD_SIZE = nodes x nprocPerNode, MASTER_ADDR/PORT of the master's Service): node ranks from
    PET_NODE_RANK, and each worker's RANK/WORLD_SIZE/MASTER_* are its own, not the pod's."""
    nproc, nnodes, port = 2, 2, free_port()
    pods = []
    for index in range(nnodes):
        pods.append({"MASTER_ADDR": "hpr-pytorchjob-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "127.0.0.1",
                     "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nnodes * 8), "RANK": str(index),
                     "PET_NNODES": str(nnodes), "PET_NODE_RANK": str(index), "PET_NPROC_PER_NODE": "8",
                     "PYTHONUNBUFFERED": "1"})
    envs = _run_pods(launcher, tmp_path, pods, ["--nproc-per-node", str(nproc)])
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, wenv in envs.items():
        assert (wenv["RANK"], wenv["WORLD_SIZE"], wenv["GROUP_RANK"]) == (str(rank), "4", str(rank // nproc))
        assert wenv["MASTER_ADDR"] != "hpr-pytorchjob-master-0" and wenv["MASTER_PORT"] != "23456"
