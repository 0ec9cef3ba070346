"""Tests for graph_examples.deepwalk and graph_examples.tables (small karate runs)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import distemb
from graph_examples.deepwalk import main, parse_args, skipgram_loss
from graph_examples.stream import overlapped
from graph_examples.tables import _node_init, make_tables

FAST = ["--dataset", "karate", "--dim", "8", "--walk-length", "8", "--window", "2",
        "--num-walks", "4", "--batch-size", "128", "--epochs", "3", "--quiet"]


def test_skipgram_loss_matches_definition():
    g = torch.Generator().manual_seed(0)
    u, v, n = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), \
        torch.randn(4, 2, 3, generator=g)
    expected = [-np.log(1 / (1 + np.exp(-float(u[i] @ v[i]))))
                - sum(np.log(1 / (1 + np.exp(float(u[i] @ n[i, k])))) for k in range(2))
                for i in range(4)]
    assert skipgram_loss(u, v, n).item() == pytest.approx(np.mean(expected), rel=1e-5)


def test_run_writes_outputs_and_learns(tmp_path):
    metrics = main(FAST + ["--backend", "torch", "--out", str(tmp_path)])
    emb = np.load(tmp_path / "embeddings.npy")
    assert emb.shape == (34, 8) and emb.dtype == np.float32
    assert np.load(tmp_path / "node_ids.npy").tolist() == list(range(34))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["steps"] == metrics["steps"] > 0
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    # Untrained (zero context rows) the loss is (1 + 5) * log 2 = 4.16.
    assert metrics["final_loss"] < 3.5
    assert 0.0 <= metrics["test_micro_f1"] <= 1.0


def test_link_prediction_flag_reports_auc(tmp_path):
    # Two well-separated blocks: even a short run ranks hidden edges above non-edges
    # (measured 0.64-0.69 over seeds 0-3; chance is 0.5).
    metrics = main(["--dataset", "sbm", "--data-opt", "num_nodes=200", "--data-opt",
                    "num_classes=2", "--data-opt", "homophily=0.95", "--dim", "16",
                    "--walk-length", "10", "--num-walks", "4", "--batch-size", "256",
                    "--lr", "0.05", "--link-prediction", "0.2", "--backend", "torch",
                    "--quiet", "--out", str(tmp_path)])
    assert metrics["nodes"] == 200 and metrics["link_auc"] > 0.58
    assert metrics["test_micro_f1"] > 0.9


def _two_cliques(tmp_path, labels):
    """An edge list of two 12-node cliques joined by one edge (string node ids), and,
    with ``labels``, a file naming each clique's class; returns the command line."""
    nodes = [[f"{side}{i}" for i in range(12)] for side in ("a", "b")]
    edges = [(u, v) for clique in nodes for i, u in enumerate(clique) for v in clique[i + 1:]]
    (tmp_path / "g.edges").write_text("".join(f"{u} {v}\n" for u, v in edges + [("a0", "b0")]))
    argv = ["--dataset", "edgelist", "--edges", str(tmp_path / "g.edges"), "--dim", "16",
            "--quiet", "--out", str(tmp_path / "out")]
    if labels:
        (tmp_path / "g.labels").write_text("".join(
            f"{v} {name}\n" for clique, name in zip(nodes, ("left", "right")) for v in clique))
        argv += ["--labels", str(tmp_path / "g.labels")]
    return argv


def test_edge_list_without_labels_trains_and_plots_every_node_alike(tmp_path, capsys):
    # --labels is optional: the report draws the embeddings in one colour, no F1.
    metrics = main(_two_cliques(tmp_path, labels=False))
    assert metrics["nodes"] == 24 and "test_micro_f1" not in metrics
    assert (tmp_path / "out" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["test_f1_per_class"] == {}


def test_edge_list_labels_keep_their_names_and_a_small_graph_trains_enough(tmp_path, capsys):
    """A small graph gets batches small enough for 100 steps an epoch (not one batch of
    16,384 pairs), says what it trains, and reports F1 under the labels' own names."""
    metrics = main(_two_cliques(tmp_path, labels=True))
    out = capsys.readouterr().out
    assert metrics["steps"] >= 100, metrics
    assert re.search(r"training 1\d\d steps of \d+ pairs", out), out
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert set(saved["test_f1_per_class"]) == {"left", "right"}, saved
    assert metrics["final_loss"] < 3.5  # untrained: (1 + 5) * log 2 = 4.16


def test_the_docs_karate_command_trains(tmp_path):
    """docs/graph-examples.md's karate command, as printed: thousands of steps (one
    batch of 16,384 pairs an epoch was 30 steps), and a loss well below the untrained
    (1 + 5) * log 2 = 4.16."""
    docs = (Path(__file__).parent.parent / "docs" / "graph-examples.md").read_text()
    line = re.search(r"graph_examples/deepwalk\.py (--dataset karate [^#\n]*)", docs).group(1)
    metrics = main(line.split() + ["--quiet", "--out", str(tmp_path)])
    assert metrics["steps"] >= 1000 and metrics["final_loss"] < 2.6, metrics


def test_few_steps_are_said(tmp_path, capsys):
    main(FAST + ["--backend", "torch", "--max-steps", "7", "--out", str(tmp_path)])
    assert "note: 7 steps learn little" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--dim", "0"], "--dim: must be >= 1, got 0"),
    (["--dataset", "edgelist"], "--dataset edgelist needs --edges PATH"),
    (["--link-prediction", "1.0"], r"--link-prediction: must be in \[0, 1\)"),
    (["--data-opt", "oops"], "--data-opt: expected KEY=VALUE"),
    (["--max-steps", "-1"], "--max-steps: must be >= 0, got -1"),
    (["--prefetch", "-1"], "--prefetch: must be >= 0, got -1"),
    (["--dataset", "cora"], "invalid choice: 'cora'"),
])
def test_bad_arguments_exit_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message.replace("\\", "") in capsys.readouterr().err


def test_make_tables_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"backend: expected one of \('distemb', 'torch'\)"):
        make_tables("jax", 10, 4, 0.1)


def test_distemb_backend_matches_torch(tmp_path):
    # SparseAdam in distemb matches torch.optim.SparseAdam, so the same batches must
    # give the same embeddings up to float rounding.
    main(FAST + ["--backend", "torch", "--out", str(tmp_path / "torch")])
    main(FAST + ["--backend", "distemb", "--out", str(tmp_path / "distemb")])
    a = np.load(tmp_path / "torch" / "embeddings.npy")
    b = np.load(tmp_path / "distemb" / "embeddings.npy")
    assert np.abs(a - b).max() < 1e-4


@pytest.mark.parametrize("optimizer, lr", [("adagrad", "0.1"), ("sgd", "2")])
def test_optimizer_flag_trains_as_torchs_class_of_that_name(tmp_path, optimizer, lr):
    # --optimizer picks distemb's and torch's optimizer of one name: the same batches
    # give the same embeddings (torch.optim.Adagrad / SGD on sparse gradients).
    args = FAST + ["--optimizer", optimizer, "--lr", lr]
    main(args + ["--backend", "torch", "--out", str(tmp_path / "torch")])
    main(args + ["--backend", "distemb", "--out", str(tmp_path / "distemb")])
    a = np.load(tmp_path / "torch" / "embeddings.npy")
    b = np.load(tmp_path / "distemb" / "embeddings.npy")
    assert np.abs(a).max() > 0.05  # trained away from the +-0.5/dim start
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)


def test_optimizer_without_a_torch_class_is_refused_for_torch():
    with pytest.raises(ValueError, match="optimizer: 'rowwise_adagrad' has no torch.optim "
                                         "class"):
        make_tables("torch", 10, 4, 0.1, optimizer="rowwise_adagrad")
    with pytest.raises(ValueError, match="optimizer: expected one of"):
        make_tables("distemb", 10, 4, 0.1, optimizer="lamb")


def test_fused_loss_and_prefetching_train_as_the_plain_loss_in_turn(tmp_path):
    """The default step (distemb.skipgram_loss on unique ids, sampling in the main thread
    while a second thread trains) against the plain torch loss, sampled and trained in
    turn in one thread: the same batches, so the same embeddings up to rounding; the
    plain loss with and without prefetching: bit for bit the same."""
    runs = {}
    for name, extra in (("plain", ["--loss", "torch", "--prefetch", "0"]),
                        ("plain_prefetch", ["--loss", "torch", "--prefetch", "3"]),
                        ("fused", [])):
        main(FAST + ["--backend", "distemb", *extra, "--out", str(tmp_path / name)])
        runs[name] = np.load(tmp_path / name / "embeddings.npy")
    assert np.array_equal(runs["plain"], runs["plain_prefetch"])
    np.testing.assert_allclose(runs["fused"], runs["plain"], rtol=0, atol=1e-5)
    assert not np.allclose(runs["fused"], _node_init(8, 0)((34, 8)).numpy(), atol=1e-3)


@pytest.mark.parametrize("depth", [0, 2])
def test_overlapped_consumes_in_order_and_raises_either_threads_error(depth):
    seen = []
    overlapped(iter(range(50)), seen.append, depth)
    assert seen == list(range(50))

    def bad_consumer(item):
        if item == 5:
            raise KeyError("consumer failed")
    with pytest.raises(KeyError, match="consumer failed"):
        overlapped(iter(range(50)), bad_consumer, depth)

    def bad_items():
        yield from range(7)
        raise IndexError("sampler failed")
    seen.clear()
    with pytest.raises(IndexError, match="sampler failed"):
        overlapped(bad_items(), seen.append, depth)
    assert seen == list(range(7))  # the trainer finished what it had, then stopped


def test_max_steps_stops_early_and_phases_add_up(tmp_path):
    metrics = main(FAST + ["--backend", "torch", "--max-steps", "7", "--out", str(tmp_path)])
    assert metrics["steps"] == 7 and metrics["pairs"] == 7 * 128
    phases = sum(metrics[f"{p}_seconds"] for p in ("sample", "forward_backward", "step"))
    assert phases <= metrics["train_seconds"] + 0.02


def test_distemb_runs_in_one_process_start_fresh(tmp_path):
    # distemb reuses a table of an existing name: a second run must not continue the
    # first one's rows.
    main(FAST + ["--out", str(tmp_path / "a")])
    main(FAST + ["--out", str(tmp_path / "b")])
    assert np.array_equal(np.load(tmp_path / "a" / "embeddings.npy"),
                          np.load(tmp_path / "b" / "embeddings.npy"))


def test_distemb_deepwalk_beats_random_embeddings_by_a_wide_margin(tmp_path):
    """Short distemb run on a 4-class planted partition vs random vectors, same evaluation."""
    from graph_examples.datasets import load_dataset
    from graph_examples.evaluate import node_classification

    data = ["--data-opt", "num_nodes=1000", "--data-opt", "num_classes=4"]
    metrics = main(["--dataset", "sbm", *data, "--dim", "16", "--walk-length", "10",
                    "--num-walks", "4", "--batch-size", "512", "--lr", "0.05",
                    "--backend", "distemb", "--quiet", "--out", str(tmp_path)])
    ds = load_dataset("sbm", num_nodes=1000, num_classes=4)
    rand = np.random.default_rng(0).standard_normal((1000, 16)).astype(np.float32)
    chance = node_classification(rand, ds, "test").micro_f1
    assert chance < 0.4, f"random embeddings should be near chance (0.25), got {chance}"
    assert metrics["test_micro_f1"] > chance + 0.4, (metrics["test_micro_f1"], chance)


@pytest.fixture
def cuda_twin(monkeypatch):
    """Make device='cuda' give distemb tables on the CPU running the CUDA kernels' twin."""
    from cpu_cuda_twin import CpuCudaTwin
    from distemb.kvstore import device as device_kv
    from distemb.kvstore import views as views_kv

    ops = CpuCudaTwin()
    monkeypatch.setattr(device_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(views_kv, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(device_kv.DeviceKVClient, "ops", ops)
    return ops


def test_device_cuda_runs_the_device_path_and_matches_torch(tmp_path, cuda_twin):
    """--device cuda through the CUDA twin: the GPU code path, the same embeddings."""
    main(FAST + ["--backend", "torch", "--out", str(tmp_path / "torch")])
    metrics = main(FAST + ["--device", "cuda", "--out", str(tmp_path / "gpu")])
    assert metrics["device"] == "cuda"
    assert cuda_twin.calls["dedup_sum_padded"] == 2 * metrics["steps"]  # node and context tables
    assert cuda_twin.calls["adam_update"] == 2 * metrics["steps"]
    a = np.load(tmp_path / "torch" / "embeddings.npy")
    b = np.load(tmp_path / "gpu" / "embeddings.npy")
    assert np.abs(a - b).max() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "distemb"])
def test_device_cuda_without_a_gpu_says_why(backend):
    from distemb.kernels import cuda

    if cuda.cuda_available():
        pytest.skip("a usable GPU is present here, so the no-GPU error cannot be provoked")
    with pytest.raises(cuda.CudaUnavailableError, match="CUDA"):
        make_tables(backend, 10, 4, 0.1, device="cuda")


def summed_pairs_oracle(args, out):
    """One embedded process: SparseAdam steps on the summed loss of each pair of
    consecutive batches of deepwalk.py's stream (``args``); saves the node table to
    ``out``. Run in a fresh process, as the job's trainers are: DGL's walks depend on the
    process's thread settings."""
    from distemb.context import DistContext
    from graph_examples.datasets import load_dataset
    from graph_examples.stream import shard
    from graph_examples.walks import SkipGramBatches

    torch.set_num_threads(1)  # as the trainers (--threads 1)
    p = parse_args(args)
    ds = load_dataset(p.dataset)
    batches = SkipGramBatches(ds.graph, p.walk_length, p.window, p.num_walks, p.negatives,
                              p.batch_size, seed=p.seed)
    ctx = DistContext.embedded(num_threads=1)
    n = ds.graph.num_nodes()
    node = distemb.DistEmbedding(n, p.dim, context=ctx, init_func=_node_init(p.dim, p.seed))
    context = distemb.DistEmbedding(n, p.dim, context=ctx,
                                    init_func=lambda s, d: torch.zeros(s, dtype=d))
    opt = distemb.SparseAdam([node, context], lr=p.lr)
    stream = list(batches.epoch(0))
    steps = len(list(shard(iter(stream), 0, 2, len(stream))))
    for k in range(steps):
        opt.zero_grad()
        loss = 0
        for centers, contexts, negatives in stream[2 * k:2 * k + 2]:
            b, m = negatives.shape
            rows = context(torch.cat([contexts, negatives.reshape(-1)]))
            loss = loss + skipgram_loss(node(centers), rows[:b], rows[b:].reshape(b, m, -1))
        loss.backward()
        opt.step()
    np.save(out, node(torch.arange(n)).detach().numpy())
    return steps


@pytest.mark.multiprocess
@pytest.mark.timeout(450)  # the job (200 s at most), then the oracle (200 s at most)
def test_deepwalk_under_distemb_launch_equals_summed_batches_in_one_process(tmp_path):
    """1 server x 2 trainers, sync_exact, behind an exact trainer cache: trainer r takes
    batch r of every pair of consecutive batches and the server applies their summed
    gradients once, so the job equals one process stepping on each pair's summed loss."""
    import os
    import subprocess
    import sys

    from mp_helper import free_port

    args = FAST[:-1] + ["--epochs", "1"]
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    argv = [sys.executable, "-m", "distemb.launch", "--ip-config", str(ip), "--num-servers",
            "1", "--num-trainers", "2", "--consistency", "sync_exact", "--cache-fraction",
            "0.5", "--master-port", str(free_port()), "--config-out",
            str(tmp_path / "cluster.json"), "--timeout", "60", "--", sys.executable,
            "graph_examples/deepwalk.py", *args, "--quiet", "--threads", "1", "--out",
            str(tmp_path / "job")]
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert metrics["trainers"] == 2 and "trainer 1:" in done.stdout

    code = (f"import sys; sys.path[:0] = [{root!r}, {here!r}]; import test_deepwalk as t; "
            f"print(t.summed_pairs_oracle({args!r}, {str(tmp_path / 'oracle.npy')!r}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, here, os.environ.get(
        "PYTHONPATH", "")]))
    # a loaded machine (a parallel run) gives this one process a fraction of a core
    oracle = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                            capture_output=True, text=True, timeout=200)
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    steps = int(oracle.stdout.split()[-1])
    assert metrics["steps"] == steps > 3
    got, want = np.load(tmp_path / "job" / "embeddings.npy"), np.load(tmp_path / "oracle.npy")
    p = parse_args(args)
    assert not np.allclose(got, _node_init(p.dim, p.seed)((34, p.dim)).numpy())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(500)  # the job (240 s at most), then the oracle (200 s at most)
def test_deepwalk_under_torchrun_equals_summed_batches_in_one_process(tmp_path):
    """2 ranks under torchrun (collective mode, no servers): rank r takes batch r of every
    pair of consecutive batches, and each owner applies the pair's summed gradients once,
    so the job equals one process stepping on each pair's summed loss (the oracle of the
    distemb-launch test above)."""
    import os
    import subprocess
    import sys

    from mp_helper import ProcessGroup, child_env, free_port

    args = FAST[:-1] + ["--epochs", "1"]
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    with ProcessGroup() as group:  # a session: kill_all ends torchrun's children too
        group.spawn([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                     "graph_examples/deepwalk.py", *args, "--quiet", "--threads", "1",
                     "--out", str(tmp_path / "job")], session=True)
        out = next(iter(group.wait_all(timeout=240).values()))
    metrics = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert metrics["trainers"] == 2 and "trainer 1:" in out, out[-3000:]

    code = (f"import sys; sys.path[:0] = [{root!r}, {here!r}]; import test_deepwalk as t; "
            f"print(t.summed_pairs_oracle({args!r}, {str(tmp_path / 'oracle.npy')!r}))")
    oracle = subprocess.run([sys.executable, "-c", code], cwd=root,
                            env=child_env(PYTHONPATH=os.pathsep.join([root, here])),
                            capture_output=True, text=True, timeout=200)
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    steps = int(oracle.stdout.split()[-1])
    assert metrics["steps"] == steps > 3
    got, want = np.load(tmp_path / "job" / "embeddings.npy"), np.load(tmp_path / "oracle.npy")
    p = parse_args(args)
    assert not np.allclose(got, _node_init(p.dim, p.seed)((34, p.dim)).numpy())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
