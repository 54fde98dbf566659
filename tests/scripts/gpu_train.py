"""tests/scripts/inproc_train.py, plus what the GPU health tests (tests/test_gpu_health_jobs.py) need to see.

Before running inproc_train.py unchanged (same arguments), it appends to OUT/cvd<rank>.jsonl one record
{"pid", "cvd"}: the CUDA_VISIBLE_DEVICES this process was started with (a rank moved to a spare GPU gets
an explicit one). With HPR_FAIL_HEALTH_RANK=<rank>, that rank's first health check at a restart fails (as
CudaHealthCheck does on a sticky CUDA error): the process exits 74 and must be replaced.
"""
import json
import os
import runpy
import sys

OUT = sys.argv[sys.argv.index("--out") + 1]
RANK = int(os.environ.get("RANK", "0"))

with open(os.path.join(OUT, f"cvd{RANK}.jsonl"), "a") as fh:
    fh.write(json.dumps({"pid": os.getpid(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")

if os.environ.get("HPR_FAIL_HEALTH_RANK") == str(RANK):
    from hyperpodrun.runtime import health

    def failing_check(self) -> None:
        marker = os.path.join(OUT, f"health_failed_{RANK}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise health.HealthCheckError("CUDA device is unhealthy: an illegal memory access was encountered "
                                          "(simulated sticky error)")

    health.CudaHealthCheck.__call__ = failing_check

sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inproc_train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
