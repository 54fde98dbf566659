# Shared bootstrap of scripts/test.sh and scripts/demo.sh (sourced, not run): make or reuse a virtual
# environment, install torch when it is missing, install the project (editable) with its test extra, and put
# the environment's bin/ first on PATH. Afterwards the current directory is the repository root and $VENV
# names the environment. Settings: HYPERPODRUN_VENV (default .venv), PYTHON (default python3).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
case "$VENV" in
  /*) export PATH="$VENV/bin:$PATH" ;;
  *) export PATH="$PWD/$VENV/bin:$PATH" ;;
esac
