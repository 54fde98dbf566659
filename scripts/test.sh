#!/usr/bin/env bash
# Make or reuse a virtual environment, install torch==2.13.0 when torch is missing, install the project with its
# test extra, type-check it (scripts/typecheck.sh: mypy over hyperpodrun and hyperpodrun.agent), run the tests. A type
# error fails the script before any test runs. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
scripts/typecheck.sh "$VENV/bin/python"
exec "$VENV/bin/python" -m pytest "$@"
