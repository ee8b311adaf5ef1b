"""The repository stays readable in an hour: the README's layout section names every
file git tracks, so that a reader finds the room for a change from it (results a run
writes, JSON and plots, may be named by their folder), and PERFORMANCE.md stays short."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return out.split()


def _layout_names() -> set[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout")
    block = text[text.index("```", start) + 3:]
    block = block[:block.index("```")]
    return set(re.split(r"[\s(),;:]+", block))


def _named(path: str, names: set[str]) -> bool:
    folder, _, name = path.rpartition("/")
    if path in names or name in names:
        return True
    # results (JSON, plots) go by their folder: its path or its last part
    return path.endswith((".json", ".png")) and bool(
        {f"{folder}/", f"{folder.rpartition('/')[2]}/"} & names)


def test_readme_layout_names_every_tracked_file():
    names = _layout_names()
    missing = [p for p in _tracked_files() if p != "README.md" and not _named(p, names)]
    assert not missing, f"README's layout does not name: {missing}"


def test_a_file_the_layout_does_not_name_is_found():
    names = _layout_names()
    assert not _named("memattn/kernels/unlisted.py", names)
    assert not _named("docs/unlisted/run.json", names)
    assert _named("memattn/kernels/turns.py", names | {"turns.py"})


def test_performance_notes_stay_the_present():
    """PERFORMANCE.md states the present in at most 36,000 characters (~390 lines: design,
    the latest run, a bullet a lever that did not pay), in lines of at most 100 characters
    (tables aside); the accounts behind each figure live in git. Twice it grew back past
    a thousand lines of A/B accounts, and a cap on lines alone it met with lines of 2,000
    characters: condense, don't append."""
    text = (ROOT / "PERFORMANCE.md").read_text()
    assert len(text) <= 36_000, f"PERFORMANCE.md has {len(text)} characters: condense it"
    long = [n for n, line in enumerate(text.splitlines(), 1)
            if len(line) > 100 and not line.startswith("|")]
    assert not long, f"PERFORMANCE.md lines {long} pass 100 characters: wrap them"
