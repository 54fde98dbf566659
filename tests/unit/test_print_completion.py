"""--print-completion / --print_completion (torchrun's): click's own completion script for bash and zsh, exit 0;
tcsh, which click has no script for, is one usage line, exit 2. The script's completion works: click answers
the completion variable it sets."""
from __future__ import annotations

import pytest

from hyperpodrun.cli import COMPLETE_VAR, main


def _main(argv: list[str]) -> int:
    """main's exit status: its SystemExit, or 0 when it returns (click's eager options such as --version end
    that way with standalone_mode off)."""
    try:
        main(argv)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


@pytest.mark.parametrize("flag", ["--print-completion", "--print_completion"])
def test_bash_and_zsh_scripts_come_from_click(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    assert _main([flag, "bash"]) == 0
    bash = capsys.readouterr().out
    assert f"{COMPLETE_VAR}=bash_complete" in bash and "-F _hyperpodrun_completion hyperpodrun" in bash
    assert _main([flag, "zsh"]) == 0
    zsh = capsys.readouterr().out
    assert zsh.startswith("#compdef hyperpodrun") and f"{COMPLETE_VAR}=zsh_complete" in zsh


def test_tcsh_and_an_unknown_shell_are_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["--print-completion", "tcsh"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.strip().splitlines() == [
        "Error: --print-completion tcsh: click's shell completion has no tcsh script; use bash or zsh"]
    assert _main(["--print-completion", "fish"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "'fish' is not one of 'bash', 'zsh', 'tcsh'" in line, line


def test_the_script_completes_the_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPLETE_VAR, "bash_complete")
    monkeypatch.setenv("COMP_WORDS", "hyperpodrun --nproc")
    monkeypatch.setenv("COMP_CWORD", "1")
    assert _main([]) == 0
    assert capsys.readouterr().out.split() == ["plain,--nproc-per-node", "plain,--nproc_per_node"]
