"""LaunchConfig owns every check of a launch (hyperpodrun/launch/config.py): the CLI only maps click's values onto
its fields. These tests go through the same path as `hyperpodrun ...` (click's parsing, then
LaunchConfig.from_flags) without starting anything."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from hyperpodrun.cli import _env_sources, launch
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import ConfigError
from hyperpodrun.launch.flags import build_config


def _config(argv: list[str], env: dict[str, str] | None = None, monkeypatch: pytest.MonkeyPatch | None = None
            ) -> LaunchConfig:
    """What `hyperpodrun ARGV` would hand to the agent (ConfigError: the one line it would print)."""
    if env:
        assert monkeypatch is not None
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    with launch.make_context("hyperpodrun", list(argv)) as ctx:
        opts = dict(ctx.params)
        script, args = opts.pop("training_script"), opts.pop("training_script_args")
        return build_config(opts, script, args, _env_sources(ctx))


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for key in ("PET_NPROC_PER_NODE", "PET_NNODES", "PET_MAX_RESTARTS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "HYPERPODRUN_LOG_DIR", "HYPERPODRUN_INPROCESS_TIMEOUT", "HYPERPODRUN_JOB_SECRET", "PET_LOG_DIR"):
        monkeypatch.delenv(key, raising=False)
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_defaults_of_a_plain_launch(script: str, tmp_path: Path) -> None:
    cfg = _config(["--log-dir", str(tmp_path / "logs"), script, "--lr", "1"])
    assert (cfg.entrypoint, cfg.args, cfg.nnodes, cfg.nproc_per_node, cfg.node_rank) == (script, ["--lr", "1"], 1, 1, 0)
    assert (cfg.rdzv_backend, cfg.join_timeout, cfg.max_restarts, cfg.shutdown_timeout) == ("static", 600.0, 0, 30.0)
    assert cfg.redirects == {} and cfg.tee == {} and cfg.local_ranks_filter is None
    assert cfg.log_dir == str(tmp_path / "logs") and (tmp_path / "logs").is_dir(), "the log dir is checked and made"


def test_flag_text_becomes_field_values(script: str, tmp_path: Path) -> None:
    cfg = _config(["--log-dir", str(tmp_path), "--nproc-per-node", "3", "--tee", "0:3,2:1", "--redirects", "2",
                   "--local-ranks-filter", "2,0", "--shutdown-signal", "INT", "--signals-to-handle", "SIGTERM,15",
                   "--rdzv-conf", "timeout=90", "--pre-train-args", "-x 'a b'", script])
    assert cfg.nproc_per_node == 3
    assert cfg.tee == {0: 3, 1: 0, 2: 1} and cfg.redirects == {0: 2, 1: 2, 2: 2}
    assert cfg.local_ranks_filter == [0, 2] and cfg.shutdown_signal == 2 and cfg.signals_to_handle == [15, 15]
    assert cfg.join_timeout == 90.0 and cfg.pre_train_args == ["-x", "a b"]


def test_topology_is_derived_from_torchruns_flags(script: str, tmp_path: Path) -> None:
    static = _config(["--log-dir", str(tmp_path), "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                      "--master-port", "29555", script])
    assert (static.single_node, static.rdzv_host, static.rdzv_port, static.master_addr, static.node_rank) == \
        (False, "localhost", 29555, "10.0.0.1", 1)
    c10d = _config(["--log-dir", str(tmp_path), "--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "[::1]:29400", script])
    assert (c10d.rdzv_backend, c10d.rdzv_host, c10d.rdzv_port, c10d.node_rank) == ("c10d", "::1", 29400, None)
    standalone = _config(["--log-dir", str(tmp_path), "--standalone", script])
    assert (standalone.rdzv_backend, standalone.rdzv_port, standalone.node_rank) == ("c10d", 0, None)


BAD = [
    (["--nproc-per-node", "1025"], "--nproc-per-node '1025': must be a whole number of workers per node from 1 to 1024"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not a number or one of auto, gpu, cpu"),
    (["--nnodes", "1:2"], "--nnodes 1:2: an elastic range needs the c10d rendezvous"),
    (["--nnodes", "x"], "--nnodes 'x' is not a number of nodes"),
    (["--rdzv-conf", "join_timeout=inf"], "--rdzv-conf join_timeout=inf: must be a finite number of seconds"),
    (["--rdzv-conf", "join_timeout"], "--rdzv-conf item 'join_timeout' is not KEY=VALUE"),
    (["-t", "7:3"], "--tee '7:3': local rank 7 does not exist with 1 processes per node"),
    (["--redirects", "0:9"], "--redirects '0:9': '0:9' is not LOCAL_RANK:MODE"),
    (["--local-ranks-filter", "4"], "--local-ranks-filter '4': local ranks are 0..0"),
    (["--local-ranks-filter", "x"], "--local-ranks-filter must be a comma-separated list"),
    (["--no-python", "-m"], "--no-python and -m/--module cannot be used together"),
    (["--logs-specs", "my_specs"], "--logs-specs 'my_specs': hyperpodrun loads no LogsSpecs plugin"),
    (["--logs_specs", ""], "--logs-specs '': hyperpodrun loads no LogsSpecs plugin"),
    (["--start-method", "bogus"], "--start-method must be spawn, fork or forkserver"),
    (["--event-log-handler", "syslog"], "--event-log-handler 'syslog' is not supported"),
    (["--standalone", "--nnodes", "2"], "--standalone runs one node"),
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend 'etcd-v2' is not supported; use static, c10d or etcd"),
    (["--nnodes", "2", "--rdzv-backend", "etcd"], "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379,h2:0"], "--rdzv-endpoint 'h1:2379,h2:0': give each etcd member as HOST:PORT"),
    (["--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379"], "--nnodes 1:2: the etcd backend runs a fixed number of nodes"),
    (["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf", "protocol=ftp"],
     "--rdzv-conf protocol=ftp: must be http or https"),
    (["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf", "cacert=/no/such.pem"],
     "--rdzv-conf cacert=/no/such.pem needs protocol=https"),
    (["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf",
      "protocol=https,cacert=/no/such.pem"], "--rdzv-conf cacert=/no/such.pem: not a readable file"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:1", "--rdzv-conf", "protocol=https"],
     "--rdzv-conf protocol: only for --rdzv-backend etcd"),
    (["--rdzv-backend", "c10d"], "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--master-port", "0"], "--master-port: port 0 cannot be found by the other nodes"),
    (["--node-rank", "1"], "--node-rank 1 with one node; it must be 0"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is out of range for --nnodes 2"),
    (["--shutdown-signal", "SIGFOO"], "--shutdown-signal 'SIGFOO' is not a signal name"),
    (["--signals-to-handle", "SIGTERM,BOGUS"], "--signals-to-handle 'BOGUS' is not a signal name"),
    (["--shutdown-timeout", "1e400"], "--shutdown-timeout '1e400': must be a finite number of seconds"),
    (["--max-restarts", "1.5"], "--max-restarts '1.5': must be a whole number from 0 to 1000000"),
    (["--inprocess-restart", "--heartbeat-interval", "5", "--heartbeat-timeout", "2"],
     "--heartbeat-interval (5s) must be shorter than --heartbeat-timeout (2s)"),
    (["--pre-train-args", "'unclosed"], "--pre-train-args \"'unclosed\": No closing quotation"),
    (["--pre-train-script", "no-such-hook.sh"], "--pre-train-script 'no-such-hook.sh' does not exist"),
]


@pytest.mark.parametrize("flags, line", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_flags_are_one_line(script: str, tmp_path: Path, flags: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(["--log-dir", str(tmp_path), *flags, script])
    assert str(err.value).startswith(line), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flag", ["--logs-specs", "--logs_specs"])
def test_logs_specs_default_is_accepted(script: str, tmp_path: Path, flag: str) -> None:
    """torchrun's `--logs-specs default` names its own LogsSpecs: hyperpodrun's own layout, no error."""
    assert _config(["--log-dir", str(tmp_path), flag, "default", script]).entrypoint == script


def test_host_checks(script: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="training script .* does not exist"):
        _config(["--log-dir", str(tmp_path), str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match="is a directory, not a script"):
        _config(["--log-dir", str(tmp_path), str(tmp_path)])
    with pytest.raises(ConfigError, match="--log-dir .* is not writable"):
        _config(["--log-dir", str(Path(script) / "logs"), script])
    assert _config(["--log-dir", str(tmp_path), "-m", "no.such.module"]).module, "a module is found at start"


def test_environment_defaults_name_their_variable(script: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"--inprocess-timeout \(from HYPERPODRUN_INPROCESS_TIMEOUT\) 'nan'"):
        _config(["--log-dir", str(tmp_path), script], {"HYPERPODRUN_INPROCESS_TIMEOUT": "nan"}, monkeypatch)
    monkeypatch.delenv("HYPERPODRUN_INPROCESS_TIMEOUT")
    with pytest.raises(ConfigError, match=r"--shutdown-timeout \(from TORCH_ELASTIC_SHUTDOWN_TIMEOUT\) 'later'"):
        _config(["--log-dir", str(tmp_path), script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "later"}, monkeypatch)
    assert _config(["--log-dir", str(tmp_path), script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"},
                   monkeypatch).shutdown_timeout == 7.0
    assert _config(["--log-dir", str(tmp_path), "--shutdown-timeout", "3", script]).shutdown_timeout == 3.0, \
        "the flag wins over the variable"


def test_built_in_code_skips_the_host_checks() -> None:
    """Tests and tools build configs for scripts that need not exist; the field rules still hold."""
    cfg = LaunchConfig(entrypoint="not-here.py", nproc_per_node="2", tee="3")
    assert cfg.nproc_per_node == 2 and cfg.tee == {0: 3, 1: 3}
    with pytest.raises(ValidationError):
        LaunchConfig(entrypoint="x.py", max_restarts=-1)
    with pytest.raises(ConfigError, match="--no-python and -m/--module"):
        LaunchConfig(entrypoint="x.py", module=True, no_python=True)


@pytest.mark.parametrize("field", ["allow_inject", "rdzv_conf"])
def test_dead_fields_are_gone(field: str) -> None:
    with pytest.raises(ValidationError):
        LaunchConfig(entrypoint="x.py", **{field: {}})
    assert not hasattr(LaunchConfig(entrypoint="x.py"), "world_size_hint")


@pytest.mark.parametrize("flag", ["--log-line-prefix-template", "--log_line_prefix_template"])
def test_the_prefix_template_is_kept_as_written(script: str, tmp_path: Path, flag: str) -> None:
    cfg = _config(["--log-dir", str(tmp_path), flag, "${hostname}:${rank}: ", script])
    assert cfg.log_line_prefix_template == "${hostname}:${rank}: "


def test_the_prefix_template_comes_from_torchruns_variable(script: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PET_LOG_LINE_PREFIX_TEMPLATE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}] ")
    assert _config(["--log-dir", str(tmp_path), script]).log_line_prefix_template == "[${rank}] "


def test_the_prefix_renders_torchruns_macros() -> None:
    from hyperpodrun.launch.flag_syntax import render_prefix
    assert render_prefix("${hostname}:${rank}: ", "default", 5, 1, "vm") == "vm:5: "
    assert render_prefix("$role_name/${local_rank} ${other} $$ ", "trainer", 5, 1, "vm") == "trainer/1 ${other} $ "


def test_etcd_without_its_client_library_is_one_line(script: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--rdzv-backend etcd needs the optional extra: without etcd3gw, one line naming it (exit 2 at the CLI)."""
    import sys
    monkeypatch.setitem(sys.modules, "etcd3gw", None)    # `import etcd3gw` raises ImportError
    with pytest.raises(ConfigError) as err:
        _config(["--log-dir", str(tmp_path), "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                 "h1:2379,h2", script])
    assert str(err.value) == "--rdzv-backend etcd needs the etcd3gw package: pip install 'hyperpodrun[etcd]'"


def test_etcd_endpoints_and_tls(script: str, tmp_path: Path) -> None:
    """The members in the order given (port 2379 when left out); TLS files as given; one node needs none."""
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg = _config(["--log-dir", str(tmp_path), "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                   "h1:2379, h2 ,[::1]:2380", "--rdzv-conf", f"protocol=https,cacert={ca},coordinator_timeout=9",
                   script])
    assert cfg.etcd is not None and cfg.etcd.endpoints == [("h1", 2379), ("h2", 2379), ("::1", 2380)]
    assert (cfg.etcd.protocol, cfg.etcd.cacert, cfg.etcd.cert, cfg.coordinator_timeout) == ("https", str(ca), None, 9)
    assert cfg.node_rank is None and cfg.rdzv_backend == "etcd"
    assert _config(["--log-dir", str(tmp_path), "--rdzv-backend", "etcd", script]).etcd is None
