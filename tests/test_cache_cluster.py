"""Trainer caches in a real job: 2 servers x 2 trainers under distemb-launch.

The oracle of the exact cache is the same job without a cache: final tables must be
bit-identical in every consistency mode, while the cache served rows without data. The
bounded-staleness mode is a relaxation: its effect on the final loss is measured.
"""
import json

import numpy as np
import pytest
import torch

import cluster_trainer as job
from test_cluster import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def final(tmp_path, consistency, options=(), extra=("--disjoint",), steps=12):
    tmp_path.mkdir()
    launch(tmp_path, consistency, options=options, extra=extra, steps=steps)
    stats = [json.loads((tmp_path / f"cache{r}.json").read_text()) for r in range(2)
             if (tmp_path / f"cache{r}.json").exists()]
    return np.load(tmp_path / "final.npy"), stats


@pytest.mark.parametrize("consistency,extra", [("sync", ("--disjoint",)),
                                               ("sync_exact", ("--side",))],
                         ids=["sync-disjoint", "sync_exact-shared-ids-and-side-table"])
def test_exact_cache_is_bit_identical_to_no_cache(tmp_path, consistency, extra):
    """sync_exact: both trainers push the same rows, so replicas are confirmed or dropped."""
    want, none = final(tmp_path / "plain", consistency, extra=extra)
    assert none == [] and not np.allclose(want, 0.5), "the job did not train"
    got, stats = final(tmp_path / "cached", consistency, extra=extra,
                       options=("--cache-rows", "12", "--cache-policy", "lfu"))
    np.testing.assert_array_equal(got, want)  # bit for bit
    assert len(stats) == 2 and all(s["unique_rows"] > 0 for s in stats)
    assert sum(s["hit_rows"] for s in stats) > 0, stats  # the cache did serve rows


def loss_after(table, steps=12):
    """Sum of the job's loss over its batches, evaluated with the final table."""
    total = 0.0
    for step in range(steps):
        ids, targets = job.batch(step, 2, disjoint=False)
        total += float(job.loss_of(torch.from_numpy(table)[ids], targets))
    return total


def test_bounded_staleness_effect_on_the_final_loss_is_measured(tmp_path):
    """s=5 in sync mode, both trainers touching the same rows: a relaxation, measured.

    The stale job reads rows up to 4 steps old (the other trainer's updates missing), so
    its table differs from the exact one; its final loss must stay within 10% of it.
    """
    exact, _ = final(tmp_path / "exact", "sync", extra=(), steps=20)
    stale, stats = final(tmp_path / "stale", "sync", extra=(), steps=20,
                         options=("--cache-fraction", "1.0", "--cache-staleness", "5"))
    assert sum(s["hit_rows"] for s in stats) > 0
    le, ls = loss_after(exact, 20), loss_after(stale, 20)
    start = loss_after(np.full_like(exact, 0.5), 20)
    print(f"final loss: exact {le:.3f}, staleness 5 {ls:.3f} (initial {start:.3f}); "
          f"relative difference {abs(ls - le) / le:.4f}")
    assert not np.array_equal(exact, stale), "staleness changed nothing: not exercised"
    assert ls < start and abs(ls - le) / le < 0.10
