"""The house rules of the code layout (docs/ARCHITECTURE.md, "Layout"): every package says in its docstring what
it owns and what it may import, no package folder holds more than 15 modules, no module is over 450 lines, and
no module imports one that imports it back. Why a test: the next capabilities (a coordinator, an etcd backend,
metrics, new state tiers) are to land in the right rooms, and a warehouse or a circle grows one import at a time."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULES = 15
MAX_LINES = 450


def _packages() -> dict[str, Path]:
    """Dotted package name -> its folder, for hyperpodrun/ and agent/ (installed as hyperpodrun.agent)."""
    found = {}
    for top, name in (("hyperpodrun", "hyperpodrun"), ("agent", "hyperpodrun.agent")):
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / top).parts
            found[".".join((name, *rel))] = init.parent
    return found


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in _packages().items():
        mods[pkg] = folder / "__init__.py"
        for path in folder.glob("*.py"):
            if path.name != "__init__.py":
                mods[f"{pkg}.{path.stem}"] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in it, at the top or inside a function)."""
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                targets.update(subs if len(subs) == len(node.names) else subs | {node.module})
        edges[name] = {t for t in targets if t in mods and t != name}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_every_package_says_what_it_owns_and_what_it_may_import() -> None:
    silent = [pkg for pkg, folder in _packages().items()
              if len(ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or "") < 80]
    assert not silent, f"give these packages an __init__ docstring (what they own, what they may import): {silent}"


def test_no_package_folder_is_a_warehouse() -> None:
    crowded = {pkg: n for pkg, folder in _packages().items()
               if (n := sum(1 for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")))
               > MAX_MODULES}
    assert not crowded, f"more than {MAX_MODULES} modules in one package; split it by capability: {crowded}"


def test_no_module_is_over_the_size_of_one_idea() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines; split them by responsibility: {long}"


def test_no_import_circle() -> None:
    circles = _circles(_imports(_modules()))
    assert not circles, f"modules that import each other (directly or around a circle): {circles}"


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
