"""Prefetch: the next batch's rows read while the current batch computes, exact.

Oracles: the same job trained embedded in one process without prefetch (the client
suite's dyadic job, tests/test_kvclient_suite.py: a wrong row anywhere changes every
later row), bit for bit, on every placement and table kind; and, for the caches, the
rows a prefetch pinned against a lookup whose admissions would evict them.
"""
import numpy as np
import pytest
import torch

from conftest import make_placement
from suite_tables import Table
from test_kvclient_suite import (B, D, OPTIMIZERS, assert_same_table, dyadic_batch, oracle,
                                 state_names)

from distemb.config import parse_cache_config
from distemb.errors import KVStoreError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.caches.device import DeviceCachedKVClient
from distemb.kvstore.caches.trainer import CachedKVClient
from distemb.pipeline import Prefetcher
from distemb.stores.spec import HashTableSpec

pytestmark = pytest.mark.timeout(180)


def prefetch_stats(kv):
    """The prefetch counters of a trainer's client (its own, or the wrapped client's), or
    None where it reads rows at their lookup."""
    while kv is not None:
        stats = getattr(kv, "prefetch_stats", None)
        if stats is not None:
            return stats()
        kv = getattr(kv, "inner", None)
    return None


def prefetch_job(t, opt_name, steps, device=None, enabled=True):
    """The dyadic job of the client suite, its batches through a :class:`Prefetcher`:
    each next batch's rows are prefetched before the current batch is looked up (the
    pipeline's order). Returns job(ctx, rank, num_trainers) -> (state names, the
    client's prefetch counters)."""
    def job(ctx, rank, num_trainers):
        emb = t.embedding(ctx)
        opt = OPTIMIZERS[opt_name](emb)
        ctx.client.barrier()
        per = B // num_trainers
        batches = []
        for step in range(steps):
            rows, c = dyadic_batch(step, t.n)
            share = slice(rank * per, (rank + 1) * per)
            batches.append((torch.from_numpy(t.key_of(rows[share])), c[share]))
        for keys, c in Prefetcher(batches, lambda b: [(emb, b[0])], enabled):
            opt.zero_grad()
            out = emb(keys, device=device)
            up = torch.from_numpy(c).to(out.device) + torch.round(out.detach() * 8) / 8
            (out * up).sum().backward()
            opt.step()
        ctx.client.barrier()
        return state_names(t.name, opt), prefetch_stats(ctx.client)
    return job


@pytest.mark.parametrize("opt_name", ["adagrad", "adam_row"])
def test_a_job_with_prefetch_equals_the_embedded_table_bit_for_bit(placement, table_kind,
                                                                   opt_name, tmp_path,
                                                                   tmp_path_factory):
    """The dyadic job with each next batch prefetched (two trainers on half batches in the
    2x2 sync_exact job) leaves rows and optimizer state bit-identical to the job embedded
    without prefetch; where rows live elsewhere, lookups took rows from the prefetches
    and updates patched the ones they wrote."""
    t = Table(table_kind, 40, D, str(tmp_path))
    names, stats = placement.run(prefetch_job(t, opt_name, 10, placement.device))[0]
    want = oracle(t, opt_name, 10, str(tmp_path_factory.getbasetemp()))
    assert_same_table(placement.client, t, names, want, f"{placement.name} {table_kind}")
    mapped = placement.name.startswith("shm1x1") and t.store != "hash"  # read in place
    if stats is not None and not mapped:
        assert stats["served_rows"] > 0 and stats["patched_rows"] > 0, stats


@pytest.mark.multiprocess
def test_an_asynchronous_job_with_prefetch_equals_the_embedded_table(clusters, tmp_path,
                                                                    tmp_path_factory):
    """One trainer of an ``async`` job: its updates have no reply, so the prefetched rows
    an update writes are read again behind it: the tables equal the embedded job's."""
    where = make_placement("tcp_async", clusters)
    try:
        t = Table("dense-range", 40, D, str(tmp_path))
        names, stats = where.run(prefetch_job(t, "adagrad", 10))[0]
        assert_same_table(where.client, t, names, oracle(
            t, "adagrad", 10, str(tmp_path_factory.getbasetemp())), "async")
        assert stats["served_rows"] > 0 and stats["patched_rows"] > 0, stats
        where.client.delete_data(t.name)
    finally:
        where.client.close(goodbye=False)


@pytest.mark.multiprocess
def test_a_store_that_evicts_on_its_own_is_not_prefetched_from_servers(clusters):
    """A hash table with a capacity evicts keys on its own: a prefetched key could be
    evicted by another lookup before its own. Its prefetch is refused, naming the table,
    the store and the client; it is looked up as before."""
    where = make_placement("tcp2x2", clusters)
    kv = where.trainers[0]
    try:
        where.client.create_table("cap", HashTableSpec(dim=D, capacity=64))
        with pytest.raises(KVStoreError, match=r"RemoteKVClient: cannot hold table 'cap' on "
                                               r"a hash store with a capacity \(64 keys\): "
                                               r"prefetch"):
            kv.prefetch("cap", np.array([1, 2], np.int64))
        assert kv.pull("cap", np.array([1], np.int64)).shape == (1, D)
    finally:
        where.client.delete_data("cap")
        where.client.close(goodbye=False)
