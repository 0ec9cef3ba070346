"""The cache bookkeeping kernels (distemb/kernels/cachebook.py): the compiled pass against
its numpy twin on random inputs, and each against answers worked out by hand."""
import numpy as np
import pytest

from distemb import kernels
from distemb.kernels import cachebook

needs_ext = pytest.mark.skipif(not kernels.HAS_EXT, reason="compiled kernels not built")


def both(call):
    """``call()`` under the compiled kernels and under the twin."""
    out = []
    for impl in ("compiled", "reference"):
        with kernels.implementation(impl):
            out.append(call())
    return out


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def random_pull(rng, cap=64, d=3, n_uniq=40, staleness=0):
    """A consistent pull: a cache's arrays, the pull's slots after admission, a reply."""
    slots = np.full(n_uniq, -1, np.int64)
    held = rng.random(n_uniq) < 0.4
    slots[held] = rng.choice(cap, int(held.sum()), replace=False)
    version = rng.integers(0, 9, cap)
    checked = rng.integers(0, 5, cap)
    have, ask, _ = cachebook.held_versions(slots, version, checked, 5, staleness)
    new = np.flatnonzero(~held)
    keep = new[rng.random(len(new)) < 0.5]
    have[keep] = -2
    ready = new[np.isin(new, keep, invert=True) & (rng.random(len(new)) < 0.3)]
    ask[ready] = False
    asked = np.flatnonzero(ask)
    # the owner answers every row not held and a random share of the held ones
    stale = asked[(have[asked] < 0) | (rng.random(len(asked)) < 0.5)]
    got = rng.permutation(stale)
    free = np.setdiff1d(np.arange(cap), slots[held])
    fits = keep[:rng.integers(0, len(keep) + 1)]
    slots[fits] = rng.choice(free, len(fits), replace=False)
    with_state = int(np.count_nonzero(have[got] != -1))
    reply = dict(got=got, vers=rng.integers(0, 99, len(got)),
                 rows=rng.standard_normal((len(got), d)).astype(np.float32),
                 states=[rng.standard_normal((with_state, d)).astype(np.float32),
                         rng.integers(0, 9, with_state).astype(np.int64)])
    cache = dict(values=rng.standard_normal((cap, d)).astype(np.float32),
                 cache_states=[rng.standard_normal((cap, d)).astype(np.float32),
                               rng.integers(0, 9, cap).astype(np.int64)],
                 version=version, checked=checked, stamp=rng.integers(0, 9, cap))
    inverse = rng.integers(0, n_uniq, 3 * n_uniq)
    ready_rows = rng.standard_normal((len(ready), d)).astype(np.float32)
    return dict(slots=slots, have=have, ask=ask, inverse=inverse, ready=ready,
                ready_rows=ready_rows, **reply), cache


def settle(args, cache, tick):
    c = {k: [x.copy() for x in v] if isinstance(v, list) else v.copy()
         for k, v in cache.items()}
    out = cachebook.settle(args["slots"], args["got"], args["vers"], args["rows"],
                           args["states"], args["have"], args["ask"], args["inverse"],
                           args["ready"], args["ready_rows"], c["values"],
                           c["cache_states"], c["version"], c["checked"], 7, c["stamp"], tick)
    return out, c["values"], c["cache_states"], c["version"], c["checked"], c["stamp"]


@needs_ext
@pytest.mark.parametrize("seed", range(20))
def test_compiled_bookkeeping_equals_its_twin_on_random_inputs(seed):
    rng = np.random.default_rng(seed)
    args, cache = random_pull(rng, staleness=seed % 3)
    for tick in (-1, 11):
        assert_same(*both(lambda: settle(args, cache, tick)))
    assert_same(*both(lambda: cachebook.held_versions(
        args["slots"], cache["version"], cache["checked"], 5, seed % 3)))
    # a pull of a dense table: ids made unique, counted, their slots
    for dtype in (np.int32, np.int64):
        slot_map = np.where(rng.random(500) < 0.2, rng.integers(0, 64, 500), -1).astype(dtype)
        ids = rng.integers(0, 500, int(rng.integers(0, 3000)))
        counts = rng.integers(0, 9, 500).astype(np.uint8)
        for held in (True, False):
            assert_same(*both(lambda: (cachebook.dense_lookup(ids, slot_map, c := counts.copy(),
                                                              held), c)))
    # an exact step: held rows, some summed, some void
    n, d = 50, 4
    slots = np.where(rng.random(n) < 0.5, rng.permutation(n), -1).astype(np.int64)
    held = np.flatnonzero(slots >= 0)
    pick = rng.permutation(held)
    drop, summed = np.sort(pick[:len(pick) // 4]), pick[len(pick) // 4:len(pick) // 2]
    grads = rng.standard_normal((n, d)).astype(np.float32)
    sums = rng.standard_normal((len(summed), d)).astype(np.float32)
    after = rng.integers(0, 99, len(summed))
    version = rng.integers(0, 9, n)
    for skip in (True, False):
        assert_same(*both(lambda: (cachebook.held_step(
            slots, grads, summed, sums, after, drop, skip, v := version.copy()), v)))
    # an owner's answer: sorted unique ids, an update's ids among them
    uniq = np.unique(rng.integers(0, 1000, 80))
    ids = rng.permutation(uniq)[:30]
    before = rng.integers(0, 5, len(uniq))
    counts = rng.integers(1, 4, len(uniq))
    have = np.where(rng.random(30) < 0.3, -1, rng.integers(0, 5, 30))
    for b in (before, None):
        assert_same(*both(lambda: cachebook.held_answer(uniq, ids, have, b, counts, 17)))


def test_settle_stores_fetched_rows_and_serves_each_position_from_where_it_is():
    # unique ids 0..3: 0 held and current (not fetched), 1 held and refetched, 2 admitted
    # to slot 4, 3 passing through; 4 prefetched
    slots = np.array([0, 2, 4, -1, -1])
    have = np.array([5, 6, -2, -1, -1])
    ask = np.array([True, True, True, True, False])
    got = np.array([3, 1, 2])
    rows = np.array([[30.0], [10.0], [20.0]], np.float32)
    state = np.array([[1.0], [2.0]], np.float32)  # rows 1 and 2 (have != -1), in order
    values = np.zeros((5, 1), np.float32)
    values[0] = 7.0
    cstate = np.zeros((5, 1), np.float32)
    version, checked, stamp = np.zeros(5, np.int64), np.zeros(5, np.int64), np.zeros(5, np.int64)
    out = cachebook.settle(slots, got, np.array([8, 9, 4]), rows, [state], have, ask,
                           np.array([4, 0, 1, 2, 3, 0]), np.array([4]),
                           np.array([[40.0]], np.float32), values, [cstate], version,
                           checked, 3, stamp, 6)
    assert out[:, 0].tolist() == [40.0, 7.0, 10.0, 20.0, 30.0, 7.0]
    assert values[:, 0].tolist() == [7.0, 0.0, 10.0, 0.0, 20.0]
    assert cstate[:, 0].tolist() == [0.0, 0.0, 1.0, 0.0, 2.0]
    assert version.tolist() == [0, 0, 9, 0, 4] and checked.tolist() == [3, 0, 3, 0, 3]
    assert stamp.tolist() == [6, 0, 6, 0, 6]
    with pytest.raises(ValueError, match="neither held, fetched nor prefetched"):
        cachebook.settle(slots, got[1:], np.array([9, 4]), rows[1:], [state], have, ask,
                         np.array([3]), np.empty(0, np.int64), np.empty((0, 1), np.float32),
                         values, [cstate], version, checked, 3, stamp, -1)


def test_dense_lookup_gives_unique_ids_in_order_of_first_appearance():
    slot_map = np.array([-1, 4, -1, 0, 2], np.int32)
    seen = np.array([0, 1, 2, 3, 4], np.uint8)
    uniq, inverse, slots = cachebook.dense_lookup(np.array([3, 1, 3, 4, 1, 0]), slot_map, seen)
    assert uniq.tolist() == [3, 1, 4, 0] and inverse.tolist() == [0, 1, 0, 2, 1, 3]
    assert slots.tolist() == [0, 4, 2, -1] and slots.dtype == np.int64
    assert seen.tolist() == [1, 2, 2, 4, 5]  # once per unique id
    uniq, inverse, slots = cachebook.dense_lookup(np.empty(0, np.int64), slot_map, seen)
    assert len(uniq) == len(inverse) == len(slots) == 0
    _, _, slots = cachebook.dense_lookup(np.array([4, 3]), slot_map, seen, any_held=False)
    assert slots.tolist() == [-1, -1]


def test_held_step_uses_the_owners_sums_and_leaves_void_copies_out():
    slots = np.array([3, -1, 0, 1])
    grads = np.arange(4, dtype=np.float32).reshape(4, 1)
    version = np.array([10, 20, 0, 30])
    at, step = cachebook.held_step(slots, grads, np.array([2]), np.array([[9.0]], np.float32),
                                   np.array([15]), np.array([3]), True, version)
    assert at.tolist() == [3, 0] and step[:, 0].tolist() == [0.0, 9.0]
    assert version.tolist() == [15, 21, 0, 31]  # slot 0 summed: the owner's version
    at, _ = cachebook.held_step(slots, grads, np.empty(0, np.int64),
                                np.empty((0, 1), np.float32), np.empty(0, np.int64),
                                np.array([3]), False, version)
    assert at.tolist() == [3, 0, 1]


def test_held_answer_names_void_and_summed_rows():
    uniq = np.array([2, 5, 9])
    before = np.array([4, 7, 1])
    counts = np.array([2, 1, 3])
    ids = np.array([9, 5, 2])
    have = np.array([1, 6, 4])  # 9 current and summed, 5 void (7 != 6), 2 current, summed
    drop, pos, vers, at = cachebook.held_answer(uniq, ids, have, before, counts, 10)
    assert drop.tolist() == [11] and pos.tolist() == [10, 12]
    assert vers.tolist() == [4, 6] and at.tolist() == [2, 0]
    drop, pos, _, _ = cachebook.held_answer(uniq, ids, np.array([1, -1, 4]), None, counts, 0)
    assert drop.tolist() == [0, 2] and pos.tolist() == []
