"""The documentation site builds with warnings as errors.

``mkdocs build --strict`` fails on a broken link between pages, a page missing from the
nav, or an API reference (mkdocstrings) that cannot find or parse what it documents. The
site goes to a temporary directory. Needs the ``test`` extra (mkdocs-material,
mkdocstrings[python]).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))   # no banner about MkDocs 2 in the log
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
