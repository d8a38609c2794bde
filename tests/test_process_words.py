"""What a user reads says what is true now, not how it came to be.

The package, the docs, the notebooks, the scripts a user runs and the README hold no
process words: "session", "issue 5", "run 65", "runs 62-67". A measurement is cited by
the file in ``lab/`` that holds its output (``lab/runs/<date>/<NN>_<what>``); the dated
journal, the raw outputs and the one-off sweeps live in ``lab/``, which this test does not
scan. Every text file under the scanned paths is read (binary files and ``__pycache__``
are skipped; a notebook's ``.ipynb`` is scanned as text, outputs included).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# "session(s)" anywhere; "issue N", "issues N"; "run N", "runs N" (which covers "runs N-M").
PROCESS_WORDS = re.compile(r"\bsessions?\b|\bissues? \d+|\bruns? \d+", re.IGNORECASE)

SCANNED = ["numbaflash", "docs", "notebooks", "scripts", "README.md"]
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def text_files(path):
    """The text files at ``path`` (a file, or every file under a folder), sorted."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        if SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts):
            continue
        data = p.read_bytes()
        if b"\0" in data:                     # binary (images, compiled files)
            continue
        try:
            yield p, data.decode("utf-8")
        except UnicodeDecodeError:            # not text either
            continue


def process_word_hits(path):
    """``file:line: text`` for each line under ``path`` that holds a process word."""
    hits = []
    for p, text in text_files(path):
        for number, line in enumerate(text.splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{number}: {line.strip()[:160]}")
    return hits


@pytest.mark.parametrize("name", SCANNED)
def test_no_process_words(name):
    path = ROOT / name
    assert path.exists(), f"{name} is missing"
    hits = process_word_hits(path)
    assert not hits, (f"{len(hits)} lines in {name} name the process instead of the result "
                      "(cite the lab/ file that holds the output instead):\n" + "\n".join(hits))


@pytest.mark.parametrize("text", [
    "measured in run 65", "Runs 62-67 timed it", "as issue 5 asks", "issues 5 and 6",
    "after session 11", "in this session", "Sessions 7 to 9", "a Jupyter session",
])
def test_the_pattern_catches_process_words(text):
    assert PROCESS_WORDS.search(text)


@pytest.mark.parametrize("text", [
    "the run of the bench", "a dry-run", "runtime", "rerun 5 times? no: rerun it",
    "issued 4 instructions", "lab/runs/2026-12-01/65_bench.json", "issue slots busy",
])
def test_the_pattern_leaves_other_words_alone(text):
    assert not PROCESS_WORDS.search(text)


def test_a_hit_is_reported_with_its_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("fine\nas run 3 showed\n")
    (tmp_path / "docs" / "plot.png").write_bytes(b"\x89PNG\0run 3")
    assert process_word_hits(tmp_path / "docs") == ["docs/page.md:2: as run 3 showed"]
