"""The client suite's whole jobs: DistEmbedding and the sparse optimizers trained on the
placement's trainers, against the same job embedded.

Part of the client suite (tests/test_kvclient_suite.py, whose table sizes ``N`` x ``D``
these tests share). Each test runs once per (placement, table kind) pair the placement
holds (``tests/conftest.py``: placements; ``tests/suite_tables.py``: store kind x row
dtype x router), except the hash and DGL routers of fixed-key tables behind a device
cache (conftest's ``routes``).

Oracle: the same job trained embedded in one process on a dense table of the same row
dtype, bit for bit (the dynamic-cluster oracle: gradients are dyadic, so sums are exact
in any order): on every placement, as an ``async`` trainer, with steps refused for
non-finite gradients, and resumed from a checkpoint on 3 servers. Then the partition
policies of file tables: the user's path to the suite's file-hash and file-dgl kinds,
and the policies refused where they cannot route.
"""
import dataclasses
import functools
import os
import re

import numpy as np
import pytest
import torch

from conftest import make_placement
from suite_tables import Table
from test_kvclient_suite import D, N

from distemb.errors import NonFiniteGradientError
from distemb.partition import PartitionPolicy
from distemb.optim import SparseAdagrad, SparseAdam, SparseRowWiseAdagrad, SparseSGD
from distemb.rules import rule_of, state_name

pytestmark = pytest.mark.timeout(120)


# --- whole jobs: DistEmbedding + sparse optimizers on the placement's trainers ----------

#: The four optimizers of a job (a float and an int64 state column among them).
OPTIMIZERS = {"sgd": lambda e: SparseSGD([e], lr=0.05),
              "adagrad": lambda e: SparseAdagrad([e], lr=0.1),
              "rowwise": lambda e: SparseRowWiseAdagrad([e], lr=0.1),
              "adam_row": lambda e: SparseAdam([e], lr=0.01, step_mode="per_row")}
B = 32


def dyadic_batch(step, n):
    """(rows, c) of step ``step``: zipf ranks over ``n`` rows, offsets in 1/8ths."""
    rng = np.random.default_rng(500 + step)
    return (rng.zipf(1.2, B) - 1) % n, rng.integers(-32, 33, (B, D)).astype(np.float32) / 8


def dyadic_job(t, opt_name, steps, start=0, device=None, load=None, save=None):
    """A job training table ``t`` (a fresh table of its name) with ``opt_name`` on
    dyadic gradients (exact sums in any order: ``c + round(8 row) / 8`` of the looked-up
    rows, so a wrong row anywhere changes the result); trainer r takes the r-th share of
    every batch. Returns job(ctx, rank, num_trainers) -> the optimizer's state names."""
    def job(ctx, rank, num_trainers):
        emb = t.embedding(ctx)
        opt = OPTIMIZERS[opt_name](emb)
        if load:
            opt.load(load)
        ctx.client.barrier()
        per = B // num_trainers
        for step in range(start, start + steps):
            rows, c = dyadic_batch(step, t.n)
            keys = torch.from_numpy(t.key_of(rows[rank * per:(rank + 1) * per]))
            opt.zero_grad()
            out = emb(keys, device=device)
            up = torch.from_numpy(c[rank * per:(rank + 1) * per]).to(out.device) + \
                torch.round(out.detach() * 8) / 8
            (out * up).sum().backward()
            opt.step()
        if save:
            opt.save(save)
        ctx.client.barrier()
        return state_names(t.name, opt)
    return job


def state_names(name, opt):
    """{state: KVStore name} of table ``name``'s state under optimizer ``opt``."""
    return {s.name: state_name(name, s.name) for s in rule_of(opt.rule).states}


@functools.lru_cache(maxsize=None)
def _oracle(dtype, keys, opt_name, steps, tmp):
    """The job embedded, on a dense table of ``dtype`` whose row i starts at key
    ``keys[i]``'s initial row: (rows, {state: rows}) in row order."""
    t = Table(f"dense{'' if dtype == 'float32' else '_' + dtype}-range", len(keys), D, tmp)
    t.init_keys = np.array(keys, np.int64)
    where = make_placement("embedded", None)
    try:
        names = where.run(dyadic_job(t, opt_name, steps))[0]
        return t.rows(where.client), t.state(where.client, names)
    finally:
        where.client.close()


def oracle(t, opt_name, steps, tmp):
    dt = {"float32": "float32", "bfloat16": "bf16", "float16": "fp16"}[t.dtype]
    return _oracle(dt, tuple(t.all_keys().tolist()), opt_name, steps, tmp)


def assert_same_table(client, t, names, want, what):
    rows, state = want
    np.testing.assert_array_equal(t.rows(client), rows, err_msg=f"{what}: rows")
    got = t.state(client, names)
    for s in names:
        assert got[s].dtype == state[s].dtype, (what, s)
        np.testing.assert_array_equal(got[s], state[s], err_msg=f"{what}: state {s}")


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_job_equals_the_embedded_table_bit_for_bit(placement, table_kind, opt_name, tmp_path,
                                                   tmp_path_factory):
    """The job on this placement (two trainers on half batches in the 2x2 job) leaves
    rows and optimizer state bit-identical to the same job on one embedded dense table."""
    t = Table(table_kind, 40, D, str(tmp_path))
    names = placement.run(dyadic_job(t, opt_name, 10, device=placement.device))[0]
    want = oracle(t, opt_name, 10, str(tmp_path_factory.getbasetemp()))
    assert np.abs(want[0] - t.initial()).max() > 0.05, "the oracle did not train"
    stats = placement.cache_stats()
    assert_same_table(placement.client, t, names, want, f"{placement.name} {table_kind}")
    if stats is not None and t.dtype == "float32":  # a cache served rows and updated them
        assert stats.get("hit_rows", 0) > 0, stats
        assert stats.get("device_updated_rows", 1) > 0, stats


def refused_step_job(t, steps, bad=None, poisoned=None, half_at=None):
    """The dyadic job of ``t`` with SparseAdam (global step counts: a refused step that
    counted would show) on ``steps`` in order; on step ``bad`` the gradient of one row is
    NaN or infinite on every trainer (or the ranks in ``poisoned``), whose ``step()``
    must refuse, naming the table. On step ``half_at`` (an oracle's) the one trainer
    takes the first half of the batch only. Returns job(ctx, rank, num_trainers) ->
    (state names, the refusals' messages)."""
    def job(ctx, rank, num_trainers):
        emb = t.embedding(ctx)
        opt = SparseAdam([emb], lr=0.01, check_finite=True)
        ctx.client.barrier()
        per, said = B // num_trainers, []
        for step in steps:
            rows, c = dyadic_batch(step, t.n)
            share = slice(rank * per, (rank + 1) * per) if step != half_at else \
                slice(0, B // 2)
            keys = torch.from_numpy(t.key_of(rows[share]))
            opt.zero_grad()
            out = emb(keys)
            up = torch.from_numpy(c[share]) + torch.round(out.detach() * 8) / 8
            if step == bad and (poisoned is None or rank in poisoned):
                up[1, 2] = float("inf") if rank % 2 else float("nan")
            (out * up).sum().backward()
            try:
                opt.step()
            except NonFiniteGradientError as e:
                said.append(str(e))
        ctx.client.barrier()
        return state_names(t.name, opt), said
    return job


def test_a_step_with_non_finite_gradients_is_refused_and_changes_nothing(placement,
                                                                         table_kind, tmp_path):
    """Every trainer's step 2 has a NaN or infinite gradient: each step() refuses it naming
    the table, and rows and optimizer state end bit-identical to the embedded job that
    skipped step 2 (Adam's step count included)."""
    t = Table(table_kind, 40, D, str(tmp_path))
    results = placement.run(refused_step_job(t, [0, 1, 2, 3], bad=2))
    for names, said in results:
        assert len(said) == 1 and re.search(
            rf"step\(\): the gradients of table\(s\) \['{t.name}'\]( \(from rank\(s\) \[0\]\))? "
            "hold NaN or infinity; the step is refused", said[0]), said
    where = make_placement("embedded", None)
    try:
        tag = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}[t.dtype]
        want_t = Table(f"dense{tag}-range", t.n, D, str(tmp_path))  # row i: key_of(i)'s
        want_t.init_keys = t.all_keys()
        want_names, _ = where.run(refused_step_job(want_t, [0, 1, 3]))[0]
        want = want_t.rows(where.client), want_t.state(where.client, want_names)
    finally:
        where.client.close()
    assert np.abs(want[0] - t.initial()).max() > 1e-3, "the oracle did not train"
    assert_same_table(placement.client, t, names, want, f"{placement.name} {table_kind}")


@pytest.mark.multiprocess
def test_a_trainer_that_refuses_its_step_keeps_a_sync_exact_job_in_step(clusters, tmp_path):
    """2 servers x 2 trainers, sync_exact (the servers apply a step once every trainer's
    share of it is in): trainer 1 refuses its step 2 and trains on; its share of step 2
    is dropped (it sends an empty one), trainer 0's is applied, and the job goes on in
    step: rows and state equal one process whose step 2 is trainer 0's half batch."""
    t = Table("dense-range", 40, D, str(tmp_path))
    where = make_placement("tcp2x2", clusters)
    try:
        results = where.run(refused_step_job(t, [0, 1, 2, 3], bad=2, poisoned={1}))
        assert [len(said) for _, said in results] == [0, 1], results
        embedded = make_placement("embedded", None)
        try:
            want_t = Table("dense-range", t.n, D, str(tmp_path))
            want_names, _ = embedded.run(refused_step_job(want_t, [0, 1, 2, 3],
                                                          half_at=2))[0]
            want = want_t.rows(embedded.client), want_t.state(embedded.client, want_names)
        finally:
            embedded.client.close()
        assert_same_table(where.client, t, results[0][0], want, "tcp2x2, trainer 1 refused")
    finally:
        for name in where.client.names():
            if "~opt~" not in name:
                where.client.delete_data(name)
        where.client.close(goodbye=False)  # the module's servers serve the next test


@pytest.mark.multiprocess
def test_an_asynchronous_trainer_equals_the_embedded_table_bit_for_bit(table_kind, clusters,
                                                                       tmp_path,
                                                                       tmp_path_factory):
    """One trainer of an ``async`` job on two servers: its updates are not awaited, but
    its connection to each server is ordered, so the tables equal the embedded job's."""
    where = make_placement("tcp_async", clusters)
    try:
        for opt_name in OPTIMIZERS:
            t = Table(table_kind, 40, D, str(tmp_path))
            names = where.run(dyadic_job(t, opt_name, 10))[0]
            assert_same_table(where.client, t, names, oracle(
                t, opt_name, 10, str(tmp_path_factory.getbasetemp())), f"async {opt_name}")
            where.client.delete_data(t.name)
    finally:
        where.client.close(goodbye=False)


def test_checkpoint_reshards_and_resumes(placement, table_kind, tmp_path, clusters,
                                         tmp_path_factory):
    """Saved on this placement after 6 steps, loaded into 3 servers (export after the load
    equals export before), 4 more steps there equal 10 uninterrupted embedded steps."""
    t = Table(table_kind, 40, D, str(tmp_path))
    ck = str(tmp_path / "ck")
    names = placement.run(dyadic_job(t, "adagrad", 6, device=placement.device, save=ck))[0]
    saved = (t.rows(placement.client), t.state(placement.client, names))
    three = make_placement("tcp3x1", clusters)
    try:
        if t.store == "file":  # the three servers make their own files
            t.spec = dataclasses.replace(t.spec, path=str(tmp_path / "three"))
        loaded = []
        three.run(lambda ctx, r, n: loaded.append(_loaded(t, ctx, ck)))
        assert_same_table(three.client, t, names, loaded[0], "after the load")
        assert_same_table(three.client, t, names, saved, "saved vs loaded")
        for what in list(three.client.names()):
            if "~opt~" not in what:
                three.client.delete_data(what)
        three.run(dyadic_job(t, "adagrad", 4, start=6, load=ck))
        assert_same_table(three.client, t, names, oracle(
            t, "adagrad", 10, str(tmp_path_factory.getbasetemp())), "resumed")
    finally:
        for what in list(three.client.names()):
            if "~opt~" not in what:
                three.client.delete_data(what)
        three.client.close(goodbye=False)


def _loaded(t, ctx, ck):
    emb = t.embedding(ctx)
    opt = OPTIMIZERS["adagrad"](emb)
    opt.load(ck)
    names = state_names(t.name, opt)
    return t.rows(ctx.client), t.state(ctx.client, names)


@pytest.mark.parametrize("router", ["range", "hash", "dgl"])
def test_a_file_table_takes_a_partition_policy_as_dense_tables_do(router, ctx, tmp_path):
    """``DistEmbedding(part_policy=..., storage=FileTableSpec(...))`` routes a file table
    by the policy (range, DGL's hash, a DGL partition config's): the same rows and the
    same training as a dense table under that policy (the suite's file-hash and file-dgl
    kinds run every placement; this is the user's path to them)."""
    from suite_tables import policy_of
    from distemb.embedding import DistEmbedding
    t = Table("file-range", N, D, str(tmp_path))
    policy = policy_of(router, N, str(tmp_path))
    emb = DistEmbedding(N, D, name="f", part_policy=policy, storage=t.spec, context=ctx)
    assert emb.part_policy is policy  # as DGL code reads it back
    dense = DistEmbedding(N, D, name="d", part_policy=policy, context=ctx)
    dense.weight[torch.arange(N)] = torch.from_numpy(t.initial())
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, N, 3 * N))  # duplicates
    for table in (emb, dense):
        opt = OPTIMIZERS["adagrad"](table)
        for step in range(3):
            (table(ids[step * N:(step + 1) * N]) ** 2).sum().backward()
            opt.step()
    everything = torch.arange(N)
    torch.testing.assert_close(emb(everything), dense(everything), rtol=0, atol=0)


def test_a_partition_policy_is_refused_where_it_cannot_route(ctx, tmp_path):
    """A hash table (routed by its keys' hash), a store object (one shard), a policy of
    another size, one of a book that cannot travel to servers, or one other than the
    spec's own: each refused naming what and why, and no table made."""
    from distemb.embedding import DistEmbedding
    from distemb.partition import RangePartitionBook, range_policy
    from distemb.stores.file import FileStore
    from distemb.stores.spec import FileTableSpec, HashTableSpec

    class OwnBook(RangePartitionBook):  # numbers its partitions in no progression
        def id_progression(self, kind, type_name, part):
            raise NotImplementedError

    spec = FileTableSpec(str(tmp_path / "f"), N, D, preallocate=False)
    store = FileStore(str(tmp_path / "s"), num_rows=N, dim=D, preallocate=False)
    cases = [
        (HashTableSpec(D), range_policy(N, 2), r"a hash store takes no partition policy"),
        (store, range_policy(N, 2), r"a FileStore store takes no partition policy .* "
                                    r"a store object is one shard"),
        (spec, range_policy(N + 1, 2), rf"covers {N + 1} ids, the file table has {N} rows"),
        (spec, PartitionPolicy("node", "_N", OwnBook(2, node_bounds={"_N": [0, 5, N]})),
         r"expected a policy whose book gives its partitions' id progressions .* of a "
         r"OwnBook"),
        (spec.partitioned_by(range_policy(N, 2)), range_policy(N, 3),
         r"the storage is partitioned as \('range', \(0, 12, 24\)\)"),
    ]
    try:
        for i, (storage, policy, match) in enumerate(cases):
            with pytest.raises(ValueError, match=match):
                DistEmbedding(None if i == 0 else N, D, name=f"t{i}", part_policy=policy,
                              storage=storage, context=ctx)
            assert f"t{i}" not in ctx.client.names()
    finally:
        store.close()


def test_a_file_tables_layout_names_its_files(tmp_path):
    """A file table's shards under a policy's layout are files of their own: a
    directory made under one layout never reopens under another's rows."""
    from suite_tables import policy_of
    from distemb.stores.spec import FileTableSpec
    spec = FileTableSpec(str(tmp_path / "f"), N, D, preallocate=False,
                         init=Table("file-range", N, D, str(tmp_path)).init)
    made = {}
    for router in ("range", "hash", "dgl"):
        s = spec.partitioned_by(policy_of(router, N, str(tmp_path)))
        stores = [s.make_store(p, 2) for p in range(2)]
        made[router] = [os.path.basename(x.path) for x in stores]
        keys = np.concatenate([s.router(2).to_global(p, np.arange(st.num_rows))
                               for p, st in enumerate(stores)])
        assert sorted(keys.tolist()) == list(range(N)), router  # each key once
        rows = np.concatenate([st.gather(np.arange(st.num_rows)) for st in stores])
        np.testing.assert_array_equal(rows, spec.init(keys))  # each at its own key
        for st in stores:
            st.close()
    one = spec.make_store(0, 2)
    made["own ranges"] = [os.path.basename(one.path)]
    one.close()
    assert made["own ranges"] == ["part-0-of-2"]
    assert made["hash"] == ["part-0-of-2-hash3", "part-1-of-2-hash3"]
    names = [n for v in made.values() for n in v]
    assert len(set(names)) == len(names), made
