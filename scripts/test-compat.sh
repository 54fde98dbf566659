#!/usr/bin/env bash
# The compatibility run: the launcher contract, in-process restart and exact-recovery tests on another torch than
# the 2.13.0 of scripts/test.sh. Usage: scripts/test-compat.sh TORCH_VERSION [PYTEST ARGUMENTS...]
#   scripts/test-compat.sh 2.15.0                 # the tests below on torch 2.15.0
#   scripts/test-compat.sh 2.15.0 -x -k parser    # arguments after the version go to pytest
# It makes (or reuses) its own virtual environment outside the repository - $HYPERPODRUN_COMPAT_VENV, default
# ${TMPDIR:-/tmp}/hyperpodrun-torch-VERSION - installs torch==VERSION there (from the configured package sources,
# else from the public index with the pip configuration bypassed, for a version the configured sources lack;
# the CUDA build is ~5 GB and runs on CPU), installs this project with its test extra (editable), and runs
# pytest on the files below. Nothing NCCL runs here: no GPU (see docs/compatibility.md).
set -euo pipefail
VERSION="${1:-}"
if [ -z "$VERSION" ] || [[ "$VERSION" == -* ]]; then
  echo "usage: scripts/test-compat.sh TORCH_VERSION [PYTEST ARGUMENTS...]   (e.g. scripts/test-compat.sh 2.15.0)" >&2
  exit 2
fi
shift
cd "$(dirname "$0")/.."
VENV="${HYPERPODRUN_COMPAT_VENV:-${TMPDIR:-/tmp}/hyperpodrun-torch-$VERSION}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Every install below keeps torch at VERSION: a pip configuration's own constraints (one that caps torch at the
# versions a machine has offline, say) would otherwise move it while installing the test extra's packages.
PIN="$(mktemp)"
trap 'rm -f "$PIN"' EXIT
echo "torch==$VERSION" > "$PIN"
export PIP_CONSTRAINT="$PIN"
have="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ "$have" != "$VERSION" ]; then
  echo "scripts/test-compat.sh: installing torch==$VERSION into $VENV" >&2
  if ! "$VENV/bin/python" -m pip install -q "torch==$VERSION" 2>/dev/null; then
    PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q "torch==$VERSION"
  fi
fi
if ! "$VENV/bin/python" -m pip install -q -e ".[test]" 2>/dev/null; then
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q -e ".[test]"
fi
TESTS=(
  # the launcher contract: torchrun's flag table (every spelling), the worker environment, the options of issue 34
  tests/unit/test_torchrun_parser.py tests/test_launcher_env.py tests/test_torchrun_flags.py
  tests/unit/test_virtual_local_rank.py tests/unit/test_print_completion.py
  # what the runtime does to torch.distributed's internals (gloo, and the nccl-legacy/nccl2 dispatch)
  tests/unit/test_pg_kind.py tests/unit/test_abort_registry.py
  # in-process restart with real processes, and recovery bitwise equal to a fault-free run
  tests/test_inprocess_faults.py "tests/test_checkpoint.py::test_recovered_run_is_bitwise_equal"
  tests/test_live_restore.py
)
echo "scripts/test-compat.sh: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)," \
     "python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')" >&2
case "$VENV" in
  /*) export PATH="$VENV/bin:$PATH" ;;
  *) export PATH="$PWD/$VENV/bin:$PATH" ;;
esac
"$VENV/bin/python" -m pytest -p no:cacheprovider "${TESTS[@]}" "$@"
