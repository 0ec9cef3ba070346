"""Prefetch: the next batch's rows read while the current batch computes, exact.

Oracles: the same job trained embedded in one process without prefetch (the client
suite's dyadic job, tests/test_kvclient_jobs.py: a wrong row anywhere changes every
later row), bit for bit, on every placement and table kind; and, for the caches, the
rows a prefetch pinned against a lookup whose admissions would evict them.
"""
import numpy as np
import pytest
import torch

from conftest import make_placement
from cpu_cuda_twin import CpuCudaTwin
from suite_tables import Table
from test_kvclient_jobs import (B, OPTIMIZERS, assert_same_table, dyadic_batch, oracle,
                                state_names)
from test_kvclient_suite import D

from distemb.config import parse_cache_config
from distemb.errors import KVStoreError
from distemb.kvstore import LocalKVClient
from distemb.kvstore.caches.device import DeviceCachedKVClient
from distemb.kvstore.caches.trainer import CachedKVClient
from distemb.partition import range_policy
from distemb.pipeline import Prefetcher
from distemb.rules import SGDHyper
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
    (a cache: its pinned copies) and, on servers, updates patched the ones they wrote."""
    t = Table(table_kind, 40, D, str(tmp_path))
    names, stats = placement.run(prefetch_job(t, opt_name, 10, placement.device))[0]
    want = oracle(t, opt_name, 10, str(tmp_path_factory.getbasetemp()))
    assert_same_table(placement.client, t, names, want, f"{placement.name} {table_kind}")
    mapped = placement.name.startswith("shm1x1") and t.store != "hash"  # read in place
    local = placement.name == "device_cache" and t.dtype != "float32"  # not cached: host
    if stats is not None and not mapped and not local:
        assert stats["served_rows"] + stats.get("remote_served_rows", 0) > 0, stats
    if placement.name in ("tcp2x2", "shm1x1") and not mapped:  # the updates patched them
        assert stats["patched_rows"] > 0, stats


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


# -- pins: a prefetched row cannot be evicted before its lookup -------------------------

#: Rows of the pinning tests' table: row i holds i * D .. i * D + D - 1.
ROWS = np.arange(20 * D, dtype=np.float32).reshape(20, D)
A, B_IDS = np.arange(4, dtype=np.int64), np.arange(10, 14, dtype=np.int64)


def test_a_device_cache_pins_prefetched_rows_against_an_eviction_before_their_lookup():
    """A device cache of 4 rows (LRU) prefetches batch A (4 rows: admitted, slots pinned
    and recorded); the current batch B (4 other rows) is looked up before A's lookup,
    and its admissions would evict A's least recently used slots and put B's rows there.
    Pinned, they stay: A's lookup, which gathers the recorded slots with no bookkeeping,
    returns A's rows (without the pins: B's rows, torchrec #4191). The step after the
    lookup releases the pins; the update is the reference SGD's."""
    kv = DeviceCachedKVClient(LocalKVClient(), parse_cache_config({"policy": "lru",
                                                                   "rows": 4}),
                              "cpu", ops=CpuCudaTwin())
    try:
        kv.init_data("t", (20, D), "float32", range_policy(20))
        kv.push("t", np.arange(20), ROWS)
        kv.init_optimizer("t", "sgd", {})
        kv.prefetch("t", A)
        assert kv.prefetch_stats()["pinned_rows"] == 4
        np.testing.assert_array_equal(kv.lookup("t", B_IDS).numpy(), ROWS[B_IDS])
        np.testing.assert_array_equal(kv.lookup("t", A[::-1]).numpy(), ROWS[A[::-1]])
        assert kv.stats()["admitted_rows"] == 4, kv.stats()  # A's only: B found no slot
        grads = np.ones((4, D), np.float32)
        kv.push_update("t", A, grads, "sgd", SGDHyper(lr=0.5))
        stats = kv.prefetch_stats()
        assert stats["pinned_rows"] == 0 and stats["served_rows"] == 4, stats
        np.testing.assert_array_equal(kv.pull("t", A), ROWS[A] - 0.5)
    finally:
        kv.close()


@pytest.mark.multiprocess
def test_a_trainer_cache_pins_prefetched_copies_against_an_eviction_before_their_lookup(
        clusters):
    """A trainer cache of 4 rows (LRU) holds batch A's copies and prefetches A: the
    copies are pinned. Batch B (4 other rows) is looked up first; its admissions would
    evict A's copies, which A's lookup would then fetch again. Pinned, they stay: A's
    lookup only validates them (no row fetched), and returns A's rows."""
    cluster = clusters("tcp")
    kv = CachedKVClient(cluster.client(), parse_cache_config({"policy": "lru", "rows": 4}))
    try:
        kv.init_data("pin", (20, D), "float32", range_policy(20, kv.num_servers))
        kv.push("pin", np.arange(20), ROWS)
        kv.init_optimizer("pin", "sgd", {})
        kv.pull("pin", A)  # A's copies cached
        kv.prefetch("pin", A)
        assert kv.prefetch_stats()["pinned_rows"] == 4
        np.testing.assert_array_equal(kv.pull("pin", B_IDS), ROWS[B_IDS])
        fetched = kv.stats()["fetched_rows"]
        np.testing.assert_array_equal(kv.pull("pin", A), ROWS[A])
        assert kv.stats()["fetched_rows"] == fetched, kv.stats()  # every copy was still there
        kv.push_update("pin", A, np.ones((4, D), np.float32), "sgd", SGDHyper(lr=0.5))
        assert kv.prefetch_stats()["pinned_rows"] == 0
        np.testing.assert_array_equal(kv.pull("pin", A), ROWS[A] - 0.5)
    finally:
        kv.delete_data("pin")
        kv.close(goodbye=False)


class _Counting:
    """A lookup target that counts the prefetches asked of it; a lookup takes the oldest
    waiting one, as a table does, and it must be the lookup's own batch."""

    def __init__(self):
        self.asked, self.waiting = [], []

    def prefetch(self, ids):
        self.asked.append(int(ids))
        self.waiting.append(int(ids))

    def lookup(self, ids):
        if self.waiting:
            assert self.waiting.pop(0) == ids, (ids, self.asked[-3:])


def _timed(monkeypatch, on_cost, off_cost, target):
    """A clock under which an iteration costs ``on_cost`` when a prefetch was asked in it
    and ``off_cost`` otherwise."""
    from distemb import pipeline
    now, seen = [0.0], [0]

    def clock():
        now[0] += on_cost if len(target.asked) > seen[0] else off_cost
        seen[0] = len(target.asked)
        return now[0]
    monkeypatch.setattr(pipeline, "clock", clock)


def test_a_prefetcher_slower_than_plain_iterations_stops_prefetching_for_a_while(
        monkeypatch):
    """Iterations with a prefetch cost three times plain ones: after its first window the
    Prefetcher measures a plain window, tries again, loses, and prefetches nothing for
    BACKOFF windows, then twice as long; the batches come in order all the same. Under
    the opposite clock it prefetches every batch but its plain windows."""
    from distemb.payoff import BACKOFF
    from distemb.pipeline import WINDOW

    def windows_on(on_cost, off_cost, windows):
        target = _Counting()
        _timed(monkeypatch, on_cost, off_cost, target)
        batches = list(range(windows * WINDOW + 1))
        pipe = Prefetcher(batches, lambda b: [(target, b)])
        seen = []
        for b in pipe:  # turned on again, the Prefetcher asks for the batch at hand first
            target.lookup(b)
            seen.append(b)
        assert seen == batches
        asked = set(target.asked)
        # the batch whose rows iteration i read ahead is i + 1
        return [all(w * WINDOW + i + 1 in asked for i in range(WINDOW))
                for w in range(windows)], pipe.payoff

    n = 3 + BACKOFF + 1 + 2 * BACKOFF
    on, payoff = windows_on(3.0, 1.0, n)
    assert on == [True, False, True] + [False] * BACKOFF + [True] + [False] * 2 * BACKOFF
    assert payoff.losses == 2
    on, payoff = windows_on(1.0, 3.0, 8)
    assert on == [True, False] + [True] * 6 and payoff.losses == 0
    target = _Counting()
    assert list(Prefetcher(range(5 * WINDOW), lambda b: [(target, b)],
                           idle_when_slower=False)) == list(range(5 * WINDOW))
    assert target.asked == list(range(5 * WINDOW))  # every batch, untimed


@pytest.mark.multiprocess
def test_a_job_whose_prefetcher_turns_itself_off_and_on_equals_the_embedded_table(
        clusters, tmp_path, tmp_path_factory, monkeypatch):
    """The dyadic job over 2 servers through a Prefetcher whose clock makes prefetching
    lose: batches with and without prefetch interleave, and the table equals the
    embedded job's bit for bit."""
    from distemb import pipeline
    from distemb.pipeline import WINDOW

    now, asked = [0.0], [False]
    real = pipeline.Prefetcher._prefetch

    def prefetch(self, batch):
        asked[0] = True
        real(self, batch)

    def clock():  # an iteration that prefetched costs three times a plain one
        now[0] += 3.0 if asked[0] else 1.0
        asked[0] = False
        return now[0]
    monkeypatch.setattr(pipeline.Prefetcher, "_prefetch", prefetch)
    monkeypatch.setattr(pipeline, "clock", clock)
    where = make_placement("tcp", clusters)
    try:
        t = Table("dense-range", 40, D, str(tmp_path))
        steps = 9 * WINDOW  # on, plain, on (loses), plain x 4, on, plain
        names, stats = where.run(prefetch_job(t, "adagrad", steps))[0]
        assert_same_table(where.client, t, names, oracle(
            t, "adagrad", steps, str(tmp_path_factory.getbasetemp())), "tcp")
        assert 0 < stats["served_rows"], stats
        where.client.delete_data(t.name)
    finally:
        where.client.close(goodbye=False)
