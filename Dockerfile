# hyperpodrun on a PyTorch base image. Build and run (GPU node; on CPU drop --gpus):
#   docker build -t hyperpodrun .
#   docker run --rm --gpus all --shm-size=16g -v "$PWD:/workspace" hyperpodrun --nproc-per-node 8 train.py
# The entrypoint execs hyperpodrun, so it is PID 1 and receives `docker stop`'s SIGTERM.
# Docker gives a container only 64 MB of /dev/shm unless --shm-size says otherwise (README, "Containers").
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

WORKDIR /opt/hyperpodrun
COPY pyproject.toml README.md ./
COPY hyperpodrun ./hyperpodrun
COPY agent ./agent
# torch comes with the base image (the project needs torch>=2.4); pip adds the other dependencies, and the
# clients of --k8s-report and --metrics-port that the manifests in examples/kubernetes/ use.
RUN python -m pip install --no-cache-dir ".[k8s,metrics]" && python -c "import torch, hyperpodrun; print(torch.__version__)"
COPY examples ./examples
COPY scripts/entrypoint.sh /usr/local/bin/hyperpodrun-entrypoint
RUN chmod 0755 /usr/local/bin/hyperpodrun-entrypoint

WORKDIR /workspace
ENTRYPOINT ["/usr/local/bin/hyperpodrun-entrypoint"]
CMD ["--help"]
