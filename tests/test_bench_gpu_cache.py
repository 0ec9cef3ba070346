"""benchmarks/bench_gpu_cache.py runs end to end on the CPU stand-in (``--twin``).

The GPU checklist runs it on a GPU machine, where a broken import costs a lease: stop 29's
move of the id streams to benchmarks/id_streams.py left it calling bench_cache.zipf_stream,
found only on the GPU. This runs the same script here, briefly, and checks its table: the
uncached host table hits nothing and brings every id in; every cache hits and brings
fewer rows in than that; and the record it writes (key ``twin``, never the GPU's
``main``), into a temporary file.
"""
import json
import os
import re
import sys

import pytest

from mp_helper import ProcessGroup

pytest.importorskip("dgl")  # the WordNet loader needs it (the GPU machine has none)
pytestmark = pytest.mark.bench_smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_twin_run_prints_a_table_where_every_cache_brings_fewer_rows_in(tmp_path):
    streams = str(tmp_path / "streams.npz")
    data = tmp_path / "results.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu_cache.py"), "--twin",
           "--streams", "zipf", "--steps", "8", "--warmup", "2", "--rounds", "2",
           "--write-streams", streams, "--results", str(data)]
    with ProcessGroup() as group:
        p = group.spawn(cmd)
        out = group.wait_all(timeout=240)[p.pid]
    rows = {m[1]: (float(m[2]), float(m[3])) for m in
            re.finditer(r"^\s*(host|l[rf]u-\d+%)\s+([\d.]+)%\s+(\d+)", out, re.M)}
    assert set(rows) == {"host", "lru-5%", "lfu-5%", "lru-20%", "lfu-20%"}, out
    assert rows["host"] == (0.0, 13000.0), out
    for name, (hit, rows_in) in rows.items():
        if name != "host":
            assert hit > 0 and rows_in < rows["host"][1], (name, out)
    assert os.path.getsize(streams) > 0
    record = json.loads(data.read_text())
    assert list(record) == ["twin"], "a stand-in's run must not take the GPU run's key"
    figures = record["twin"]["figures"]
    assert figures["hit_rate.zipf.host"]["value"] == 0.0
    assert figures["hit_rate.zipf.lfu-20"]["value"] > 0
