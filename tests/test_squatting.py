"""Names another user can squat (issue 33, item 5), at their real defaults: another user's
`/dev/shm/hyperpodrun-<uid>` (the slot base), `/dev/shm/pdl_cache` (the old MMAP cache default, still named in
code) and `/dev/shm/pdl_cache-<uid>` (the new one) no longer end a job. The job runs in a mount namespace
with a private /dev/shm (as tests/nodes.py's nodes do), where uid 65534 created all three first: the agent
hands its worker a private slot base (event `slot_base_squatted`), both caches degrade to uncached reads with
one warning, the job finishes, and the other user's directories are left as they were."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import HYPERPODRUN, read_events, write_script

WORKER = r'''
import json, logging, os, sys
import torch
from hyperpodrun import CacheResumeMMAPConfig, CheckpointManager, MMAPDataLoader

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
cm = CheckpointManager()
state = {"w": torch.arange(3.0)}
cm.save(1, state)
cm.save(2, state)
slots = sorted(os.listdir(cm.slot_dir()))
got = {}
for name, cfg in (("default", CacheResumeMMAPConfig()), ("old", CacheResumeMMAPConfig(cache_dir="/dev/shm/pdl_cache"))):
    loader = MMAPDataLoader([torch.full((1,), float(i)) for i in range(3)], cfg, epochs=1, name=name)
    got[name] = [[s, b.item()] for s, b in loader.iter_from(0)]
with open(os.path.join(out, "worker.json"), "w") as fh:
    json.dump({"slot_dir": cm.slot_dir(), "slots": slots, "batches": got,
               "default_cache": CacheResumeMMAPConfig().cache_dir}, fh)
cm.close(success=True)
'''

_NAMESPACE = r'''
mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm || exit 99
for d in "hyperpodrun-$(id -u)" pdl_cache "pdl_cache-$(id -u)"; do
  setpriv --reuid=65534 --regid=65534 --clear-groups mkdir -m 777 "/dev/shm/$d" || exit 98
done
"$@"; rc=$?
stat -c '%u %a %n' /dev/shm/* > "$OUT/after"
for d in /dev/shm/*/; do ls -A "$d" >> "$OUT/after-contents"; done
exit $rc
'''


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="a private /dev/shm and another user need root (unshare, setpriv); CI runs as root")
def test_a_job_finishes_with_its_default_shm_names_squatted(launcher, tmp_path: Path, out_dir: Path) -> None:
    worker = write_script(tmp_path, "squatted.py", WORKER)
    log_dir = tmp_path / "logs"
    cmd = ["unshare", "--mount", "--propagation", "private", "bash", "-c", _NAMESPACE, "bash", HYPERPODRUN,
           "--log-dir", str(log_dir)]
    res = launcher.run(["--nproc-per-node", "1", str(worker), str(out_dir)], cmd=cmd, timeout=90,
                       env={"OUT": str(out_dir)})
    assert res.rc == 0, res
    uid = os.getuid()
    rec = json.loads((out_dir / "worker.json").read_text())
    [event] = [e for e in read_events(log_dir) if e["event"] == "slot_base_squatted"]
    assert event["path"] == f"/dev/shm/hyperpodrun-{uid}" and "uid 65534" in event["msg"]
    assert rec["slot_dir"].startswith(event["private"] + os.sep) and rec["slots"], rec   # slots were saved there
    assert rec["default_cache"] == f"/dev/shm/pdl_cache-{uid}"
    assert rec["batches"] == {"default": [[0, 0.0], [1, 1.0], [2, 2.0]], "old": [[0, 0.0], [1, 1.0], [2, 2.0]]}
    console = res.out + res.err
    assert console.count("MMAP data cache off") == 1 and "belongs to uid 65534" in console, res
    # the other user's three directories as they were (empty, theirs, 0777); the private base is gone
    after = sorted((out_dir / "after").read_text().splitlines())
    assert after == sorted(f"65534 777 /dev/shm/{d}" for d in (f"hyperpodrun-{uid}", "pdl_cache",
                                                                 f"pdl_cache-{uid}")), after
    assert (out_dir / "after-contents").read_text() == ""


LATE_WORKER = r'''
import json, os, stat, subprocess, sys
import torch
from hyperpodrun import CheckpointManager

out = sys.argv[1]
base = f"/dev/shm/hyperpodrun-{os.getuid()}"
# another user tries to take the slot base now, after the agent started and before this worker makes it
late = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "mkdir", "-m", "777", base],
                      capture_output=True, text=True)
cm = CheckpointManager()
cm.save(1, {"w": torch.arange(3.0)})
used = os.path.dirname(os.path.dirname(cm.slot_dir()))     # <base>/<run>/local<rank>
st = os.lstat(used)
with open(os.path.join(out, "worker.json"), "w") as fh:
    json.dump({"late_rc": late.returncode, "used": used, "uid": st.st_uid, "mode": stat.S_IMODE(st.st_mode),
               "dir": stat.S_ISDIR(st.st_mode), "slots": os.listdir(cm.slot_dir())}, fh)
cm.close(success=True)
'''

_SETUPS = {
    # nothing at start: the other user comes once the job runs (LATE_WORKER)
    "absent-at-start": "",
    # another user's symlink to a directory of theirs
    "symlink": 'setpriv --reuid=65534 --regid=65534 --clear-groups bash -c '
               '"mkdir -m 777 /dev/shm/theirs && ln -s /dev/shm/theirs /dev/shm/hyperpodrun-$(id -u)" || exit 98',
}
_LATE_NAMESPACE = r'''
mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm || exit 99
eval "$SETUP"
"$@"; rc=$?
stat -c '%u %F %n' /dev/shm/* > "$OUT/after"
exit $rc
'''


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="a private /dev/shm and another user need root (unshare, setpriv); CI runs as root")
@pytest.mark.parametrize("setup", sorted(_SETUPS))
def test_the_agent_makes_the_slot_base_itself_before_any_worker(launcher, tmp_path: Path, out_dir: Path,
                                                                 setup: str) -> None:
    """The agent creates `/dev/shm/hyperpodrun-<uid>` itself, 0700, before a worker runs: another user who
    tries to take it once the job runs cannot (before, the workers made it and the job failed); one who took
    it before the job (a symlink here) gets a private base instead. Either way the base used is ours, 0700."""
    worker = write_script(tmp_path, "late.py", LATE_WORKER)
    log_dir = tmp_path / "logs"
    cmd = ["unshare", "--mount", "--propagation", "private", "bash", "-c", _LATE_NAMESPACE, "bash", HYPERPODRUN,
           "--log-dir", str(log_dir)]
    res = launcher.run(["--nproc-per-node", "1", str(worker), str(out_dir)], cmd=cmd, timeout=90,
                       env={"OUT": str(out_dir), "SETUP": _SETUPS[setup]})
    assert res.rc == 0, res
    uid = os.getuid()
    base = f"/dev/shm/hyperpodrun-{uid}"
    rec = json.loads((out_dir / "worker.json").read_text())
    assert rec["late_rc"] != 0 and rec["slots"], rec                 # the other user could not take it
    assert rec["uid"] == uid and rec["mode"] == 0o700 and rec["dir"], rec
    squatted = [e for e in read_events(log_dir) if e["event"] == "slot_base_squatted"]
    after = (out_dir / "after").read_text().splitlines()
    if setup == "symlink":
        [event] = squatted
        assert event["path"] == base and "it is a symlink" in event["msg"], event
        assert rec["used"] == os.path.join(event["private"], f"hyperpodrun-{uid}"), rec
        assert f"65534 symbolic link {base}" in after, after           # theirs, left as it was
    else:
        assert not squatted and rec["used"] == base, (squatted, rec)
        assert not [line for line in after if line.startswith("65534 ")], after    # nothing of theirs there
