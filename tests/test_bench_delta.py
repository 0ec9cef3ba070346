"""benchmarks/bench_delta.py runs end to end at tiny sizes and prints its tables: a full
save, a delta of each fraction asked for with its bytes and time against the full save,
and the step with versions tracked against one without (the script's own figures are in
docs/incremental.md; tests never assert on wall-clock time)."""
import os
import re
import sys

from mp_helper import ROOT, ProcessGroup


def test_a_tiny_run_prints_the_full_save_and_each_delta(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_delta.py"), "--rows", "2000",
           "--dim", "8", "--fractions", "0.01", "0.1", "--repeat", "2", "--batch", "64",
           "--steps", "3", "--dir", str(tmp_path / "ck"), "--results", "none"]
    os.mkdir(tmp_path / "ck")
    with ProcessGroup() as group:
        p = group.spawn(cmd)
        out = group.wait_all(timeout=120)[p.pid]
    assert "# bench_delta: rows=2,000 dim=8 float32, SparseAdagrad" in out, out
    assert "# CPU: " in out, out
    rows = re.findall(r"^\| (full|delta, (\d+)% of rows touched) \| ([\d,]+) \| +([\d.]+) \| "
                      r"([\d.]+) \| ([\d.]+)x \| ([\d.]+)x \|$", out, re.M)
    assert [(r[0], r[2]) for r in rows] == [("full", "2,000"),
                                            ("delta, 1% of rows touched", "20"),
                                            ("delta, 10% of rows touched", "200")], out
    full, one, ten = (float(r[5]) for r in rows)
    assert full == 1.0 and 0 < one < ten < 0.2, out  # bytes: about the share of rows
    assert re.search(r"^\| saved \(versions tracked\) \| [\d.]+ \| [\d.]+ \| [\d.]+x \| "
                     r"[\d.]+x \|$", out, re.M), out
    assert os.listdir(tmp_path / "ck") == [], "the benchmark left its checkpoints behind"
