"""Every benchmark script runs end to end at tiny sizes, prints its table and writes its data.

Benchmarks rot unseen: a script that nobody runs for a week stops at its first line
(bench_collective.py did: it handed bench_kvstore's step a namespace without the options
that step reads). Each test here runs one script as a user would, in its own process,
with sizes that take seconds, and checks what it printed (its table, its ratio) and the
record it wrote (benchmarks/results.py: date, commit, machine, command, the named
figures, the printed output), into a temporary file, never the repository's. Timings at
these sizes mean nothing; no test looks at them.

GPU-only scripts run on a GPU where there is one; elsewhere they must refuse with a
message that says why, and write nothing. All of them are marked ``bench_smoke``
(``-m "not bench_smoke"`` leaves them out).
"""
import os
import re
import subprocess
import sys

import pytest

from mp_helper import ROOT, ProcessGroup, child_env

from distemb.kernels import cuda

BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import results  # noqa: E402

pytestmark = pytest.mark.bench_smoke
HAS_GPU = cuda.cuda_available()
try:
    import dgl  # noqa: F401
    HAS_DGL = True
except ImportError:  # the GPU machine has none
    HAS_DGL = False
needs_dgl = pytest.mark.skipif(not HAS_DGL, reason="DGL is not installed (the dgl extra)")


def run(tmp_path, script, *args, key="main", timeout=300, expect=0):
    """Run ``benchmarks/<script>`` with ``args``; its output and the record it wrote."""
    data = tmp_path / "results.json"
    cmd = [sys.executable, os.path.join(BENCH, script), "--results", str(data), *args]
    with ProcessGroup() as group:
        # its own session: what a benchmark starts (launchers, servers) goes with it
        p = group.spawn(cmd, env=child_env(), session=True, expect=expect)
        out = group.wait_all(timeout=timeout)[p.pid]
    if expect != 0:
        assert not data.exists(), f"{script} failed and still wrote {data}"
        return out, None
    assert data.exists(), f"{script} wrote no data file; output:\n{out}"
    record = results.load(data)[key]
    for field in results.FIELDS:
        assert record[field], (field, record)
    printed = [line for line in record["output"].splitlines() if line.strip()]
    assert printed and all(line in out for line in printed), "the record's output must " \
        "be what the run printed"  # out has stderr too, interleaved
    assert f"benchmarks/{script}" in record["command"]
    assert str(data) not in record["command"]
    return out, record


def figure(record, name):
    assert name in record["figures"], (name, sorted(record["figures"]))
    return record["figures"][name]["value"]


def table_rows(out, first_cell):
    """The cells of each Markdown table row whose first cell is ``first_cell``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in out.splitlines() if line.startswith("|")]
    return [cells for cells in rows if cells[0] == first_cell]


def table_row(out, first_cell):
    """The cells of the first Markdown table row whose first cell is ``first_cell``."""
    rows = table_rows(out, first_cell)
    assert rows, f"no table row {first_cell!r} in:\n{out}"
    return rows[0]


TINY_STEP = ["--rows", "2000", "--dim", "8", "--batch", "64"]


def test_bench_step(tmp_path):
    args = TINY_STEP + ["--repeats", "1", "--steps", "2", "--warmup", "1", "--pool", "2",
                        "--processes", "1", "--threads", "1", "--dist", "zipf"]
    out, rec = run(tmp_path, "bench_step.py", *args + ([] if HAS_DGL else ["--no-dgl"]))
    assert table_row(out, "torch Adagrad")[3] == "1.00x"
    assert re.fullmatch(r"\d+\.\d\dx", table_row(out, "distemb Adagrad")[3])
    assert figure(rec, "adagrad_vs_torch.zipf.1t") > 0
    if HAS_DGL:
        assert table_row(out, "DGL SparseAdagrad")[5] == "1.00x"
        assert figure(rec, "adagrad_vs_dgl.zipf.1t") > 0


def test_step_parts(tmp_path):
    out, rec = run(tmp_path, "step_parts.py", *TINY_STEP, "--steps", "3", "--warmup", "1")
    assert "kernel adagrad_update" in out and "rest (Python, checks)" in out
    assert figure(rec, "steps") > 0 and figure(rec, "ms.adagrad_update") >= 0


def test_bench_isa(tmp_path):
    out, rec = run(tmp_path, "bench_isa.py", *TINY_STEP, "--rounds", "1")
    assert table_row(out, "adagrad_update")[1].endswith("(1.00x)")  # the baseline build
    assert figure(rec, "adagrad_update.baseline.zipf") == 1.0


def test_bench_dynamic_step(tmp_path):
    out, rec = run(tmp_path, "bench_dynamic_step.py", *TINY_STEP, "--repeats", "1",
                   "--steps", "2", "--warmup", "1", "--pool", "2", "--dist", "zipf")
    assert table_row(out, "dense DistEmbedding")[3] == "1.00x"
    for name in ("DynamicEmbedding int64 keys", "FileStore (resident)"):
        assert re.fullmatch(r"\d+\.\d\dx", table_row(out, name)[3])
    assert figure(rec, "time_vs_dense.dynamic_int64.zipf") > 0


def test_bench_half_step(tmp_path):
    out, rec = run(tmp_path, "bench_half_step.py", *TINY_STEP, "--repeats", "1", "--steps",
                   "2", "--warmup", "1", "--pool", "2", "--optimizers", "Adagrad")
    assert table_row(out, "Adagrad DistEmbedding float32")[3] == "1.00x"
    assert "kernels that half rows shrink" in out
    assert figure(rec, "paired_vs_fp32.adagrad.bfloat16") > 0


def test_bench_hash(tmp_path):
    out, rec = run(tmp_path, "bench_hash.py", "--log2-buckets", "14", "--batch", "256",
                   "--repeats", "2", "--dim", "8", "--gather-rows", "1024", "--evict-keys",
                   "4096")
    assert table_row(out, "0.5")[1] == "8192" and "# eviction lfu" in out
    assert figure(rec, "find_or_insert.0.9") > 0 and figure(rec, "evict_ns.lru") > 0


def test_bench_file_store(tmp_path):
    table_dir = tmp_path / "disk"
    table_dir.mkdir()
    out, rec = run(tmp_path, "bench_file_store.py", "--dir", str(table_dir), "--gib", "0.002",
                   "--dim", "8", "--batch", "64", "--steps", "3", "--seconds", "5",
                   "--mem-rows", "2000", "--disk-seconds", "0.2")
    assert "FileStore table, cold, ids/s (median step)" in out
    assert figure(rec, "memory_vs_file") > 0
    assert not os.listdir(table_dir), "the benchmark must remove its table"


def test_bench_locks(tmp_path):
    out, rec = run(tmp_path, "bench_locks.py", *TINY_STEP, "--calls", "5")
    assert table_row(out, "pull, bare kernel (baseline)")[2] == "1.000x"
    assert figure(rec, "us.read_lock") > 0 and figure(rec, "us.write_lock") > 0


def test_bench_doorbell(tmp_path):
    out, rec = run(tmp_path, "bench_doorbell.py", "--rounds", "1", "--trips", "20")
    assert table_row(out, "unix socket, a frame each way (distemb; baseline)")[3] == "1.00x"
    assert figure(rec, "us.socket") > 0 and figure(rec, "speedup.eventfd") > 0
    assert figure(rec, "us.spin") > 0
    (tmp_path / "bad").mkdir()
    out, _ = run(tmp_path / "bad", "bench_doorbell.py", "--mechanisms", "socket,bell",
                 expect=2)
    assert "unknown ['bell']" in out


def test_bench_checkpoint(tmp_path):
    out, rec = run(tmp_path, "bench_checkpoint.py", "--rows", "2000", "--dim", "8",
                   "--repeat", "1", "--dir", str(tmp_path))
    assert table_row(out, "ndarray.tofile + fsync / np.fromfile (baseline)")[3] == "1.00x"
    assert figure(rec, "save_vs_baseline.servers") > 0
    assert not [f for f in os.listdir(tmp_path) if f.startswith("bench-ck-")]


@pytest.mark.multiprocess
def test_bench_kvstore(tmp_path):
    out, rec = run(tmp_path, "bench_kvstore.py", *TINY_STEP, "--only-shm", "--prefetch",
                   "--steps", "3", "--warmup", "1")
    assert table_row(out, "in-process (baseline)")[3] == "1.00x"
    shm = sorted(k for k in rec["figures"]
                 if k.startswith("vs_inprocess.1_server_x_1_trainer_shm"))
    assert len(shm) == 2 and shm[1] == shm[0] + "_prefetch" and figure(rec, shm[1]) > 0
    assert figure(rec, "prefetch." + shm[0].split(".", 1)[1]) > 0  # with over without


@pytest.mark.multiprocess
def test_bench_collective(tmp_path):
    """The one-table collective job runs bench_kvstore's step, whose options it must pass
    whole (it passed too few and stopped before measuring anything)."""
    out, rec = run(tmp_path, "bench_collective.py", "--rows", "1000", "--dim", "8",
                   "--batch", "64", "--steps", "2", "--warmup", "1", "--rounds", "1",
                   "--only", "collective,grouped")
    assert table_row(out, "collective, 2 ranks")[4].endswith("MB (measured)")
    assert table_row(out, "collective, 2 ranks, 2 tables, grouped")[4].endswith("MB (measured)")
    assert figure(rec, "bytes_sent.collective_2_ranks") > 0
    assert figure(rec, "steps.collective_2_ranks_2_tables_grouped") > 0


def test_bench_collective_refuses_an_unknown_configuration(tmp_path):
    out, _ = run(tmp_path, "bench_collective.py", "--only", "collective,rdma", expect=2)
    assert "--only: expected some of tcp,shm,collective,dgl,by-table,grouped" in out


@pytest.mark.multiprocess
def test_bench_malloc(tmp_path):
    out, rec = run(tmp_path, "bench_malloc.py", "--rounds", "1", "--steps", "3", "--warmup",
                   "1", "--batch", "64", "--dim", "8", "--rows", "2000")
    assert table_row(out, "tuned")[0] == "tuned" and "tuned / default:" in out
    assert figure(rec, "tuned_vs_default") > 0


@pytest.mark.multiprocess
def test_bench_cache(tmp_path):
    out, rec = run(tmp_path, "bench_cache.py", "--streams", "zipf10m", "--zipf-rows", "2000",
                   "--zipf-batch", "64", "--dim", "8", "--jobs", "1", "--fractions", "0.1",
                   "--policies", "lfu", "--staleness", "0", "--skip-hit-rate", "--rounds",
                   "1", "--steps", "2", "--warmup", "1")
    assert table_row(out, "zipf10m, 1s x 1t, loopback")[1] == "no cache"
    assert figure(rec, "vs_no_cache.zipf10m_1s_x_1t_loopback.lfu_10_exact") > 0
    # the headline figures the docs quote (docs/caches.md, docs/performance.md)
    assert figure(rec, "vs_no_cache.loopback") > 0 and figure(rec, "cpu_more") > -100


@needs_dgl
@pytest.mark.multiprocess
def test_bench_staleness(tmp_path):
    out, rec = run(tmp_path, "bench_staleness.py", "--dataset", "karate", "--servers", "1",
                   "--trainers", "1", "--max-steps", "2", "--", "--batch-size", "64")
    assert table_row(out, "exact")[4] == "+0.00" and "staleness 5 - exact" in out
    # one trainer: nobody else writes, so the stale cache trains exactly as exact
    assert figure(rec, "micro_f1.stale") == figure(rec, "micro_f1.exact")


@needs_dgl
def test_bench_deepwalk(tmp_path):
    out, rec = run(tmp_path, "bench_deepwalk.py", "--dataset", "karate", "--max-steps", "3",
                   "--batch-size", "64")
    assert "DeepWalk on karate" in out and "time / gensim" in out
    assert figure(rec, "time_vs_torch.torch") == 1.0
    assert 0 <= figure(rec, "micro_f1.distemb") <= 1


@needs_dgl
@pytest.mark.multiprocess
def test_bench_deepwalk_cluster(tmp_path):
    """Loopback only: no namespaces needed (and none made)."""
    out, rec = run(tmp_path, "bench_deepwalk_cluster.py", "--dataset", "karate", "--hosts",
                   "1x1", "--links", "loopback", "--steps", "4", "--warmup", "1", "--rounds",
                   "1", "--sides", "prefetch,every", "--", "--batch-size", "64", "--dim", "8")
    assert [row[2] for row in table_rows(out, "1x1")] == ["prefetch", "every", "none"]
    assert table_rows(out, "1x1")[1][6] == "100%"  # every lookup prefetched
    assert table_rows(out, "1x1")[2][4] == "1.00x"  # the baseline against itself
    assert figure(rec, "prefetch_every.1x1_loopback") > 0 and figure(rec, "mb_per_step") > 0
    out, rec = run(tmp_path, "bench_deepwalk_cluster.py", "--dataset", "karate", "--hosts",
                   "1x1", "--links", "loopback", "--shared-memory", "--steps", "4",
                   "--warmup", "1", "--rounds", "1", "--sides", "every", "--", "--batch-size",
                   "64", "--dim", "8")
    assert table_rows(out, "1x1")[0][6] == "0%"  # read in place: nothing read ahead
    assert figure(rec, "prefetch_every.1x1_loopback") > 0


@needs_dgl
def test_bench_graphsage(tmp_path):
    out, rec = run(tmp_path, "bench_graphsage.py", "--dataset", "karate", "--steps", "2",
                   "--warmup", "1", "--rounds", "1", "--batch-size", "8", "--optimizers",
                   "adagrad")
    ours, torch_row = table_rows(out, "adagrad")
    assert ours[1].startswith("distemb.DistEmbedding") and torch_row[5] == "1.00x"
    assert figure(rec, "vs_torch.adagrad") > 0
    assert figure(rec, "max_loss_diff.adagrad") < 1e-4  # the same model, trained alike


@needs_dgl
def test_bench_node2vec(tmp_path):
    pytest.importorskip("torch_geometric", reason="PyG is not installed (the pyg extra)")
    out, rec = run(tmp_path, "bench_node2vec.py", "--dataset", "karate", "--batches", "2",
                   "--turn", "1", "--batch-size", "16")
    assert "Node2Vec on karate" in out and "largest difference" in out
    assert figure(rec, "step_speedup.pyg") == 1.0
    assert figure(rec, "max_loss_diff") < 1e-4  # the same model on the same batches


GPU_SCRIPTS = {
    "bench_gpu_step.py": ["--rows", "4096", "--dim", "8", "--batch", "256", "--rounds", "1",
                          "--per-round", "2", "--optimizers", "adagrad", "--ids", "zipf"],
    "bench_gpu_dynamic.py": ["--keys", "4096", "--dim", "8", "--batch", "256", "--rounds", "1",
                             "--per-round", "2"],
    "gpu_host_parts.py": ["--rows", "4096", "--batch", "256", "--calls", "10"],
}


@pytest.mark.parametrize("script", sorted(GPU_SCRIPTS))
def test_gpu_script(tmp_path, script):
    """On a GPU: a tiny run with its table and data. Elsewhere: a refusal naming why."""
    if not HAS_GPU:
        out, _ = run(tmp_path, script, *GPU_SCRIPTS[script], expect=1)
        assert f"{script[:-3]}: cannot run without a usable GPU" in out
        return
    out, rec = run(tmp_path, script, *GPU_SCRIPTS[script])
    assert "; " in rec["machine"]  # the device is named beside the host
    assert rec["figures"]


def test_gpu_checklist_names_what_exists_and_refuses_without_a_gpu(tmp_path):
    """benchmarks/gpu_checklist.sh runs on a GPU machine's short lease: every file it
    names must exist here already, and without a GPU it stops at once, saying why."""
    path = os.path.join(BENCH, "gpu_checklist.sh")
    with open(path) as f:
        text = f.read()
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/]+\.(?:py|sh))", text))
    assert {"benchmarks/bench_gpu_step.py", "tests/test_cuda_kernels.py"} <= named
    assert [n for n in named if not os.path.exists(os.path.join(ROOT, n))] == []
    subprocess.run(["bash", "-n", path], check=True)
    if HAS_GPU:
        return
    done = subprocess.run(["bash", path, str(tmp_path / "log"), "bench"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no usable GPU here" in done.stdout + done.stderr
