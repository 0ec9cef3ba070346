"""The benchmarks' data files and the pages that read them (benchmarks/results.py,
docs/results_hook.py).

A figure lives once, in ``benchmarks/results/<script>.json`` with its date, commit,
machine and command; pages name it (``{{ figure script/key/name }}``) and the site build
puts it in. Checked here without building the site: every data file is well formed,
every name a page uses exists, the hook renders what the file holds and refuses a name
it does not hold, naming it; and every benchmark script has its index entry, its data
file and its smoke test.
"""
import glob
import json
import os
import re
import sys

import pytest

from mp_helper import ROOT

BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import results  # noqa: E402

#: The measuring scripts (the rest of benchmarks/ are their parts: bench_systems,
#: id_streams, cache_report, netns, dgl_kvstore_job, thread_profile, results).
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in
                 glob.glob(os.path.join(BENCH, "bench_*.py")) if "bench_systems" not in p) + [
    "gpu_host_parts", "step_parts"]
MACRO = re.compile(r"\{\{\s*(figure|measured|output)\s+([\w-]+)/([\w-]+)(?:/([\w.%-]+))?\s*\}\}")


def data_files():
    return sorted(glob.glob(os.path.join(results.RESULTS_DIR, "*.json")))


@pytest.mark.parametrize("path", data_files(), ids=os.path.basename)
def test_every_record_says_when_where_and_how_it_was_measured(path):
    data = results.load(path)
    assert data, path
    for key, rec in data.items():
        where = f"{os.path.basename(path)} [{key}]"
        assert set(results.FIELDS) <= set(rec), (where, sorted(rec))
        assert re.match(r"20\d\d-\d\d-\d\d", rec["date"]), where
        assert re.match(r"[0-9a-f]{7}", rec["commit"]), where
        assert rec["machine"] and rec["output"].strip(), where
        script = os.path.basename(path)[:-5]
        assert f"{script}.py" in rec["command"], where
        for name, fig in rec["figures"].items():
            assert set(fig) == {"value", "text", "what"}, (where, name)
            assert fig["text"] and fig["what"], (where, name)


def test_every_script_has_an_index_entry_a_data_file_and_a_smoke_test():
    with open(os.path.join(BENCH, "README.md")) as f:
        index = f.read()
    smoke = ""
    for path in glob.glob(os.path.join(ROOT, "tests", "test_bench_*.py")):
        with open(path) as f:
            smoke += f.read()
    for script in SCRIPTS:
        assert f"`{script}.py`" in index, f"{script}.py has no entry in benchmarks/README.md"
        assert os.path.exists(os.path.join(results.RESULTS_DIR, f"{script}.json")), script
        assert f'"{script}.py"' in smoke, f"{script}.py has no smoke run"
    assert len(index.splitlines()) < 400, "benchmarks/README.md is an index, not a log"


def pages():
    return sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def test_every_figure_a_page_names_is_in_the_data_files():
    used = 0
    for page in pages():
        with open(page) as f:
            for kind, bench, key, name in MACRO.findall(f.read()):
                rec = results.load(os.path.join(results.RESULTS_DIR, f"{bench}.json")).get(key)
                assert rec is not None, (page, bench, key)
                if kind == "figure":
                    assert name in rec["figures"], (page, bench, key, name)
                used += 1
    assert used > 50  # docs/performance.md reads its figures from the files


def test_performance_page_copies_no_figure():
    """docs/performance.md quotes benchmark results only through the data files: no
    measured ratio ('3.61x', as the scripts print them) or rate written into its text
    (targets, such as '1.5x', are the page's own)."""
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        text = MACRO.sub("", f.read())
    text = re.sub(r"`[^`]*`", "", text)  # code: commands, sizes in names
    copied = re.findall(r"\b\d+\.\d\dx\b|\b\d+(?:\.\d+)? ?(?:steps/s|ms|us|GB/s)\b", text)
    assert copied == [], copied


@pytest.fixture(scope="module")
def hook():
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (make installs it)")
    import importlib.util
    spec = importlib.util.spec_from_file_location("results_hook",
                                                  os.path.join(ROOT, "docs", "results_hook.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Page:
    class file:
        src_path = "test.md"


def test_hook_puts_the_figure_and_its_provenance_in_the_page(hook, tmp_path, monkeypatch):
    rec = {"date": "2026-11-28 10:00 UTC", "commit": "abc1234", "machine": "a CPU, 2 cores",
           "command": "python benchmarks/bench_x.py --rows 5", "load": "1.0-2.0",
           "figures": {"speedup.zipf": {"value": 2.5, "text": "2.50x", "what": "x"}},
           "output": "| a | b |\n"}
    results.write(tmp_path / "bench_x.json", "main", rec)
    monkeypatch.setattr(hook.results, "RESULTS_DIR", tmp_path)
    page = hook.on_page_markdown("A {{ figure bench_x/main/speedup.zipf }} step.\n"
                                 "{{ measured bench_x/main }}\n{{ output bench_x/main }}",
                                 Page, None, None)
    assert page.startswith("A 2.50x step.\n*Measured 2026-11-28 10:00 UTC, commit `abc1234`, "
                           "a CPU, 2 cores, load average 1.0-2.0:* "
                           "`python benchmarks/bench_x.py --rows 5`.\n```\n| a | b |\n```")
    from mkdocs.exceptions import PluginError
    with pytest.raises(PluginError, match="has no figure 'speedup.uniform'"):
        hook.on_page_markdown("{{ figure bench_x/main/speedup.uniform }}", Page, None, None)
    with pytest.raises(PluginError, match=r"bench_x.json has no result 'quiet'"):
        hook.on_page_markdown("{{ measured bench_x/quiet }}", Page, None, None)


def test_recorder_writes_its_key_and_keeps_the_others(tmp_path, capsys):
    import argparse
    path = tmp_path / "r.json"
    results.write(path, "older", {"kept": True})
    p = argparse.ArgumentParser()
    results.add_arguments(p)
    args = p.parse_args(["--results", str(path), "--result-key", "new"])
    with results.Recorder("bench_x", args, ["--rows", "5", "--results", str(path)]) as rec:
        print("| table |")
        rec.figure("ratio", 1.234, "{:.2f}x", "a ratio")
    data = json.loads(path.read_text())
    assert data["older"] == {"kept": True}
    new = data["new"]
    assert new["output"] == "| table |\n" and new["figures"]["ratio"]["text"] == "1.23x"
    assert new["command"].endswith("python benchmarks/bench_x.py --rows 5")
    assert new["machine"] and new["date"] and new["commit"]
    with pytest.raises(RuntimeError):
        with results.Recorder("bench_x", args, []) as rec:
            raise RuntimeError("a run that fails")
    assert json.loads(path.read_text())["new"] == new, "a failed run must write nothing"
    with pytest.raises(ValueError, match="figure name"):
        rec.figure("a b", 1, "{}", "x")
