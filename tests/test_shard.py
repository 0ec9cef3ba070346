"""ShardTable, the one shard type: its lock, seqlock counters and row versions, over every
store kind, and KVServer's shards as ShardTables (state arrays as columns of their table)."""
import gc
import os
import threading
import time

import numpy as np
import pytest
from mp_helper import memory_files

from distemb.errors import KVStoreError
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.server.shard import VERSION, ShardTable
from distemb.routers import KeyHashRouter, PolicyRouter
from distemb.rules import AdagradHyper, SGDHyper, state_name
from distemb.stores import DenseStore, FileStore, HashStore
from distemb.stores.dense import DenseSpec
from distemb.transport.messages import Create


def _stores(tmp_path):
    return {"dense": DenseStore(8, 2), "hash": HashStore(2),
            "file": FileStore(str(tmp_path / "f"), 8, 2)}


def _shard(store):
    """The ShardTable of a table whose one shard is ``store``."""
    router = PolicyRouter.ranges(store.size(), 1) if store.fixed_keys else KeyHashRouter(1)
    return ShardTable(store, router)


def _dense(srv, name, shape, rule=None):
    """Table ``name`` of ``shape`` in one shard of ``srv`` (its state of ``rule`` too)."""
    spec = DenseSpec(shape)
    table, = srv.create_table(name, spec, spec.router(), [0])
    if rule is not None:
        srv.attach_states(name, 0, table.init_states(rule, {}))
    return table


@pytest.mark.parametrize("kind", ["dense", "hash", "file"])
def test_versions_start_at_first_and_count_writes(tmp_path, kind):
    store = _stores(tmp_path)[kind]
    t = _shard(store)
    keys = np.array([1, 5, 7])
    with t.write():
        store.scatter(keys, np.ones((3, 2), np.float32))
    assert not t.tracks_versions
    assert t.versions(keys, first=100).tolist() == [100, 100, 100]
    with t.write():
        t.bump(keys[[0, 0, 2]])  # duplicates change once
        t.bump(keys[2:], by=np.array([3]))
    assert t.versions(keys, first=None).tolist() == [101, 100, 104]
    t.push(keys[1:2], np.zeros((1, 2), np.float32))
    assert t.versions(keys, first=None).tolist() == [101, 101, 104]
    t.bump_all()
    assert t.versions(keys, first=None).tolist() == [102, 102, 105]
    assert VERSION not in t.columns()  # hidden from exports and checkpoints
    store.close()


def test_a_hash_rows_version_is_evicted_with_the_row():
    store = HashStore(2)
    t = _shard(store)
    store.lookup(np.array([10, 20, 30]))
    first = 7 << 40
    t.versions(np.array([10]), first)
    with t.write():
        t.bump(np.array([10]), by=5)
    assert t.versions(np.array([10]), None).tolist() == [first + 5]
    t.push(np.array([20]), np.ones((1, 2), np.float32))
    store.remove(np.array([10]))
    t.pull(np.array([40, 10]))  # 10 comes back as a fresh row, above every version issued
    v10, v20, v40 = t.versions(np.array([10, 20, 40]), None).tolist()
    assert v20 == first + 1 and v10 == v40 > first + 5
    store.evict(2, "lru")  # 30 and 20 are the least recent: evicted
    t.pull(np.array([20]))
    assert t.versions(np.array([20]), None)[0] > v10
    assert VERSION in store.columns() and VERSION not in t.columns()


def test_a_copy_of_an_evicted_row_never_matches_the_row_that_replaced_it():
    """A trainer cache holds key 10 at version v; the server evicts 10, a lookup inserts it
    again with its initial row, and updates follow. Were versions restarted, the k-th
    update would bring the new row back to v and the cache would take a stale copy for
    current (versions are all a cache compares)."""
    store = HashStore(2)
    t = _shard(store)
    held = t.versions(np.array([10]), 1 << 40)[0]
    for _ in range(3):
        t.push(np.array([10]), np.ones((1, 2), np.float32))
    cached = t.versions(np.array([10]), None)[0]  # the cache's copy: three writes in
    assert cached == held + 3
    seen = set()
    for _ in range(2):  # evicted and inserted twice, written 8 times after each insert
        with t.write():
            store.remove(np.array([10]))
        for _ in range(8):
            t.push(np.array([10]), np.full((1, 2), 2, np.float32))
            seen.add(int(t.versions(np.array([10]), None)[0]))
    assert cached not in seen and min(seen) > cached


def test_seqlock_counters_are_odd_while_a_write_runs():
    t = _shard(DenseStore(4, 2))
    w, s = np.zeros(1, np.int64), np.zeros(1, np.int64)
    t.set_counter("weight", w)
    t.set_counter("sum", s)
    with t.write():
        assert (w[0], s[0]) == (1, 1)
    assert (w[0], s[0]) == (2, 2)
    t.set_counter("sum", None)
    with t.write():
        assert (w[0], s[0]) == (3, 2)


def test_a_writer_excludes_readers():
    t = _shard(DenseStore(4, 2))
    seen = []
    inside = threading.Event()

    def reader():
        inside.wait()
        with t.read():
            seen.append("read")

    th = threading.Thread(target=reader)
    th.start()
    with t.write():
        inside.set()
        time.sleep(0.2)
        seen.append("write done")
    th.join(10)
    assert seen == ["write done", "read"]


def test_server_state_shards_are_columns_of_their_table():
    srv = KVServer()
    table = _dense(srv, "T", (5, 2), "adagrad")
    assert srv.table(state_name("T", "sum"), 0) is table
    assert "sum" in table.store.columns()
    # a write of the state voids cached copies of the table's rows
    v0 = srv.versions("T", 0, np.array([3])).tolist()
    srv.push(state_name("T", "sum"), 0, np.array([3]), np.ones((1, 2), np.float32))
    assert srv.versions("T", 0, np.array([3])).tolist() == [v0[0] + 1]
    srv.drop_shard(state_name("T", "sum"), 0)
    assert "sum" not in table.store.columns()
    assert srv.has("T", 0)


def test_update_of_a_state_name_or_with_missing_state_is_refused():
    srv = KVServer()
    table = _dense(srv, "T", (5, 2))
    with pytest.raises(KVStoreError, match="no shard 0 of 'T~opt~sum'"):
        srv.update("T", 0, np.array([1]), np.ones((1, 2), np.float32), "adagrad",
                   AdagradHyper(clr=0.1, eps=1e-10))
    srv.attach_states("T", 0, table.init_states("adagrad", {}))
    with pytest.raises(KVStoreError, match="optimizer state"):
        srv.update(state_name("T", "sum"), 0, np.array([1]), np.ones((1, 2), np.float32),
                   "sgd", SGDHyper(lr=0.1))


def test_a_state_column_has_its_tables_rows_so_a_versioned_pull_stays_inside():
    """Issue 18's crash: Create T (100000 x 4), Create 'T~opt~evil' (1 x 65536), then a
    VersionedPull of T's last row with state 'evil' read outside the 1-row array. The
    second Create is refused by its reserved name (optimizer state is made by OptInit
    alone, as columns of its table's stores: their rows are the table's) and the pull
    names the missing state; the service goes on serving."""
    from distemb.kvstore.server.service import KVService
    from distemb.transport.messages import Pull, Service, VersionedPull
    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=1)

    def ask(msg):
        return svc.handle(msg.encode())
    assert ask(Create.of_spec("T", DenseSpec((100000, 4)))).service == Service.REPLY
    bad = ask(Create.of_spec("T~opt~evil", DenseSpec((1, 65536))))
    assert bad.service == Service.ERROR and "reserved" in bad.fields["message"]
    pulled = ask(VersionedPull(name="T", parts=[0], counts=[1], ids=np.array([99999]),
                               have=np.array([-2]), states=["evil"]))
    assert pulled.service == Service.ERROR and "T~opt~evil" in pulled.fields["message"]
    ok = ask(Pull(name="T", parts=[0], counts=[1], ids=np.array([99999])))
    assert ok.service == Service.REPLY and ok.arrays[0].shape == (1, 4)


def test_reserved_state_names_and_non_finite_initial_state_are_refused():
    """Issue 18: '~opt~' names optimizer state, so no table may be created with it (on
    the wire, by SpecCreate, or by the API); an OptInit with a NaN or infinite initial
    value is refused before any state is made."""
    import math

    import distemb
    from distemb.kvstore.server.service import KVService
    from distemb.stores.spec import HashTableSpec
    from distemb.transport.messages import OptInit, Service
    from test_hostile import SpecCreate
    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=1)

    def ask(msg):
        return svc.handle(msg.encode())
    for msg in (Create.of_spec("a~opt~b", DenseSpec((5, 4))),
                SpecCreate(name="d~opt~sum", **HashTableSpec(4).fields())):
        r = ask(msg)
        assert r.service == Service.ERROR and "reserved" in r.fields["message"], r.fields
    assert not svc.server.parts_of("a~opt~b") and not svc.server.parts_of("d~opt~sum")
    assert ask(Create.of_spec("T", DenseSpec((5, 4)))).service == Service.REPLY
    for value in (math.nan, math.inf, -math.inf):
        r = ask(OptInit(name="T", rule="adagrad", parts=[0],
                        options={"initial_accumulator_value": value}))
        assert r.service == Service.ERROR and "finite" in r.fields["message"]
        assert not svc.server.has("T~opt~sum", 0)
    distemb.shutdown()
    try:
        with pytest.raises(ValueError, match="reserved"):
            distemb.DistEmbedding(10, 4, name="x~opt~y")
        with pytest.raises(ValueError, match="reserved"):
            distemb.DistEmbedding(None, 4, name="x~opt~y")
    finally:
        distemb.shutdown()


def test_dropping_a_table_frees_its_arrays_and_its_optimizer_states():
    """A table's state shards are columns of its store: dropping the table must let go of
    every array (a server kept a deleted table's weight alive through its states)."""
    import weakref
    srv = KVServer()
    table = _dense(srv, "T", (1000, 8), "adagrad")
    refs = [weakref.ref(table.store.column("weight")), weakref.ref(table.store.column("sum"))]
    _dense(srv, "U", (3, 2))
    del table
    srv.drop("T")
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert not srv.has("T", 0) and not srv.has(state_name("T", "sum"), 0)
    assert srv.has("U", 0)


def test_a_servers_shm_shards_are_found_by_identity_and_freed_on_drop():
    """The server's arena knows its arrays by identity: the shard a ShardTable holds must
    be the arena's own array, or co-located trainers get no segment (and read over
    sockets) and a dropped table's memory file is never released (its memory stays)."""
    from distemb.kvstore.server.service import KVService
    from distemb.transport.messages import Drop, OptInit, Service, ShmInfo
    from distemb.transport.shm import ShmArena
    arena = ShmArena("idjob", 0)
    svc = KVService(KVServer(), 0, 1, 1, arena=arena)

    def ask(msg):
        reply = svc.handle(msg.encode())
        assert reply.service == Service.REPLY, reply.fields
        return reply
    ask(Create.of_spec("T", DenseSpec((50, 4))))
    ask(OptInit(name="T", rule="adagrad", options={}, parts=[0]))
    reply = ask(ShmInfo(name="T", parts=[0]))  # the rows, which trainers read in place
    assert reply.fields["segments"] == [True] and len(reply.fds) == 1, reply.fields
    os.close(reply.fds[0])
    reply = ask(ShmInfo(name=state_name("T", "sum"), parts=[0]))  # read over the socket
    assert reply.fields["segments"] == [False] and not reply.fds, reply.fields
    assert memory_files(os.getpid(), "idjob") == ["distemb-idjob-s0-0",
                                                     "distemb-idjob-s0-1"]
    ask(Drop(name="T"))
    gc.collect()  # the last views of the shards go: their mappings with them
    assert memory_files(os.getpid(), "idjob") == []
    arena.close()


def test_versions_of_keys_that_grow_a_hash_store_are_read_after_the_growth():
    """A versioned pull of new keys inserts them; when that grows the store's arrays, the
    versions come from the grown column (a trainer cache asks for versions of new keys)."""
    t = _shard(HashStore(2))
    first = 1 << 40
    t.versions(np.arange(4), first)
    got = t.versions(np.arange(100, 100 + 5000), None)  # grows every column many times
    assert len(got) == 5000 and (got == got[0]).all() and got[0] > first
    # a write of absent keys inserts them (growing every column again), then counts
    t.push(np.arange(200_000, 210_000), np.ones((10_000, 2), np.float32))
    bumped = t.versions(np.arange(200_000, 210_000), None)
    assert (bumped == bumped[0]).all() and bumped[0] > got[0]



def _service():
    """An in-process server's service, and ``ask(message) -> reply frame``."""
    from distemb.kvstore.server.service import KVService
    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=1)
    return svc, lambda msg: svc.handle(msg.encode())


def test_an_optimizer_option_the_rule_does_not_read_is_refused_naming_it():
    """Issue 37: an OptInit option that no state of the rule starts from is refused,
    named, before any state is made (it was ignored, as unknown hyperparameters are not)."""
    from distemb.transport.messages import OptInit, Service
    svc, ask = _service()
    assert ask(Create.of_spec("T", DenseSpec((5, 4)))).service == Service.REPLY
    for rule, options, bad in (
            ("adagrad", {"initial_accumulator_value": 0.1, "bogus": 1.0}, "bogus"),
            ("sgd", {"initial_accumulator_value": 0.1}, "initial_accumulator_value"),
            ("adam", {"lr": 0.1}, "lr")):
        r = ask(OptInit(name="T", rule=rule, parts=[0], options=options))
        assert r.service == Service.ERROR, (rule, options)
        assert f"options.{bad}: unknown option of rule {rule!r}" in r.fields["message"], \
            r.fields["message"]
        assert list(svc.server.table("T", 0).columns()) == ["weight"]  # no state made


def test_a_spec_whose_initialiser_contradicts_its_dim_is_refused_naming_it():
    """Issue 37: a table spec's ``init_args.dim`` must be its ``dim`` (a zeros
    initialiser's was not compared: the spec was taken with the table's dim)."""
    from distemb.stores.spec import HashTableSpec
    from distemb.transport.messages import Service
    from test_hostile import SpecCreate
    svc, ask = _service()
    for init, args in (("zeros", {"dim": 9}), ("normal", {"dim": 9, "std": 1.0, "seed": 0})):
        r = ask(SpecCreate(name="d", **dict(HashTableSpec(8).fields(), init=init,
                                            init_args=args)))
        assert r.service == Service.ERROR, init
        assert "init_args.dim: 9, the table's dim is 8" in r.fields["message"], r.fields
        assert not svc.server.has("d", 0)


def test_a_write_of_state_to_a_key_the_table_lacks_is_refused_naming_it():
    """Issue 37: optimizer state is written only to keys a hash table holds (the push
    inserted the key, with a fresh row); nothing of the push is written."""
    from distemb.stores.spec import HashTableSpec
    from distemb.transport.messages import OptInit, Push, Service
    from test_hostile import SpecCreate
    svc, ask = _service()
    assert ask(SpecCreate(name="d", **HashTableSpec(2).fields())).service == Service.REPLY
    assert ask(OptInit(name="d", rule="adagrad", parts=[0],
                       options={"initial_accumulator_value": 0.5})).service == Service.REPLY
    assert ask(Push(name="d", parts=[0], counts=[1], ids=np.array([7]),
                    values=np.ones((1, 2), np.float32))).service == Service.REPLY
    r = ask(Push(name="d~opt~sum", parts=[0], counts=[2], ids=np.array([7, 8]),
                 values=np.full((2, 2), 3.0, np.float32)))
    assert r.service == Service.ERROR
    assert "keys: 1 key(s) not in the store, e.g. [8]" in r.fields["message"], r.fields
    table = svc.server.table("d", 0)
    assert table.store.keys().tolist() == [7]
    assert table.get(np.array([7]), "sum").tolist() == [[0.5, 0.5]]  # nothing written
