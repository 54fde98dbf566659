"""`hyperpodrun logs` (tail a run's worker logs or its event log), `hyperpodrun inject` (fault drills) and
`hyperpodrun coordinator` (the standalone coordination store, agent/coordination/coordinator.py).

Both read only our own trees and print no control characters (hyperpodrun/trusted_read.py)."""
from __future__ import annotations

import glob
import os
import re
import sys
import time
from typing import Optional

import click

from hyperpodrun import trusted_read as T
from hyperpodrun.launch.config import default_log_dir, temp_log_base


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def tools() -> None:
    """Tools around hyperpodrun jobs."""


def _runs(log_dir: str) -> tuple[list[str], list[str]]:
    """(run directories of ours under `log_dir`, oldest first; the names of those skipped as not ours)."""
    if not os.path.isdir(log_dir):
        return [], []
    runs: list[str] = []
    skipped: list[str] = []
    for d in os.listdir(log_dir):
        path = os.path.join(log_dir, d)
        if not os.path.isdir(path) or not glob.glob(os.path.join(path, "*.events.jsonl")):
            continue
        (runs if T.is_ours(path) else skipped).append(path)
    return sorted(runs, key=lambda p: os.lstat(p).st_mtime), skipped


def _trusted(path: str, private: bool = False) -> None:
    try:
        T.check_dir(path, private)
    except T.UnsafePathError as exc:
        raise click.UsageError(f"not reading {T.printable(str(exc))}. hyperpodrun reads only its own log "
                               "directories: remove it, or pass the --log-dir the job used") from None


def resolve_run(path: Optional[str]) -> str:
    """A run directory of ours from: nothing (newest under the default log dir), a log dir, or a run dir."""
    base = os.path.abspath(path) if path else default_log_dir()
    if path is None and base == temp_log_base() and os.path.lexists(base):
        _trusted(base, private=True)   # the per-user temp base: ours alone, as the launcher makes it
    if glob.glob(os.path.join(base, "*.events.jsonl")):
        _trusted(base)
        return base
    runs, skipped = _runs(base)
    if not runs:
        other = f" ({len(skipped)} run(s) there are not this user's: not read)" if skipped else ""
        raise click.UsageError(f"no hyperpodrun run found under {T.printable(base)!r}{other}; pass the --log-dir "
                               "the job used")
    return runs[-1]


def _rank_files(run: str, rank: Optional[int]) -> list[str]:
    pattern = os.path.join(run, "attempt_*", f"rank_{rank}" if rank is not None else "rank_*", "std*.log")
    files = glob.glob(pattern)

    def key(p: str) -> tuple[int, int, str]:
        m = re.search(r"attempt_(\d+)/rank_(\d+)/(std\w+)", p)
        return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else (0, 0, p)
    return sorted(files, key=key)


def _render_events(run: str) -> list[tuple[float, str]]:
    from hyperpodrun.agent.observe.events import format_event
    return [(rec["ts"], T.printable(format_event(rec))) for rec in T.read_events(run)]


@tools.command("logs")
@click.argument("log_dir", required=False)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines.")
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Only this global rank's logs.")
@click.option("--events", is_flag=True, help="The agent's event log (faults, restarts, timings) instead.")
@click.option("--timeline", "timeline_png", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Draw the run's recovery timeline (one lane per rank, coloured phases) into this PNG file "
                   "(needs matplotlib: pip install 'hyperpodrun[timeline]').")
def logs(log_dir: Optional[str], follow: bool, rank: Optional[int], events: bool,
         timeline_png: Optional[str]) -> None:
    """Show the newest run's logs (or those of LOG_DIR: a --log-dir or one run's directory)."""
    run = resolve_run(log_dir)
    click.echo(f"== {run}", err=True)
    if timeline_png is not None:
        _draw_timeline(run, timeline_png)
        return
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
    if rank is not None and not follow and not _rank_files(run, rank):
        found = (re.search(r"rank_(\d+)/", p) for p in _rank_files(run, None))
        here = sorted({int(m.group(1)) for m in found if m})
        raise click.UsageError(f"no log files for rank {rank} in {run} (ranks here: "
                               f"{', '.join(map(str, here)) or 'none'})")
    offsets: dict[str, int] = {}
    refused: set[str] = set()
    while True:
        for path in _rank_files(run, rank):
            m = re.search(r"attempt_(\d+)/rank_(\d+)/(std\w+)", path)
            label = f"[rank {m.group(2)} attempt {m.group(1)} {m.group(3)}] " if m else ""
            try:
                data = T.read_bytes(path, offsets.get(path, 0))
            except (OSError, T.UnsafePathError) as exc:
                if path not in refused:
                    refused.add(path)
                    click.echo(f"hyperpodrun logs: skipped {T.printable(str(exc))}", err=True)
                continue
            if not data:
                continue
            cut = data.rfind(b"\n") + 1 if follow else len(data)
            offsets[path] = offsets.get(path, 0) + cut
            for line in data[:cut].decode(errors="replace").splitlines():
                sys.stdout.write(label + T.printable(line) + "\n")
        sys.stdout.flush()
        if not follow:
            return
        time.sleep(0.2)


def _draw_timeline(run: str, png: str) -> None:
    from hyperpodrun import timeline
    from hyperpodrun.errors import MissingDependencyError
    segs = timeline.segments(T.read_events(run))
    if not segs:
        raise click.UsageError(f"no worker started in {run}'s event log: nothing to draw")
    try:
        timeline.draw(segs, png, title=os.path.basename(run))
    except MissingDependencyError as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:
        raise click.UsageError(f"cannot write {png}: {exc.strerror or exc}") from None
    click.echo(f"wrote {png}: {timeline.summary(segs)}")


GPU_KINDS = ("nvml-xid", "gpu-lost")


@tools.command("inject")
@click.argument("log_dir", required=False)
@click.option("--rank", type=click.IntRange(min=0), required=True, help="Global rank to hit.")
@click.option("--kind", type=click.Choice(["kill", "segv", "exit", "raise", "hang", "hang-gil", "hang-c", *GPU_KINDS]),
              required=True, help="kill/segv/exit: the process dies; raise: an exception; hang: a Python loop; "
              "hang-gil: a C call holding the GIL; hang-c: a C call without the GIL (like a stuck collective); "
              "nvml-xid: a synthetic NVML XID event (--xid) on the rank's GPU; gpu-lost: its GPU stops answering.")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="Fire when the rank reports progress at or past this step (default: now / next progress).")
@click.option("--exit-code", type=click.IntRange(0, 255), default=1, help="Exit code for --kind exit.")
@click.option("--xid", type=click.IntRange(min=0), default=None, help="XID number for --kind nvml-xid (e.g. 79).")
@click.option("--timeout", type=float, default=10.0, help="Seconds to wait for the agent's answer.")
def inject(log_dir: Optional[str], rank: int, kind: str, step: Optional[int], exit_code: int, xid: Optional[int],
           timeout: float) -> None:
    """Inject a fault into a running job (chaos drills, tests).

    Process faults need a job started with --inprocess-restart; GPU events (nvml-xid, gpu-lost) go to the
    agent's GPU health handling, as if NVML had reported them, in any job with --health-check auto or nvml.
    """
    import zmq

    from hyperpodrun import protocol as P
    if kind in GPU_KINDS and step is not None:
        raise click.UsageError(f"--step does not apply to --kind {kind}: a GPU event is delivered now")
    if kind == "nvml-xid" and xid is None:
        raise click.UsageError("--kind nvml-xid needs --xid N (e.g. --xid 79: GPU fallen off the bus)")
    if kind != "nvml-xid" and xid is not None:
        raise click.UsageError("--xid only goes with --kind nvml-xid")
    from hyperpodrun.agent.control.agent_info import AgentInfo
    run = resolve_run(log_dir)
    target = None
    for path in sorted(glob.glob(os.path.join(run, "node*.agent.json"))):
        try:
            info = AgentInfo.read(path)   # a regular file of ours only (trusted_read)
        except (OSError, ValueError, T.UnsafePathError) as exc:
            click.echo(f"hyperpodrun inject: skipped {T.printable(str(exc).splitlines()[0] if str(exc) else path)}",
                       err=True)
            continue
        if info.hosts(rank):
            target = info
    if target is None:
        raise click.UsageError(f"no running agent of {run} that takes injections hosts rank {rank} (process faults "
                               "need --inprocess-restart; GPU events need --health-check auto or nvml)")
    ctx = zmq.Context()
    deadline = time.monotonic() + timeout
    try:
        while True:   # a rank still starting up ("not connected yet") is retried until the timeout
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(target.control)
            sock.send(P.encode(P.InjectRequest.model_validate(   # click's Choice already limits --kind to InjectKind
                {"rank": rank, "kind": kind, "step": step, "exit_code": exit_code, "xid": xid})))
            left = max(0.0, deadline - time.monotonic())
            if not sock.poll(int(left * 1000)):
                sock.close()
                raise click.ClickException(f"the agent (pid {target.pid}) did not answer within {timeout:g}s; "
                                           "is the job still running?")
            reply = P.decode(sock.recv())
            sock.close()
            if getattr(reply, "ok", False) or "not connected yet" not in getattr(reply, "detail", "") \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        ctx.term()
    if not getattr(reply, "ok", False):
        raise click.ClickException(T.printable(getattr(reply, "detail", "refused")))
    click.echo(T.printable(getattr(reply, "detail", "ok")))


@tools.command("coordinator")
@click.option("--host", required=True, metavar="ADDRESS",
              help="The address to listen on: this machine's address on the jobs' network (0.0.0.0: every "
                   "interface, with a warning).")
@click.option("--port", type=click.IntRange(1, 65535), required=True,
              help="The port; the agents' --rdzv-endpoint is ADDRESS:PORT.")
def coordinator(host: str, port: int) -> None:
    """Serve the agents' coordination store on ADDRESS:PORT until SIGTERM/SIGINT (CPU only, no workers).

    Agents started with --rdzv-backend c10d --rdzv-endpoint ADDRESS:PORT use it and host no coordination store
    themselves, so any node - node 0 included - can be lost and replaced (docs/deployment.md). Start it before
    the agents; one coordinator per job unless the jobs trust each other (docs/security.md)."""
    import logging

    from hyperpodrun import netaddr
    from hyperpodrun.errors import HyperpodrunError
    from hyperpodrun.launch import settings
    try:
        settings.use(settings.load())
    except HyperpodrunError as exc:
        raise click.UsageError(str(exc)) from None
    ours = [a for a in netaddr.addresses_of(host) if a in ("0.0.0.0", "::") or netaddr.is_bindable(a)]
    if not ours:
        raise click.UsageError(f"--host {host!r} is not an address of this machine; give one of its addresses "
                               "(or 0.0.0.0 for every interface)")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[hyperpodrun coordinator %(asctime)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hyperpodrun")
    root.handlers[:] = [handler]
    root.setLevel(settings.current().log_level)
    root.propagate = False
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # broken agent connections are no news here
    from hyperpodrun.agent.coordination.coordinator import serve
    try:
        code = serve(ours[0], port)
    except HyperpodrunError as exc:
        root.error("hyperpodrun coordinator: %s", exc)
        code = 1
    logging.shutdown()
    sys.exit(code)
