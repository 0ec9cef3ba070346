"""Collective mode (distemb.kvstore.collective) with real gloo processes on 127.0.0.1.

The job of tests/collective_trainer.py (every optimizer, zipf ids with many duplicates,
a rank that looks nothing up on some steps) run by W ranks must give bit-identical rows
and optimizer state to the same job in one embedded process on the concatenated
batches (exact by construction: see that module); its checkpoint, each rank writing its
own shards, loads into one process and into another number of ranks. A rank that dies, tables defined
differently, and ranks whose calls went apart make every surviving rank raise a
KVStoreError that says what happened, within the timeout, never hang. What collective
mode does not do yet is refused (a world of one, in this process).
"""
import json
import os
import re
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import collective_trainer as job
import distemb
from distemb import DistEmbedding
from distemb.dynamic import StoreEmbedding
from distemb.errors import DistEmbError, KVStoreError
from distemb.optim import SparseSGD
from distemb.stores import HashStore
from mp_helper import ProcessGroup, child_env, free_port

TRAINER = os.path.join(os.path.dirname(__file__), "collective_trainer.py")


def run_job(tmp_path, world, *extra, expect=0, timeout=150):
    """Start ``world`` ranks with torchrun's environment; {rank: output}."""
    port = free_port()
    with ProcessGroup() as group:
        procs = [group.spawn([sys.executable, TRAINER, str(tmp_path), *extra],
                             env=child_env(RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port, LOCAL_RANK=r),
                             expect=expect(r) if callable(expect) else expect)
                 for r in range(world)]
        outs = group.wait_all(timeout=timeout)
        return {r: outs[p.pid] for r, p in enumerate(procs)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_collective_equals_one_process_bit_for_bit(tmp_path, world):
    steps = 15
    outs = run_job(tmp_path, world, "--steps", str(steps), "--keys")
    assert all(f"rank {r} of {world}: done" in outs[r] for r in range(world))
    want, keys = job.oracle(steps, world, keys=True)
    for k in want:
        with np.load(tmp_path / f"{k}.npz") as z:
            got = {c: z[c] for c in z.files}
        assert sorted(got) == sorted(want[k]), k
        for col, arr in want[k].items():
            assert got[col].dtype == arr.dtype, (k, col)
            assert np.array_equal(got[col], arr), f"table {k}: {col} differs from one process"
    for i, k in enumerate(job.OPTIMIZERS):
        moved = np.abs(want[k]["weight"] - job.initial(i).numpy()).max(axis=1)
        assert (moved > 0).sum() >= 50, f"table {k}: too few rows trained to mean anything"
    # the grouped model: Adam's step counts only steps where some rank had gradients
    steps_rare = sum(1 for s in range(steps) if s % 3)
    assert int(want["grare"]["step"]) == steps_rare and int(want["gnode"]["step"]) == steps
    # one exchange per lookup and one per step for the grouped model's three tables and
    # four lookups (seven, table by table); two per step for each table of its own
    with open(tmp_path / "exchanges.json", encoding="utf-8") as f:
        calls = json.load(f)
    assert calls["calls"] == steps * (2 * len(job.OPTIMIZERS) + 2), calls
    # a dynamic table's keys: each rank holds those the key hash sends it (above, its
    # rows and state equal one process's); key management answers as one process would
    assert len(want["gdyn"]["keys"]) > 40
    for r in range(world):
        with np.load(tmp_path / f"keys{r}.npz") as z:
            assert_same({c: z[c] for c in z.files}, keys[r], f"key management on rank {r}")
    assert all(keys[r]["missing"] and keys[r]["removed"] > 0 for r in range(world))
    # a bfloat16 dynamic table's rows cross between ranks in 2 bytes a value: the same
    # pull sends 8 bytes less per row a rank serves to another (dim 4)
    for r in range(world):
        with open(tmp_path / f"wire{r}.json", encoding="utf-8") as f:
            wire = json.load(f)
        assert wire["gdyn"] - wire["gdyn16"] == 8 * wire["owned"] * (world - 1), (r, wire)
    # a table on files: rank r holds the range of keys in files/part-r-of-W
    with np.load(tmp_path / "file_table.npz") as z:
        assert_same({c: z[c] for c in z.files}, job.file_oracle(str(tmp_path / "one"), world),
                    "file table")
    assert sorted(os.listdir(tmp_path / "files")) == [f"part-{r}-of-{world}"
                                                      for r in range(world)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_collective_with_prefetch_equals_one_process_bit_for_bit(tmp_path):
    """Two ranks, every lookup prefetched one step ahead (the keys ride in the step's
    round, the owners answer after the update, in the background): rows and optimizer
    state of every table, the grouped model's too, equal one process's without
    prefetch, and the lookups took their rows from the prefetches."""
    steps = 12
    outs = run_job(tmp_path, 2, "--steps", str(steps), "--prefetch")
    assert all(f"rank {r} of 2: done" in outs[r] for r in range(2))
    want = job.oracle(steps, 2)
    for k in want:
        with np.load(tmp_path / f"{k}.npz") as z:
            got = {c: z[c] for c in z.files}
        assert_same(got, want[k], f"table {k} with prefetch")
    with open(tmp_path / "prefetch.json", encoding="utf-8") as f:
        stats = json.load(f)
    assert stats["served_rows"] > 0 and stats["prefetches"] > steps, stats


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_under_torchrun_equals_one_process(tmp_path):
    """The job started by torchrun itself (its agent hosts the rendezvous store)."""
    steps = 10
    with ProcessGroup() as group:  # session: kill_all ends torchrun's children too
        group.spawn([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                     TRAINER, str(tmp_path), "--steps", str(steps)],
                    session=True)
        out = next(iter(group.wait_all(timeout=180).values()))
    assert "rank 0 of 2: done" in out and "rank 1 of 2: done" in out, out
    want = job.oracle(steps, 2)
    for k in want:
        with np.load(tmp_path / f"{k}.npz") as z:
            assert_same({c: z[c] for c in z.files}, want[k], f"table {k} under torchrun")


def assert_same(got, want, what):
    assert sorted(got) == sorted(want), what
    for col, arr in want.items():
        assert got[col].dtype == arr.dtype, (what, col)
        assert np.array_equal(got[col], arr), f"{what}: {col} differs"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_checkpoint_of_two_ranks_loads_embedded_and_into_three_ranks(tmp_path):
    ck, first, second = tmp_path / "ck", tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    run_job(first, 2, "--steps", "8", "--save", str(ck))
    with open(ck / "adam" / "manifest.json", encoding="utf-8") as f:
        tensors = json.load(f)["tensors"]
    shards = tensors["coll-adam"]["shards"]  # one record per rank, each file there
    assert sorted(s["part"] for s in shards) == [0, 1]
    for col in ("weight", "exp_avg"):
        segs = [s["columns"][col]["segment"] for s in shards]
        assert all(os.path.isfile(ck / "adam" / s["file"]) for s in segs), col
    # W ranks -> one process: the embedded job after the same 8 steps
    assert_embedded = job.oracle(0, 1, load=str(ck))
    after8 = job.oracle(8, 2)
    for k in after8:
        assert_same(assert_embedded[k], after8[k], f"table {k} loaded into one process")
    # W ranks -> W' ranks, resumed: the uninterrupted job
    run_job(second, 3, "--start", "8", "--steps", "7", "--load", str(ck))
    want = job.oracle(8, 2, then=[(7, 3)])
    for k in want:
        with np.load(second / f"{k}.npz") as z:
            assert_same({c: z[c] for c in z.files}, want[k], f"table {k} resumed on 3 ranks")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoints_cross_from_collective_to_servers_and_back(tmp_path):
    """2 ranks save; a distemb-launch job (2 servers x 2 trainers, sync_exact) loads it,
    trains and saves; 3 ranks load that and train: every table (dense, bfloat16, keyed,
    2W+1 hash partitions) and its optimizer state equal the uninterrupted job, bit for
    bit, after each leg."""
    ck1, ck2 = tmp_path / "ck1", tmp_path / "ck2"
    legs = [tmp_path / name for name in ("a", "b", "c")]
    for leg in legs:
        leg.mkdir()
    run_job(legs[0], 2, "--steps", "6", "--save", str(ck1), "--every-step")
    ip = tmp_path / "ip.txt"
    ip.write_text(f"127.0.0.1 {free_port()}\n")
    with ProcessGroup() as group:
        group.spawn([sys.executable, "-m", "distemb.launch", "--ip-config", str(ip),
                     "--num-servers", "2", "--num-trainers", "2", "--consistency",
                     "sync_exact", "--config-out", str(tmp_path / "cluster.json"),
                     "--timeout", "60", "--", sys.executable, TRAINER, str(legs[1]),
                     "--servers", "--load", str(ck1), "--start", "6", "--steps", "5",
                     "--save", str(ck2), "--every-step"])
        out = next(iter(group.wait_all(timeout=200).values()))
    assert "rank 1 of 2: done" in out, out[-3000:]
    want = job.oracle(6, 2, then=[(5, 2)], skip_rare=False)
    for k in want:
        with np.load(legs[1] / f"{k}.npz") as z:
            assert_same({c: z[c] for c in z.files}, want[k], f"table {k} on servers")
    run_job(legs[2], 3, "--load", str(ck2), "--start", "11", "--steps", "4", "--every-step")
    want = job.oracle(6, 2, then=[(5, 2), (4, 3)], skip_rare=False)
    for k in want:
        with np.load(legs[2] / f"{k}.npz") as z:
            assert_same({c: z[c] for c in z.files}, want[k], f"table {k} back on 3 ranks")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_dying_rank_fails_the_others_naming_it(tmp_path):
    start = time.monotonic()
    outs = run_job(tmp_path, 3, "--steps", "10", "--die-at", "4", "--timeout", "20",
                   expect=lambda r: 9 if r == 2 else 3, timeout=90)
    for r in (0, 1):
        assert "KVStoreError" in outs[r] and "rank(s) [2] did not report" in outs[r], outs[r]
    assert time.monotonic() - start < 90


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_nan_gradient_on_one_rank_is_refused_by_every_rank_and_the_job_goes_on(tmp_path):
    """Rank 0's gradients hold a NaN on step 3: every rank's step() of each such table
    refuses it, naming the table and rank 0, before any owner applies anything; after 6
    steps the tables equal one process that skipped step 3 of them, bit for bit."""
    steps = 6
    outs = run_job(tmp_path, 2, "--steps", str(steps), "--nan-at", "3")
    for r in (0, 1):
        for k in job.OPTIMIZERS:
            assert re.search(rf"rank {r}: step 3 of '{k}' refused: step\(\): the gradients "
                             rf"of table\(s\) \['coll-{k}'\] \(from rank\(s\) \[0\]\) "
                             "hold NaN or infinity", outs[r]), outs[r]
    want = job.oracle(steps, 2, skip=3)
    for k in job.OPTIMIZERS:
        with np.load(tmp_path / f"{k}.npz") as z:
            assert_same({c: z[c] for c in z.files}, want[k], f"table {k}")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_that_took_fewer_steps_is_named_as_such_not_as_dead(tmp_path):
    """The last rank takes 3 of 5 steps and closes distemb as a finished script does: the
    others are told it closed after fewer calls, not that it is dead or hung."""
    outs = run_job(tmp_path, 3, "--steps", "5", "--fewer-steps", "3", "--timeout", "20",
                   expect=lambda r: 0 if r == 2 else 3, timeout=90)
    assert "done after 3 steps" in outs[2], outs[2]
    for r in (0, 1):
        assert "KVStoreError" in outs[r], outs[r]
        assert re.search(r"rank 2 after \d+ exchange\(s\) closed distemb, and this rank is "
                         r"in exchange \d+ \((pull|push_update) of ", outs[r]), outs[r]
        assert "a rank with fewer batches must still take part" in outs[r], outs[r]
        assert "dead or hung" not in outs[r], outs[r]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_dying_store_host_fails_the_others_saying_so(tmp_path):
    """Rank 0 hosts the rendezvous store under a tcp:// init: with it gone no rank can be
    named through the store, and the error says which rank has likely died."""
    outs = run_job(tmp_path, 3, "--steps", "10", "--die-at", "4", "--die-rank", "0",
                   "--timeout", "20", expect=lambda r: 9 if r == 0 else 3, timeout=90)
    for r in (1, 2):
        assert "KVStoreError" in outs[r] and "rank 0 under a tcp:// init" in outs[r], outs[r]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag,says", [
    ("--mismatch", "table 'mismatched': rank 1 defines it differently from rank 0 (shape"),
    ("--apart", "every rank must make the same distemb calls in the same order")])
def test_ranks_that_disagree_all_raise(tmp_path, flag, says):
    outs = run_job(tmp_path, 2, "--steps", "3", flag, "--timeout", "20", expect=3, timeout=90)
    for r in (0, 1):
        assert says in outs[r], outs[r]


# -- a world of one, in this process: semantics and refusals -----------------------------

@pytest.fixture
def ctx(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        c = distemb.initialize(backend="pytorch", num_threads=1, mode="collective",
                               timeout_s=10)
        yield c
        distemb.shutdown()
    finally:
        dist.destroy_process_group()


def test_world_of_one_pulls_pushes_and_trains_as_embedded(ctx):
    assert ctx.role == "collective" and ctx.num_trainers == 1
    emb = DistEmbedding(10, 3, name="one", context=ctx)
    emb.weight[torch.tensor([4, 9, 4])] = torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3])
    assert emb.weight[torch.tensor([9, 4, 0])].tolist() == [[2.0] * 3, [3.0] * 3, [0.0] * 3]
    opt = SparseSGD([emb], lr=0.5)
    emb(torch.tensor([9, 9, 0])).sum().backward()
    opt.step()
    assert emb.weight[torch.tensor([9, 0])].tolist() == [[1.0] * 3, [-0.5] * 3]


def test_not_yet_in_collective_mode_is_refused(ctx):
    emb = DistEmbedding(10, 3, name="refused", context=ctx)
    with pytest.raises(KVStoreError, match="CollectiveKVClient: cannot hold table 'given' on "
                                           "a HashStore object: a store object lives in one "
                                           "process, and this client's tables are sharded "
                                           "over its ranks"):
        StoreEmbedding(HashStore(4), name="given", context=ctx)
    with pytest.raises(KVStoreError, match="onto 'cuda' is not available in collective"):
        emb(torch.tensor([1]), device="cuda")


def test_initialize_collective_refuses_what_it_cannot_do(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DistEmbError, match="MASTER_ADDR, MASTER_PORT not set"):
        distemb.initialize(mode="collective")
    with pytest.raises(DistEmbError, match="no device_cache yet"):
        distemb.initialize(mode="collective", device_cache={"fraction": 0.1})
    with pytest.raises(DistEmbError, match="consistency 'async' is not available"):
        distemb.initialize(mode="collective", consistency="async")
    with pytest.raises(DistEmbError, match="mode: expected None or 'collective'"):
        distemb.initialize(mode="servers")
