"""The warm spawner's process: imports torch once, then forks respawned workers (see warm_spawner.py).

Run by the agent as `python -u zygote.py FD SCRIPT` with FD one end of a SOCK_SEQPACKET socket pair. It
imports the modules of HYPERPODRUN_WARM_IMPORTS (default: torch, torch.distributed, torch._dynamo, the hyperpodrun runtime and
the known-safe packages SCRIPT imports at top level, e.g. lightning), reports `{"ready": true}` (false when an
import opened the GPU driver: a fork could not use CUDA), and then answers each request - JSON {"argv": [script, args...], "env": {...}, "cwd": ...}
with the worker's stdout and stderr descriptors attached - by forking twice: the worker is the grandchild,
re-parented to the agent (a subreaper) when the middle process exits, so the agent waits for it as for any
worker. The worker gets its own session, the request's environment, directory and descriptors, and runs the
script as `python -u script args` would, in a process that has the imports done already. A request
{"standby": true, "local_rank": k} with one descriptor - the standby's own socket - forks a standby instead
(`stand_by`): it makes its GPU's CUDA context and waits on that socket for the rank it becomes; with
"prerun": {argv, env, cwd} (--standby-prerun) it runs the script up to its first HPWrapper call and waits there
instead (`run_ahead`, agent/workers/prerun.py). EOF on the socket (the agent is gone or done) ends this process.
"""
from __future__ import annotations

import ast
import functools
import importlib
import json
import logging
import os
import runpy
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

#: torch._dynamo too: HPWrapper imports it before the first process group (runtime/torch_state.py), and a
#: respawned worker would otherwise spend ~1 s (CPU) to 3.4-3.8 s (H200 host) importing it after the fork
#: hyperpodrun.runtime.control (pyzmq: no context is made at import, so forks stay safe) and checkpoint: what
#: HPWrapper's entry and CheckpointManager load in a rank (8 ms and 28 ms on CPU, before its READY)
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "hyperpodrun.runtime.wrapper",
                   "hyperpodrun.runtime.control", "hyperpodrun.state.checkpoint")

log = logging.getLogger("hyperpodrun.agent")

# Packages whose import is known not to start threads or touch the GPU driver: when the script imports them
# at top level, the zygote imports them too. Anything else only by HYPERPODRUN_WARM_IMPORTS.
KNOWN_SAFE = {"torch", "numpy", "lightning", "pytorch_lightning", "torchvision", "torchaudio", "torchdata",
              "transformers", "tokenizers", "safetensors", "einops", "hyperpodrun"}


def script_imports(script: str) -> list[str]:
    """The modules of KNOWN_SAFE packages that `script` imports at its top level, as written."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, (ast.Try, ast.If)):   # `try: import lightning.pytorch as pl except ImportError: ...`
            nodes += [*node.body, *node.orelse]   # not the except branches: fallbacks the script may not run
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            if node.module == "hyperpodrun":     # its public names load their modules lazily: load them here
                from hyperpodrun import _LAZY
                names += [_LAZY[a.name] for a in node.names if a.name in _LAZY]
    return [n for n in names if n.split(".")[0] in KNOWN_SAFE]


def gpu_driver_opened() -> bool:
    """Whether something imported opened the GPU driver (/dev/nvidia*): a fork of this process could not use
    CUDA then."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


def prewarm(script: str) -> list[str]:
    """Import the configured modules; returns those that failed (they are imported by the worker instead)."""
    from hyperpodrun.launch import settings  # HYPERPODRUN_WARM_IMPORTS, read where every setting is (the agent checked it)
    configured = settings.current().warm_imports
    names = list(configured) if configured is not None else [*DEFAULT_IMPORTS, *script_imports(script)]
    failed = []
    for name in dict.fromkeys(filter(None, names)):
        try:
            importlib.import_module(name)
        except Exception as exc:   # a module the job does not have: not an error, just not warm
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def serve(sock: socket.socket) -> Optional[tuple[dict[str, Any], list[int]]]:
    """Answer spawn requests until EOF (returns None); in a forked worker, returns its request."""
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        except (ConnectionError, OSError):
            return None
        if not msg:
            return None
        try:
            req = json.loads(msg)
            middle = os.fork()
        except (ValueError, OSError) as exc:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            continue
        if middle == 0:
            try:
                worker = os.fork()
            except OSError as exc:
                sock.send(json.dumps({"error": f"fork: {exc}"}).encode())
                os._exit(1)
            if worker == 0:
                sock.close()
                return req, fds
            sock.send(json.dumps({"pid": worker}).encode())
            os._exit(0)
        for fd in fds:
            os.close(fd)
        os.waitpid(middle, 0)


def stand_by(req: dict[str, Any], chan_fd: int) -> Optional[tuple[dict[str, Any], list[int]]]:
    """A standby (agent/workers/standby.py): make the CUDA context of local rank `req["local_rank"]`'s GPU where there is
    one, report {"ready": true} on the standby's own socket, then wait there for the rank to become - a
    request like the zygote's, answered {"ok": true} - and return it; None at EOF (not needed any more)."""
    chan = socket.socket(fileno=chan_fd)
    info, slot_dir = prepare(req)
    return await_rank(chan, info, slot_dir)


def run_ahead(req: dict[str, Any], chan_fd: int) -> None:
    """A standby that runs the script ahead (--standby-prerun, agent/workers/prerun.py): its CUDA context as
    `stand_by` makes it, then the script up to its first HPWrapper call, where it reports ready and waits
    (`await_rank`, called by hyperpodrun/runtime/park.py). Returns in the rank it became, once the script ended."""
    from hyperpodrun.agent.workers import prerun
    chan = socket.socket(fileno=chan_fd)
    info, slot_dir = prepare(req)
    prerun.run_ahead(req["prerun"], chan, functools.partial(await_rank, chan, info, slot_dir))


def prepare(req: dict[str, Any]) -> tuple[dict[str, Any], Optional[str]]:
    """A standby's preparation before it is ready: its GPU's CUDA context and NCCL's start where there is one.
    Returns (its ready report, the slot directory to pin while it waits, where it has a GPU)."""
    info: dict[str, Any] = {"ready": True, "pid": os.getpid(), "cuda": False}
    slot_dir: Optional[str] = None
    if req.get("cuda_visible") is not None:   # --virtual-local-rank: its rank's one GPU, set before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = str(req["cuda_visible"])
    try:
        import torch
        if torch.cuda.is_available():
            device = int(req.get("local_rank", 0)) % torch.cuda.device_count()
            torch.cuda.set_device(device)
            torch.zeros(1, device=f"cuda:{device}")   # the context, made now rather than after the fault
            info.update(cuda=True, device=device)
            info["nccl_warm_s"] = warm_nccl(device, info)
            if req.get("kernel_warm", True):
                info["kernel_warm"] = "background"
            slot_dir = req.get("slot_dir")
    except Exception as exc:   # no usable GPU here: a standby still saves the fork and the imports
        info["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return info, slot_dir


def await_rank(chan: socket.socket, info: dict[str, Any], slot_dir: Optional[str],
               extra: Optional[dict[str, Any]] = None) -> Optional[tuple[dict[str, Any], list[int]]]:
    """Report ready (`info`, with `extra`), warm the kernels and pin the slots while waiting, then take the rank
    to become - (its request, its stdout and stderr descriptors), acknowledged {"ok": true} - or None at EOF."""
    prepinner = None
    taken = threading.Event()
    try:
        chan.send(json.dumps({**info, **(extra or {})}).encode())
        if info.get("kernel_warm") == "background":   # after ready: a rank dying meanwhile is taken over at once
            threading.Thread(target=warm_kernels, args=(info["device"], taken.is_set), daemon=True,
                             name="hyperpodrun-kernel-warm").start()
        if slot_dir is not None:        # the slots it would restore from, mapped and pinned meanwhile
            from hyperpodrun.state.slots import pinned_read
            prepinner = pinned_read.Prepinner(slot_dir, PREPIN_EVERY_S).start()
        msg, fds, _, _ = socket.recv_fds(chan, 1 << 20, 2)
    except OSError:
        return None
    finally:
        taken.set()                     # the warm-up ends before its next step (it never touches the script's
        if prepinner is not None:       # state); the takeover goes on; a registration in progress ends by itself
            prepinner.stop()
    if not msg:
        return None
    task = json.loads(msg)
    chan.send(b'{"ok": true}')
    chan.close()
    return task, fds


#: how often a waiting standby looks at its slot files (new, grown or replaced ones are mapped and pinned again)
PREPIN_EVERY_S = 0.5


def warm_kernels(device: int, stop: Callable[[], bool]) -> None:
    """agent/workers/kernel_warm.py on this GPU, in the standby's warm-up thread; a failure is one warning line (on the
    zygote's log, or the rank's once the standby became one), never fatal: the standby still saves the fork,
    the imports and the context."""
    try:
        import torch

        from hyperpodrun.agent.workers import kernel_warm
        done = kernel_warm.warm(torch.device("cuda", device), stop=stop)
        log.debug("standby %d: kernels warmed on GPU %d in %.2fs%s", os.getpid(), device, done["warm_s"],
                  " (stopped: it became a rank)" if done["stopped"] else "")
    except Exception as exc:
        log.warning("hyperpodrun standby %d: kernels not warmed (%s: %s); the rank it becomes loads them as it "
                    "goes", os.getpid(), type(exc).__name__, exc)


def warm_nccl(device: int, info: Optional[dict[str, Any]] = None) -> Optional[float]:
    """Form and end a one-rank NCCL group on this GPU: NCCL's once-per-process start (loading, topology) is
    then done when the rank's own group forms after a fault (0.41 s for a fresh process's first group on an
    H200 host, 0.02 s for the next one). NCCL's own settings are read here, from the job's environment, as
    they would be in the rank - TORCH_DIST_USE_NCCL2 included, so "nccl" builds the engine the rank's "nccl"
    gets (nccl2 on torch 2.15, nccl-legacy before it or with TORCH_DIST_USE_NCCL2=0; both load the same
    libnccl, whose start is what is warmed). Which engine was formed is read from the group's backend
    (runtime/pg_kind.py) into `info["nccl_warm_kind"]`; a "nccl" that a plugin replaced by something else
    is ended without a collective. Seconds taken, or None where there is no NCCL."""
    import torch
    import torch.distributed as dist

    from hyperpodrun.runtime import pg_kind
    if not (dist.is_available() and dist.is_nccl_available()):
        return None
    t0 = time.monotonic()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", device))
    try:
        kinds = pg_kind.group_kinds(dist.distributed_c10d._get_default_group())
        if info is not None:
            info["nccl_warm_kind"] = ",".join(sorted(kinds))
        if not pg_kind.uses_nccl(kinds):
            return None
        t = torch.ones(1, device=f"cuda:{device}")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    return round(time.monotonic() - t0, 3)


def become_worker(req: dict[str, Any], fds: list[int]) -> str:
    """Set this process up as `python -u script` started by the agent would be; returns the script path."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    from hyperpodrun.agent.workers.script_entry import enter_script
    return enter_script(req)


def main() -> None:
    del sys.path[0]   # this file's directory (the agent's modules) must not shadow what the imports look for
    sock = socket.socket(fileno=int(sys.argv[1]))
    t0 = time.monotonic()
    from hyperpodrun.runtime import group_hook   # the roll call in the forks' init_process_group, as in a cold
    group_hook.install()                         # worker (its sitecustomize ran in this process, not in them)
    failed = prewarm(sys.argv[2])
    if gpu_driver_opened():
        sock.send(json.dumps({"ready": False, "why": "an import opened the GPU driver; forks could not use "
                              "CUDA (set HYPERPODRUN_WARM_IMPORTS to modules that do not)"}).encode())
        return
    sock.send(json.dumps({"ready": True, "import_s": round(time.monotonic() - t0, 3), "failed": failed}).encode())
    task = serve(sock)
    if task is None:
        return
    if task[0].get("prerun"):        # a standby that runs the script ahead: returns once it became a rank and
        run_ahead(task[0], task[1][0])   # the script ended (or ends this process when it cannot run ahead)
        return
    if task[0].get("standby"):
        task = stand_by(task[0], task[1][0])
        if task is None:
            os._exit(0)
    script = become_worker(*task)
    del task
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
