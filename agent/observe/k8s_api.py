"""The Kubernetes API as `--k8s-report` uses it: where the client's configuration comes from, which pod this
agent runs in, and the two calls it makes (patch the pod's annotations, create a core/v1 Event about it).

Why a module of its own: the reporter (agent/observe/k8s_report.py) must be testable against any API server,
so it takes a `PodApi` and never loads a configuration itself; and the launch must fail at start, with one line,
when the client is not installed or the agent is not in a pod - not hours later inside a helper thread
(`preflight`, called by the CLI). The configuration is chosen the way Kubernetes' own tools choose it: in a pod
(KUBERNETES_SERVICE_HOST set, the service account's token mounted) the in-cluster one, else the kubeconfig file
KUBECONFIG names. Every call has short timeouts and no retries: a slow API server costs the reporter's thread
one timeout per call, nothing else.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from hyperpodrun.errors import ConfigError

log = logging.getLogger("hyperpodrun.agent")

#: where Kubernetes mounts the pod's service account (token, CA, namespace)
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: seconds to connect to the API server, and to wait for its answer, per call
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 5.0
#: Kubernetes keeps an Event's message to about 1 KiB
MAX_MESSAGE = 1024
#: the Event's source and reporting component
COMPONENT = "hyperpodrun"

FIX_INSTALL = "--k8s-report needs the Kubernetes client: pip install 'hyperpodrun[k8s]' (or drop --k8s-report)"


@dataclass(frozen=True)
class PodRef:
    """The pod this agent runs in: from the downward API (POD_NAME, POD_NAMESPACE, POD_UID; the manifests in
    examples/kubernetes/ set them), else the pod's hostname and the service account's namespace."""

    name: str
    namespace: str
    uid: Optional[str] = None


def pod_ref(environ: Optional[Mapping[str, str]] = None) -> PodRef:
    """This pod's name and namespace; ConfigError when neither the downward API nor the hostname tells."""
    env = os.environ if environ is None else environ
    name = env.get("POD_NAME") or env.get("HOSTNAME") or ""
    namespace = env.get("POD_NAMESPACE") or _read(os.path.join(SERVICE_ACCOUNT_DIR, "namespace")) or "default"
    if not name:
        raise ConfigError("--k8s-report cannot tell which pod this is: set POD_NAME from the downward API "
                          "(env: valueFrom: fieldRef: fieldPath: metadata.name), as examples/kubernetes/ does")
    return PodRef(name=name.strip(), namespace=namespace.strip(), uid=(env.get("POD_UID") or None))


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _client_module() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise ConfigError(FIX_INSTALL) from None
    return kubernetes


def load_client(environ: Optional[Mapping[str, str]] = None) -> Any:
    """A `kubernetes.client.ApiClient` configured as Kubernetes' tools are: in a pod (KUBERNETES_SERVICE_HOST)
    from the service account, else from the kubeconfig file KUBECONFIG names; without retries (a call that
    fails is counted and the next report goes on). ConfigError with the fix when neither is there."""
    kubernetes = _client_module()
    env = os.environ if environ is None else environ
    cfg = kubernetes.client.Configuration()
    try:
        if env.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        elif env.get("KUBECONFIG"):
            path = env["KUBECONFIG"].split(os.pathsep)[0]
            kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
        else:
            raise ConfigError("--k8s-report reports to the Kubernetes API from inside a pod, and this is not one "
                              "(KUBERNETES_SERVICE_HOST is not set, nor KUBECONFIG): run it in a pod or drop "
                              "--k8s-report")
    except kubernetes.config.ConfigException as exc:
        raise ConfigError(f"--k8s-report: the Kubernetes client configuration cannot be loaded ({exc}); mount the "
                          "pod's service account token (automountServiceAccountToken: true) or drop "
                          "--k8s-report") from None
    cfg.retries = False
    return kubernetes.client.ApiClient(cfg)


def preflight(environ: Optional[Mapping[str, str]] = None) -> None:
    """What `--k8s-report` needs, checked at launch without a request: the client installed, a configuration
    (in a pod, or KUBECONFIG), the pod's name. ConfigError (exit 2, one line) otherwise."""
    load_client(environ).close()
    pod_ref(environ)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class PodApi:
    """The two calls of the reporter, on one pod: patch its annotations, create an Event about it."""

    def __init__(self, api_client: Any, pod: PodRef, host: str,
                 timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) -> None:
        kubernetes = _client_module()
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.api_client = api_client
        self.pod, self.host, self.timeout = pod, host, timeout

    def annotate(self, annotations: Mapping[str, str]) -> None:
        """Merge `annotations` into the pod's (a strategic-merge patch of metadata.annotations)."""
        self.core.patch_namespaced_pod(self.pod.name, self.pod.namespace, {"metadata": {"annotations": dict(annotations)}},
                                       _request_timeout=self.timeout, _preload_content=False)

    def post_event(self, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event whose involvedObject is the pod: `kubectl describe pod` lists it."""
        now = _now()
        involved = {"apiVersion": "v1", "kind": "Pod", "name": self.pod.name, "namespace": self.pod.namespace}
        if self.pod.uid:
            involved["uid"] = self.pod.uid
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{self.pod.name}.{secrets.token_hex(8)}", "namespace": self.pod.namespace},
                "involvedObject": involved, "type": kind, "reason": reason, "message": message[:MAX_MESSAGE],
                "source": {"component": COMPONENT, "host": self.host}, "reportingComponent": COMPONENT,
                "reportingInstance": self.host, "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        self.core.create_namespaced_event(self.pod.namespace, body, _request_timeout=self.timeout,
                                          _preload_content=False)

    def close(self) -> None:
        self.api_client.close()


#: how a reporter gets its PodApi: the default loads the configuration from the environment (load_client);
#: a caller may give its own (another configuration, another pod)
ApiLoader = Callable[[str], PodApi]


def pod_api_from_environment(host: str) -> PodApi:
    """The PodApi of this pod, configured from the environment (load_client, pod_ref)."""
    return PodApi(load_client(), pod_ref(), host)
