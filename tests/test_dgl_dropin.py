"""DGL 1.1.3's own tests of DistEmbedding and its optimizers, run on distemb.

Each test is one of DGL's test functions (tests/distributed/test_dist_graph_store.py,
tests/python/pytorch/distributed/optim/test_dist_optim.py, dmlc/dgl tag v1.1.3) with
the import changed to ``import distemb.dgl as dist`` / ``from distemb.dgl... import``,
on graphs built here (dgl.data downloads fail offline). Where DGL and torch differ (DGL
averages the gradients of duplicate ids, distemb sums them as torch does), the
assertion is against torch.
"""
import json
import os
import sys

import numpy as np
import pytest
import torch

from mp_helper import ProcessGroup, free_port

import distemb
import distemb.dgl as dist
from distemb.context import DistContext
from distemb.dgl.optim import SparseAdagrad, SparseAdam
from distemb.integrations.dgl import dgl

TRAINER = os.path.join(os.path.dirname(__file__), "dgl_optim_trainer.py")


@pytest.fixture
def embedded():
    """distemb's current context, as DGL's module-level one: fresh per test."""
    distemb.shutdown()
    ctx = distemb.initialize()
    yield ctx
    distemb.shutdown()


def _random_graph(n, seed=100):
    """DGL's create_random_graph: a scipy random sparse matrix as a graph."""
    from scipy import sparse as spsp

    arr = (spsp.random(n, n, density=0.001, format="coo", random_state=seed) != 0)
    return dgl.from_scipy(arr.astype(np.int64))


@pytest.fixture(scope="module")
def gpb(tmp_path_factory):
    """DGL's partition book of a 2-partition random graph (partition_graph + load).

    Its ``num_nodes`` is set here from the graph (DistGraph's g.num_nodes() in DGL's test).
    """
    out = tmp_path_factory.mktemp("dist_graph")
    g = _random_graph(2000)
    dgl.distributed.partition_graph(g, "dropin", 2, str(out))
    book = dgl.distributed.load_partition_book(str(out / "dropin.json"), 0)[0]
    book.test_num_nodes = g.num_nodes()
    return book


def emb_init(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def test_check_dist_emb(embedded, gpb):
    """check_dist_emb: one Adagrad step on every node, the '<emb>_sum' state, duplicates."""
    num_nodes = gpb.test_num_nodes
    emb = dist.DistEmbedding(num_nodes, 1, "emb1", emb_init)
    nids = torch.arange(0, num_nodes)
    lr = 0.001
    optimizer = SparseAdagrad([emb], lr=lr)
    feats = emb(nids)
    assert np.all(feats.detach().numpy() == np.zeros((len(nids), 1)))
    loss = torch.sum(feats + 1, 0)
    loss.backward()
    optimizer.step()
    feats = emb(nids)
    np.testing.assert_almost_equal(feats.detach().numpy(), np.ones((len(nids), 1)) * -lr)

    policy = dist.PartitionPolicy("node", gpb)
    # DGL's test passes the policy as the 4th positional argument (init_func): the
    # tensor exists (the optimizer's state), so it attaches and never calls it.
    grad_sum = dist.DistTensor((num_nodes, 1), torch.float32, "emb1_sum", policy)
    assert np.all(grad_sum[nids].numpy() == np.ones((len(nids), 1)))

    emb = dist.DistEmbedding(num_nodes, 1, "emb2", emb_init)
    with torch.no_grad():
        feats1 = emb(nids)
    assert np.all(feats1.numpy() == 0)
    optimizer = SparseAdagrad([emb], lr=lr)
    feats1 = emb(nids)
    feats2 = emb(nids)
    feats = torch.cat([feats1, feats2], 0)
    loss = torch.sum(feats + 1, 0)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        feats = emb(nids)
    # Adagrad's first step is lr * g / |g| whether duplicates sum (torch) or average (DGL)
    np.testing.assert_almost_equal(feats.numpy(), np.ones((len(nids), 1)) * -lr)
    # ...but its state is g^2: torch sums the two lookups' gradients, 2^2 = 4 (DGL: 1)
    state = dist.DistTensor((num_nodes, 1), torch.float32, "emb2_sum", policy)
    assert np.all(state[nids].numpy() == 4.0)


def _torch_like_dgl_test(num_nodes, emb_dim):
    torch_emb = torch.nn.Embedding(num_nodes, emb_dim, sparse=True)
    torch_emb_zero = torch.nn.Embedding(num_nodes, emb_dim, sparse=True)
    torch.manual_seed(0)
    torch.nn.init.uniform_(torch_emb.weight, 0, 1.0)
    torch.manual_seed(0)
    torch.nn.init.uniform_(torch_emb_zero.weight, 0, 1.0)
    return torch_emb, torch_emb_zero


def initializer(shape, dtype):
    arr = torch.zeros(shape, dtype=dtype)
    torch.manual_seed(0)
    torch.nn.init.uniform_(arr, 0, 1.0)
    return arr


@pytest.mark.parametrize("steps", [1, 30])
def test_sparse_adam_run_client(embedded, gpb, steps):
    """test_dist_optim's run_client: DGL's own PartitionPolicy object, DGL's loop order
    (zero_grad between forward and backward), against torch.optim.SparseAdam; then the
    same for many steps of duplicate-heavy ids (DGL's test draws 4 ids once)."""
    num_nodes, emb_dim = gpb.test_num_nodes, 4
    policy = dgl.distributed.PartitionPolicy("node", gpb)  # DGL's class, not a mirror
    dgl_emb = dist.DistEmbedding(num_nodes, emb_dim, name="optim", init_func=initializer,
                                 part_policy=policy)
    dgl_emb_zero = dist.DistEmbedding(num_nodes, emb_dim, name="optim-zero",
                                      init_func=initializer, part_policy=policy)
    dgl_adam = SparseAdam(params=[dgl_emb, dgl_emb_zero], lr=0.01)
    dgl_adam._world_size = 1
    dgl_adam._rank = 0

    torch_emb, torch_emb_zero = _torch_like_dgl_test(num_nodes, emb_dim)
    # init_func runs once per shard (as on DGL's servers), so with two partitions the
    # second half repeats the first: DGL's test compares only the first half. Start
    # torch from the same rows to compare all of them.
    assert torch.equal(dgl_emb.weight[0:num_nodes // 2], torch_emb.weight[0:num_nodes // 2])
    with torch.no_grad():
        torch_emb.weight.copy_(dgl_emb.weight[0:num_nodes])
    torch_adam = torch.optim.SparseAdam(
        list(torch_emb.parameters()) + list(torch_emb_zero.parameters()), lr=0.01)

    labels = torch.ones((4,)).long()
    start, seen = dgl_emb.weight[0:num_nodes], []
    for step in range(steps):
        size = 4 if steps == 1 else 64
        idx = torch.randint(0, num_nodes if steps == 1 else 50, size=(size,))
        labels = torch.ones((size,)).long()
        seen.append(idx)
        dgl_value = dgl_emb(idx, torch.device("cpu")).to(torch.device("cpu"))
        torch_value = torch_emb(idx)
        torch_adam.zero_grad()
        torch_loss = torch.nn.functional.cross_entropy(torch_value, labels)
        torch_loss.backward()
        torch_adam.step()

        dgl_adam.zero_grad()
        dgl_loss = torch.nn.functional.cross_entropy(dgl_value, labels)
        dgl_loss.backward()
        dgl_adam.step()

    assert torch.allclose(dgl_emb.weight[0:num_nodes // 2],
                          torch_emb.weight[0:num_nodes // 2], atol=1e-6)
    assert torch.allclose(dgl_emb.weight[0:num_nodes], torch_emb.weight.detach(), atol=1e-6)
    seen = torch.unique(torch.cat(seen))
    assert (dgl_emb.weight[seen] != start[seen]).any(dim=1).all()  # every looked-up row


def test_dgl_policy_is_converted_exactly(gpb):
    ctx = DistContext.embedded()
    for kind in ("node", "edge"):
        theirs = dgl.distributed.PartitionPolicy(  # DGL 1.1.3 fails on plain "edge"
            "node" if kind == "node" else "edge~_N:_E:_N", gpb)
        ours = dist.convert_policy(theirs)
        n = theirs.get_size()
        assert ours.get_size() == n
        ids = torch.arange(n)
        assert ours.to_partid(ids.numpy()).tolist() == theirs.to_partid(ids).tolist()
        mine = ids[theirs.to_partid(ids) == theirs.part_id]  # DGL's to_local: own part only
        assert len(mine) and ours.to_local(mine.numpy()).tolist() == theirs.to_local(mine).tolist()
        assert ours.get_part_size() == theirs.get_part_size()
    ctx.close()


def test_plain_distemb_names_part_policy_for_dgl_objects(gpb):
    ctx = DistContext.embedded()
    policy = dgl.distributed.PartitionPolicy("node", gpb)
    with pytest.raises(TypeError, match=r"part_policy: .*dgl.*distemb\.dgl"):
        distemb.DistEmbedding(gpb.test_num_nodes, 4, part_policy=policy, context=ctx)
    ctx.close()


def test_namespace_mirrors_dgl_distributed():
    for name in ("DistEmbedding", "DistTensor", "PartitionPolicy", "initialize",
                 "exit_client"):
        assert hasattr(dgl.distributed, name) and hasattr(dist, name), name
    for name in ("NodePartitionPolicy", "EdgePartitionPolicy"):  # DGL: in its submodule
        assert hasattr(dgl.distributed.graph_partition_book, name) and hasattr(dist, name)
    for name in ("SparseAdagrad", "SparseAdam"):
        assert hasattr(dgl.distributed.optim, name) and hasattr(dist.optim, name), name


def test_every_name_of_dgl_distributed_is_reachable_through_the_import_swap():
    """``dist.X`` for every X of dgl.distributed: distemb's where it has its own, DGL's
    otherwise (DistGraph, node_split, partition_graph, ...), by attribute and by
    ``from ... import``."""
    from distemb.dgl import DistGraph, node_split  # noqa: F401  (the import form works)

    theirs = [n for n in dir(dgl.distributed) if not n.startswith("_")]
    assert {"DistGraph", "node_split", "edge_split", "DistDataLoader", "partition_graph",
            "load_partition"} <= set(theirs)
    for name in theirs:
        assert hasattr(dist, name), name
    assert dist.DistGraph is dgl.distributed.DistGraph
    assert dist.node_split is dgl.distributed.node_split
    assert dist.DistEmbedding.__module__ == "distemb.dgl.tables"  # distemb's own
    assert dist.optim.SparseAdam is distemb.SparseAdam
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName', nor has "
                                             "dgl.distributed"):
        dist.NoSuchName


def test_without_dgl_the_import_says_what_to_install():
    import subprocess

    from mp_helper import child_env

    code = "import sys; sys.modules['dgl'] = None; import distemb.dgl"  # DGL not installed
    run = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1
    assert "ModuleNotFoundError: distemb's DGL integration (distemb.dgl, " in run.stderr
    assert "pip install 'distemb[dgl]'" in run.stderr, run.stderr[-2000:]


def _launch(tmp_path, trainers, mode, ckpt):
    ip = tmp_path / f"ip-{mode}-{trainers}.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip),
            "--num-servers", "1", "--num-trainers", str(trainers), "--timeout", "30",
            "--config-out", str(tmp_path / f"cluster-{mode}-{trainers}.json"), "--",
            sys.executable, TRAINER, mode, str(ckpt)]
    with ProcessGroup() as group:
        group.spawn(argv)
        out = next(iter(group.wait_all(timeout=150).values()))
    for r in range(trainers):
        assert f"rank {r} of {trainers}: {mode} ok" in out, out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dist_optim_store_save_by_all_load_with_other_counts(tmp_path):
    """test_dist_optim_server_client (DGL: 4 save, 8 and 2 load), smaller: every trainer
    of 3 saves, then 2 and 1 load."""
    ckpt = tmp_path / "emb.pt"
    _launch(tmp_path, 3, "save", ckpt)
    assert sorted(os.listdir(tmp_path)).count("emb.pt") == 1
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no half-written leftovers
    _launch(tmp_path, 2, "load", ckpt)
    _launch(tmp_path, 1, "load", ckpt)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_transductive_example_trains_like_dgl(tmp_path):
    """train_dist_transductive.py (DistGraph, node_split, DistNodeDataLoader, zero_grad
    between forward and backward), run by DGL itself and by distemb with the import
    swapped: every looked-up row trains, nothing else moves, and the test accuracy is
    DGL's within 0.05."""
    script = os.path.join(os.path.dirname(__file__), "dgl_transductive.py")
    with ProcessGroup() as group:
        for which in ("dgl", "distemb"):
            group.spawn([sys.executable, script, which, str(tmp_path)])
        group.wait_all(timeout=240)
    theirs = json.loads((tmp_path / "dgl.json").read_text())
    ours = json.loads((tmp_path / "distemb.json").read_text())
    assert ours["looked_up"] > 0
    assert ours["looked_up_trained"] == ours["looked_up"], ours
    assert ours["trained_not_looked_up"] == 0, ours
    assert theirs["test_acc"] > 0.8, theirs  # the graph is learnable (3 classes)
    assert abs(ours["test_acc"] - theirs["test_acc"]) <= 0.05, (ours, theirs)


def _ones(shape, dtype):
    return torch.ones(shape, dtype=dtype)


def test_non_persistent_table_restarts_from_its_initialiser(embedded):
    """DGL's lifetime rule in the mirror: a DistEmbedding re-created by name after the
    first object is gone starts again from init_func, with fresh optimizer state."""
    ids = torch.tensor([1, 1, 2])
    emb = dist.DistEmbedding(10, 2, name="life", init_func=_ones)
    opt = SparseAdagrad([emb], lr=0.5)
    emb(ids).sum().backward()
    opt.step()
    trained = emb.weight[0:10]
    assert (trained[1:3] != 1).all()
    alias = dist.DistTensor((10, 2), torch.float32, "life_sum")  # DGL's name of the state
    assert (alias[torch.tensor([1])] == 4).all()
    del alias  # an object that attached never deletes what it attached to
    assert "life~opt~sum" in embedded.client.names()
    client = emb.kvstore
    del emb, opt
    assert not [n for n in client.names() if n.startswith("life")], client.names()

    emb = dist.DistEmbedding(10, 2, name="life", init_func=_ones)
    assert torch.equal(emb.weight[0:10], torch.ones(10, 2))
    opt = SparseAdagrad([emb], lr=0.5)
    emb(torch.tensor([3])).sum().backward()
    opt.step()  # fresh state: Adagrad's first step is exactly lr
    assert torch.allclose(emb.weight[torch.tensor([3])], torch.full((1, 2), 0.5))


def test_table_lives_while_any_object_of_it_does(embedded):
    first = dist.DistEmbedding(4, 2, name="two", init_func=_ones)
    second = dist.DistEmbedding(4, 2, name="two")
    first.weight[0:4] = torch.full((4, 2), 5.0)
    del first
    assert torch.equal(second.weight[0:4], torch.full((4, 2), 5.0))


def test_a_shape_that_is_not_ints_is_refused_by_name_as_in_the_core(embedded):
    """The mirror looks the shape's rows up among DGL's policies first; a float shape
    failed there ('float' object is not subscriptable) before the core named it."""
    for shape in (10.9, (10.9, 2), "10"):
        with pytest.raises(TypeError, match=r"shape: expected an int or a tuple of ints"):
            dist.DistTensor(shape, torch.float32, "floaty")


@pytest.mark.parametrize("make", [
    lambda **kw: dist.DistEmbedding(4, 2, persistent=True, **kw),  # DGL mirror, opted in
    lambda **kw: distemb.DistEmbedding(4, 2, **kw),                 # core: persistent
    lambda **kw: dist.DistTensor((4, 2), torch.float32, persistent=True, **kw)])
def test_persistent_tables_outlive_their_objects(embedded, make):
    t = make(name="kept", init_func=_ones)
    (t.weight if hasattr(t, "weight") else t)[0:4] = torch.full((4, 2), 3.0)
    del t
    again = make(name="kept", init_func=_ones)
    assert torch.equal((again.weight if hasattr(again, "weight") else again)[0:4],
                       torch.full((4, 2), 3.0))


def test_patch_runner_runs_a_script_patched_and_unpatch_restores(tmp_path):
    """``python -m distemb.dgl.patch script.py args``: the script sees distemb's classes
    at DGL's paths (imported by name before any line of its own), with its argv."""
    script = tmp_path / "uses_dgl.py"
    script.write_text(
        "import sys\n"
        "from dgl.distributed import DistEmbedding, DistTensor\n"
        "from dgl.distributed.optim import SparseAdam\n"
        "import distemb.dgl\n"
        "print(DistEmbedding.__module__, DistTensor.__module__, SparseAdam.__module__,\n"
        "      sys.argv[1:], distemb.dgl.is_patched())\n"
        "distemb.dgl.unpatch()\n"
        "import dgl.distributed\n"
        "print(dgl.distributed.DistEmbedding.__module__, distemb.dgl.is_patched())\n")
    with ProcessGroup() as group:
        group.spawn([sys.executable, "-m", "distemb.dgl.patch", str(script), "a", "--b"])
        (out,) = group.wait_all(timeout=120).values()
    lines = out.strip().splitlines()
    assert lines[-2] == ("distemb.dgl.tables distemb.dgl.tables distemb.optim.optimizers "
                         "['a', '--b'] True"), out
    assert lines[-1] == "dgl.distributed.nn.pytorch.sparse_emb False", out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_dgl_script_runs_under_torchrun_with_one_changed_line(tmp_path):
    """tests/dgl_collective_script.py: DGL's API through ``import distemb.dgl as dist``
    and ``dist.initialize(mode="collective")``, 2 ranks under torchrun, equals the same
    script in one process looking up both ranks' shares, bit for bit."""
    import subprocess

    from mp_helper import child_env

    script = os.path.join(os.path.dirname(__file__), "dgl_collective_script.py")
    (tmp_path / "job").mkdir()
    (tmp_path / "alone").mkdir()
    with ProcessGroup() as group:  # a session: kill_all ends torchrun's children too
        group.spawn([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                     script, str(tmp_path / "job")], session=True)
        group.wait_all(timeout=200)
    alone = subprocess.run([sys.executable, script, str(tmp_path / "alone"), "--alone", "2"],
                           env=child_env(), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-2000:]
    with np.load(tmp_path / "job" / "tables.npz") as got, \
            np.load(tmp_path / "alone" / "tables.npz") as want:
        for name in ("node", "edge"):
            assert np.array_equal(got[name], want[name]), name
            assert (np.abs(want[name] - 0.25).max(axis=1) > 0).sum() > 20, name  # trained
