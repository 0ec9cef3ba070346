"""HashStore beyond the shared suite: removal, slot reuse, LRU/LFU eviction, capacity."""
import numpy as np
import pytest

from distemb.errors import MissingKeyError, StoreError
from distemb.stores import EvictPolicy, HashStore, key_uniform


@pytest.fixture(params=[True, False], ids=["compiled", "twin"])
def native(request):
    from distemb import kernels
    if request.param and not kernels.HAS_EXT:
        pytest.skip("compiled hash index not loaded (DISTEMB_NO_EXT set or not built)")
    return request.param


def test_remove_then_read_back_raises_and_reinsert_starts_fresh(native):
    init = key_uniform(3, seed=1)
    s = HashStore(3, init=init, native=native)
    s.add_column("sum", (3,), "float32", fill=0.25)
    keys = np.array([10, 20, 30])
    s.gather(keys)
    s.scatter(keys, np.full((3, 3), 9.0, np.float32))
    s.scatter(keys, np.full((3, 3), 5.0, np.float32), "sum")
    assert s.remove(np.array([20, 99])) == 1
    assert s.size() == 2 and s.keys().tolist() == [10, 30]
    with pytest.raises(MissingKeyError, match=r"\[20\]"):
        s.gather(np.array([20]), insert=False)
    # the freed slot goes to the next new key, with its own initial row and fresh state
    got = s.gather(np.array([40]))
    np.testing.assert_array_equal(got, init(np.array([40])))
    assert s.gather(np.array([40]), "sum").tolist() == [[0.25] * 3]
    assert s.gather(np.array([10]))[0].tolist() == [9.0] * 3


def test_lru_evicts_least_recently_looked_up(native):
    s = HashStore(2, native=native)
    for k in [1, 2, 3, 4]:
        s.lookup(np.array([k]))
    s.lookup(np.array([1, 3]))  # 2 and 4 are now the least recent
    evicted = s.evict(2)
    assert sorted(evicted.tolist()) == [2, 4] and s.keys().tolist() == [1, 3]


def test_lfu_evicts_least_frequently_looked_up(native):
    s = HashStore(2, evict="lfu", native=native)
    for batch in ([1, 2, 3], [1, 2], [1, 3], [1]):
        s.lookup(np.array(batch))
    # counts: 1 -> 4, 2 -> 2, 3 -> 2 (3 more recent than 2)
    assert s.evict(2).tolist() == [2]
    assert s.evict(1, policy=EvictPolicy.LFU).tolist() == [3]
    assert s.evict(5).tolist() == []


def test_capacity_evicts_automatically_and_spares_the_current_lookup(native):
    s = HashStore(2, capacity=100, low_water=0.5, native=native)
    s.add_column("sum", (2,), "float32")
    s.lookup(np.arange(100))
    assert s.size() == 100
    s.lookup(np.arange(50, 60))  # touched again: recent
    s.lookup(np.arange(1000, 1010))
    assert s.size() == 50
    kept = set(s.keys().tolist())
    assert set(range(1000, 1010)) <= kept and set(range(50, 60)) <= kept
    # evicted keys lost their state: the state column of the reused slots is reset
    s.scatter(np.arange(1000, 1010), np.ones((10, 2), np.float32), "sum")
    s.evict(0)
    assert s.size() == 0
    assert s.gather(np.array([1005]), "sum").tolist() == [[0.0, 0.0]]


def test_a_lookup_larger_than_capacity_keeps_its_keys(native, caplog):
    s = HashStore(2, capacity=4, native=native)
    s.lookup(np.arange(3))
    rows = s.lookup(np.arange(10, 20))
    assert rows.shape == (10, 2) and s.size() == 10
    assert sorted(s.keys().tolist()) == list(range(10, 20))
    assert "exceed the capacity" in caplog.text


def test_a_lookup_past_the_low_water_target_is_logged_with_that_target(native, caplog):
    """The log said the keys of one lookup 'exceed the capacity 40' when they exceeded
    only the low-water target (32 of 40) an automatic eviction goes down to."""
    s = HashStore(2, capacity=40, low_water=0.8, native=native)
    s.lookup(np.arange(10))
    s.lookup(np.arange(100, 135))  # 45 keys > 40: evict down to 32, sparing these 35
    assert s.size() == 35
    assert ("35 keys of one lookup exceed the capacity's low-water target of 32 keys "
            "(low_water 0.8 x capacity 40); holding 35 keys") in caplog.text
    assert "exceed the capacity 40" not in caplog.text


def test_access_counts(native):
    s = HashStore(2, native=native)
    s.lookup(np.array([5, 6]))
    s.lookup(np.array([5, 5]))
    last, count = s.access_counts(np.array([5, 6]))
    assert last.tolist() == [2, 1] and count.tolist() == [2, 1]


def test_bad_arguments(native):
    with pytest.raises(ValueError, match="capacity: expected a positive int, got 0"):
        HashStore(2, capacity=0, native=native)
    with pytest.raises(ValueError, match=r"evict: must be one of \['lru', 'lfu'\], got 'fifo'"):
        HashStore(2, evict="fifo", native=native)
    with pytest.raises(ValueError, match="low_water"):
        HashStore(2, low_water=0.0, native=native)
    with pytest.raises(ValueError, match="dim"):
        HashStore(0, native=native)
    s = HashStore(2, native=native)
    with pytest.raises(ValueError, match="target_size"):
        s.evict(-1)
    with pytest.raises(ValueError, match="policy: must be one of"):
        s.evict(0, policy="random")


def test_key_minus_one_is_evicted_like_any_key(native):
    """-1 is a valid key: it used to mark a free slot, so key -1 was never evicted (and a
    table went over its capacity holding it)."""
    s = HashStore(2, capacity=2, native=native)
    s.lookup(np.array([-1, 0]))
    for k in range(10, 15):
        s.lookup(np.array([k]))
    assert s.size() == 2 and sorted(s.keys().tolist()) == [13, 14]
    assert s.evict(0).tolist() and s.size() == 0


def test_a_failing_init_inserts_nothing(native):
    """The keys of a lookup whose init raises are not inserted: the next lookup calls init
    again, and no slot keeps a stale row (a removed key's) under a new key."""
    calls = []

    def init(keys):
        calls.append(keys.tolist())
        if len(calls) == 2:
            raise RuntimeError("init failed")
        return np.full((len(keys), 2), 7.0, np.float32)

    s = HashStore(2, init=init, native=native)
    s.lookup(np.array([1]))
    s.scatter(np.array([1]), np.full((1, 2), 123.0, np.float32))
    s.remove(np.array([1]))  # its slot is free, its row still in the array
    with pytest.raises(RuntimeError, match="init failed"):
        s.lookup(np.array([5, 6]))
    assert s.size() == 0 and s.find(np.array([5, 6])).tolist() == [-1, -1]
    assert s.lookup(np.array([5])).tolist() == [[7.0, 7.0]] and calls[-1] == [5]
    assert s.evict(0).tolist() == [5] and s.size() == 0


def test_writes_hold_the_capacity(native):
    """An upsert is an access: past the capacity it evicts other keys, sparing its own; a
    write of more distinct keys than the capacity is refused before anything changes."""
    s = HashStore(2, capacity=4, native=native)
    s.lookup(np.arange(4))
    s.lookup(np.array([0]))  # 1, 2, 3 are the least recent
    s.scatter(np.array([10, 11]), np.ones((2, 2), np.float32))
    assert sorted(s.keys().tolist()) == [0, 3, 10, 11]
    with pytest.raises(StoreError, match="5 distinct keys .* at most 4"):
        s.import_(np.arange(20, 25), {"weight": np.ones((5, 2), np.float32)})
    assert sorted(s.keys().tolist()) == [0, 3, 10, 11]
