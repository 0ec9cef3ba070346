"""PyG 2.8.0.post1's own feature-store tests, run against distemb.pyg.DistFeatureStore.

The files in tests/pyg_upstream/ are PyG's (see its README), their feature store class
renamed. Each run is PyG's pytest in fresh processes: embedded (one process), and as
the two trainers of a job on two distemb servers (``$DISTEMB_CONFIG``): both trainers
run the same cases, so every table a case puts is made collectively on the servers and
read back from them.
"""
import os
import re
import sys

import pytest

from mp_helper import ProcessGroup, child_env, cluster_dict, write_json

pytest.importorskip("torch_geometric")

UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyg_upstream")
#: (file, -k selection, cases that must pass): every case of the first two files; the
#: loader cases that take a (FeatureStore, GraphStore) pair.
CASES = [("test_feature_store.py", None, 2), ("test_remote_backend_utils.py", None, 4),
         ("test_neighbor_loader.py", "custom and not temporal", 3),
         ("test_link_neighbor_loader.py", "custom", 1)]


def _argv(file, select, trainer=False):
    """PyG's pytest of ``file``; a ``trainer`` of a job closes its context at the end
    (tests/pyg_upstream/distemb_trainer.py, a plugin of ours)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            *(["-p", "distemb_trainer"] if trainer else []), os.path.join(UPSTREAM, file)]
    return argv + (["-k", select] if select else [])


def _check(out, file, expected):
    """PyG's cases of ``file`` passed, all of them: none skipped, none failed."""
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) == expected, f"{file}:\n{out[-3000:]}"
    assert " failed" not in out and " skipped" not in out and "error" not in out.lower(), \
        f"{file}:\n{out[-3000:]}"


@pytest.mark.parametrize("file, select, expected", CASES)
@pytest.mark.timeout(300)
def test_pyg_cases_embedded(tmp_path, file, select, expected):
    with ProcessGroup() as group:
        group.spawn(_argv(file, select), env=child_env(), cwd=str(tmp_path))
        (out,) = group.wait_all(timeout=280).values()
    _check(out, file, expected)


@pytest.mark.multiprocess
@pytest.mark.parametrize("file, select, expected", CASES)
@pytest.mark.timeout(400)
def test_pyg_cases_two_trainers_on_two_servers(tmp_path, file, select, expected):
    path = write_json(tmp_path / "cluster.json", cluster_dict(2, 2, shared_memory=False))
    with ProcessGroup() as group:
        group.spawn_servers(path, 2)
        env = child_env()
        env["PYTHONPATH"] = os.pathsep.join([UPSTREAM, env["PYTHONPATH"]])
        trainers = [group.spawn(_argv(file, select, trainer=True),
                                env={**env, "DISTEMB_CONFIG": path, "DISTEMB_RANK": str(rank)},
                                cwd=str(tmp_path)) for rank in (0, 1)]
        outs = group.wait_all(timeout=380)  # the servers exit 0 once both trainers left
    for p in trainers:
        _check(outs[p.pid], f"{file} (trainer pid {p.pid})", expected)
