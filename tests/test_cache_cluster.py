"""Trainer caches in a real job: 2 servers x 2 trainers under distemb-launch.

Each job trains the table 'emb' without a cache and, with the same batches in the same
steps, twins behind an exact cache and a bounded-staleness cache
(``cluster_trainer.py --twins``). The oracle of the exact cache is the uncached table:
bit-identical in every consistency mode, while the cache served rows without data. The
bounded-staleness twin is a relaxation: every row it trains with is checked against the
servers' row of that moment (within 2 (s - 1) lr, see below), and its effect on the final
loss is measured.
"""
import json

import numpy as np
import pytest
import torch

import cluster_trainer as job
from test_cluster import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def run(tmp_path, consistency, extra, steps=12):
    launch(tmp_path, consistency, extra=["--twins", *extra], steps=steps)
    stats = [json.loads((tmp_path / f"cache{r}.json").read_text()) for r in range(2)]
    tables = {k: np.load(tmp_path / f"final{k}.npy") for k in ("", "-exact", "-stale")}
    return tables, stats


def loss_after(table, steps):
    """The job's loss over its whole batches, evaluated with the final table."""
    total = 0.0
    for step in range(steps):
        ids, targets = job.batch(step, 2, disjoint=False)
        total += float(job.loss_of(torch.from_numpy(table)[ids], targets))
    return total


def test_exact_cache_is_bit_identical_to_no_cache_sync(tmp_path):
    """sync: disjoint ids (the uncached result does not depend on arrival order)."""
    tables, stats = run(tmp_path, "sync", ["--disjoint"])
    assert not np.allclose(tables[""], 0.5), "the job did not train"
    np.testing.assert_array_equal(tables["-exact"], tables[""])  # bit for bit
    assert sum(s["exact"]["hit_rows"] for s in stats) > 0, stats  # the cache served rows
    # No row has another writer: staleness serves nothing old; every row it trained with
    # equalled the servers' (own updates are applied to both, with the same kernels).
    assert max(s["stale_dev"] for s in stats) == 0.0, stats
    np.testing.assert_array_equal(tables["-stale"], tables[""])


def test_exact_cache_bit_identical_and_staleness_measured_sync_exact(tmp_path):
    """sync_exact, both trainers on the same rows: a held row both trainers updated in a
    step stays cached, updated with the owner's summed gradient; staleness 5 reads rows
    missing the other trainer's updates of rows it did not update itself, so its table
    differs; its final loss must stay within 10%."""
    steps = 16
    tables, stats = run(tmp_path, "sync_exact", [], steps=steps)
    np.testing.assert_array_equal(tables["-exact"], tables[""])
    assert sum(s["exact"]["hit_rows"] for s in stats) > 0, stats
    assert sum(s["exact"]["summed_rows"] for s in stats) > 0, stats  # shared rows kept
    exact, stale = loss_after(tables[""], steps), loss_after(tables["-stale"], steps)
    start = loss_after(np.full_like(tables[""], 0.5), steps)
    print(f"final loss: exact {exact:.3f}, staleness 5 {stale:.3f} (initial {start:.3f}); "
          f"relative difference {abs(stale - exact) / exact:.4f}")
    assert not np.array_equal(tables["-stale"], tables[""]), "staleness not exercised"
    assert stale < start and abs(stale - exact) / exact < 0.10
    # The staleness bound on every row a step used: validated at most s - 1 steps before,
    # the cached copy has since had at most s - 1 of this trainer's Adagrad updates and the
    # servers' copy at most s - 1 updates (sync_exact: one summed update per step), and an
    # Adagrad update moves an element by at most lr (|g| / sqrt(sum + g^2) <= 1). So
    # |cached - servers'| <= 2 (s - 1) lr elementwise, whatever the gradients.
    s = job.TWINS["stale"]["staleness"]
    bound = 2 * (s - 1) * job.LR
    dev = max(st["stale_dev"] for st in stats)
    print(f"largest |stale row - servers' row| a step used: {dev:.4f} (bound {bound:.4f})")
    assert 0 < dev <= bound * (1 + 1e-5), (dev, bound)


def test_exact_cache_stays_bit_identical_when_a_row_is_written_outside_the_step(tmp_path):
    """sync_exact; every 3rd step, between the lookups and the updates, trainer 1 writes
    rows trainer 0 holds (``--push-every``). Trainer 0's copies are then void at its
    update: the owner says so (its version before the step is not the one held), they
    are dropped, not updated; the table stays bit-identical to no cache."""
    tables, stats = run(tmp_path, "sync_exact", ["--push-every", "3"], steps=12)
    np.testing.assert_array_equal(tables["-exact"], tables[""])
    assert sum(s["exact"]["evicted_replicas"] for s in stats) > 0, stats  # the drop path
    assert sum(s["exact"]["summed_rows"] for s in stats) > 0, stats


def test_exact_cache_of_a_dynamic_table_is_bit_identical_to_no_cache(tmp_path):
    """The same job on DynamicEmbeddings (int64 keys over the whole key space, a hash
    store per server): the cache's slot map and LFU counts are hashed, its copies are
    validated by the servers' row versions, and the oracle is the same: the uncached
    table, bit for bit, in sync_exact with both trainers on the same rows."""
    tables, stats = run(tmp_path, "sync_exact", ["--dynamic"], steps=16)
    assert not np.array_equal(tables[""][0], tables[""][1]), "rows from their keys"
    np.testing.assert_array_equal(tables["-exact"], tables[""])
    assert sum(s["exact"]["hit_rows"] for s in stats) > 0, stats
    assert sum(s["exact"]["summed_rows"] for s in stats) > 0, stats
    # the bounded-staleness twin keeps its bound on a keyed table too (see above)
    bound = 2 * (job.TWINS["stale"]["staleness"] - 1) * job.LR
    assert max(s["stale_dev"] for s in stats) <= bound * (1 + 1e-5), stats
