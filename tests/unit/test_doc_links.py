"""Every relative link and every anchor in README.md, BENCHMARKS.md and docs/ resolves.

A link `[text](path#anchor)` must name a file that exists relative to the linking file, and the anchor must be
one of that file's headings as GitHub writes it (lower case, punctuation dropped, spaces as hyphens, `-1`,
`-2`, ... for repeated headings). `[text](#anchor)` points into the linking file itself. Links with a scheme
(https:, mailto:) are not checked; links inside code blocks and code spans are not links."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _without_code(text: str, spans: bool = True) -> str:
    """The text with fenced code blocks (and, with `spans`, inline code spans) blanked; line numbers kept."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line) if spans else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text, lower case, every character that is not a
    letter, a mark, a number, `_`, `-` or a space dropped, and each space made a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)        # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()                # inline HTML
    kept = "".join(c for c in text
                   if c in "-_ " or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for a markdown file's headings (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _without_code(path.read_text(), spans=False).split("\n"):
        m = re.match(r" {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link in the file, outside code."""
    found = []
    for no, line in enumerate(_without_code(path.read_text()).split("\n"), 1):
        found += [(no, m.group(1)) for m in LINK.finditer(line)]
    return found


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    rel = _show(path)
    for no, target in links(path):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):     # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{rel}:{no}: [..]({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file {_show(dest)}")
            continue
        if not dest.is_relative_to(root):
            problems.append(f"{where}: points outside the repository")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: no heading in {_show(dest)} has the anchor #{anchor}")
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [p for path in _doc_files() for p in broken_links(path)]
    assert not problems, "broken links in the documentation:\n  " + "\n  ".join(problems)


def test_the_documentation_links_no_source_module() -> None:
    """The code layout changes; the docs name modules in backticks instead of linking to their files."""
    problems = [f"{path.relative_to(ROOT)}:{no}: [..]({target})" for path in _doc_files()
                for no, target in links(path)
                if re.match(r"^(\.\./)*(hyperpodrun|agent)/", target.split("#")[0])]
    assert not problems, "links to source files (name the module in backticks instead):\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("heading, expected", [
    ("Flags and environment", "flags-and-environment"),
    ("Elastic jobs (`--nnodes MIN:MAX`)", "elastic-jobs---nnodes-minmax"),
    ("Recovery side by side: hyperpodrun vs torchrun + checkpoints vs NVIDIA Resiliency Extension (CPU)",
     "recovery-side-by-side-hyperpodrun-vs-torchrun--checkpoints-vs-nvidia-resiliency-extension-cpu"),
    ("In-process restart on 2×H200 (NCCL) — issue 3", "in-process-restart-on-2h200-nccl--issue-3"),
    ("A replacement that is READY in 0.08 s: where a standby's rank spent its time",
     "a-replacement-that-is-ready-in-008-s-where-a-standbys-rank-spent-its-time"),
    ("Fault injection (tests and chaos drills)", "fault-injection-tests-and-chaos-drills"),
])
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_a_broken_link_and_a_broken_anchor_are_reported(tmp_path: Path) -> None:
    (tmp_path / "flags.md").write_text("# Flags\n")
    page = tmp_path / "probe.md"
    page.write_text("# Probe\n\n## A heading\n\n[ok](#a-heading) [ok](flags.md) [bad](no-such-page.md)\n"
                    "[bad anchor](#no-such-heading) `[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "no such file" in problems[0] and "no-such-page.md" in problems[0]
    assert "#no-such-heading" in problems[1]
