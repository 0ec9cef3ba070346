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
dynamic-cluster oracle: gradients are dyadic, so sums are exact in any order). The whole
jobs (DistEmbedding and the sparse optimizers on the placement's trainers) are in
tests/test_kvclient_jobs.py, on this module's table sizes.
"""
import re

import numpy as np
import pytest
import torch

from conftest import holds
from suite_tables import TABLE_KINDS, Table, parse_kind

from distemb import checkpoint
from distemb.errors import DistEmbError, KVStoreError
from distemb.kernels import reference
from distemb.rules import AdagradHyper, AdamHyper, FtrlHyper, SGDHyper

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
