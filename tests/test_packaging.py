"""The distribution installs the agent as hyperpodrun.agent: nothing named `agent` lands in site-packages, and a
user's own agent.py / agent/ (common in RL code) cannot shadow it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HYPERPODRUN, Launcher

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_has_no_top_level_agent_package(tmp_path: Path) -> None:
    target = tmp_path / "site"
    src = tmp_path / "src"   # build from a copy: the build leaves build/ and *.egg-info next to its sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "hyperpodrun_logs", ".whl", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top = sorted(p.name for p in target.iterdir())
    assert "agent" not in top and "agent.py" not in top, top
    assert (target / "hyperpodrun" / "agent" / "agent.py").is_file(), top
    assert (target / "hyperpodrun" / "agent" / "workers" / "zygote.py").is_file()
    # every package of the source tree is in the distribution (pyproject lists them one by one)
    ours = {p.parent.relative_to(ROOT / "hyperpodrun") for p in (ROOT / "hyperpodrun").rglob("__init__.py")}
    ours |= {Path("agent") / p.parent.relative_to(ROOT / "agent") for p in (ROOT / "agent").rglob("__init__.py")}
    installed = {p.parent.relative_to(target / "hyperpodrun") for p in (target / "hyperpodrun").rglob("__init__.py")}
    assert ours <= installed, f"packages missing from the distribution (pyproject.toml, packages): {ours - installed}"
    # the installed copy imports on its own (not through the checkout)
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", "import hyperpodrun.agent.agent as a; print(a.__file__)"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target)), out.stdout


def test_user_agent_module_does_not_shadow_ours(tmp_path: Path, launcher: Launcher) -> None:
    """`python -m hyperpodrun` and the console script, run from a training directory with its own agent.py and
    agent/ package, launch a real job."""
    (tmp_path / "agent.py").write_text("raise SystemExit('the user agent.py was imported by hyperpodrun')\n")
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "__init__.py").write_text("raise SystemExit('the user agent/ was imported')\n")
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'ok')\n")
    for argv in ([sys.executable, "-m", "hyperpodrun"], [HYPERPODRUN]):
        res = launcher.run(["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "train.py"],
                           cmd=argv, cwd=tmp_path, timeout=120)
        assert res.rc == 0, res
        assert "rank 0" in res.out and "ok" in res.out and res.out.count(" ok") >= 2, res
