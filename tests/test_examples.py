"""Every script in examples/ runs as the docs show it, and does what it says.

The documentation site includes these files verbatim (docs/examples.md and the guide's
pages, through pymdownx.snippets), so this test is what keeps the docs' code working.
Each runs in its own process, from a temporary directory; ``TMPDIR`` points there too,
so whatever an example writes with ``tempfile`` stays in the test's directory.
"""
import os
import re
import sys

import pytest

from mp_helper import ROOT, ProcessGroup, child_env, free_port

EXAMPLES = os.path.join(ROOT, "examples")


def run_example(tmp_path, name, *args, timeout=300):
    env = child_env(TMPDIR=str(tmp_path))
    with ProcessGroup() as group:
        group.spawn([sys.executable, os.path.join(EXAMPLES, name), *args], env=env,
                    cwd=str(tmp_path))
        (out,) = group.wait_all(timeout=timeout).values()
    return out


def test_every_example_is_run_here():
    tested = {"quickstart.py", "dynamic_table.py", "dynamic_cluster.py", "half_rows.py",
              "file_table.py"}
    assert set(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == tested


def test_quickstart_learns(tmp_path):
    out = run_example(tmp_path, "quickstart.py")
    losses = {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss +([\d.]+)", out)}
    assert sorted(losses) == [0, 100, 200, 300], out
    # randn rows: (x - 1)^2 summed over 64 columns starts near 128; Adagrad drives it down
    assert losses[0] > 100 and losses[300] < losses[0] / 10, losses


def test_dynamic_table_evicts_exports_and_removes(tmp_path):
    out = run_example(tmp_path, "dynamic_table.py")
    size, capacity = map(int, re.search(r"size (\d+) of capacity (\d+)", out).groups())
    assert capacity == 4000 and 0 < size <= capacity, out
    assert "['keys', 'sum', 'weight']" in out, out  # rows and Adagrad's state
    evicted, after = map(int, re.search(r"evicted (\d+), size (\d+)", out).groups())
    assert after == 1000 and evicted > 0, out


def test_half_rows_store_16_bit_rows_and_look_up_float32(tmp_path):
    out = run_example(tmp_path, "half_rows.py")
    assert "rows torch.bfloat16, lookups torch.float32" in out, out
    # 100,000 x 64 bfloat16: 2 bytes per value
    assert "weight bytes 12,800,000" in out, out


def test_file_table_reopens_its_rows(tmp_path):
    path = tmp_path / "table"
    out = run_example(tmp_path, "file_table.py", str(path))
    assert str(path) in out, out
    assert os.path.isdir(path) and os.listdir(path)


def test_file_table_without_a_directory_leaves_nothing_behind(tmp_path):
    out = run_example(tmp_path, "file_table.py")  # TMPDIR is tmp_path
    assert "distemb-table-" in out, out
    assert not [p for p in os.listdir(tmp_path) if p.startswith("distemb-table-")]


def test_dynamic_cluster_runs_embedded(tmp_path):
    out = run_example(tmp_path, "dynamic_cluster.py")
    assert re.search(r"\d+ keys over 1 server\(s\)", out), out
    assert os.path.exists(tmp_path / "dynamic-cluster-1" / "manifest.json")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dynamic_cluster_runs_under_distemb_launch(tmp_path):
    """The command in the example's docstring: 2 servers x 2 trainers, sync_exact."""
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip),
            "--num-servers", "2", "--num-trainers", "2", "--consistency", "sync_exact",
            "--config-out", str(tmp_path / "cluster.json"), "--timeout", "60", "--",
            sys.executable, os.path.join(EXAMPLES, "dynamic_cluster.py")]
    with ProcessGroup() as group:
        group.spawn(argv, env=child_env(TMPDIR=str(tmp_path)), cwd=str(tmp_path))
        (out,) = group.wait_all(timeout=280).values()
    assert re.search(r"\d+ keys over 2 server\(s\)", out), out
    assert out.count("keys over") == 1, out  # rank 0 reports
    assert os.path.exists(tmp_path / "dynamic-cluster-2" / "manifest.json")
