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
    raw = (site / f"{page}.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_site_builds_without_warnings(site):
    page = (site / "api" / "index.html").read_text()
    assert "DistEmbedding" in page and "patch" in page  # the reference came from docstrings


def test_every_link_works_opened_from_disk_and_nothing_comes_from_the_network(site):
    """A browser on file:// shows a directory listing for a directory URL: every link of
    every built page (between pages, to their anchors, to the site's CSS, scripts and
    images) must name a file of the site, every #anchor an id on its page; no stylesheet,
    script or image is fetched from the network (the highlighting is the site's own)."""
    # 404.html is a web server's page (its links start at the server's root), never opened
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    ids = {p: set(re.findall(r'\bid="([^"]+)"', p.read_text())) for p in pages}
    followed = 0
    for page in pages:
        raw = page.read_text()
        for tag in re.findall(r"<(?:link|script|img)\b[^>]*>", raw):
            assert not re.search(r'(?:href|src)="(?:https?:)?//', tag), (page, tag)
        for target in re.findall(r'(?:href|src)="([^"]*)"', raw):
            target = html.unescape(target)
            if re.match(r"[a-z]+:|//", target):  # a link out (https://, mailto:)
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path.split("?")[0]).resolve() if path else page
            assert dest.is_file(), f"{page.relative_to(site)}: {target!r} is not a file"
            if anchor and dest.suffix == ".html":
                assert anchor in ids[dest], f"{page.relative_to(site)}: {target!r}: no anchor"
            followed += 1
    assert len(pages) > 20 and followed > 1000, (len(pages), followed)


def test_code_is_highlighted_by_the_site_itself(site):
    raw = (site / "quickstart.html").read_text()
    assert 'href="css/pygments.css"' in raw and (site / "css" / "pygments.css").is_file()
    # Pygments' spans: a keyword and a name in the quickstart's code
    assert re.search(r'<span class="kn">import</span>', raw), raw[:2000]
    assert "highlight.js" not in raw and "hljs" not in raw


def test_api_pages_show_signatures_with_every_argument(site):
    text = page_text(site, "api/optim")
    assert re.search(r"SparseAdam\(params: Params, lr: float = 0\.001, betas: Tuple\[float, "
                     r"float\] = \(0\.9, 0\.999\), eps: float = 1e-08, step_mode", text), text
    text = page_text(site, "api/tables")
    assert re.search(r"DistEmbedding\(num_embeddings", text), text


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
    for page in (site / "api").rglob("*.html"):
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
