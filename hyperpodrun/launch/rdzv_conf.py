"""`--rdzv-conf KEY=VALUE,...` and the etcd backend's `--rdzv-endpoint h1:2379,h2:2379,...`, as torchrun spells them.

Why a module of its own: the launch configuration (hyperpodrun/launch/config.py) is at its size limit, and the
etcd backend brings a list of endpoints and TLS settings of its own; the parsing of --rdzv-conf lives here
whole, so every key it takes is in one place:

- join_timeout (torchrun's `timeout` too), last_call_timeout, coordinator_timeout: seconds (config.py's fields);
- with `--rdzv-backend etcd`: protocol (http or https), cacert, cert, key - torchrun's etcd keys: the CA that
  signs the etcd members' certificates, and this agent's client certificate and its key (docs/security.md).

A problem is a ConfigError with one line naming the flag and the fix (the CLI prints it and exits 2).
"""
from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from hyperpodrun.errors import ConfigError
from hyperpodrun.launch.flag_syntax import parse_endpoint

#: the port of an etcd endpoint given without one (etcd's client port)
ETCD_PORT = 2379
#: the --rdzv-conf keys of the etcd backend (torchrun's)
ETCD_KEYS = ("protocol", "cacert", "cert", "key")


class EtcdConf(BaseModel):
    """Where the etcd cluster is and how to talk to it: the members' client endpoints, tried in turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoints: list[tuple[str, int]]
    protocol: Literal["http", "https"] = "http"
    cacert: Optional[str] = None     # the CA that signed the members' certificates (https)
    cert: Optional[str] = None       # this agent's client certificate (https with client authentication)
    key: Optional[str] = None        # its private key

    def where(self) -> str:
        """The endpoints as given, for messages."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


def seconds(conf: dict[str, str], key: str, default: float, *, zero_ok: bool, most: float) -> float:
    """`--rdzv-conf KEY=SECONDS`, bounded: last_call_timeout (how long an elastic job that has MIN nodes waits
    for more: torchrun's meaning; 0 allowed) and coordinator_timeout (how long the agents keep trying a
    coordination store that went away - a standalone coordinator, or every etcd member - while training goes
    on, before the job ends)."""
    text = conf.get(key)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 <= value if zero_ok else 0 < value) or not value <= most:   # nan and inf fail here too
        lowest = "0" if zero_ok else "more than 0"
        raise ConfigError(f"--rdzv-conf {key}={text}: must be seconds from {lowest} to {most:g} "
                          f"(e.g. --rdzv-conf {key}={default:g})")
    return value


def join_timeout(conf: dict[str, str], default: float, most: float, accepts: str) -> float:
    """`--rdzv-conf join_timeout=S` (or torchrun's `timeout=S`), bounded."""
    key = "join_timeout" if "join_timeout" in conf else "timeout"
    try:
        value = float(conf.get(key, default))
    except ValueError:
        value = float("nan")
    if not 0 < value <= most:   # nan and inf fail here too
        raise ConfigError(f"--rdzv-conf {key}={conf[key]}: must be {accepts} (e.g. --rdzv-conf join_timeout=900)")
    return value


def etcd_conf(endpoint: str, conf: dict[str, str]) -> EtcdConf:
    """`--rdzv-endpoint h1:2379,h2:2379 --rdzv-conf protocol=https,cacert=..,cert=..,key=..` -> EtcdConf.

    The files must be readable now (a typo is exit 2 here, not a job that cannot reach etcd), and etcd3gw
    must be installed (the optional extra `hyperpodrun[etcd]`)."""
    if not endpoint:
        raise ConfigError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (the etcd members' "
                          f"client addresses, port {ETCD_PORT} by default)")
    endpoints = [parse_endpoint(e, default_port=ETCD_PORT) for e in endpoint.split(",") if e.strip()]
    if not endpoints or any(p == 0 for _, p in endpoints):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: give each etcd member as HOST:PORT with a port that is "
                          f"not 0 (e.g. 10.0.0.1:{ETCD_PORT},10.0.0.2:{ETCD_PORT})")
    protocol = conf.get("protocol", "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol={conf['protocol']}: must be http or https")
    files: dict[str, Optional[str]] = {}
    for key in ("cacert", "cert", "key"):
        path = conf.get(key) or None
        if path is not None:
            if protocol != "https":
                raise ConfigError(f"--rdzv-conf {key}={path} needs protocol=https (TLS); add it to --rdzv-conf")
            if not os.access(path, os.R_OK) or not os.path.isfile(path):
                raise ConfigError(f"--rdzv-conf {key}={path}: not a readable file")
        files[key] = path
    if (files["cert"] is None) != (files["key"] is None):
        raise ConfigError("--rdzv-conf cert and key go together (the client certificate and its private key)")
    require_etcd3gw()
    return EtcdConf.model_validate({"endpoints": endpoints, "protocol": protocol, **files})


def require_etcd3gw() -> None:
    """The etcd backend's client library, or one line saying how to install it."""
    try:
        import etcd3gw  # noqa: F401  (the HTTP gateway client: agent/coordination/etcd_store.py)
    except ImportError:
        raise ConfigError("--rdzv-backend etcd needs the etcd3gw package: pip install 'hyperpodrun[etcd]'") from None


def refuse_etcd_keys(backend: str, conf: dict[str, str]) -> None:
    """The etcd keys of --rdzv-conf with another backend: a mistake, said plainly rather than ignored."""
    given = [k for k in ETCD_KEYS if k in conf]
    if given and backend != "etcd":
        raise ConfigError(f"--rdzv-conf {','.join(given)}: only for --rdzv-backend etcd (TLS to the etcd members); "
                          "drop them or use --rdzv-backend etcd")
