"""`hyperpodrun logs RUN --timeline out.png`: the recovery timeline of a run, drawn from its event log.

The phases come from the records the agents wrote (unit cases with hand-made records), and a real in-process
job with a SIGKILLed rank draws a PNG whose lanes show the killed rank respawned and the others abort, wait
at the barrier, restore and train again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import SCRIPTS
from hyperpodrun import timeline
from hyperpodrun.agent.observe.events import event_files

HYPERPODRUN = os.path.join(os.path.dirname(sys.executable), "hyperpodrun")


def ev(ts: float, event: str, **fields) -> dict:
    return {"ts": ts, "event": event, **fields}


def test_an_in_process_round_is_cut_into_the_recorded_phases():
    events = [ev(0.0, "worker_start", rank=0, generation=0), ev(0.0, "worker_start", rank=1, generation=0),
              ev(10.0, "fault", generation=0, rank=1),
              ev(10.1, "respawn", rank=1, generation=1), ev(10.1, "worker_start", rank=1, generation=1),
              ev(10.6, "rank_ready", rank=0, generation=1, abort_s=0.2, finalize_s=0.1, health_s=0.05),
              ev(12.0, "rank_ready", rank=1, generation=1, abort_s=0, finalize_s=0, health_s=0),
              ev(12.1, "go", generation=1), ev(12.5, "state_restored", generation=1, step=7),
              ev(20.0, "job_done")]
    segs = timeline.segments(events)
    assert timeline.phases_of(segs, 0) == ["training", "detection", "abort", "finalize", "barrier", "restore",
                                           "training"]
    assert timeline.phases_of(segs, 1) == ["training", "respawn", "barrier", "restore", "training"]
    by = {(s.rank, s.phase): s for s in segs if s.phase != "training"}
    assert (by[(0, "abort")].start, by[(0, "abort")].end) == (10.25, 10.45)   # abort and finalize end at READY
    assert (by[(0, "barrier")].start, by[(0, "barrier")].end) == (10.6, 12.1)
    assert (by[(1, "respawn")].start, by[(1, "respawn")].end) == (10.0, 12.0)
    assert by[(1, "restore")].end == 12.5
    assert max(s.end for s in segs) == 20.0


def test_a_process_level_restart_is_one_phase_for_every_rank():
    events = [ev(0.0, "worker_start", rank=0, generation=0), ev(0.0, "worker_start", rank=1, generation=0),
              ev(5.0, "fault", generation=0, rank=0), ev(9.0, "restart_done", generation=1),
              ev(9.0, "worker_start", rank=0, generation=1), ev(12.0, "job_done")]
    segs = timeline.segments(events)
    for rank in (0, 1):
        assert timeline.phases_of(segs, rank) == ["training", "restart", "training"]
    assert "restart" in timeline.summary(segs) and "2 rank(s)" in timeline.summary(segs)


def test_a_real_run_with_a_killed_rank_draws_its_timeline(tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "HYPERPODRUN_", "TORCHELASTIC_"))}
    env.update(OUT_DIR=str(out), MODE="allreduce", STEPS="16", DIM="64", FAULTS="kill:1:6:top")
    job = subprocess.run([HYPERPODRUN, "--nproc-per-node", "3", "--inprocess-restart", "--log-dir", str(logs),
                          "--rdzv-id", "tl", str(SCRIPTS / "ckpt_worker.py")], env=env, capture_output=True,
                         text=True, timeout=180)
    assert job.returncode == 0, job.stderr[-3000:]
    png = tmp_path / "timeline.png"
    drawn = subprocess.run([HYPERPODRUN, "logs", str(logs / "tl"), "--timeline", str(png)], capture_output=True,
                           text=True, timeout=60)
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "3 rank(s)" in drawn.stdout and "respawn" in drawn.stdout, drawn.stdout
    segs = timeline.segments(timeline.read_events(event_files(str(logs / "tl"))))
    assert timeline.phases_of(segs, 1)[:2] == ["training", "respawn"], timeline.phases_of(segs, 1)
    for survivor in (0, 2):
        phases = timeline.phases_of(segs, survivor)
        assert "abort" in phases and "barrier" in phases and phases[-1] == "training", phases


def test_timeline_of_a_run_without_workers_is_one_line_exit_2(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "node0.events.jsonl").write_text('{"ts": 1.0, "event": "agent_start"}\n')
    res = subprocess.run([HYPERPODRUN, "logs", str(run), "--timeline", str(tmp_path / "x.png")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "nothing to draw" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not Path(tmp_path / "x.png").exists()
