"""The Python examples in README.md and docs/*.md run, as a reader would paste them.

Every fenced block whose language starts with ``py`` (```python, ```py, ...) is an
example. A page's examples run in order in one namespace, in a fresh Python process with
NUMBA_ENABLE_CUDASIM=1 (one test per page, so a failure names the page; the message names
the block and its line). Shell blocks (```bash) are not examples.

A block that cannot run here (it needs a GPU, PyTorch or CuPy, or it is a fragment and not
a program) says so in the markdown, on the line before its fence (a blank line between is
allowed), with the reason:

    <!-- skip-test: needs a GPU (CuPy arrays) -->
    ```python
    ...

Each such block is reported as a skipped test with its page, number and reason
(``pytest -rs`` lists them). A block without the marker must run. The runner sets
``sys.setswitchinterval(2e-4)`` before the first block, as tests/conftest.py does: the
simulator's Python threads then hand over sooner, which makes a launch several times
faster and changes no result.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGE_TIMEOUT_S = 600

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
SKIP_MARKER = re.compile(r"^\s*<!--\s*skip-test:(?P<reason>.*?)-->\s*$")
MARKER_START = re.compile(r"<!--\s*skip-test")


@dataclass
class Block:
    page: str          # path relative to the repository
    number: int        # 1, 2, ... among the page's Python blocks
    line: int          # line of the opening fence (1-based)
    code: str
    skip: str | None   # the reason given in a skip-test marker, or None: it must run


def is_python(info):
    return info.lower().startswith("py")


def python_blocks(text, page="page"):
    """The Python blocks of a markdown text, in order. Raises ValueError for a skip-test
    marker without a reason, or one that is not followed by a Python block."""
    lines = text.splitlines()
    blocks, marker, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        m = SKIP_MARKER.match(line)
        if m:
            reason = m["reason"].strip()
            if not reason:
                raise ValueError(f"{page}:{i + 1}: a skip-test marker must give its reason")
            if marker is not None:
                raise ValueError(f"{page}:{marker[0]}: skip-test marker not followed by a "
                                 f"Python block")
            marker = (i + 1, reason)
            i += 1
            continue
        if MARKER_START.search(line):
            raise ValueError(f"{page}:{i + 1}: malformed skip-test marker (write "
                             f"<!-- skip-test: reason --> on a line of its own)")
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and marker is not None:
                raise ValueError(f"{page}:{marker[0]}: skip-test marker not followed by a "
                                 f"Python block")
            i += 1
            continue
        # A fenced block: find its closing fence (same character, at least as long).
        opening, indent, info = fence["fence"], fence["indent"], fence["info"]
        close = re.compile(rf"^[ \t]*{re.escape(opening[0])}{{{len(opening)},}}\s*$")
        end = i + 1
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:end]]
        if is_python(info):
            blocks.append(Block(page, len(blocks) + 1, i + 1,
                                textwrap.dedent("\n".join(body)) + "\n",
                                marker[1] if marker else None))
        elif marker is not None:
            raise ValueError(f"{page}:{marker[0]}: skip-test marker before a {info or 'plain'} "
                             f"block; only Python blocks run")
        marker = None
        i = end + 1
    if marker is not None:
        raise ValueError(f"{page}:{marker[0]}: skip-test marker not followed by a Python block")
    return blocks


def page_blocks(path):
    return python_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))


ALL_BLOCKS = [b for p in PAGES for b in page_blocks(p)]
RUN_PAGES = [p for p in PAGES if any(b.skip is None for b in page_blocks(p))]
SKIPPED = [b for b in ALL_BLOCKS if b.skip is not None]

# Runs a page's blocks (a JSON list on stdin) in one namespace; on an exception prints the
# traceback and "FAILED block N" and exits 1.
RUNNER = r"""
import json, sys, traceback
sys.setswitchinterval(2e-4)
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for b in blocks:
    print(f"--- block {b['number']} (line {b['line']})", flush=True)
    try:
        exec(compile(b["code"], f"{b['page']}, block {b['number']} (line {b['line']})",
                     "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED block {b['number']}", flush=True)
        sys.exit(1)
print("ALL BLOCKS RAN", flush=True)
"""


def run_blocks(blocks, cwd):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    payload = json.dumps([b.__dict__ for b in blocks])
    return subprocess.run([sys.executable, "-c", RUNNER], input=payload, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_page_examples_run(page, tmp_path):
    blocks = [b for b in page_blocks(page) if b.skip is None]
    result = run_blocks(blocks, tmp_path)
    out = result.stdout + result.stderr
    if result.returncode != 0 or "ALL BLOCKS RAN" not in result.stdout:
        failed = re.search(r"FAILED block (\d+)", result.stdout)
        which = blocks[int(failed[1]) - 1] if failed else None
        where = (f"block {which.number} (line {which.line})" if which
                 else f"the process (exit status {result.returncode})")
        pytest.fail(f"{page.relative_to(ROOT)}: {where} raised:\n{out[-6000:]}")
    skipped = [b for b in page_blocks(page) if b.skip is not None]
    print(f"{page.relative_to(ROOT)}: {len(blocks)} Python block(s) ran"
          + (f", {len(skipped)} marked skip-test" if skipped else ""))


@pytest.mark.parametrize("block", SKIPPED, ids=[f"{b.page}-block{b.number}" for b in SKIPPED])
def test_marked_block_is_skipped(block):
    pytest.skip(f"{block.page} block {block.number} (line {block.line}): {block.skip}")


def test_the_readme_and_the_docs_have_examples_to_run():
    pages = {b.page for b in ALL_BLOCKS if b.skip is None}
    assert "README.md" in pages, "no runnable Python block found in README.md"
    assert any(p.startswith("docs/") for p in pages), "no runnable Python block in docs/"


def test_the_extractor_reads_fences_markers_and_indentation():
    text = textwrap.dedent("""\
        # A page

        ```bash
        echo not python
        ```

        ```python
        x = 1
        ```

        <!-- skip-test: needs a GPU -->

        ```python
        raise RuntimeError("never run")
        ```

        - a list item:

          ```py
          y = x + 1
          ```

        ~~~~python
        ```
        z = 3
        ~~~~
        """)
    blocks = python_blocks(text)
    assert [(b.number, b.line, b.skip) for b in blocks] == [
        (1, 7, None), (2, 13, "needs a GPU"), (3, 19, None), (4, 23, None)]
    assert blocks[0].code == "x = 1\n"
    assert blocks[2].code == "y = x + 1\n"
    assert blocks[3].code == "```\nz = 3\n"


@pytest.mark.parametrize("text, message", [
    ("<!-- skip-test: -->\n```python\nx = 1\n```\n", "must give its reason"),
    ("<!-- skip-test: GPU -->\nsome prose\n```python\nx = 1\n```\n", "not followed by"),
    ("<!-- skip-test: GPU -->\n```bash\nls\n```\n", "only Python blocks run"),
    ("text\n<!-- skip-test: GPU -->\n", "not followed by"),
    ("<!-- skip-test GPU -->\n```python\nx = 1\n```\n", "malformed"),
], ids=["no reason", "prose between", "before bash", "at the end", "malformed"])
def test_a_misplaced_or_empty_marker_is_an_error(text, message):
    with pytest.raises(ValueError, match=message):
        python_blocks(text)


def test_a_failing_block_is_reported_with_its_number(tmp_path):
    blocks = [Block("page.md", 1, 3, "import numbaflash\nx = 1\n", None),
              Block("page.md", 2, 9, "assert x == 2, 'x is not 2'\n", None)]
    result = run_blocks(blocks, tmp_path)
    assert result.returncode == 1
    assert "FAILED block 2" in result.stdout
    assert "x is not 2" in result.stderr and "page.md, block 2 (line 9)" in result.stderr
