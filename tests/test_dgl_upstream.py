"""DGL 1.1.3's own tests, unedited but for one added line (``distemb.dgl.patch()``).

The files in tests/dgl_upstream/ are DGL's (see its README). Each case runs DGL's own
pytest function in a fresh process, as DGL's CI does: DGL's test starts DGL's servers
(``DistGraphServer``) and clients itself, with DGL's variables, in spawned processes.
Under the patch each DGL server process also starts a distemb server beside it and each
client joins those (distemb.dgl.job). DGL's tests start their servers and trainers from
the test process, whose ``patch()`` makes the job token they inherit: no variable is set
by hand. Processes started separately (run_dist_objects.py's, as DGL's launcher starts
them) are given ``$DISTEMB_JOB_TOKEN``, and refuse to start without it.

Besides DGL's own assertions (and the exit codes DGL's test checks), every case asserts
that distemb really ran: the log lines of the distemb servers that started and of the
trainers that joined (tests/dgl_upstream/log_distemb turns distemb's INFO log on in
every process), and no traceback in any process (DGL's ``test_sparse_opt`` does not
check its clients' exit codes).
"""
import os
import re
import secrets
import shutil
import sys

import pytest

from mp_helper import ROOT, ProcessGroup, child_env, free_port

pytest.importorskip("dgl")

UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dgl_upstream")
LOGGING = os.path.join(UPSTREAM, "log_distemb")


def upstream_env(**extra):
    """Environment of DGL's test process: DGL's test helpers and distemb's log on; no
    job token unless ``extra`` gives one."""
    env = child_env(DGLBACKEND="pytorch", **extra)
    env.pop("DISTEMB_JOB_TOKEN", None)
    env.pop("DISTEMB_JOB_TOKEN_MADE_BY", None)
    env.update({k: str(v) for k, v in extra.items()})
    env["PYTHONPATH"] = os.pathsep.join([LOGGING, UPSTREAM, ROOT])
    return env


def below_ephemeral_offset():
    """``$DISTEMB_DGL_PORT_OFFSET`` for DGL's test_dist_optim.py, whose DGL server takes an
    ephemeral port P (bound to 0): distemb's beside it then listens on P + offset below
    the kernel's ephemeral range. With the default offset 1000 it took another ephemeral
    port, which any socket's connect() may hold (seen once in a parallel run: distemb's
    server exited 'port in use' and the trainer's hello reached a stranger). The other
    cases' ports come from DGL's generate_ip_config, below that range already."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    return -(high - low + 1) - 64  # P + offset < low - 64 for every P in [low, high]


def run_dgl_pytest(tmp_path, test_file, test_name, timeout, env=None, expect=0):
    """Run DGL's ``test_file::test_name`` in ``tmp_path`` (its ip_config goes there);
    returns the output of every process it started."""
    os.makedirs("/tmp/dist_graph", exist_ok=True)  # DGL's tests write their graphs here
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
            f"{os.path.join(UPSTREAM, test_file)}::{test_name}"]
    with ProcessGroup() as group:
        group.spawn(argv, env=env or upstream_env(), cwd=str(tmp_path), session=True,
                    expect=expect)
        return next(iter(group.wait_all(timeout=timeout).values()))


def run_dgl_test(tmp_path, test_file, test_name, timeout, env=None):
    """DGL's case, which must pass with no traceback in any of its processes."""
    out = run_dgl_pytest(tmp_path, test_file, test_name, timeout, env)
    assert "1 passed" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return out


def joined(out):
    """(rank, trainers) of every 'trainer joined' log line."""
    return [(int(r), int(t)) for r, t in
            re.findall(r"distemb-log: distemb trainer (\d+) of (\d+) joined", out)]


def servers_started(out):
    return re.findall(r"distemb-log: distemb server (\d+) of (\d+) started beside", out)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_dist_optim_sparse_opt(tmp_path):
    """test_dist_optim.py::test_sparse_opt: DGL's SparseAdam test against torch's, one
    trainer, with and without DGL's shared memory; DistGraph, DGL's own policy object."""
    env = upstream_env(DISTEMB_DGL_PORT_OFFSET=below_ephemeral_offset())
    out = run_dgl_test(tmp_path, "test_dist_optim.py", "test_sparse_opt", 360, env)
    assert joined(out) == [(0, 1), (0, 1)], out[-3000:]
    assert len(servers_started(out)) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_dist_graph_store_dist_emb_server_client(tmp_path):
    """test_dist_graph_store.py::test_dist_emb_server_client: check_dist_emb (Adagrad
    step, '<emb>_sum' state, duplicate lookups) through DGL's servers' processes."""
    out = run_dgl_test(tmp_path, "test_dist_graph_store.py", "test_dist_emb_server_client",
                       360)
    assert joined(out) == [(0, 1), (0, 1)], out[-3000:]
    assert len(servers_started(out)) == 2


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dist_graph_store_optim_save_4_load_8_and_2(tmp_path):
    """test_dist_graph_store.py::test_dist_optim_server_client: 4 trainers save the
    optimizer state, then 8 and then 2 trainers load it and compare (rank 0)."""
    shutil.rmtree("/tmp/dist_graph/emb.pt", ignore_errors=True)  # an earlier run's
    out = run_dgl_test(tmp_path, "test_dist_graph_store.py", "test_dist_optim_server_client",
                       840)
    counts = [t for _, t in joined(out)]
    assert sorted(counts) == [2] * 2 + [4] * 4 + [8] * 8, out[-3000:]
    for t in (4, 8, 2):  # every rank of each job joined once
        assert sorted(r for r, n in joined(out) if n == t) == list(range(t))
    # distemb's checkpoint (a directory with a manifest), not DGL's per-trainer files
    assert os.path.exists("/tmp/dist_graph/emb.pt/manifest.json")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dist_graph_store_standalone_node_emb(tmp_path):
    """test_dist_graph_store.py::test_standalone_node_emb: check_dist_emb in DGL's
    standalone mode (DistGraph on a partition config, tables embedded in distemb)."""
    out = run_dgl_test(tmp_path, "test_dist_graph_store.py", "test_standalone_node_emb", 240)
    assert "distemb-log: distemb in DGL's standalone mode" in out, out[-3000:]


def _objects_env(tmp_path, num_servers, num_clients):
    """The variables DGL's tests/dist/test_dist_objects.py gives run_dist_objects.py, on
    a 1-partition graph it writes here."""
    import dgl  # DGL's partitioner writes the graph the job loads

    graph_path = tmp_path / "dist_graph"
    g = dgl.rand_graph(10000, 40000)
    dgl.distributed.partition_graph(g, "random_test_graph", 1, str(graph_path))
    ip_config = tmp_path / "ip_config.txt"
    ip_config.write_text(f"127.0.0.1 {free_port(16)}\n")
    return {"DIST_DGL_TEST_WORKSPACE": str(tmp_path), "DIST_DGL_TEST_NUM_PART": "1",
            "DIST_DGL_TEST_NUM_SERVER": str(num_servers),
            "DIST_DGL_TEST_NUM_CLIENT": str(num_clients), "DIST_DGL_TEST_NET_TYPE": "socket",
            "DIST_DGL_TEST_GRAPH_PATH": str(graph_path),
            "DIST_DGL_TEST_IP_CONFIG": str(ip_config), "DIST_DGL_TEST_PART_ID": "0"}


def _objects_job(tmp_path, num_servers, num_clients, targets, timeout):
    """DGL's tests/dist/test_dist_objects.py on one machine, without its ssh: the servers
    and clients of run_dist_objects.py, with the variables DGL's test gives them, each
    started separately (as DGL's launcher starts them), so each is given the token."""
    base = _objects_env(tmp_path, num_servers, num_clients)
    token = secrets.token_hex(16)
    script = [sys.executable, os.path.join(UPSTREAM, "run_dist_objects.py")]
    with ProcessGroup() as group:
        for sid in range(num_servers):
            group.spawn(script, env=upstream_env(
                **base, DIST_DGL_TEST_SERVER_ID=sid, DIST_DGL_TEST_SHARED_MEM=1,
                DIST_DGL_TEST_MODE="server", DISTEMB_JOB_TOKEN=token), cwd=str(tmp_path))
        for _ in range(num_clients):
            group.spawn(script, env=upstream_env(
                **base, DIST_DGL_TEST_OBJECT_TYPE=targets, DIST_DGL_TEST_MODE="client",
                DISTEMB_JOB_TOKEN=token), cwd=str(tmp_path))
        outs = group.wait_all(timeout=timeout)
    out = "\n".join(outs.values())
    assert "Traceback" not in out, out[-3000:]
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_process_started_separately_still_needs_the_token(tmp_path):
    """run_dist_objects.py's server, started on its own as DGL's launcher starts it and
    given no token: its patch() makes one for its children only, so the distemb server
    it would start beside DGL's is refused with the message that says how to pass one."""
    base = _objects_env(tmp_path, 1, 1)
    with ProcessGroup() as group:
        group.spawn([sys.executable, os.path.join(UPSTREAM, "run_dist_objects.py")],
                    env=upstream_env(**base, DIST_DGL_TEST_SERVER_ID=0,
                                     DIST_DGL_TEST_SHARED_MEM=1, DIST_DGL_TEST_MODE="server"),
                    cwd=str(tmp_path), expect=1)
        (out,) = group.wait_all(timeout=150).values()
    assert "DistEmbError: $DISTEMB_JOB_TOKEN is not set" in out, out[-3000:]
    assert "--extra_envs DISTEMB_JOB_TOKEN=" in out, out[-3000:]
    assert "distemb server 0 of 1 started" not in out, out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_servers", [1, 2])
@pytest.mark.timeout(400)
def test_run_dist_objects_tables(tmp_path, num_servers):
    """tests/dist/python/run_dist_objects.py (DGL's multi-machine test) targets DistTensor
    (anonymous and named tensors shared by the trainers, destroy and re-create with a new
    shape, persistent), DistEmbedding (Adagrad/Adam, 'SomeEmbedding' made three times)
    and DistOptimizer (SparseAdam save/load by every trainer): 2 trainers."""
    out = _objects_job(tmp_path, num_servers, 2, "DistTensor,DistEmbedding,DistOptimizer",
                       360)
    assert sorted(joined(out)) == [(0, 2), (1, 2)], out[-3000:]
    assert len(servers_started(out)) == num_servers


def _sbm_partition(out):
    """A learnable graph, partitioned as DGL's example expects (labels and masks)."""
    import dgl
    import torch

    sys.path.insert(0, ROOT)
    from graph_examples.datasets import load_sbm

    ds = load_sbm(num_nodes=1500, num_classes=3, avg_degree=8.0, seed=3)
    g = ds.graph
    g.ndata["labels"] = ds.labels
    for key, idx in (("train_mask", ds.train_idx), ("val_mask", ds.val_idx),
                     ("test_mask", ds.test_idx)):
        mask = torch.zeros(g.num_nodes(), dtype=torch.bool)
        mask[idx] = True
        g.ndata[key] = mask
    dgl.distributed.partition_graph(g, "sbm", 1, str(out / "parts"))
    return str(out / "parts" / "sbm.json")


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_train_dist_transductive_standalone_like_dgl(tmp_path):
    """examples/pytorch/graphsage/dist/train_dist_transductive.py --standalone
    --dgl_sparse: the file with distemb's line, and DGL's own file (that line removed),
    on the same partitioned graph: both learn it, to within 0.05 test accuracy."""
    part_config = _sbm_partition(tmp_path)
    (tmp_path / "ip_config.txt").write_text("127.0.0.1\n")
    with open(os.path.join(UPSTREAM, "train_dist_transductive.py")) as f:
        ours = f.read()
    assert ours.startswith("import distemb.dgl; distemb.dgl.patch()")
    theirs = tmp_path / "train_dist_transductive_dgl.py"
    theirs.write_text(ours.split("\n", 1)[1])
    args = ["--standalone", "--dgl_sparse", "--graph_name", "sbm", "--ip_config",
            "ip_config.txt", "--part_config", part_config, "--num_epochs", "8",
            "--eval_every", "8", "--batch_size", "100", "--num_hidden", "16",
            "--sparse_lr", "0.05", "--lr", "0.01", "--fan_out", "10,25"]
    accs = {}
    for which, script in (("distemb", os.path.join(UPSTREAM, "train_dist_transductive.py")),
                          ("dgl", str(theirs))):
        with ProcessGroup() as group:
            group.spawn([sys.executable, script, *args], env=upstream_env(),
                        cwd=str(tmp_path))
            (out,) = group.wait_all(timeout=400).values()
        found = re.findall(r"Test Acc (\d\.\d+)", out)
        assert found, out[-3000:]
        accs[which] = float(found[-1])
        patched = "distemb-log: distemb in DGL's standalone mode" in out
        assert patched == (which == "distemb"), out[-3000:]
    assert accs["dgl"] > 0.8, accs  # the graph is learnable (3 classes)
    assert abs(accs["distemb"] - accs["dgl"]) <= 0.05, accs


# The cases below pin the differences docs/dgl.md documents ("What differs on purpose"):
# if one of them starts to pass, or fails elsewhere, the docs are wrong.


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dist_graph_store_standalone_differs_only_at_dgl_private_names(tmp_path):
    """test_dist_graph_store.py::test_standalone (check_dist_graph): every check passes up
    to the assertion that a new DistTensor is in DGL's private ``g._client``'s name list;
    the tensor is distemb's (asserted by the log line), so DGL's list does not name it."""
    out = run_dgl_pytest(tmp_path, "test_dist_graph_store.py", "test_standalone", 240,
                         expect=1)
    assert "1 failed" in out, out[-3000:]
    assert ">       assert test3_name in g._client.data_name_list()" in out, out[-3000:]
    assert "test_dist_graph_store.py:403: AssertionError" in out, out[-3000:]
    assert "distemb-log: distemb in DGL's standalone mode" in out, out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dgl_example_under_torch_launcher_fails_for_dgl_too(tmp_path):
    """DGL 1.1.3's launch.py wraps the trainer in ``python -m torch.distributed.launch``
    (tests/dgl_upstream/launch.py, construct_torch_dist_launcher_cmd); this torch passes
    ``--local-rank=<n>``, which DGL's own train_dist_transductive.py (without distemb's
    line) does not parse: it stops in argparse before DGL or distemb is reached."""
    launch = os.path.join(UPSTREAM, "launch.py")
    with open(launch) as f:
        assert '"-m torch.distributed.launch "' in f.read()
    with open(os.path.join(UPSTREAM, "train_dist_transductive.py")) as f:
        theirs = tmp_path / "train_dist_transductive_dgl.py"
        theirs.write_text(f.read().split("\n", 1)[1])  # DGL's file: distemb's line removed
    shutil.copy(os.path.join(UPSTREAM, "train_dist.py"), tmp_path)
    argv = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=1",
            "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
            f"--master_port={free_port(1)}", str(theirs), "--graph_name", "g",
            "--ip_config", "ip_config.txt"]
    with ProcessGroup() as group:
        group.spawn(argv, env=child_env(DGLBACKEND="pytorch"), cwd=str(tmp_path), expect=1)
        (out,) = group.wait_all(timeout=240).values()
    assert "error: unrecognized arguments: --local-rank=0" in out, out[-3000:]
