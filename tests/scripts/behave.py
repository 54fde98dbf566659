"""A torch-free worker whose behaviour the tests choose: fail, hold on, ignore SIGTERM, leave grandchildren.

Markers (JSON, written atomically) in OUT: ready_<g>_<rank>.json once the worker is set up (pid, session,
grandchild pid), term_<g>_<rank> when it received SIGTERM, done_<g>_<rank>.json when it finished.
<g> is TORCHELASTIC_RESTART_COUNT. A generation g < --fail-until with --fail-rank set is a failing one:
the failing rank waits until --wait-peers ready markers of g exist, then exits with --fail-code (or kills
itself with --fail-signal); the other ranks hold on until they are killed. --hold makes every rank hold on
in every generation (for signal tests).
"""
import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

HOLD_LIMIT_S = 120  # a holding worker gives up (exit 99) if nobody ends it: tests never hang forever


def marker(out, name, data):
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, os.path.join(out, name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--fail-code", type=int, default=1)
    ap.add_argument("--fail-signal", type=int, default=None)
    ap.add_argument("--fail-until", type=int, default=1, help="generations 0..N-1 fail")
    ap.add_argument("--wait-peers", type=int, default=0)
    ap.add_argument("--term", choices=("default", "ignore", "log"), default="default",
                    help="SIGTERM while holding on: die, ignore, or write a marker and carry on")
    ap.add_argument("--grandchild", action="store_true",
                    help="start a `sleep` in a new process group of this session that ignores SIGTERM")
    ap.add_argument("--hold", action="store_true")
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    gen = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    tag = f"{gen}_{rank}"
    if args.term == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.term == "log":
        signal.signal(signal.SIGTERM, lambda *_: marker(args.out, f"term_{tag}", {"pid": os.getpid()}))
    gc_pid = None
    if args.grandchild:
        old = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SIG_IGN survives exec: the sleep ignores it
        gc_pid = subprocess.Popen(["sleep", "600"], process_group=0).pid
        signal.signal(signal.SIGTERM, old)
    # one write() per line: sys.stderr writes through, and print() would write the text and the newline
    # separately, so two ranks sharing the console could interleave mid-line
    sys.stdout.write(f"out from rank {rank} gen {gen}\n")
    sys.stdout.flush()
    sys.stderr.write(f"err from rank {rank} gen {gen}\n")
    sys.stderr.flush()
    marker(args.out, f"ready_{tag}.json", {"rank": rank, "gen": gen, "pid": os.getpid(), "sid": os.getsid(0),
                                           "pgrp": os.getpgrp(), "grandchild": gc_pid,
                                           "env": {k: v for k, v in os.environ.items()
                                                   if k.startswith(("TORCHELASTIC_", "HYPERPODRUN_"))
                                                   or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}})

    failing_gen = args.fail_rank is not None and gen < args.fail_until
    if failing_gen and rank == args.fail_rank:
        end = time.monotonic() + HOLD_LIMIT_S
        while len(glob.glob(os.path.join(args.out, f"ready_{gen}_*.json"))) < args.wait_peers:
            if time.monotonic() > end:
                sys.exit(98)
            time.sleep(0.01)
        print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
        if args.fail_signal:
            os.kill(os.getpid(), args.fail_signal)
        sys.exit(args.fail_code)
    if failing_gen or args.hold:
        end = time.monotonic() + HOLD_LIMIT_S
        while time.monotonic() < end:
            time.sleep(0.02)
        sys.exit(99)
    marker(args.out, f"done_{tag}.json", {"rank": rank, "gen": gen})


if __name__ == "__main__":
    main()
