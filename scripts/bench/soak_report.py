"""The chaos soak's verdicts and outputs (scripts/bench/soak.py): the fault-free replay that the final state is
compared with, DIR/soak.json, DIR/soak.md and the picture of the run, DIR/soak.png (a lane per rank per system:
steps that count, steps done again, the faults as lines; the sampled resources below).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import soak_jobs

COLOURS = {"raise": "#e63946", "oom": "#9d0208", "kill": "#000000", "hang": "#7b2cbf", "node": "#f77f00",
           "double": "#d00000", "coordinator": "#0077b6", "rot": "#6a994e", "logfull": "#8d6e63"}


def replay_and_compare(work: Path, out: Path, steps: int, env: dict[str, str]) -> dict[str, Any]:
    """Run the same training fault-free for `steps` steps on the same 4 ranks (2 nodes x 2, gloo) and compare
    every rank's final parameters and optimizer state with the soak's, bitwise. The replay runs under torchrun
    without checkpoints and without the steps' sleep: plain training, nothing of hyperpodrun in it (and a
    fraction of the time that saving every step would take)."""
    from conftest import assert_same_ckpt_state
    tmp = work / "replay"
    tmp.mkdir()
    t = time.time()
    job = soak_jobs.TorchrunJob(tmp, {**env, "STEPS": str(steps), "STEP_SLEEP": "0", "CKPT_EVERY": str(1 << 40)},
                                max_restarts=0)
    try:
        codes = job.wait_end(3600)
    finally:
        job.shutdown()
    res: dict[str, Any] = {"steps": steps, "replay_s": round(time.time() - t, 1), "replay_exit_codes": codes}
    if set(codes.values()) != {0}:
        res.update(equal=False, detail="the fault-free replay failed:\n" + job.describe()[-4000:])
        return res
    try:
        assert_same_ckpt_state(job.out, out, ranks=soak_jobs.RANKS)
        res.update(equal=True, detail="every rank's parameters and Adam state bitwise equal")
    except (AssertionError, OSError) as exc:
        res.update(equal=False, detail=str(exc))
    return res


def _fmt(v: Any, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f} {unit}" if isinstance(v, float) else str(v)


def markdown(meta: dict[str, Any], results: list[dict[str, Any]], kinds: dict[str, dict[str, dict[str, Any]]],
             verdict: Callable[[dict[str, Any]], str]) -> str:
    lines = [f"# Chaos soak, seed {meta['seed']}, {meta['minutes']:g} minutes per system", "",
             f"Command: `{meta['command']}`", "", f"Machine: {meta['machine']}", "",
             "| system | faults done | handled | exit codes | steps (final) | step s | wall s | goodput |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        done = [f for f in r["faults"] if "skipped" not in f]
        late = len([f for f in r["faults"] if f.get("skipped", "").startswith("not reached")])
        handled = [f for f in done if "recovered_at" in f]
        good = f"{100 * r['goodput']:.1f} %" if r.get("goodput") else "-"
        lines.append(f"| {r['system']} | {len(done)} (+{late} not reached) | {len(handled)} | {list(r['exit_codes'].values())}"
                     + (f" (spare: {r['spare_exits']})" if r.get("spare_exits") else "") + f" | "
                     f"{r.get('steps_final')} | {_fmt(r.get('step_s'), '')} | {_fmt(r.get('wall_s'), '')} | {good} |")
    lines += ["", "Recovery per fault kind (seconds: median / p95 / max; n = faults recovered of those done; a fault a "
              "system did not reach within the run's time is not counted):", "",
              "| kind | " + " | ".join(r["system"] for r in results) + " |", "|---|" + "---|" * len(results)]
    for kind in meta["kinds"]:
        cells = []
        for r in results:
            k = kinds[r["system"]].get(kind)
            if not k:
                cells.append("-")
            elif k["skipped"] == k["faults"]:
                cells.append("skipped")
            elif k["not_reached"] == k["faults"]:
                cells.append("not reached")
            else:
                n = f"n={k['recovered']}/{k['faults'] - k['skipped'] - k['not_reached']}"
                cells.append(f"{k['median_s']:.2f} / {k['p95_s']:.2f} / {k['max_s']:.2f} ({n})" if "median_s" in k
                             else n)
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    for r in results:
        lines += ["", f"## {r['system']}", ""]
        if "exact" in r:
            lines.append(f"- final state vs a fault-free replay of {r['exact']['steps']} steps: "
                         f"{'EQUAL' if r['exact']['equal'] else 'DIFFERENT'} ({r['exact']['detail'][:300]})")
        if "flat" in r:
            judged = [s for s in r["flat"] if s["judged"]]
            bad = [s for s in judged if not s["flat"]]
            lines.append(f"- resources (sampled totals, the medians of the first and last fifth of the samples): "
                         f"{len(judged)} judged, "
                         f"{'all flat' if not bad else str(len(bad)) + ' NOT flat'}")
            for s in judged:
                mib = s["metric"] in ("rss", "shm")
                scale, unit = (1 / (1 << 20), " MiB") if mib else (1, "")
                lines.append(f"  - {s['role']} {s['metric']}: {s['first'] * scale:.1f} -> {s['last'] * scale:.1f}{unit} "
                             f"over {s['span_s']:.0f} s (fitted growth {s['fitted_growth'] * scale:.1f}, allowed "
                             f"{s['allowed'] * scale:.1f}){'' if s['flat'] else ' NOT FLAT'}")
        lines.append(f"- left running after the job: {r.get('leftovers') or 'nothing'}")
        others = [f for f in r["faults"] if verdict(f) != "recovered" and not verdict(f).startswith("not reached")]
        if others:
            lines.append("- faults not recovered:")
            lines += [f"  - #{f['i']} {f['kind']} (rank {f['rank']}): {verdict(f)}" for f in others]
    lines += ["", f"/dev/shm of this machine after both jobs: {meta['shm_left'] or 'nothing new'}"]
    return "\n".join(lines) + "\n"


def draw(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    rows = [r for r in results if r.get("lanes")]
    hpr = next((r for r in rows if r.get("samples")), None)
    n = len(rows) + (1 if hpr else 0)
    fig, axes = plt.subplots(n, 1, figsize=(14, 2.2 * n + 0.8), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        t0 = r["t0"]
        step_s = r.get("step_s") or 0.1
        for rank, lane in sorted(r["lanes"].items(), key=lambda kv: int(kv[0])):
            later_min = float("inf")
            redone = [False] * len(lane)
            for i in range(len(lane) - 1, -1, -1):   # a step done again later is lost work
                redone[i] = lane[i][1] >= later_min
                later_min = min(later_min, lane[i][1])
            seg_start, prev = None, None
            for i, (t, step, gen) in enumerate(lane):
                cont = prev is not None and t - prev[0] < 5 * step_s and gen == prev[2] and redone[i] == prev[3]
                if not cont:
                    if seg_start is not None and prev is not None:
                        ax.barh(int(rank), prev[0] - seg_start, left=seg_start - t0, height=0.7, linewidth=0,
                                color="#000000" if prev[3] else "#2a9d8f")
                    seg_start = t - step_s
                prev = (t, step, gen, redone[i])
            if seg_start is not None and prev is not None:
                ax.barh(int(rank), prev[0] - seg_start, left=seg_start - t0, height=0.7, linewidth=0,
                        color="#000000" if prev[3] else "#2a9d8f")
        for f in r["faults"]:
            if "t" in f and "skipped" not in f:
                ax.axvline(f["t"] - t0, color=COLOURS.get(f["kind"], "#888"), linewidth=0.9)
        ax.set_yticks(range(soak_jobs.RANKS), [f"rank {i}" for i in range(soak_jobs.RANKS)])
        ax.invert_yaxis()
        good = f"{100 * r['goodput']:.1f} %" if r.get("goodput") else "-"
        ax.set_title(f"{r['system']}: goodput {good}", fontsize=9, loc="left")
        ax.set_xlim(left=0)
    if hpr:
        ax = axes[-1, 0]
        t0 = hpr["t0"]
        for role_prefix, metric, scale, style in (("agent", "threads", 1, "-"), ("agent", "fds", 1, "--"),
                                                  ("rank", "rss", 1 / (1 << 20), ":"),
                                                  ("shm", "shm", 1 / (1 << 20), "-.")):
            roles = sorted({s["role"] for s in hpr["samples"] if s["role"].startswith(role_prefix) and metric in s})
            for role in roles:
                pts = [(s["t"] - t0, s[metric] * scale) for s in hpr["samples"] if s["role"] == role
                       and s.get(metric) is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, linewidth=0.8,
                            label=f"{role} {metric}{' MiB' if scale != 1 else ''}")
        ax.set_title("hyperpodrun: agents' threads and fds, ranks' RSS (MiB), nodes' /dev/shm (MiB)", fontsize=9,
                     loc="left")
        ax.legend(fontsize=6, ncol=6, loc="upper left")
        ax.set_xlim(left=0)
    axes[-1, 0].set_xlabel("seconds since training began")
    handles = [Patch(color="#2a9d8f", label="steps that count"), Patch(color="#000000", label="steps done again")]
    handles += [Line2D([0], [0], color=c, label=k) for k, c in COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(out: Path, meta: dict[str, Any], results: list[dict[str, Any]],
          per_kind: Callable[[dict[str, Any]], dict[str, dict[str, Any]]],
          verdict: Callable[[dict[str, Any]], str]) -> bool:
    """soak.json, soak.md, soak.png; True when hyperpodrun's run met every check."""
    kinds = {r["system"]: per_kind(r) for r in results}
    for r in results:
        for f in r["faults"]:
            f["verdict"] = verdict(f)
    (out / "soak.md").write_text(markdown(meta, results, kinds, verdict))
    try:
        draw(results, out / "soak.png")
    except ImportError:
        print("no soak.png: matplotlib is not installed (pip install matplotlib)")
    slim = [{k: v for k, v in r.items() if k not in ("lanes",)} for r in results]
    (out / "soak.json").write_text(json.dumps({"meta": meta, "per_kind": kinds, "results": slim}, indent=1,
                                              default=str))
    print((out / "soak.md").read_text())
    hpr = next((r for r in results if r["system"] == "hyperpodrun"), None)
    if hpr is None:
        return True
    return (all(f["verdict"] == "recovered" or f["verdict"].startswith("not reached") for f in hpr["faults"]) and set(hpr["exit_codes"].values()) == {0}
            and all(c == 0 for c in hpr.get("spare_exits", []))
            and hpr.get("exact", {}).get("equal", False) and all(s["flat"] for s in hpr.get("flat", []))
            and not hpr.get("leftovers") and not meta["shm_left"])
