"""The documentation site (mkdocs.yml, docs/) builds with no warning: ``make docs``.

``--strict`` turns every warning into a failure: a broken link or anchor between pages,
a page left out of the nav, a docstring the API reference cannot read.
"""
import subprocess
import sys

import pytest

from mp_helper import ROOT

pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (make installs it)")


def test_site_builds_without_warnings(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WARNING" not in run.stderr, run.stderr[-3000:]
    page = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "DistEmbedding" in page and "patch" in page  # the reference came from docstrings
