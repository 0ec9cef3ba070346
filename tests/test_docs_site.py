"""The documentation site (mkdocs.yml, docs/) builds with no warning: ``make docs``.

``--strict`` turns every warning into a failure: a broken link or anchor between pages,
a page left out of the nav, an included example file that is missing, a docstring the API
reference cannot read. Beyond the build: the API reference covers the whole public API,
the examples on the site are the files the tests run, word for word, and the README is a
landing page whose quickstart is the tested file and whose links lead somewhere.
"""
import html
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

from mp_helper import ROOT

pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (make installs it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WARNING" not in run.stderr, run.stderr[-3000:]
    return out


def page_text(site, page):
    """The text of a built page, tags stripped (code is split into highlighted spans)."""
    raw = (site / page / "index.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_site_builds_without_warnings(site):
    page = (site / "api" / "index.html").read_text()
    assert "DistEmbedding" in page and "patch" in page  # the reference came from docstrings


def public_names():
    """(where it is exported, name, object) of every public class and function."""
    for package in ("distemb", "distemb.optim", "distemb.stores", "distemb.dgl"):
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield package, name, obj


def test_api_reference_covers_the_public_api(site):
    ids = set()
    for page in (site / "api").rglob("index.html"):
        ids.update(re.findall(r'id="(distemb[\w.]*)"', page.read_text()))
    missing = [f"{package}.{name} ({obj.__module__}.{obj.__qualname__})"
               for package, name, obj in public_names()
               if f"{obj.__module__}.{obj.__qualname__}" not in ids]
    assert not missing, f"public names with no entry in the API reference: {missing}"
    for module in ("distemb.checkpoint", "distemb.losses", "distemb.launch", "distemb.errors",
                   "distemb.config", "distemb.partition", "distemb.kernels.cuda",
                   "distemb.dgl.patch", "distemb.dgl.job", "distemb.integrations.dgl",
                   "distemb.stores.spec", "distemb.routers", "distemb.rules"):
        assert any(i == module or i.startswith(module + ".") for i in ids), module


INCLUDED = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)


def test_every_example_file_is_on_the_site_word_for_word(site):
    with open(os.path.join(ROOT, "docs", "examples.md")) as f:
        source = f.read()
    included = set(INCLUDED.findall(source))
    examples = {f"examples/{f}" for f in os.listdir(os.path.join(ROOT, "examples"))
                if f.endswith(".py")}
    assert examples | {"graph_examples/deepwalk.py", "graph_examples/graphsage.py"} <= included
    text = page_text(site, "examples")
    for path in included:
        with open(os.path.join(ROOT, path)) as f:
            for line in f:
                assert line.strip() in text, f"{path}: {line!r} is not on the examples page"


def test_readme_is_a_landing_page_into_the_site():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    # its quickstart is the file tests/test_examples.py runs
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as f:
        assert "```python\n" + f.read() + "```" in readme
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        if not re.match(r"[a-z]+://", target):
            assert os.path.exists(os.path.join(ROOT, target)), target
