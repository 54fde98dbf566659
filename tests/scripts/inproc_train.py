"""A small HPWrapper training loop (gloo, CPU) for the in-process restart tests; it records what happened.

Each rank appends JSON lines to OUT/rank<r>.jsonl (one line per record, from every process that ever held
the rank):
  {"ev": "start", "pid", "gen0"}            the process started (gen0: HYPERPODRUN_GENERATION at spawn)
  {"ev": "enter", "pid", "it", "t"}         the wrapped function was entered with caller.iteration = it
  {"ev": "step", "pid", "it", "step"}       generation 0 reached a multiple of 10 steps
  {"ev": "raise", "pid", "it", "step", "t"} this rank is about to raise on purpose
  {"ev": "abort", "pid", "it", "t"}         HPWrapper called abort (first call per generation): the main
                                            thread has left the failed generation's code (collective included)
  {"ev": "done", "pid", "it", "step"}       the function returned
  {"ev": "exit", "pid", "it", "t"}         the process is about to exit normally

Generation 0 trains until a fault moves the job on (a cap of --forever-cap seconds ends it with exit 97, so
a test whose fault never fires fails instead of hanging); every later generation trains --steps steps and
returns. Faults the script raises itself: --raise-rank/--raise-step (in generation 0 only, or every
generation with --raise-always). Recovery-time faults: --finalize-exit-rank (that rank's finalize exits the
process once), --finalize-hang-rank (that rank's finalize never returns), --finalize-hold-gil-rank (that
rank's finalize spends --hold-gil-s seconds in a C call that keeps the GIL: no heartbeat meanwhile).
--usr1-log-rank: in that rank SIGUSR1 writes a record and is otherwise ignored. --gate FILE: a process
started for a generation > 0 waits for FILE before it joins (so a test can act while the replacement is on
its way). --exit-delay: a process whose job completed takes that long to exit (by default it leaves with
os._exit at once).
"""
import argparse
import ctypes
import datetime
import gc
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from hyperpodrun import HPWrapper, wait_rank
from hyperpodrun.runtime.abort import CheckpointlessAbortManager, CheckpointlessFinalizeCleanup

CAP_EXIT = 97


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20, help="steps of every generation after 0")
    p.add_argument("--step-time", type=float, default=0.01)
    p.add_argument("--forever-cap", type=float, default=90.0)
    p.add_argument("--pg-timeout", type=float, default=10.0)
    p.add_argument("--raise-rank", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="rank(s) that raise, e.g. 1 or 1,2")
    p.add_argument("--raise-step", type=int, default=5)
    p.add_argument("--symptom-rank", type=int, default=None,
                   help="at --raise-step this rank first reports a 'connection closed by peer' error; the "
                        "--raise-rank ranks raise only once it has reported and begun its abort")
    p.add_argument("--raise-always", action="store_true", help="raise in every generation, not only in 0")
    p.add_argument("--finalize-exit-rank", type=int, default=None)
    p.add_argument("--finalize-hang-rank", type=int, default=None)
    p.add_argument("--finalize-hold-gil-rank", type=int, default=None)
    p.add_argument("--hold-gil-s", type=float, default=5.0)
    p.add_argument("--usr1-log-rank", type=int, default=None)
    p.add_argument("--gate", default=None)
    p.add_argument("--hello-line", action="store_true", help="print a line naming this process to stdout at start")
    p.add_argument("--exit-delay", type=float, default=None,
                   help="after the job completed, take this long to exit (default: exit at once)")
    return p.parse_args()


ARGS = parse()
RANK = int(os.environ.get("RANK", "0"))
LOG = os.path.join(ARGS.out, f"rank{RANK}.jsonl")
_aborted = set()


def record(ev: str, **fields) -> None:
    line = json.dumps({"ev": ev, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def current_iteration() -> int:
    return int(os.environ.get("HYPERPODRUN_GENERATION", "0"))


class RecordingAbort:
    """The default abort, after noting when this rank got here (runs in HPWrapper's abort thread)."""

    def __init__(self) -> None:
        self.inner = CheckpointlessAbortManager.get_default_checkpointless_abort()
        self.it = 0

    def __call__(self) -> None:
        if self.it not in _aborted:
            _aborted.add(self.it)
            record("abort", it=self.it, t=time.time())
        self.inner()


ABORT = RecordingAbort()


class TestFinalize(CheckpointlessFinalizeCleanup):
    def __call__(self) -> None:
        if RANK == ARGS.finalize_exit_rank:
            marker = os.path.join(ARGS.out, f"finalize_exit_{RANK}")
            try:
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                record("finalize_exit", t=time.time())
                sys.stdout.flush()
                os._exit(5)
        if RANK == ARGS.finalize_hold_gil_rank:
            record("finalize_hold_gil", t=time.time())
            ctypes.PyDLL(None).usleep(int(ARGS.hold_gil_s * 1e6))   # a slow C call that keeps the GIL
        if RANK == ARGS.finalize_hang_rank:
            record("finalize_hang", t=time.time())
            end = time.monotonic() + ARGS.forever_cap
            while time.monotonic() < end:
                time.sleep(0.05)
            os._exit(CAP_EXIT)
        super().__call__()


def wait_for_abort(rank: int) -> None:
    """Until `rank` has begun its abort in iteration 0 (so its FAULT report was sent before ours)."""
    path = os.path.join(ARGS.out, f"rank{rank}.jsonl")
    end = time.monotonic() + ARGS.forever_cap
    while time.monotonic() < end:
        with open(path) as f:
            if any('"ev": "abort"' in line for line in f):
                return
        time.sleep(0.005)
    os._exit(CAP_EXIT)


@HPWrapper(abort=ABORT, finalize=TestFinalize())
def train(caller=None) -> None:
    ABORT.it = caller.iteration
    record("enter", it=caller.iteration, t=time.time())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=ARGS.pg_timeout))
    steps = ARGS.steps if caller.iteration > 0 else None
    end = time.monotonic() + ARGS.forever_cap
    t = torch.ones(4)
    step = 0
    while steps is None or step < steps:
        if steps is None and time.monotonic() > end:
            record("cap", it=caller.iteration, step=step)
            os._exit(CAP_EXIT)
        caller.progress(step)
        if RANK == ARGS.symptom_rank and step == ARGS.raise_step and caller.iteration == 0:
            record("symptom", it=caller.iteration, step=step, t=time.time())
            raise RuntimeError(f"[pair.cc] Connection closed by peer (rank {RANK} at step {step})")
        if RANK in ARGS.raise_rank and step == ARGS.raise_step and (ARGS.raise_always or caller.iteration == 0):
            if ARGS.symptom_rank is not None:
                wait_for_abort(ARGS.symptom_rank)
            record("raise", it=caller.iteration, step=step, t=time.time())
            raise RuntimeError(f"boom at step {step}")
        dist.all_reduce(t)
        t.fill_(1.0)
        time.sleep(ARGS.step_time)
        step += 1
        if steps is None and step % 10 == 0:
            record("step", it=caller.iteration, step=step)
    dist.barrier()
    # the job's tensors go before the group: a gloo thread must not free one while Python exits
    t = None
    gc.collect()
    dist.destroy_process_group()
    record("done", it=caller.iteration, step=step)


if __name__ == "__main__":
    record("start", gen0=current_iteration())
    if ARGS.hello_line:
        print(f"hello from rank {RANK} pid {os.getpid()} generation {current_iteration()}", flush=True)
    if RANK == ARGS.usr1_log_rank:
        signal.signal(signal.SIGUSR1, lambda *_: record("sigusr1", t=time.time()))
    if ARGS.gate and current_iteration() > 0:
        end = time.monotonic() + ARGS.forever_cap
        while not os.path.exists(ARGS.gate):
            if time.monotonic() > end:
                os._exit(CAP_EXIT)
            time.sleep(0.02)
    wait_rank()
    train()
    record("exit", it=current_iteration(), t=time.time())
    sys.stdout.flush()
    sys.stderr.flush()
    if ARGS.exit_delay is None:
        os._exit(0)   # skip torch's interpreter teardown (seconds on a busy machine): the tests do not need it
    time.sleep(ARGS.exit_delay)   # a slow teardown after the control connection closed: not a hang
