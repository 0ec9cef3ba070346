"""The client suite: every table kind on every placement, against oracles.

Each test runs once per (placement, table kind) pair the placement holds
(``tests/conftest.py``: placements; ``tests/suite_tables.py``: store kind x row dtype x
router), except the hash and DGL routers of fixed-key tables behind a device cache, which
routes nothing itself (conftest's ``routes``); a pair a placement cannot hold is a refusal naming both, tested by
:func:`test_every_table_kind_is_held_or_refused_by_name`. The tests use only the KVClient
interface and the public table API, so any difference between placements is a bug.

Oracles: ``torch.optim`` on ``torch.nn.Embedding(sparse=True)`` with duplicate-heavy ids
(the update maths), numpy reference rules (FTRL, which torch lacks), and the same job
trained embedded in one process on a dense table of the same row dtype, bit for bit (the
dynamic-cluster oracle: gradients are dyadic, so sums are exact in any order).
"""
import dataclasses
import functools
import os
import re

import numpy as np
import pytest
import torch

from conftest import holds, make_placement
from suite_tables import TABLE_KINDS, Table, parse_kind

from distemb import checkpoint
from distemb.errors import DistEmbError, KVStoreError, NonFiniteGradientError
from distemb.kernels import reference
from distemb.partition import PartitionPolicy
from distemb.optim import SparseAdagrad, SparseAdam, SparseRowWiseAdagrad, SparseSGD
from distemb.rules import AdagradHyper, AdamHyper, FtrlHyper, SGDHyper, rule_of, state_name

pytestmark = pytest.mark.timeout(120)
N, D = 24, 4


@pytest.fixture
def table(client, table_kind, tmp_path):
    """A table of ``table_kind`` on ``client``, at its initial rows (dropped by the
    placement fixture)."""
    return Table(table_kind, N, D, str(tmp_path)).make(client)


def test_every_table_kind_is_held_or_refused_by_name(placement, tmp_path):
    """Each placement holds each table kind (rows round-trip) or refuses it with an error
    naming both the store and the placement; never a silent bypass. Which do what is the
    capability table in docs/stores.md."""
    for kind in TABLE_KINDS:
        t = Table(kind, N, D, str(tmp_path))
        if holds(placement.name, kind):
            t.make(placement.client)
            np.testing.assert_array_equal(t.rows(placement.client), t.initial())
            continue
        store, _, _ = parse_kind(kind)
        with pytest.raises(KVStoreError) as e:
            t.make(placement.client)
        assert store in str(e.value) and placement.refuser in str(e.value), str(e.value)
        assert t.name not in placement.client.names()


def test_rows_start_from_the_initialiser_and_round_trip(client, table):
    t = table
    ids = np.array([N - 1, 0, 5, 5, 3])
    np.testing.assert_array_equal(client.pull(t.name, t.key_of(ids)), t.initial(ids))
    vals = np.random.default_rng(0).standard_normal((4, D)).astype(np.float32)
    client.push(t.name, t.key_of([3, 7, 3, 0]), vals)  # duplicates: the last write wins
    np.testing.assert_array_equal(client.pull(t.name, t.key_of([0, 3, 7])),
                                  t.rounded(vals[[3, 2, 1]]))
    np.testing.assert_array_equal(client.pull(t.name, t.key_of([7, 3, 0])),
                                  t.rounded(vals[[1, 2, 3]]))
    assert client.pull(t.name, t.key_of([])).shape == (0, D)
    np.testing.assert_array_equal(client.pull(t.name, t.key_of([1])), t.initial([1]))


def _torch_opt(rule, params):
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.05),
            "adagrad": lambda: torch.optim.Adagrad(params, lr=0.1),
            "adam": lambda: torch.optim.SparseAdam(params, lr=0.01)}[rule]()


def _hyper(rule, step):
    return {"sgd": SGDHyper(lr=0.05), "adagrad": AdagradHyper(clr=0.1, eps=1e-10),
            "adam": AdamHyper(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=step)}[rule]


#: torch's name of each state of our rules.
TORCH_STATE = {"sum": "sum", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_updates_match_torch_optim(client, table, rule):
    """The rule through the client, on keys, against torch.optim on a sparse
    nn.Embedding over 10 steps of duplicate-heavy ids (summed as torch sums them)."""
    t = table
    np.testing.assert_array_equal(t.rows(client), t.initial())  # every key held
    names = client.init_optimizer(t.name, rule, {"initial_accumulator_value": 0.0}
                                  if rule == "adagrad" else {})  # what each rule reads
    ref = torch.nn.Embedding(N, D, sparse=True)
    ref.weight.data.copy_(torch.from_numpy(t.initial()))
    opt = _torch_opt(rule, [ref.weight])
    rng = np.random.default_rng(1)
    for step in range(1, 11):
        ids = torch.from_numpy((rng.zipf(1.3, 40) - 1) % N)
        up = torch.from_numpy(rng.standard_normal((40, D)).astype(np.float32))
        opt.zero_grad()
        (ref(ids) * up).sum().backward()
        grad = ref.weight.grad.coalesce()
        opt.step()
        rows = grad.indices()[0].numpy()
        client.push_update(t.name, t.key_of(rows), np.ascontiguousarray(grad.values().numpy()),
                           rule, _hyper(rule, step))
    want = ref.weight.detach().numpy()
    atol = t.rtol * float(np.abs(want).max())
    np.testing.assert_allclose(t.rows(client), want, rtol=t.rtol, atol=atol)
    assert np.abs(want - t.initial()).max() > 1e-3, "the oracle did not move"
    state = t.state(client, names)
    for sname in names:
        np.testing.assert_allclose(state[sname], opt.state[ref.weight][TORCH_STATE[sname]],
                                   rtol=1e-4, atol=1e-6, err_msg=sname)


def test_an_option_no_state_of_the_rule_reads_is_refused_naming_it(client, table):
    """Every placement refuses an optimizer option the rule's states do not start from
    (a server ignored it, an embedded store still does not read it), before any state
    changes; the rule's own option is taken."""
    t = table
    np.testing.assert_array_equal(t.rows(client), t.initial())  # every key held
    names = client.init_optimizer(t.name, "adagrad", {"initial_accumulator_value": 0.5})
    for rule, options, bad in (("adagrad", {"initial_accumulator_value": 0.1, "bogus": 1.0},
                                "bogus"),
                               ("sgd", {"initial_accumulator_value": 0.1},
                                "initial_accumulator_value")):
        with pytest.raises(KVStoreError, match=f"options.{bad}: unknown option of rule "
                                               f"'{rule}'"):
            client.init_optimizer(t.name, rule, options)
    np.testing.assert_array_equal(t.state(client, names)["sum"], np.full((N, D), 0.5))


def test_ftrl_matches_the_reference_rule(client, table):
    t = table
    np.testing.assert_array_equal(t.rows(client), t.initial())
    names = client.init_optimizer(t.name, "ftrl", {"initial_accumulator_value": 0.0})
    hyper = FtrlHyper(lr=0.1, lr_power=-0.5, l1=0.05, l2=0.01, l2_shrinkage=0.02, beta=0.1)
    weight, accum, linear = t.initial(), np.zeros((N, D), np.float32), \
        np.zeros((N, D), np.float32)
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = np.unique(rng.integers(0, N, 12)).astype(np.int64)
        grads = rng.standard_normal((len(ids), D)).astype(np.float32)
        client.push_update(t.name, t.key_of(ids), grads, "ftrl", hyper)
        reference.ftrl_update(weight, accum, linear, ids, grads, *hyper.fields().values())
        weight = t.rounded(weight)
    np.testing.assert_allclose(t.rows(client), weight, rtol=t.rtol,
                               atol=t.rtol * float(np.abs(weight).max()))
    state = t.state(client, names)
    np.testing.assert_allclose(state["accum"], accum, rtol=1e-5)
    if t.dtype == "float32":
        np.testing.assert_allclose(state["linear"], linear, rtol=1e-5, atol=1e-6)


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


# --- array tables: what only dense tables of rows 0..N-1 have ----------------------------

def test_init_func_fills_each_shard_with_its_shape(client):
    from distemb.partition import range_policy
    shapes = []

    def init(shape, dtype):
        shapes.append(shape)
        return np.full(shape, float(len(shapes)), dtype=dtype)

    client.init_data("t", (10, 2), "float32", range_policy(10, 2), init)
    assert sorted(set(shapes)) == [(5, 2)]
    got = client.pull("t", np.arange(10, dtype=np.int64))
    assert len(set(got[:5, 0].tolist())) == 1 and len(set(got[5:, 0].tolist())) == 1
    assert got[0, 0] != got[5, 0]


def test_meta_names_and_delete(client):
    from distemb.partition import range_policy
    policy = range_policy(6, 2)
    client.init_data("a", (6, 4), "float32", policy)
    client.init_data("b", (6,), "int64", policy)
    meta = client.data_meta("a")
    assert (meta.shape, meta.dtype, meta.policy) == ((6, 4), "float32", policy)
    assert sorted(client.names()) == ["a", "b"]
    client.delete_data("a")
    assert client.names() == ["b"] and client.data_meta("a") is None


def test_one_dim_int_table(client):
    from distemb.partition import range_policy
    client.init_data("n", (7,), "int64", range_policy(7, 2))
    client.push("n", np.array([6, 1], dtype=np.int64), np.array([-3, 9], dtype=np.int64))
    out = client.pull("n", np.array([1, 6, 0], dtype=np.int64))
    assert out.dtype == np.int64 and out.tolist() == [9, -3, 0]


def test_duplicate_name_and_unknown_name_raise(client):
    from distemb.partition import range_policy
    client.init_data("t", (4, 2), "float32", range_policy(4))
    with pytest.raises(KVStoreError, match="already exists"):
        client.init_data("t", (4, 2), "float32", range_policy(4))
    with pytest.raises(KVStoreError, match="'nope' is not in the KVStore"):
        client.pull("nope", np.array([0], dtype=np.int64))


def test_new_optimizer_starts_from_fresh_state(client):
    from distemb.partition import range_policy
    client.init_data("w", (4, 2), "float32", range_policy(4, 2))
    names = client.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.0})
    client.push_update("w", np.array([1], dtype=np.int64), np.ones((1, 2), np.float32),
                       "adagrad", AdagradHyper(clr=0.1, eps=1e-10))
    assert client.pull(names["sum"], np.array([1], dtype=np.int64)).tolist() == [[1.0, 1.0]]
    client.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.5})
    assert client.pull(names["sum"], np.array([1], dtype=np.int64)).tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("ids", [[3, 7, 19], [19, 3, 7], [7, 3, 7, 19, 3]],
                         ids=["ascending-unique", "unique-unsorted", "duplicates"])
def test_coalesce_sums_each_ids_gradient_whatever_the_order(client, ids):
    """The oracle is torch's coalesce of the sparse gradient. One lookup of ascending
    unique ids (a fused loss's rows) is already coalesced: it must come back as it is,
    without the sort, and equal the oracle as the other orders do."""
    from distemb.backend import pytorch as F
    from distemb.partition import range_policy

    client.init_data("co", (20, 4), "float32", range_policy(20, client.num_servers))
    grads = torch.arange(len(ids) * 4, dtype=torch.float32).reshape(-1, 4) - 5
    flat, _ = client.ids_in("co", torch.tensor(ids), F)
    got = client.coalesce("co", [flat], [grads], F)
    want = torch.sparse_coo_tensor(torch.tensor([ids]), grads, (20, 4)).coalesce()
    got_ids = np.asarray(client.to_host(got[0]))
    # a GPU table's sum is padded (no wait for the device): unused slots hold id 20,
    # outside the table, which its update skips
    k = len(want.indices()[0])
    assert (got_ids[k:] == 20).all(), got_ids
    np.testing.assert_array_equal(got_ids[:k], want.indices()[0].numpy())
    np.testing.assert_array_equal(np.asarray(client.to_host(got[1]))[:k],
                                  want.values().numpy())


def test_values_are_rows_shaped_as_the_ids_or_one_per_id_never_reshaped(client):
    """The placement half's ``values_in`` (``t[ids] = values``), on an array and a keyed
    table: values shaped as the ids + the row shape, or (number of ids,) + the row shape
    (DGL's push), come back one row per id in the order of the flat ids; values of any
    other shape with as many elements (a transposed batch, a flat vector) are refused
    naming ``values`` and both shapes, where they used to be reshaped (scrambled)."""
    from distemb.backend import pytorch as F
    from distemb.partition import range_policy
    from distemb.stores.spec import HashTableSpec

    client.init_data("vd", (6, 3), "float32", range_policy(6, client.num_servers))
    client.create_table("vk", HashTableSpec(3))
    rows = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)
    for name in ("vd", "vk"):
        _, shape = client.ids_in(name, torch.tensor([[1, 2], [4, 5]]), F)
        for values in (rows, rows.reshape(4, 3)):
            got = np.asarray(client.to_host(client.values_in(name, values, F, shape)))
            np.testing.assert_array_equal(got, rows.reshape(4, 3).numpy())
        for bad in (rows.reshape(4, 3).T.contiguous(), rows.reshape(-1), rows.reshape(2, 6)):
            with pytest.raises(ValueError, match=rf"values: expected shape \(2, 2, 3\) "
                                                 rf"\(the ids' shape \+ the row shape\) or "
                                                 rf"\(4, 3\) for 4 ids of '{name}', got "
                                                 rf"{re.escape(str(tuple(bad.shape)))}"):
                client.values_in(name, bad, F, shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_keyed_table_takes_rows_in_its_own_dtype(client, dtype):
    """``values_in`` of a keyed table with 16-bit rows takes float32 rows or rows of its own
    dtype (exact in float32), as an array table's does; float16 rows were refused."""
    from distemb.backend import pytorch as F
    from distemb.stores.spec import HashTableSpec

    client.create_table("hv", HashTableSpec(3, dtype=dtype))
    rows = torch.tensor([[0.5, 1.0, -2.0]])
    _, shape = client.ids_in("hv", torch.tensor([7]), F)
    for values in (rows, rows.to(getattr(torch, dtype))):
        got = client.values_in("hv", values, F, shape)
        assert str(got.dtype).endswith("float32")
        np.testing.assert_array_equal(np.asarray(client.to_host(got)), rows.numpy())
    with pytest.raises(TypeError, match=rf"values: expected dtype {dtype} \(or float32\) for "
                                        r"'hv', got float64"):
        client.values_in("hv", rows.double(), F, shape)


def test_bad_ids_are_refused_with_their_names(client, table):
    """Keys outside a fixed key space, reserved keys of a hash index, and (keyed tables;
    an array table's ids are int64 by the KVClient contract) non-integer keys."""
    t = table
    if t.keyed:
        with pytest.raises(TypeError, match="integer"):
            client.pull(t.name, np.array([1.5]))
    if t.store == "hash":
        with pytest.raises(ValueError, match="reserved"):
            client.pull(t.name, np.array([-2 ** 63], np.int64))
    else:
        with pytest.raises(DistEmbError, match=f"(id|key) {N} is out of range|from {N} to {N}"):
            # a GPU table checks on the device and reports at its next call at the latest
            client.pull(t.name, np.array([N], np.int64))
            client.pull(t.name, np.array([0], np.int64))


def test_checkpoint_of_the_client_round_trips(client, table, tmp_path):
    """checkpoint.save_items / restore of the table alone (no optimizer) on one client."""
    t = table
    vals = np.arange(N * D, dtype=np.float32).reshape(N, D) / 8
    client.push(t.name, t.all_keys(), vals)
    path = str(tmp_path / "ck")
    checkpoint.save_items(path, [(client, t.name)], {"note": "suite"})
    client.push(t.name, t.key_of([0, 1]), np.zeros((2, D), np.float32))
    checkpoint.restore(path, client, [t.name])
    np.testing.assert_array_equal(t.rows(client), t.rounded(vals))



@pytest.mark.multiprocess
def test_several_tables_are_read_in_one_round_trip_per_server(clusters):
    """``pull_many`` (a grouped lookup, a PyG feature store's multi-get) sends each server
    its Pulls of every table back to back and reads the replies after: one round trip per
    server for all the tables, the rows those of table-by-table pulls."""
    from distemb.partition import range_policy
    from distemb.stores.spec import HashTableSpec
    kv = clusters("tcp").client()
    try:
        kv.init_data("m-dense", (10, 3), "float32", range_policy(10, 2))
        kv.init_data("m-half", (10, 2), "bfloat16", range_policy(10, 2))
        kv.create_table("m-hash", HashTableSpec(4))
        kv.push("m-dense", np.arange(10), np.arange(30, dtype=np.float32).reshape(10, 3))
        kv.push("m-half", np.arange(10), np.full((10, 2), 1.5, np.float32))
        asks = [("m-dense", np.array([9, 0, 5])), ("m-hash", np.array([2 ** 40, -3, 7, 8])),
                ("m-half", np.array([1, 8])), ("m-dense", np.array([4]))]
        want = [kv.pull(n, i) for n, i in asks]
        calls, real = [], kv.servers.call

        def counted(requests, **kw):
            calls.append({sid: len(m) if isinstance(m, list) else 1
                          for sid, m in requests.items()})
            return real(requests, **kw)
        kv.servers.call = counted
        got = kv.pull_many(asks)
        kv.servers.call = real
        assert calls == [{0: 4, 1: 3}] or calls == [{1: 3, 0: 4}], calls
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        for name in ("m-dense", "m-half", "m-hash"):
            kv.delete_data(name)
    finally:
        kv.close(goodbye=False)
