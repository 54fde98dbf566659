"""docs/ARCHITECTURE.md's layout is the code's: every module of hyperpodrun/ and agent/ is listed there, and
every module the document names exists."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
LAYOUT = DOC[DOC.index("## 2. Layout"):DOC.index("## 3. Contracts")]


def _modules() -> list[Path]:
    return sorted(p for top in ("hyperpodrun", "agent") for p in (ROOT / top).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def test_every_module_is_in_the_layout() -> None:
    missing = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        # hyperpodrun/*.py, agent/*.py and integrations/ are listed by file name; runtime/ and data/ by module name
        needle = path.name if len(rel.parts) == 2 or rel.parts[1] == "integrations" else path.stem
        if not re.search(rf"(?<![\w.]){re.escape(needle)}(?![\w])", LAYOUT):
            missing.append(str(rel))
    assert not missing, f"add these to docs/ARCHITECTURE.md, section 2 (Layout): {missing}"


def _repo_files() -> set[str]:
    found = set()
    for here, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "hyperpodrun_logs")]
        found |= {os.path.relpath(os.path.join(here, f), ROOT) for f in files if f.endswith(".py")}
    return found


def test_every_module_the_document_names_exists() -> None:
    known = _repo_files()
    named = set(re.findall(r"(?<![\w/.])([\w/]*\w\.py)\b", DOC)) - {"train.py"}   # the user's script (section 1)
    stale = sorted(n for n in named if not any(k == n or k.endswith("/" + n) for k in known))
    assert not stale, f"docs/ARCHITECTURE.md names modules that do not exist: {stale}"
    assert "agent/workers/standby.py" in named and "integrations/transformers.py" in named


def test_a_listed_name_is_found_and_an_unlisted_one_is_not() -> None:
    assert re.search(r"(?<![\w.])standby\.py(?![\w])", LAYOUT)
    assert not re.search(r"(?<![\w.])no_such_module\.py(?![\w])", LAYOUT)
