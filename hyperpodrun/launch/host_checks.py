"""Facts of this machine a launch depends on, and the checks against them: GPU and CPU counts, whether the
workers would see a CUDA GPU (what `--standby-workers auto` goes by), this host's address, the log directory
(writable, not full, ours alone), the scripts and programs to run, the NVML library.

LaunchConfig runs the checks when it is built from the command line (`LaunchConfig.from_flags`, the
"host" validation context in hyperpodrun/launch/config.py); a LaunchConfig built in code (tests, tools) skips the
ones that touch the file system. Every problem is a ConfigError naming the flag and the fix.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from typing import Callable, Mapping, Optional

from hyperpodrun.launch import settings
from hyperpodrun.errors import ConfigError

#: bytes the start-up probe writes into --log-dir: a full filesystem refuses data, not always an empty file
LOG_PROBE_BYTES = 64 * 1024


def count_workers(word: str) -> int:
    """`--nproc-per-node cpu|gpu|auto|cuda` -> the number of CPUs (this process's affinity) or GPUs."""
    if word == "cpu":
        return len(os.sched_getaffinity(0))
    if word in ("gpu", "auto", "cuda"):
        import torch
        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
        if word == "auto":
            return len(os.sched_getaffinity(0))
        raise ConfigError("--nproc-per-node gpu: no CUDA GPU is visible on this node; give a number instead")
    raise ConfigError(f"--nproc-per-node {word!r} is not a number or one of auto, gpu, cpu")


#: the NVIDIA driver's device files, one per GPU (/dev/nvidia0, ...): there on a host, or in a container,
#: that has CUDA GPUs; looking needs no library (NVML or torch would open the driver)
NVIDIA_DEVICES = "/dev/nvidia[0-9]*"
#: standbys per local rank that `--standby-workers auto` starts on a host with CUDA GPUs
AUTO_STANDBY_WORKERS = 1


def cuda_gpus(env: Optional[Mapping[str, str]] = None, devices: Optional[str] = None) -> tuple[bool, str]:
    """Whether the workers of this host would see a CUDA GPU, and why in a few words.

    Decided without loading torch or the driver, so that the default `--standby-workers auto` costs a launch
    nothing: a GPU device file of the NVIDIA driver exists (`devices`) and CUDA_VISIBLE_DEVICES, when set,
    does not hide every GPU (CUDA stops at its first entry that is not an index or a GPU-/MIG- UUID, so an
    empty value or -1 hides them all). `env` is os.environ and `devices` NVIDIA_DEVICES unless given."""
    cvd = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        first = cvd.split(",")[0].strip()
        if not (first.isdigit() or first.upper().startswith(("GPU-", "MIG-"))):
            return False, f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU"
    if not glob.glob(devices or NVIDIA_DEVICES):
        return False, "no CUDA GPU on this host"
    return True, "CUDA present"


def standby_auto(inprocess_restart: bool, script_entry: bool,
                 detect: Optional[Callable[[], tuple[bool, str]]] = None) -> tuple[int, str]:
    """`--standby-workers auto` -> (standbys per local rank, why). The default, so it never fails a launch:
    AUTO_STANDBY_WORKERS where standbys pay off (an in-process restart of a script on a CUDA host: a standby
    saves the replacement its CUDA context, NCCL's start and the kernels' loading), 0 wherever they cannot
    run (no --inprocess-restart, a -m or --no-python entry point) or save little (no GPU). `detect` (default
    `cuda_gpus`) is asked only when the rest allows standbys."""
    if not inprocess_restart:
        return 0, "auto: no --inprocess-restart"
    if not script_entry:
        return 0, "auto: standbys need a script entry point, not -m/--no-python"
    present, why = (detect or cuda_gpus)()
    return (AUTO_STANDBY_WORKERS if present else 0), f"auto: {why}"


def own_address(local_addr: Optional[str]) -> str:
    """--local-addr, else this host's FQDN as torchrun's c10d rendezvous gives it ('localhost' if it does not
    resolve: the workers must reach the agent's store)."""
    if local_addr:
        return local_addr
    fqdn = socket.getfqdn()
    try:
        socket.getaddrinfo(fqdn, None)
    except OSError:
        return "localhost"
    return fqdn


# ------------------------------------------------------------------------------------------ log directory
def temp_log_base() -> str:
    """The per-user log directory in the temp dir (`$TMPDIR/hyperpodrun-logs-<uid>`): a predictable path in a
    directory every user can write, so it is kept ours alone (`private_log_base`)."""
    return os.path.join(tempfile.gettempdir(), f"hyperpodrun-logs-{os.getuid()}")


def default_log_dir(create: bool = False) -> str:
    """Where logs go without --log-dir; `hyperpodrun logs` looks here by default too.

    HYPERPODRUN_LOG_DIR (hyperpodrun/launch/settings.py) / PET_LOG_DIR are the user's, like --log-dir; otherwise the
    per-user temp dir, which `create=True` makes (or accepts) as ours alone - ConfigError when another user
    got there first."""
    given = settings.current().log_dir or os.environ.get("PET_LOG_DIR")   # PET_*: torchrun's, as click reads them
    if given:
        return given
    return private_log_base() if create else temp_log_base()


def private_log_base() -> str:
    """Create `temp_log_base()` 0700, or accept it only when it is a real directory of ours that nobody else
    can write (one of ours that is merely readable by others, from an older version, is narrowed to 0700)."""
    from hyperpodrun import safe_fs
    path = temp_log_base()
    try:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077
                    and not st.st_mode & 0o022):
                os.chmod(path, 0o700)
        return safe_fs.private_dir(path)
    except (OSError, safe_fs.UnsafePathError) as exc:
        raise ConfigError(f"the default log directory is not safe to use: {exc}; or give --log-dir DIR") from None


def check_log_dir(path: str) -> str:
    """`path` as an absolute path once it exists and takes data (a write probe: a full filesystem fails)."""
    path = os.path.abspath(os.path.expanduser(path))
    probe = os.path.join(path, f".hyperpodrun-write-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\0" * LOG_PROBE_BYTES)   # ENOSPC here (local filesystems) or at close (NFS)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(f"--log-dir {path!r}: its filesystem is full ({exc.strerror}); free some space "
                              "or pick another directory") from None
        raise ConfigError(f"--log-dir {path!r} is not writable ({exc.strerror or exc}); "
                          "pick a directory you can write to") from None
    return path


# ------------------------------------------------------------------------------------------ what runs
def _not_a_directory(entry: str, flag: str, what: str) -> None:
    """A script or program path that is not a file: say whether it is missing or a directory."""
    if os.path.isdir(entry):
        raise ConfigError(f"{flag} {entry!r} is a directory, not a {what}; give the {what} inside it")


def check_entrypoint(entry: str, module: bool, no_python: bool, run_path: bool) -> None:
    """The training script exists (a module is found by Python at start; a --no-python program is a file or
    on PATH)."""
    if not module and not no_python:
        if not os.path.isfile(entry):
            _not_a_directory(entry, "training script", "script")
            raise ConfigError(f"training script {entry!r} does not exist; check the path "
                              "(or use -m for a module, --no-python for a program)")
    elif no_python and not run_path:
        if not (os.path.isfile(entry) or shutil.which(entry)):
            _not_a_directory(entry, "--no-python: program", "program")
            raise ConfigError(f"--no-python: program {entry!r} is neither a file nor on PATH")


def check_hook_script(path: Optional[str], flag: str) -> None:
    """A --pre-train-script / --post-train-script that is given exists."""
    if path and not os.path.isfile(path):
        _not_a_directory(path, flag, "script")
        raise ConfigError(f"{flag} {path!r} does not exist")


def check_nvml() -> None:
    """`--health-check nvml` needs the NVML library and a GPU it can query."""
    from hyperpodrun.agent.health.nvml_backend import NVML_FIX, probe_nvml
    problem = probe_nvml()
    if problem:
        raise ConfigError(f"--health-check nvml: {problem}. Fix: {NVML_FIX}")


#: the modes of torchrun's --numa-binding (torch.numa.binding.AffinityMode)
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
# run in a child, so that the agent itself never starts CUDA: the CPUs torch.numa.binding picks for the GPU of
# each local rank (`cuda:<local rank>`, as torchrun passes gpu_index=local_rank), as JSON
_NUMA_PROBE = r"""
import json, sys
import torch
try:
    from torch.numa import binding
except ImportError:
    sys.exit("this torch has no torch.numa.binding (torch 2.9 or newer)")
if not torch.cuda.is_available():
    sys.exit("No accelerator available for NUMA binding")
mode, nproc, count = sys.argv[1], int(sys.argv[2]), torch.cuda.device_count()
options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
cpus = {}
for lr in range(nproc):
    if lr >= count:
        sys.exit(f"local rank {lr} has no GPU cuda:{lr} to bind near ({count} visible)")
    cpus[lr] = sorted(binding._get_logical_cpus_to_bind_to(gpu_index=lr, numa_options=options))
    if not cpus[lr]:
        sys.exit(f"no CPUs to bind local rank {lr} to")
print(json.dumps(cpus))
"""


def check_status_api(port: Optional[int], host: str, token_file: Optional[str]) -> None:
    """--metrics-port, --metrics-host and --api-token-file (agent/observe/http_api.py) before anything starts: the
    token file needs the server, the server needs prometheus-client (the `metrics` extra) and an address of this
    host whose port is free, and the token must be readable - each a usage error (exit 2), never a failed job."""
    if token_file and port is None:
        raise ConfigError("--api-token-file needs --metrics-port: the status API is served on the metrics port; "
                          "add --metrics-port PORT or drop --api-token-file")
    if port is None:
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError("--metrics-port needs the prometheus-client package: pip install 'hyperpodrun[metrics]'") \
            from None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except OSError as exc:
        raise ConfigError(f"--metrics-host {host} --metrics-port {port}: cannot listen there "
                          f"({getattr(exc, 'strerror', None) or exc}); give an address of this host and a free port") \
            from None
    if token_file:
        from hyperpodrun import auth
        auth.read_api_token(token_file)


def numa_cpus(mode: str, nproc: int) -> dict[int, list[int]]:
    """--numa-binding MODE: the CPUs of each local rank, as torch.numa.binding (torchrun's) chooses them near its
    GPU. ConfigError with torch's reason where it cannot (no GPU: "No accelerator available for NUMA binding")."""
    try:
        done = subprocess.run([sys.executable, "-c", _NUMA_PROBE, mode, str(nproc)], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"--numa-binding {mode}: cannot ask torch.numa.binding ({exc})") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise ConfigError(f"--numa-binding {mode}: {lines[-1] if lines else 'torch.numa.binding failed'}; run "
                          "on a host with GPUs or drop --numa-binding")
    return {int(lr): list(cpus) for lr, cpus in json.loads(done.stdout).items()}
