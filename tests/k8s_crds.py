"""Models of the custom resources examples/kubernetes/ uses, for checking the manifests offline: only the fields the
manifests set, unknown keys rejected (extra="forbid"), so a misspelt or misplaced field fails the test. The core
objects inside them (a Job's spec, a pod template) are checked against the Kubernetes schemas themselves
(tests/test_kubernetes.py wraps them as batch/v1 Job and v1 PodTemplate for kubernetes-validate --strict).

Pinned to these CRD versions (field names and enums from their Go types):
- JobSet v0.8: jobset.x-k8s.io/v1alpha2 JobSet (api/jobset/v1alpha2/jobset_types.go)
- Kubeflow Training Operator v1.9: kubeflow.org/v1 PyTorchJob (pkg/apis/kubeflow.org/v1/pytorch_types.go,
  common_types.go)
- Kubeflow Trainer v2.0: trainer.kubeflow.org/v1alpha1 TrainingRuntime and TrainJob
  (pkg/apis/trainer/v1alpha1/trainingruntime_types.go, trainjob_types.go)
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Meta(Strict):
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class TemplateMeta(Strict):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


# ------------------------------------------------------------------------------------------ JobSet v1alpha2
class Network(Strict):
    enableDNSHostnames: Optional[bool] = None
    subdomain: Optional[str] = None
    publishNotReadyAddresses: Optional[bool] = None


class FailurePolicy(Strict):
    maxRestarts: int = Field(ge=0)


class SuccessPolicy(Strict):
    operator: Literal["All", "Any"]
    targetReplicatedJobs: list[str] = Field(default_factory=list)


class JobTemplate(Strict):
    metadata: Optional[TemplateMeta] = None
    spec: dict[str, Any]          # a batch/v1 JobSpec: checked against the Kubernetes schema


class ReplicatedJob(Strict):
    name: str
    replicas: int = Field(1, ge=1)
    template: JobTemplate


class JobSetSpec(Strict):
    network: Optional[Network] = None
    failurePolicy: Optional[FailurePolicy] = None
    successPolicy: Optional[SuccessPolicy] = None
    replicatedJobs: list[ReplicatedJob] = Field(min_length=1)


class JobSet(Strict):
    apiVersion: Literal["jobset.x-k8s.io/v1alpha2"]
    kind: Literal["JobSet"]
    metadata: Meta
    spec: JobSetSpec


# ------------------------------------------------------------------------------------------ PyTorchJob v1
class RunPolicy(Strict):
    backoffLimit: Optional[int] = Field(None, ge=0)
    cleanPodPolicy: Optional[Literal["None", "Running", "All"]] = None


class ReplicaSpec(Strict):
    replicas: int = Field(ge=1)
    restartPolicy: Literal["Always", "OnFailure", "Never", "ExitCode"]
    template: dict[str, Any]      # a v1 PodTemplateSpec: checked against the Kubernetes schema


class PyTorchJobSpec(Strict):
    nprocPerNode: Optional[str] = None
    runPolicy: Optional[RunPolicy] = None
    pytorchReplicaSpecs: dict[Literal["Master", "Worker"], ReplicaSpec]


class PyTorchJob(Strict):
    apiVersion: Literal["kubeflow.org/v1"]
    kind: Literal["PyTorchJob"]
    metadata: Meta
    spec: PyTorchJobSpec


# ------------------------------------------------------------------------------------------ Trainer v1alpha1
class TorchPolicy(Strict):
    numProcPerNode: Union[int, str]


class MLPolicy(Strict):
    numNodes: int = Field(ge=1)
    torch: TorchPolicy


class JobSetTemplate(Strict):
    metadata: Optional[TemplateMeta] = None
    spec: JobSetSpec


class TrainingRuntimeSpec(Strict):
    mlPolicy: MLPolicy
    template: JobSetTemplate


class TrainingRuntime(Strict):
    apiVersion: Literal["trainer.kubeflow.org/v1alpha1"]
    kind: Literal["TrainingRuntime"]
    metadata: Meta
    spec: TrainingRuntimeSpec


class RuntimeRef(Strict):
    name: str
    kind: Literal["TrainingRuntime", "ClusterTrainingRuntime"]
    apiGroup: Literal["trainer.kubeflow.org"]


class Trainer(Strict):
    numNodes: int = Field(ge=1)
    numProcPerNode: Union[int, str]


class TrainJobSpec(Strict):
    runtimeRef: RuntimeRef
    trainer: Trainer


class TrainJob(Strict):
    apiVersion: Literal["trainer.kubeflow.org/v1alpha1"]
    kind: Literal["TrainJob"]
    metadata: Meta
    spec: TrainJobSpec


MODELS: dict[str, type[Strict]] = {"JobSet": JobSet, "PyTorchJob": PyTorchJob, "TrainingRuntime": TrainingRuntime,
                                   "TrainJob": TrainJob}
