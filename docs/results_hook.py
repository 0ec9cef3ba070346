"""mkdocs hook: the benchmarks' figures, read from their data files into the pages.

A page names a figure, never copies it; the number and its provenance live once, in
``benchmarks/results/<script>.json`` (written by the script's run, see
benchmarks/results.py). In a page's Markdown:

- ``{{ figure bench_step/main/adagrad_vs_torch.zipf.1t }}``: the figure's text ("3.61x");
- ``{{ measured bench_step/main }}``: when, on which commit and machine, at what load and
  by which command that run was measured;
- ``{{ output bench_step/main }}``: what the run printed (its tables), as a code block.

A name that is not in the data files fails the build (mkdocs.yml loads this file under
``hooks``; ``mkdocs build --strict`` runs it), so a page cannot cite a figure that is gone.
"""
import importlib.util
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent
MACRO = re.compile(r"\{\{\s*(figure|measured|output)\s+([\w-]+)/([\w-]+)(?:/([\w.%-]+))?\s*\}\}")


def _results_module():
    spec = importlib.util.spec_from_file_location("distemb_bench_results",
                                                  ROOT / "benchmarks" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _results_module()


def record(bench, key):
    """The record ``key`` of ``benchmarks/results/<bench>.json``."""
    path = results.RESULTS_DIR / f"{bench}.json"
    data = results.load(path)
    if key not in data:
        raise PluginError(f"benchmarks/results/{bench}.json has no result {key!r} "
                          f"(it has {sorted(data)})")
    return data[key]


def measured(r):
    """One line: date, commit, machine, load, command (a record's ``note``, where the
    data file has one, stays there: how the record came to be, not what it measured)."""
    load = r.get("load")
    load = "" if load in (None, "-", "not recorded") else f", load average {load}"
    return (f"*Measured {r['date']}, commit `{r['commit']}`, {r['machine']}{load}:* "
            f"`{r['command']}`.")


def render(match, page):
    kind, bench, key, name = match.groups()
    r = record(bench, key)
    if kind == "figure":
        if name not in r["figures"]:
            raise PluginError(f"{page}: benchmarks/results/{bench}.json [{key}] has no figure "
                              f"{name!r} (it has {sorted(r['figures'])})")
        return r["figures"][name]["text"]
    if name is not None:
        raise PluginError(f"{page}: '{{{{ {kind} {bench}/{key} }}}}' takes no figure name")
    if kind == "measured":
        return measured(r)
    if not r["output"].strip():
        raise PluginError(f"{page}: benchmarks/results/{bench}.json [{key}] has no output")
    return "```\n" + r["output"].rstrip("\n") + "\n```"


def on_page_markdown(markdown, page, config, files):
    return MACRO.sub(lambda m: render(m, page.file.src_path), markdown)
