"""The growth laws and the store model of scripts/bench/control_plane.py, apart from the simulation that
measures them (also run on a saved --json by `control_plane.py --report`)."""
from __future__ import annotations

import math
import statistics
from typing import Any

#: the agents' process counts as saturated past this many cores: hundreds of threads then queue for one
#: interpreter lock and a round stretches with the simulator, not with the store (256 agents on a TCPStore:
#: 0.48 of a core, a 2 s round where 128 agents at 0.25 took 0.26 s); such a point is shown, not fitted
SATURATED = 0.4


def fit_power(ns: list[int], ys: list[float]) -> tuple[float, float]:
    """y = a * N^b by least squares on the logs -> (a, b): b is the growth law of a count (1: linear, 2: N^2)."""
    pts = [(math.log(x), math.log(max(y, 1e-9))) for x, y in zip(ns, ys)]
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else 0.0
    return math.exp(my - b * mx), b


def fit_line(ns: list[int], ys: list[float]) -> tuple[float, float]:
    """y = a + b * N by least squares -> (a, b): a time is a fixed part (the polling intervals) plus a part
    per agent (the work the store and this process's cores do for each)."""
    mx, my = sum(ns) / len(ns), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in ns)
    b = sum((x - mx) * (y - my) for x, y in zip(ns, ys)) / var if var else 0.0
    return my - b * mx, b


def report(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The growth laws (points where the agents' process was saturated left out) and the store model, printed.

    Counts are fitted as a*N^b. Times on this machine are the simulator's as much as the store's (every
    agent shares its cores), so the time at 1,000 and 10,000 nodes comes from a model instead: the store
    serves one operation at a time at the CPU cost per operation measured here (c); the agents' background
    keeps it busy rho = b*N*c of the time (b: background operations per agent per second); a round's burst of
    r*N operations (r: per agent) then takes r*N*c/(1-rho) on top of the polling latency t0 (the fault to
    GO at the smallest N). rho >= 1: the store cannot keep up at all."""
    fits: dict[str, Any] = {}
    for name in sorted({(r["store"], r["mode"]) for r in out}):
        kind, mode = name
        rows = [r for r in out if (r["store"], r["mode"]) == name and r["sim_cpu"] <= SATURATED]
        if len(rows) < 2:
            continue
        label = kind if mode == "now" else f"{kind}-{mode}"
        x = [r["nodes"] for r in rows]
        for key in ("round_ops", "bg_ops_per_agent_per_period"):
            a, b = fit_power(x, [r[key] for r in rows])
            fits[f"{label}/{key}"] = dict(law=f"{a:.4g} * N^{b:.2f}", at_1000=a * 1000 ** b, at_10000=a * 10000 ** b)
        us = sorted(r["store_cpu_us_per_op"] for r in rows if r["store_cpu_us_per_op"])
        if us:
            c = statistics.median(us) * 1e-6
            bg = sum(r["bg_ops_per_agent_per_period"] / r["lease_period_s"] for r in rows) / len(rows)
            per_agent = sum(r["round_ops_per_agent"] for r in rows) / len(rows)
            t0 = min(rows, key=lambda r: r["nodes"])["last_go_s"]

            def model(n: int) -> float:
                rho = bg * n * c
                return t0 + per_agent * n * c / (1 - rho) if rho < 1 else math.inf
            fits[f"{label}/store_busy"] = dict(law=f"{bg:.1f} ops/s x {c * 1e6:.0f} us x N", at_1000=bg * c * 1000,
                                               at_10000=bg * c * 10000)
            fits[f"{label}/last_go_s_model"] = dict(law=f"{t0:.2f} + {per_agent:.1f}N x c/(1-rho)",
                                                    at_1000=model(1000), at_10000=model(10000))
            fits[f"{label}/most_nodes_one_store"] = dict(law="1/(b x c)", at_1000=1 / (bg * c), at_10000=1 / (bg * c))
        for key, f in fits.items():
            if key.startswith(label + "/"):
                print(f"{key:40s} ~ {f['law']:30s}  N=1,000 -> {f['at_1000']:.4g}   N=10,000 -> {f['at_10000']:.4g}")
    return fits
