"""benchmarks/bench_bag.py runs end to end at tiny sizes and prints its table: every
contender of every mode asked for, with a time and a ratio against the baseline, and
writes its record into the test's temporary directory (the script's own numbers are in
benchmarks/results/bench_bag.json; tests never assert on wall-clock time)."""
import json
import os
import re
import sys

import pytest

from mp_helper import ROOT, ProcessGroup

pytestmark = pytest.mark.bench_smoke


def test_a_tiny_run_prints_every_contender_of_every_mode(tmp_path):
    data = tmp_path / "results.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_bag.py"), "--rows", "500",
           "--dim", "8", "--bags", "32", "--length", "5", "--modes", "sum", "mean", "max",
           "--pool", "2", "--steps", "2", "--repeats", "2", "--warmup", "1",
           "--results", str(data)]
    with ProcessGroup() as group:
        p = group.spawn(cmd)
        out = group.wait_all(timeout=120)[p.pid]
    assert "# bench_bag: rows=500 dim=8 bags=32 length=5 ids/step=160" in out, out
    assert "# CPU: " in out, out
    rows = re.findall(r"^\| (\w+) +\| ([\w ]+?) +\| +([\d.]+) \| +([\d.]+) \| +([\d.]+)x \| "
                      r"+([\d.]+)x \|$", out, re.M)
    got = {(mode, name) for mode, name, *_ in rows}
    want = {(m, n) for m in ("sum", "mean", "max")
            for n in ("torch EmbeddingBag", "distemb bag", "distemb unpooled")}
    assert got == want, out
    for mode, name, ms, cpu_ms, ratio, cpu_ratio in rows:
        assert min(float(ms), float(cpu_ms), float(ratio), float(cpu_ratio)) > 0, (mode, name)
        if name == "torch EmbeddingBag":
            assert float(ratio) == float(cpu_ratio) == 1.0
    figures = json.loads(data.read_text())["main"]["figures"]
    assert figures["vs_torch_cpu.sum.EmbeddingBag"]["value"] == 1.0
    assert figures["vs_torch_cpu.max.bag"]["value"] > 0
