#!/usr/bin/env bash
# Make or reuse a virtual environment, install torch (CPU build) when missing, install the project with its
# test extra, run the tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HYPERPODRUN_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install -q -e ".[test]"
export PATH="$PWD/$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest "$@"
