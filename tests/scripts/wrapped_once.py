"""An HPWrapper-decorated function run outside `hyperpodrun --inprocess-restart` (plain python, torchrun):
each call appends {"pid", "rank", "it"} to OUT/calls.jsonl; with --fail (or in rank --fail-rank) it raises after that
(with --wait-calls N only once N calls are recorded)."""
import argparse
import json
import os
import time

from hyperpodrun import HPWrapper, wait_rank


@HPWrapper()
def main(out: str, fail: bool, wait_calls: int = 0, caller=None) -> int:
    path = os.path.join(out, "calls.jsonl")
    line = json.dumps({"pid": os.getpid(), "rank": int(os.environ["RANK"]), "it": caller.iteration}) + "\n"
    with open(path, "a") as fh:
        fh.write(line)
    if fail:
        end = time.monotonic() + 60   # raise only once the other ranks have been called too
        while open(path).read().count("\n") < wait_calls and time.monotonic() < end:
            time.sleep(0.01)
        raise RuntimeError("failing on purpose")
    return 42


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fail", action="store_true")
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--wait-calls", type=int, default=0, help="the failing rank waits for this many calls")
    args = ap.parse_args()
    wait_rank()
    assert main(args.out, args.fail or args.fail_rank == int(os.environ["RANK"]), args.wait_calls) == 42
    print("returned 42", flush=True)
