"""`hyperpodrun logs` (tail a run's worker logs or its event log) and `hyperpodrun inject` (fault drills)."""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
from typing import Optional

import click

from hyperpodrun.config import default_log_dir


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def tools() -> None:
    """Tools around hyperpodrun jobs."""


def _runs(log_dir: str) -> list[str]:
    if not os.path.isdir(log_dir):
        return []
    runs = [os.path.join(log_dir, d) for d in os.listdir(log_dir)
            if os.path.isdir(os.path.join(log_dir, d)) and glob.glob(os.path.join(log_dir, d, "*.events.jsonl"))]
    return sorted(runs, key=os.path.getmtime)


def resolve_run(path: Optional[str]) -> str:
    """A run directory from: nothing (newest under the default log dir), a log dir, or a run dir."""
    base = os.path.abspath(path) if path else default_log_dir()
    if glob.glob(os.path.join(base, "*.events.jsonl")):
        return base
    runs = _runs(base)
    if not runs:
        raise click.UsageError(f"no hyperpodrun run found under {base!r}; pass the --log-dir the job used")
    return runs[-1]


def _rank_files(run: str, rank: Optional[int]) -> list[str]:
    pattern = os.path.join(run, "attempt_*", f"rank_{rank}" if rank is not None else "rank_*", "std*.log")
    files = glob.glob(pattern)

    def key(p: str) -> tuple[int, int, str]:
        m = re.search(r"attempt_(\d+)/rank_(\d+)/(std\w+)", p)
        return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else (0, 0, p)
    return sorted(files, key=key)


def _render_events(run: str) -> list[tuple[float, str]]:
    from agent.events import event_files, format_event
    out = []
    for path in event_files(run):
        with open(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                out.append((rec.get("ts", 0.0), format_event(rec)))
    return sorted(out)


@tools.command("logs")
@click.argument("log_dir", required=False)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines.")
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Only this global rank's logs.")
@click.option("--events", is_flag=True, help="The agent's event log (faults, restarts, timings) instead.")
def logs(log_dir: Optional[str], follow: bool, rank: Optional[int], events: bool) -> None:
    """Show the newest run's logs (or those of LOG_DIR: a --log-dir or one run's directory)."""
    run = resolve_run(log_dir)
    click.echo(f"== {run}", err=True)
    if events:
        shown = 0
        while True:
            lines = _render_events(run)
            for _, text in lines[shown:]:
                click.echo(text)
            shown = len(lines)
            if not follow:
                return
            time.sleep(0.5)
    offsets: dict[str, int] = {}
    while True:
        for path in _rank_files(run, rank):
            m = re.search(r"attempt_(\d+)/rank_(\d+)/(std\w+)", path)
            label = f"[rank {m.group(2)} attempt {m.group(1)} {m.group(3)}] " if m else ""
            with open(path, "rb") as fh:
                fh.seek(offsets.get(path, 0))
                data = fh.read()
            if not data:
                continue
            cut = data.rfind(b"\n") + 1 if follow else len(data)
            offsets[path] = offsets.get(path, 0) + cut
            for line in data[:cut].decode(errors="replace").splitlines():
                sys.stdout.write(label + line + "\n")
        sys.stdout.flush()
        if not follow:
            return
        time.sleep(0.2)
