"""HashIndex, compiled and dict twin, against a plain-dict model of a key -> slot map.

The model checks what callers rely on: every held key finds the slot it was given, two
held keys never share a slot, absent keys find -1, freed slots are reused before new
ones, and removals (backward-shift deletion in the compiled table) never lose a key.
"""
import numpy as np
import pytest

from distemb import kernels
from distemb.kernels.hashtable import HashIndex


@pytest.fixture(params=["compiled", "reference"])
def native(request):
    if request.param == "compiled" and not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT set or not built)")
    return request.param == "compiled"


def check_against(idx, model):
    keys, slots = idx.items()
    assert dict(zip(keys.tolist(), slots.tolist())) == model
    assert idx.size == len(model)
    if model:
        k = np.fromiter(model, np.int64)
        assert idx.find(k).tolist() == [model[x] for x in k.tolist()]


def test_find_or_insert_assigns_dense_slots_and_dedups(native):
    idx = HashIndex(native=native)
    slots, new = idx.find_or_insert(np.array([5, -9, 5, 2 ** 62, -9], np.int64))
    assert slots.tolist() == [0, 1, 0, 2, 1]
    assert new.tolist() == [True, True, False, True, False]
    assert idx.find(np.array([5, 6], np.int32)).tolist() == [0, -1]
    assert idx.high_water == 3


def test_random_inserts_and_removals_match_a_dict(native):
    rng = np.random.default_rng(0)
    idx, model, free, high = HashIndex(max_load=0.9, native=native), {}, [], 0
    for it in range(60):
        # a narrow key range makes long probe runs and many hits
        keys = rng.integers(-300, 300, size=rng.integers(1, 200))
        slots, new = idx.find_or_insert(keys)
        for k, s, n in zip(keys.tolist(), slots.tolist(), new.tolist()):
            if k in model:
                assert (s, n) == (model[k], False)
            else:
                assert n
                if free:
                    assert s == free.pop()
                else:
                    assert s == high
                    high += 1
                model[k] = s
        assert len(set(model.values())) == len(model)
        gone = rng.integers(-300, 300, size=rng.integers(1, 150))
        freed = idx.remove(gone)
        for k, s in zip(gone.tolist(), freed.tolist()):
            assert s == model.pop(k, -1)
            if s >= 0:
                free.append(s)
        check_against(idx, model)
    assert idx.high_water == high <= 600


def test_freed_slots_are_reused_last_freed_first(native):
    idx = HashIndex(native=native)
    idx.find_or_insert(np.arange(10))
    assert idx.remove(np.array([3, 7, 42])).tolist() == [3, 7, -1]
    slots, new = idx.find_or_insert(np.array([100, 101, 102]))
    assert slots.tolist() == [7, 3, 10] and new.all()
    assert idx.find(np.array([3, 7])).tolist() == [-1, -1]


def test_grows_past_capacity_and_keeps_every_key(native):
    idx = HashIndex(capacity=4, native=native)
    b0 = idx.buckets
    keys = np.random.default_rng(1).permutation(5000).astype(np.int64) * 7919 - 10 ** 12
    idx.find_or_insert(keys[:2500])
    idx.find_or_insert(keys[2500:])
    assert idx.buckets > b0 and idx.size <= 0.75 * idx.buckets
    np.testing.assert_array_equal(idx.find(keys), np.arange(5000))


def test_twins_give_the_same_slots():
    if not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT set or not built)")
    rng = np.random.default_rng(2)
    a, b = HashIndex(native=True), HashIndex(native=False)
    for _ in range(20):
        keys = rng.integers(0, 500, 100)
        np.testing.assert_array_equal(a.find_or_insert(keys)[0], b.find_or_insert(keys)[0])
        gone = rng.integers(0, 500, 40)
        np.testing.assert_array_equal(a.remove(gone), b.remove(gone))


def test_bad_input(native):
    with pytest.raises(ValueError, match="max_load"):
        HashIndex(max_load=1.0, native=native)
    with pytest.raises(ValueError, match="capacity"):
        HashIndex(capacity=-1, native=native)
    idx = HashIndex(native=native)
    with pytest.raises(TypeError, match="keys: expected integer keys"):
        idx.find_or_insert(np.array([1.5]))
    with pytest.raises(ValueError, match="reserved"):
        idx.find_or_insert(np.array([np.iinfo(np.int64).min]))
    with pytest.raises(ValueError, match="fit in int64"):
        idx.find(np.array([2 ** 63], np.uint64))
