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
# The oldest transformers the Hugging Face callback supports, beside the newest the test extra installs, for
# tests/test_hf_trainer.py (its workers put this directory first on PYTHONPATH). Only what differs from the
# environment's own packages goes there.
if [ ! -d "$VENV/oldest-transformers/transformers-5.17.0.dist-info" ]; then
  rm -rf "$VENV/oldest-transformers"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/oldest-transformers" "transformers==5.17.0" \
    "huggingface-hub>=1.5,<2" httpx httpcore h11 anyio certifi
fi
case "$VENV" in
  /*) export PATH="$VENV/bin:$PATH" ;;
  *) export PATH="$PWD/$VENV/bin:$PATH" ;;
esac
