"""Run at the start of each of the agent's workers (its folder is first on their PYTHONPATH): arrange the roll
call in torch's `init_process_group` (hyperpodrun/runtime/group_hook.py; nothing heavy is imported), then run
the `sitecustomize` this one shadows, if there is one, as Python would have."""
import importlib.machinery
import importlib.util
import os
import sys


def _arrange() -> None:
    try:
        from hyperpodrun.runtime import group_hook
        group_hook.install()
    except Exception as exc:   # hyperpodrun not importable here (e.g. another interpreter): say so, go on
        sys.stderr.write(f"hyperpodrun: the roll call is not arranged in this process ({exc})\n")


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_arrange()
_chain()
