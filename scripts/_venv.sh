# Shared bootstrap of scripts/test.sh and scripts/demo.sh (sourced, not run): make or reuse a virtual
# environment, install torch==2.13.0 when torch is missing from it, install the project (editable) with its
# test extra, and put the environment's bin/ first on PATH. Afterwards the current directory is the
# repository root and $VENV names the environment. Settings: HYPERPODRUN_VENV (default .venv), PYTHON (the
# interpreter that creates it, default python3).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${HYPERPODRUN_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  _hpr_new=0
  [ -e "$VENV" ] || _hpr_new=1
  if ! "$PY" -m venv "$VENV"; then
    # Debian and Ubuntu ship python3 without its venv module (package python3-venv): fall back to
    # virtualenv from PyPI, installed into a throw-away directory (not into the system's Python).
    echo "scripts/_venv.sh: '$PY -m venv' failed; creating $VENV with virtualenv instead" >&2
    if [ "$_hpr_new" = 1 ]; then rm -rf "$VENV"; fi   # only what the failed attempt just created
    _hpr_tmp="$(mktemp -d)"
    "$PY" -m pip install -q --target "$_hpr_tmp" virtualenv
    PYTHONPATH="$_hpr_tmp" "$PY" -m virtualenv -q "$VENV"
    rm -rf "$_hpr_tmp"
    unset _hpr_tmp
  fi
  unset _hpr_new
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
