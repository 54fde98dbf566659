#!/usr/bin/env bash
# Make or reuse a virtual environment, install torch==2.13.0 when torch is missing, install the project with its
# test extra, run the tests. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
exec "$VENV/bin/python" -m pytest "$@"
