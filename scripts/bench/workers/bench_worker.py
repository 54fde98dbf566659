"""The worker of scripts/bench/launcher_bench.py: records wall-clock timestamps to a file, nothing else.

Lines are `<event> <unix time>` in $BENCH_OUT/g<generation>_r<rank>_p<pid>.txt:
  top   - first statement of the script, before torch is imported
  init  - right after dist.init_process_group() returned
  fail  - (restart mode) rank 1 of generation 0, just before it exits with code 1
BENCH_MODE=startup: init, barrier, exit 0.
BENCH_MODE=restart: in generation 0 every rank inits and meets in a barrier; then rank 1 waits
  BENCH_FAIL_AFTER seconds and exits 1 while the others run Python code (sleep loop, no collective);
  BENCH_IGNORE_TERM=1 makes every rank ignore SIGTERM. In later generations: init, barrier, exit 0.
"""
import os
import time

T_TOP = time.time()
import signal  # noqa: E402
import sys  # noqa: E402

GEN = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])
OUT = os.path.join(os.environ["BENCH_OUT"], f"g{GEN}_r{RANK}_p{os.getpid()}.txt")


def record(event: str, t: float) -> None:
    with open(OUT, "a") as fh:
        fh.write(f"{event} {t:.6f}\n")
        fh.flush()
        os.fsync(fh.fileno())


record("top", T_TOP)
print(f"rank {RANK} generation {GEN}: started", flush=True)
mode = os.environ.get("BENCH_MODE", "startup")
if mode == "restart" and os.environ.get("BENCH_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

from datetime import timedelta  # noqa: E402

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
record("init", time.time())
dist.barrier()

if mode == "restart" and GEN == 0:
    if RANK == 1:
        time.sleep(float(os.environ.get("BENCH_FAIL_AFTER", "0.5")))
        record("fail", time.time())
        os._exit(1)
    while True:  # user code that is not inside a collective
        time.sleep(0.01)

dist.destroy_process_group()
sys.exit(0)
