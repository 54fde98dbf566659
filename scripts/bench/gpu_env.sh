# The GPU machine set-up, sourced by scripts/bench/gpu.sh for every sequence (or by hand before running a
# Python benchmark directly), from the repository root: puts this checkout (as installed) and the wheels in ./.whl
# (pyzmq, pydantic, nvidia-resiliency-ext: what the machine lacks) on PYTHONPATH, a `hyperpodrun` command on PATH,
# sets NCCL_NVLS_ENABLE=0, and records the machine in $OUT/machine.txt (OUT: gpu.sh names it; by hand, bench-out).
OUT="${OUT:-bench-out}"
mkdir -p "$OUT" /tmp/bin
# hyperpodrun as it is installed (agent/ is the package hyperpodrun.agent): a tree of links to this checkout
rm -rf /tmp/hpr-src && mkdir -p /tmp/hpr-src/hyperpodrun
for entry in "$PWD"/hyperpodrun/*; do ln -s "$entry" /tmp/hpr-src/hyperpodrun/; done
ln -s "$PWD/agent" /tmp/hpr-src/hyperpodrun/agent
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:/tmp/hpr-src${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="/tmp/hpr-src${PYTHONPATH:+:$PYTHONPATH}"
fi
printf '#!/bin/sh\nexec %s -P -m hyperpodrun "$@"\n' "$(command -v python3)" > /tmp/bin/hyperpodrun
chmod +x /tmp/bin/hyperpodrun
export PATH="/tmp/bin:$PATH" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  lscpu | grep 'Model name'; df -h /dev/shm | tail -1; free -g | head -2; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
