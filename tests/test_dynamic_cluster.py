"""Dynamic tables in a cluster against the one-process oracle (tests/dynamic_trainer.py).

The same DynamicEmbedding job (four optimizers, zipf-distributed int64 keys with
duplicates, 30 steps) run by distemb-launch with S servers x T trainers must give
bit-identical tables (keys, rows, optimizer state) to the embedded job on whole
batches: 2 x 2 and 1 x 2 under sync_exact, and 2 x 1 asynchronous (one trainer: its
connection to each server is ordered). A checkpoint saved by 2 servers loads into 3
(export after load equals export before), and training resumed there equals the
uninterrupted run. The same for file-backed tables (``--kind file``: a FileStore per
server holding a range of the keys), 2 x 2 and the 2 -> 3 checkpoint.
"""
import os
import sys

import numpy as np
import pytest

import dynamic_trainer as job
from mp_helper import ProcessGroup, free_port

pytestmark = pytest.mark.multiprocess
TRAINER = os.path.join(os.path.dirname(__file__), "dynamic_trainer.py")


def launch(tmp_path, consistency, servers, trainers, *extra):
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip),
            "--num-servers", str(servers), "--num-trainers", str(trainers),
            "--consistency", consistency, "--config-out", str(tmp_path / "cluster.json"),
            "--timeout", "60", "--", sys.executable, TRAINER, str(tmp_path), *extra]
    with ProcessGroup() as group:
        group.spawn(argv)
        return next(iter(group.wait_all(timeout=150).values()))


def load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same(got, want, what):
    assert sorted(got) == sorted(want), what
    for col in want:
        assert got[col].dtype == want[col].dtype, (what, col)
        assert np.array_equal(got[col], want[col]), f"{what}: column {col!r} differs"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("consistency,servers,trainers,kind",
                         [("sync_exact", 2, 2, "hash"), ("sync_exact", 1, 2, "hash"),
                          ("async", 2, 1, "hash"), ("sync_exact", 2, 2, "file")])
def test_cluster_equals_embedded_bit_for_bit(tmp_path, consistency, servers, trainers, kind):
    out = launch(tmp_path, consistency, servers, trainers, "--steps", "30", "--kind", kind)
    want = job.oracle(30, kind=kind, files=str(tmp_path / "oracle-files"))
    for k in job.OPTIMIZERS:
        got = load(tmp_path / f"{k}.npz")
        assert_same(got, want[k], f"table {k}")
        assert len(got["keys"]) >= 100, "too few keys were looked up to mean anything"
        init = job.key_normal(job.D, std=0.5, seed=list(job.OPTIMIZERS).index(k))
        assert np.abs(got["weight"] - init(got["keys"])).max() > 0.05, "did not train"
    assert f"on {servers} servers" in out
    if kind == "file":  # each server made its shard's files, under its own range
        assert sorted(os.listdir(tmp_path / "files" / "sgd")) == ["part-0-of-2", "part-1-of-2"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["hash", "file"])
def test_checkpoint_of_two_servers_loads_into_three_and_resumes(tmp_path, kind):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    ck = tmp_path / "ck"
    launch(first, "sync_exact", 2, 2, "--steps", "12", "--save", str(ck), "--kind", kind)
    launch(second, "sync_exact", 3, 1, "--start", "12", "--steps", "10", "--load", str(ck),
           "--kind", kind)
    want = job.oracle(22, kind=kind, files=str(tmp_path / "oracle-files"))
    for k in job.OPTIMIZERS:
        saved = load(first / f"{k}.npz")
        assert_same(load(second / f"loaded-{k}.npz"), saved, f"table {k} after load")
        assert_same(load(second / f"{k}.npz"), want[k], f"table {k} resumed")
