"""Every flag that `hyperpodrun --help` (and `hyperpodrun logs|inject|coordinator --help`) shows is
documented in docs/flags.md, in every spelling the help shows (`--nproc-per-node` and `--nproc_per_node`).

The flags are read from the help text of the installed command, run in a subprocess, so the test follows the
CLI wherever its code lives. Only the "Options:" section is read: the epilogue lists torchrun flags that are
refused, which docs/differences-from-torchrun.md covers."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAGS_PAGE = ROOT / "docs" / "flags.md"
COMMANDS = ((), ("logs",), ("inject",), ("coordinator",))


def _help(*sub: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb"}
    done = subprocess.run([sys.executable, "-m", "hyperpodrun", *sub, "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, f"`{' '.join(('hyperpodrun', *sub, '--help'))}` failed: {done.stderr}"
    return done.stdout


def flags_in_help(text: str) -> list[str]:
    """The option names of a click help text's "Options:" section, in order: every spelling on each option's
    own line (`  --nproc-per-node, --nproc_per_node TEXT  help...`), not the flags its help text mentions."""
    section = text.split("\nOptions:\n", 1)[1]
    names: list[str] = []
    for line in section.split("\n"):
        if line and not line.startswith(" "):
            break                                   # the next section
        m = re.match(r"  (-[^ ].*?)(?:\s{2,}|$)", line)
        if not m:
            continue                                # a wrapped help line, or the epilogue
        for name in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", m.group(1)):
            if name not in names:
                names.append(name)
    return names


def missing_from(page: str, flags: list[str]) -> list[str]:
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", page)]


@pytest.mark.parametrize("sub", COMMANDS, ids=lambda s: " ".join(("hyperpodrun", *s)))
def test_every_flag_of_the_help_is_on_the_flags_page(sub: tuple[str, ...]) -> None:
    flags = flags_in_help(_help(*sub))
    least = 40 if not sub else 4 if sub == ("coordinator",) else 5   # coordinator: --host, --port, -h, --help
    assert len(flags) >= least, f"too few flags read from the help: {flags}"
    missing = missing_from(FLAGS_PAGE.read_text(), flags)
    command = " ".join(("hyperpodrun", *sub, "--help"))
    assert not missing, f"{FLAGS_PAGE.relative_to(ROOT)} does not mention these flags of `{command}`: {missing}"


def test_both_spellings_are_read_and_a_missing_flag_is_named() -> None:
    text = ("Usage: hyperpodrun [OPTIONS]\n\nOptions:\n"
            "  --nproc-per-node, --nproc_per_node TEXT\n"
            "                                  Workers per node (see --inprocess-restart).\n"
            "  -m, --module                    Run as a module.\n"
            "  -h, --help                      Show this message and exit.\n\n"
            "  Refused torchrun flags and values (exit 2, one line):\n    --numa-binding: not implemented\n")
    flags = flags_in_help(text)
    assert flags == ["--nproc-per-node", "--nproc_per_node", "-m", "--module", "-h", "--help"]
    assert missing_from("`--nproc-per-node` `-m`, `--module`, `-h`, `--help`", flags) == ["--nproc_per_node"]
