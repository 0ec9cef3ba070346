"""Every script in examples/ runs as the docs show it, and does what it says.

The documentation site includes these files verbatim (docs/examples.md and the guide's
pages, through pymdownx.snippets), so this test is what keeps the docs' code working.
Each runs in its own process, from a temporary directory; ``TMPDIR`` points there too,
so whatever an example writes with ``tempfile`` stays in the test's directory.
"""
import os
import re
import sys

import numpy as np
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
              "file_table.py", "pooled_lookups.py", "serving.py",
              "pyg_feature_store.py", "pyg_node2vec.py", "save_resume.py",
              "incremental_checkpoint.py"}
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


def test_pooled_lookups_learn_and_pool_as_said(tmp_path):
    out = run_example(tmp_path, "pooled_lookups.py")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first / 5, out
    traced, looked = map(int, re.search(r"traced ids per step (\d+) of (\d+)", out).groups())
    assert traced < looked == 32768, out  # one row per unique id, not per id
    assert "weighted bag equal: True, padding-only bag: 0.0" in out, out
    assert "max bags (4, 16)" in out, out


def test_serving_gives_the_training_rows(tmp_path):
    out = run_example(tmp_path, "serving.py")
    for line in ("tables: ['items', 'users']", "Embedding equal to training rows: True",
                 "EmbeddingBag torch.bfloat16 (2, 16)", "exported equal: True",
                 "trained row equal: True", "unseen key gets its initial row: True"):
        assert line in out, out
    assert re.search(r"KeyedEmbedding \d+ keys", out), out


def test_incremental_checkpoint_saves_deltas_replays_them_and_keeps_evicted_rows(tmp_path):
    out = run_example(tmp_path, "incremental_checkpoint.py")
    full = float(re.search(r"full save: ([\d.]+) MB", out).group(1))
    deltas = [float(x) for x in re.findall(r"delta \d: ([\d.]+) MB, after save [0-9a-f]{8}",
                                           out)]
    assert len(deltas) == 3 and 0 < max(deltas) < full / 10, out
    for line in ("items after the load equal the trained rows: True", "served rows equal: True"):
        assert line in out, out
    m = re.search(r"evictions: (\d+), keys sunk: (\d+), columns: \['sum', 'weight'\]; "
                  r"users held now: (\d+)", out)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0 and int(m.group(3)) <= 2000, out


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


def _has_neighbor_sampler():
    try:
        from torch_geometric.typing import WITH_PYG_LIB, WITH_TORCH_SPARSE
    except ImportError:
        return False
    return WITH_PYG_LIB or WITH_TORCH_SPARSE


@pytest.mark.skipif(not _has_neighbor_sampler(),
                    reason="no neighbour sampler: make installs torch-sparse")
def test_pyg_feature_store_feeds_neighbor_loader(tmp_path):
    out = run_example(tmp_path, "pyg_feature_store.py")
    accs = [float(a) for a in re.findall(r"train accuracy ([\d.]+)", out)]
    assert len(accs) == 5 and accs[-1] > 0.6, out  # 4 classes, features + homophily
    assert """tables: ["example:None:'x':0", "example:None:'y':0"]""" in out, out


def test_pyg_node2vec_separates_the_clubs(tmp_path):
    out = run_example(tmp_path, "pyg_node2vec.py")
    accs = [float(a) for a in re.findall(r"club accuracy ([\d.]+)", out)]
    assert len(accs) == 3 and accs[-1] >= 0.8, out


def save_resume_oracle(steps):
    """examples/save_resume.py's model trained ``steps`` steps in one go with torch alone:
    nn.Embedding(sparse=True) with torch.optim.SparseAdam, the Linear with Adam."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, EXAMPLES)
    try:
        import save_resume as ex
    finally:
        sys.path.remove(EXAMPLES)
    emb = torch.nn.Embedding(ex.N, ex.D, sparse=True)
    torch.nn.init.constant_(emb.weight, 0.1)
    torch.manual_seed(0)
    dense = torch.nn.Linear(ex.D, 1)
    opts = [torch.optim.SparseAdam([emb.weight], lr=0.01),
            torch.optim.Adam(dense.parameters(), lr=0.01)]
    for step in range(steps):
        ids, target = ex.batch(step)
        loss = F.binary_cross_entropy_with_logits(dense(emb(ids)).squeeze(1), target,
                                                  reduction="sum") / ex.BATCH
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    return emb.weight.detach().numpy(), dense.state_dict()


def _launch_example(tmp_path, servers, trainers, *args):
    ip = tmp_path / f"ip-{servers}x{trainers}.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip), "--num-servers",
            str(servers), "--num-trainers", str(trainers), "--consistency", "sync_exact",
            "--master-port", str(free_port()), "--timeout", "60", "--", sys.executable,
            os.path.join(EXAMPLES, "save_resume.py"), *args]
    with ProcessGroup() as group:
        group.spawn(argv, env=child_env(TMPDIR=str(tmp_path)), cwd=str(tmp_path))
        (out,) = group.wait_all(timeout=200).values()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_save_resume_continues_in_a_job_of_other_counts_as_one_uninterrupted_run(tmp_path):
    """The recipe's commands: 6 steps by 2 servers x 2 trainers, saved; 6 more by 1 server
    x 1 trainer from that checkpoint: the table and the dense layer equal 12 steps of
    torch alone on the same global batches (the step count, Adam's moments of both and
    the rows all crossed); then the same alone, embedded, from the first checkpoint."""
    import torch

    out = _launch_example(tmp_path, 2, 2, "--steps", "6", "--save", "ck1")
    assert "trainer 1 of 2: steps 0..5" in out, out
    out = _launch_example(tmp_path, 1, 1, "--load", "ck1", "--steps", "6", "--export",
                          "job.npy")
    assert "trainer 0 of 1: steps 6..11" in out, out
    out = run_example(tmp_path, "save_resume.py", "--load", "ck1", "--steps", "6",
                      "--export", "alone.npy")
    rows, dense = save_resume_oracle(12)
    assert np.abs(rows - 0.1).max() > 0.05  # it trained
    for name in ("job", "alone"):
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), rows, rtol=0, atol=2e-5,
                                   err_msg=name)
        got = torch.load(tmp_path / f"{name}.npy.dense.pt")
        for k, v in dense.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=f"{name}: {k}")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_two_machine_recipe_trains_as_one_process(tmp_path):
    """docs/recipes.md's two-machine job, with 127.0.0.1 and 127.0.0.2 for the machines
    (an sshd of the test on both): one server and one trainer on each, started over ssh,
    the config on the "shared" file system (the same directory here); the table and the
    dense layer equal torch alone on the same global batches."""
    import torch
    from ssh_helper import ssh_wrapper, start_sshd

    with ProcessGroup() as group:
        port, key = start_sshd(tmp_path, group, "the recipe starts its processes over ssh",
                               addresses=("127.0.0.1", "127.0.0.2"))
        bindir = ssh_wrapper(tmp_path / "bin", key, port)
        server_port = free_port()
        (tmp_path / "ip.txt").write_text(f"127.0.0.1 {server_port}\n127.0.0.2 {server_port}\n")
        (tmp_path / "shared").mkdir()
        launcher = group.spawn(
            [sys.executable, "-m", "distemb.launch", "--ip-config", "ip.txt", "--num-servers",
             "1", "--num-trainers", "1", "--launcher", "ssh", "--consistency", "sync_exact",
             "--master-port", str(free_port()), "--config-out", "shared/cluster.json", "--",
             sys.executable, os.path.join(EXAMPLES, "save_resume.py"), "--steps", "6",
             "--export", "rows.npy"],
            env=child_env(PATH=bindir + os.pathsep + os.environ["PATH"]), cwd=str(tmp_path))
        out, _ = launcher.communicate(timeout=240)  # (the sshd runs on)
    assert launcher.returncode == 0, out
    assert "trainer 0 of 2: steps 0..5" in out and "trainer 1 of 2: steps 0..5" in out, out
    rows, dense = save_resume_oracle(6)
    np.testing.assert_allclose(np.load(tmp_path / "rows.npy"), rows, rtol=0, atol=2e-5)
    got = torch.load(tmp_path / "rows.npy.dense.pt")
    for k, v in dense.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-5, msg=k)
