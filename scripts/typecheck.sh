#!/usr/bin/env bash
# Type-check hyperpodrun and its agent with mypy (configured in pyproject.toml) as they are installed: the agent
# folder agent/ is the package hyperpodrun.agent, which mypy cannot see through the editable install's import
# hook. So mypy runs on a tree of links that has agent/ in its installed place, and every
# `hyperpodrun.agent.*` import is checked for real. Usage: scripts/typecheck.sh [PYTHON]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-python3}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT
mkdir "$TREE/hyperpodrun"
for entry in "$ROOT"/hyperpodrun/*; do
  case "$(basename "$entry")" in __pycache__) continue ;; esac
  ln -s "$entry" "$TREE/hyperpodrun/"
done
ln -s "$ROOT/agent" "$TREE/hyperpodrun/agent"
cd "$TREE"
"$PY" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" -p hyperpodrun
