"""The durable tier on an S3-protocol server on loopback (moto's server mode, started here): upload and restore
rates of CheckpointManager(fallback_dir="s3://...") beside the bare boto3 transfer of the same bytes, and the
step time of a CPU training loop with the tier on and off, all in one invocation.

    .venv/bin/python scripts/bench/durable_tier.py [--state-mb 128] [--steps 40] [--rounds 3] \
        [--out scripts/bench/results/durable-tier-cpu.json]

Needs the test extra (boto3, moto[server]). One process, no launcher: the tier's writer thread and the training
share this machine's cores, as on a node.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    import boto3
    client = boto3.client("s3")
    end = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket="bench")
            return proc, url
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def model(mb: int):
    import torch.nn as nn
    dim = int((mb * 2**20 / 4 / 3) ** 0.5)   # params + Adam's two moments ~ mb MiB
    return nn.Sequential(nn.Linear(dim, dim, bias=False))


def rates(state_mb: int, rounds: int) -> dict:
    import boto3
    import torch
    from boto3.s3.transfer import TransferConfig
    from hyperpodrun import CheckpointManager
    from hyperpodrun.state.durable.stores import PART_BYTES, PARTS_IN_FLIGHT
    client = boto3.client("s3")
    up, down, raw_up, raw_down = [], [], [], []
    size = 0
    for i in range(rounds):
        os.environ["HYPERPODRUN_SHM_DIR"] = tempfile.mkdtemp()
        torch.manual_seed(i)
        m = model(state_mb)
        opt = torch.optim.Adam(m.parameters())
        m(torch.randn(2, m[0].in_features)).sum().backward()
        opt.step()
        cm = CheckpointManager(fallback_dir=f"s3://bench/rates{i}", fallback_every=1)
        cm.save(1, {"model": m, "opt": opt})
        cm.wait()
        assert cm._durable is not None and cm._durable.last_write is not None
        seconds, size = cm._durable.last_write
        up.append(size / seconds / 2**20)
        os.environ["HYPERPODRUN_SHM_DIR"] = tempfile.mkdtemp()
        fresh = CheckpointManager(fallback_dir=f"s3://bench/rates{i}")
        t = time.perf_counter()
        assert fresh.restore({"model": m, "opt": opt}) == 1
        down.append(size / (time.perf_counter() - t) / 2**20)
        blob = os.urandom(size)   # the bare SDK, same bytes, same transfer settings
        cfg = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                             max_concurrency=PARTS_IN_FLIGHT)
        t = time.perf_counter()
        client.upload_fileobj(io.BytesIO(blob), "bench", f"raw{i}", Config=cfg)
        raw_up.append(size / (time.perf_counter() - t) / 2**20)
        t = time.perf_counter()
        client.get_object(Bucket="bench", Key=f"raw{i}")["Body"].read()
        raw_down.append(size / (time.perf_counter() - t) / 2**20)
    med = statistics.median
    return {"object_mib": round(size / 2**20, 1), "tier_upload_mib_s": round(med(up), 1),
            "tier_restore_mib_s": round(med(down), 1), "boto3_upload_mib_s": round(med(raw_up), 1),
            "boto3_download_mib_s": round(med(raw_down), 1),
            "runs": {"tier_upload": up, "tier_restore": down, "boto3_upload": raw_up, "boto3_download": raw_down}}


def step_times(state_mb: int, steps: int, every: int, rounds: int) -> dict:
    import torch
    from hyperpodrun import CheckpointManager
    out: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on"):
            os.environ["HYPERPODRUN_SHM_DIR"] = tempfile.mkdtemp()
            torch.manual_seed(0)
            m = model(state_mb)
            opt = torch.optim.Adam(m.parameters())
            cm = CheckpointManager(fallback_dir=f"s3://bench/steps{r}" if mode == "on" else None,
                                   fallback_every=every if mode == "on" else None)
            state = {"model": m, "opt": opt}
            x = torch.randn(64, m[0].in_features)
            times = []
            for step in range(steps):
                t = time.perf_counter()
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                cm.save(step + 1, state)
                times.append(time.perf_counter() - t)
            cm.wait()
            out[mode].append(statistics.median(times[2:]))
    med_off, med_on = statistics.median(out["off"]), statistics.median(out["on"])
    return {"fallback_every": every, "step_ms_off": round(1e3 * med_off, 2), "step_ms_on": round(1e3 * med_on, 2),
            "ratio": round(med_on / med_off, 3), "runs_ms": {k: [round(1e3 * v, 2) for v in vs] for k, vs in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mb", type=int, default=128, help="the state (parameters + Adam) in MiB, for the rates")
    ap.add_argument("--step-state-mb", type=int, default=64, help="the state of the step-time loop, MiB")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="fallback_every of the step-time loop")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    server, url = start_server()
    try:
        result = {"machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
                  "server": f"moto server on {url} (loopback)", "python": sys.version.split()[0]}
        result["rates"] = rates(args.state_mb, args.rounds)
        result["steps"] = step_times(args.step_state_mb, args.steps, args.every, args.rounds)
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
