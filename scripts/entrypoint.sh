#!/usr/bin/env bash
# Container entrypoint (the Dockerfile's ENTRYPOINT), after the product note's Tier-1 example:
#   docker run --shm-size=8g IMAGE --nproc-per-node 8 train.py
# All arguments go to hyperpodrun. exec makes hyperpodrun PID 1, so it receives the container's SIGTERM
# (docker stop, pod deletion), forwards it to every worker, SIGKILLs what is left after --shutdown-timeout
# and reaps orphaned processes.
set -euo pipefail

# The product note's Tier-1 switches. Stock PyTorch reads neither; hyperpodrun accepts both and they change
# nothing further: its workers always get an agent-hosted store per restart generation (docs/deployment.md, "Rootless
# bootstrap"). Kept so that scripts written for the note run unchanged.
export HPCT_USE_ROOTLESS="${HPCT_USE_ROOTLESS:-1}"
export TORCH_SKIP_TCPSTORE="${TORCH_SKIP_TCPSTORE:-1}"

# A wide ephemeral port range (many connections at scale), only where the container may set it: needs
# `docker run --sysctl net.ipv4.ip_local_port_range="20000 65535"` or a privileged container; in Kubernetes
# the pod's securityContext.sysctls. Otherwise the range stays as it is.
PORT_RANGE="${HYPERPODRUN_PORT_RANGE:-20000 65535}"
RANGE_FILE=/proc/sys/net/ipv4/ip_local_port_range
if [ -n "$PORT_RANGE" ] && [ -w "$RANGE_FILE" ]; then
  if ! { echo "$PORT_RANGE" > "$RANGE_FILE"; } 2>/dev/null; then
    echo "entrypoint: not permitted to set net.ipv4.ip_local_port_range; keeping the current range" >&2
  fi
fi

exec hyperpodrun "$@"
