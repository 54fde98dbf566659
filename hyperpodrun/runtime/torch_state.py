"""What the in-process runtime reads from, and does to, this process's torch state: the rank's device, the
collective sequence number, the main thread's stack, the failed call's frames, torch modules imported
ahead, process groups created before the wrapped function, the interpreter's exit (used by HPWrapper)."""
from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import traceback
from typing import Optional

log = logging.getLogger("hyperpodrun.runtime")

_group_before_wrapper = False   # set by _warn_existing_group: a default group existed before the first call


def _device_ids() -> dict:
    """GPU UUID / PCI bus id of this thread's current CUDA device, for the agent's NVML monitor; {} until CUDA is in
    use (cheap then: called at every progress() until it answers)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if torch.cuda.is_initialized():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            uuid = str(props.uuid)
            return {"device_uuid": uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}",
                    "pci_bus_id": f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"}
    except Exception:
        pass
    return {}


def _abort_nccl_from_monitor() -> None:
    """NCCL only (nccl-legacy or nccl2, told by the groups' backends: pg_kind): abort the communicators from the
    monitor thread, so a main thread blocked on the GPU (a collective whose peer died, a synchronize, `.item()`)
    returns and the interrupt can land. gloo groups are left to the main thread (destroying them from another
    thread is not safe)."""
    try:
        import torch.distributed as dist

        from hyperpodrun.runtime import pg_kind
        if not (dist.is_available() and dist.is_initialized()) or not pg_kind.uses_nccl(pg_kind.current_kinds()):
            return
        from hyperpodrun.runtime.abort import abort_nccl_in_background
        if abort_nccl_in_background():
            log.warning("rank %s: NCCL communicators being aborted on RESTART", os.environ.get("RANK"))
            return
        abort_pg = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort_pg is not None:
            abort_pg()
            log.warning("rank %s: NCCL communicators aborted on RESTART", os.environ.get("RANK"))
    except Exception as exc:  # the main thread's abort runs anyway
        log.warning("NCCL abort from the monitor thread failed: %s", exc)


def _main_stack(limit: int = 6) -> Optional[str]:
    """The innermost frames of the main thread, `func (file:line) <- caller (...)`, innermost first; read by the
    monitor thread, so it answers while the main thread waits in a C call that released the GIL."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return None
    parts = [f"{fs.name} ({os.path.basename(fs.filename)}:{fs.lineno})"
             for fs in reversed(traceback.extract_stack(frame, limit=limit))]
    return " <- ".join(parts)[:800]


def _collective_seq() -> Optional[int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
            # a private ProcessGroup method that torch's stubs do not declare
            return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except Exception:
        return None
    return None


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of the failed call's frames so what they referenced (modules, DDP reducers, process
    groups and their sockets) can be freed now, not when the exception object dies."""
    tb = exc.__traceback__
    while tb is not None:
        try:
            tb.tb_frame.clear()
        except RuntimeError:  # a frame still executing (ours)
            pass
        tb = tb.tb_next
    for chained in (exc.__cause__, exc.__context__):
        if chained is not None and chained is not exc:
            _drop_frames(chained)


def _preload_torch_modules() -> None:
    """Import torch._dynamo before the user's first process group exists.

    Imported later (torch.optim does it lazily), it keeps Python references to the process groups that
    exist at that moment (measured on torch 2.13: +10), so a failed gloo group is never destroyed, its
    sockets stay open and peers blocked in a collective with it are not released.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        pass


def _warn_existing_group() -> None:
    """One warning line when a default process group exists before the wrapped function runs (created at
    import time, e.g. by a Hugging Face `TrainingArguments` built at module level): a restart cannot create it
    again in-process, and a replaced rank would wait for its peers in it until --inprocess-timeout."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        import torch.distributed as dist
        exists = dist.is_available() and dist.is_initialized()
    except Exception:
        return
    if exists:
        global _group_before_wrapper
        _group_before_wrapper = True
        log.warning("hyperpodrun: rank %s: a default process group already exists before the HPWrapper function "
                    "runs; it cannot be re-created in-process, so a restart would hang until "
                    "--inprocess-timeout: call init_process_group() (and build whatever creates it, e.g. "
                    "TrainingArguments) inside the wrapped function", os.environ.get("RANK", "?"))


def group_before_wrapper() -> bool:
    """True when a default process group already existed when HPWrapper first ran its function in this process
    (under --inprocess-restart): integrations that need the group re-created at every re-entry refuse it."""
    return _group_before_wrapper


def freeze_before_training() -> None:
    """Move every object that exists now - torch's modules, the imports, a model built before the wrapped
    function - into the cyclic collector's permanent generation (gc.freeze), once per process, so that the
    full collection of the restart path (finalize: the failed generation's frames, DDP, process groups) scans
    only what training made since: about 0.11 s less per recovery with torch and torch._dynamo imported
    (CPU, BENCHMARKS.md). Frozen objects are still freed by reference counting; only reference cycles among
    them are never collected. HYPERPODRUN_GC_FREEZE=0 turns it off."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    from hyperpodrun.launch import settings
    if settings.current().gc_freeze:
        gc.freeze()


_frozen = False


def _exit_without_last_collection() -> None:
    """The job has completed and this process is on its way out: skip the interpreter's last garbage
    collection, which walks torch's whole object graph (0.5 s on an idle host, seconds on a busy one,
    torch 2.13) while the job waits for every rank to exit. Objects frozen at exit are still released by
    module teardown; only reference cycles among them are left to the OS, as with os._exit. At exit, not now:
    the script may go on after the wrapped function returns."""
    atexit.register(gc.freeze)


def _reset_torch_group_counter() -> None:
    """A failed `init_process_group` leaves torch's group counter advanced, so the next init on this rank
    would use other store keys than a fresh process. Reset it when no group exists (torch internals: guarded)."""
    try:
        import torch.distributed as dist
        world = getattr(dist.distributed_c10d, "_world", None)
        if world is not None and not dist.is_initialized() and hasattr(world, "group_count"):
            world.group_count = 0
    except Exception:
        pass
