"""A co-located server answers a trainer's update before it applies it
(distemb/kvstore/server/early.py). The oracle is the reference update rule applied in order:
a lookup right after an update, while the server may still be writing it, returns the
updated rows; an update that fails after its answer is raised at the next request and
leaves the server serving; a trainer that maps the shard learns a success from the shard's
header, and the server sends it no second frame.
"""
import threading
import time

import numpy as np
import pytest

from mp_helper import cluster_dict
from served import FAILED, fail_updates, serving, stall_updates

from distemb.config import parse_cluster_config
from distemb.errors import KVStoreError, ServerUnavailableError
from distemb.kernels import reference
from distemb.kvstore.server import early
from distemb.kvstore.server.early import may_answer_early
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy
from distemb.rules import AdagradHyper, SGDHyper
from distemb.stores.dense import DenseSpec, DenseStore
from distemb.stores.file import FileTableSpec
from distemb.transport.base import FLAG_NO_REPLY
from distemb.transport.messages import Barrier, Hello, Update

pytestmark = pytest.mark.timeout(120)


def update(**kw):
    fields = dict(name="t", rule="sgd", hyper={"lr": 1.0}, seq=1, exact=False, parts=[0],
                  counts=[1], ids=np.zeros(1, np.int64), grads=np.zeros((1, 2), np.float32))
    fields.update(kw)
    return Update(**fields)


@pytest.mark.parametrize("what, msg, in_slot, early", [
    ("an update in the slot", update(), True, True),
    ("the same in a frame (TCP, or asynchronous)", update(), False, False),
    ("asynchronous", update(flags=FLAG_NO_REPLY), True, False),
    ("sync_exact (summed with other trainers' first)", update(exact=True), True, False),
    ("asking versions (a trainer cache)", update(versions=True), True, False),
    ("two shards of one server", update(parts=[0, 2], counts=[1, 0]), True, False),
])
def test_only_what_needs_nothing_more_is_answered_early(what, msg, in_slot, early):
    assert may_answer_early(msg, in_slot) is early, what


@pytest.mark.multiprocess
@pytest.mark.parametrize("rule, parts, marks, table, prefetch", [
    ("sgd", 1, "bool per row", "array", False),
    ("adagrad", 1, "bool per row", "array", False),
    ("adagrad", 2, "bool per row", "array", False),
    ("adagrad", 1, "np.isin", "array", False),
    ("adagrad", 1, "bool per row", "file", False),
    ("adagrad", 2, "bool per row", "file", False),
    ("sgd", 1, "np.isin", "file", False),
    ("adagrad", 1, "bool per row", "array", True),
    ("adagrad", 1, "np.isin", "array", True),
    ("adagrad", 2, "bool per row", "file", True)])
def test_a_lookup_beside_an_update_answered_early_returns_its_rows(clusters, monkeypatch,
                                                                   tmp_path, rule, parts,
                                                                   marks, table, prefetch):
    """Updates large enough that the server is still writing when the next lookup
    starts (half of whose ids the update touches): every lookup equals the rows of
    the reference rule applied in order, and some were served beside an update. With
    two shards on the server, updates touch the first only (one shard: answered early)
    and lookups read both (the second's own seqlock decides there). The rows touched
    are found by the bool per row of a shard, or by np.isin past MARK_ROWS. ``file``: a
    file table, whose rows the trainer maps from the server's file; on two servers
    (``parts`` 2), an update touches both, each answering early for its range of keys.
    ``prefetch``: the lookup's ids were prefetched before the update, whose server
    writes them first: the lookup reads them as soon as they are written."""
    if marks == "np.isin":
        monkeypatch.setattr(early, "MARK_ROWS", 1000)
    cluster = clusters("shm1x1" if table == "array" or parts == 1 else "tcp_shm")
    kv = RemoteKVClient(cluster.cfg, 0)
    n, d = 100_000, 32
    rng = np.random.default_rng(5)
    try:
        init = rng.standard_normal((n, d)).astype(np.float32)
        if table == "file":
            kv.create_table("early", FileTableSpec(str(tmp_path / "early"), num_rows=n,
                                                   dim=d, preallocate=False))
        else:
            kv.init_data("early", (n, d), "float32", range_policy(n, parts))
        kv.push("early", np.arange(n), init)
        kv.init_optimizer("early", rule, {"initial_accumulator_value": 0.1}
                          if rule == "adagrad" else {})
        weight, state = init.copy(), np.full_like(init, 0.1)
        hyper = AdagradHyper(clr=0.05, eps=1e-10) if rule == "adagrad" else SGDHyper(lr=0.5)
        for _ in range(12):
            ids = np.unique(rng.integers(0, n // parts if table == "array" else n,
                                         60_000)).astype(np.int64)
            grads = rng.standard_normal((len(ids), d)).astype(np.float32)
            look = np.concatenate([rng.choice(ids, 2000), rng.integers(0, n, 2000)])
            sums = grads
            if prefetch:
                kv.prefetch("early", look)
                if parts == 1:  # summed in the request slot, as the optimizer's coalesce
                    sums = kv._sum_buffer("early", len(ids), d)[:len(ids)]  # (push_update's
                    sums[:] = grads  # to consume: the server's rows first, reordered there)
            kv.push_update("early", ids, sums, rule, hyper)
            got = kv.pull("early", look)  # at once: the server is still writing
            if rule == "adagrad":
                reference.adagrad_update(weight, state, ids, grads, hyper.clr, hyper.eps)
            else:
                reference.sgd_update(weight, ids, grads, hyper.lr)
            np.testing.assert_allclose(got, weight[look], rtol=1e-6, atol=1e-6)
        assert kv.servers.applying.beside > 0, "no lookup ran beside an update: a void test"
        assert (kv.servers.applying.first_read > 0) is (prefetch and parts == 1)
        assert bool(kv.servers.applying._marks) is (marks == "bool per row")
    finally:
        kv.delete_data("early")
        kv.close(goodbye=False)


@pytest.fixture
def served():
    """One server with shared memory, served by threads of this process (so a test can
    make its store fail): (the cluster config, the event its last goodbye sets)."""
    cfg = parse_cluster_config(cluster_dict(1, shared_memory=True, timeout_s=20.0))
    with serving(cfg) as stops:
        yield cfg, stops[0]


@pytest.fixture
def server_here(served):
    """The cluster config of that server."""
    return served[0]


@pytest.fixture
def mapped_t(server_here):
    """A client of that server, with table "t" (10 x 2, SGD) mapped here."""
    kv = RemoteKVClient(server_here, 0)
    try:
        kv.init_data("t", (10, 2), "float32", range_policy(10, 1))
        kv.init_optimizer("t", "sgd", {})
        kv.pull("t", np.array([0]))  # mapped now
        yield kv
    finally:
        kv.close(goodbye=False)


def test_an_update_that_fails_after_its_early_answer_is_raised_next(server_here,
                                                                    monkeypatch):
    kv = RemoteKVClient(server_here, 0)
    try:
        kv.init_data("t", (10, 2), "float32", range_policy(10, 1))
        kv.init_optimizer("t", "sgd", {})
        ones = np.ones((2, 2), np.float32)
        with monkeypatch.context() as m:
            fail_updates(m)
            for then in (lambda: kv.push("t", np.array([5]), ones[:1]),  # any request
                         lambda: kv.pull("t", np.array([1]))):  # a lookup beside it
                kv.push_update("t", np.array([1, 3]), ones, "sgd", SGDHyper(lr=1.0))
                with pytest.raises(KVStoreError, match=FAILED):
                    then()
        assert kv.pull("t", np.array([5])).tolist() == [[0, 0]]  # raised before it went
        # the shard was unlocked and the server serves on; the failed update wrote nothing
        kv.push_update("t", np.array([3]), ones[:1], "sgd", SGDHyper(lr=1.0))
        assert kv.pull("t", np.array([1, 3])).tolist() == [[0, 0], [-1, -1]]
    finally:
        kv.close(goodbye=False)


def test_each_trainer_learns_its_own_failure_though_another_fails_after(
        mapped_t, server_here, monkeypatch):
    """Two trainers map one shard; A's update fails after its early answer, then B's
    does. A learns its own failure, not a success, and stays in step: the server tells
    each trainer on its own connection, before the counter moves (a failure word in the
    shard's header, one for all trainers, held B's failure by the time A looked)."""
    a, b = mapped_t, RemoteKVClient(server_here, 0)
    try:
        b.init_data("t", (10, 2), "float32", range_policy(10, 1))  # attaches to A's
        b.init_optimizer("t", "sgd", {})
        b.pull("t", np.array([0]))  # B maps the shard too
        ones = np.ones((1, 2), np.float32)
        counter = a.servers.mapped[("t", 0)].version  # the shard's seqlock: +2 a write
        with monkeypatch.context() as m:
            fail_updates(m)
            start = int(counter[0])
            a.push_update("t", np.array([1]), ones, "sgd", SGDHyper(lr=1.0))
            deadline = time.monotonic() + 20
            while int(counter[0]) < start + 2:  # A's has failed (its answer left unread)
                assert time.monotonic() < deadline, "A's update never ran"
                time.sleep(0.001)
            b.push_update("t", np.array([2]), ones, "sgd", SGDHyper(lr=1.0))
            with pytest.raises(KVStoreError, match=FAILED):
                b.servers.applying.settle(0)  # B's has failed after A's
        with pytest.raises(KVStoreError, match=FAILED):
            a.pull("t", np.array([1]))  # a lookup beside A's update learns its outcome
        assert not a.servers.connections[0].pending()
        a.push("t", np.array([5]), np.full((1, 2), 7, np.float32))
        assert a.pull("t", np.array([1, 2, 5])).tolist() == [[0, 0], [0, 0], [7, 7]]
    finally:
        b.close(goodbye=False)


def test_a_success_read_in_the_shard_costs_no_second_frame(mapped_t):
    """The trainer maps the shard, so it asks to read the outcome in the shard's header:
    once the server has applied the update (the counter moved on) and the trainer has
    read its early answer, nothing more is on the connection, and the next requests
    answer in step."""
    kv = mapped_t
    conn = kv.servers.connections[0]
    for step in range(1, 4):
        kv.push_update("t", np.array([1, 3]), np.ones((2, 2), np.float32), "sgd",
                       SGDHyper(lr=1.0))
        kv.servers.applying.settle(0)  # reads the early answer, then the header
        time.sleep(0.05)  # an outcome frame, if one were sent, would be here by now
        assert not conn.pending(), "the server sent a frame after a success"
        assert kv.pull("t", np.array([1, 3, 4])).tolist() == \
            [[-step, -step], [-step, -step], [0, 0]]


def test_an_update_still_applying_past_the_timeout_is_a_server_unavailable(
        mapped_t, monkeypatch, request):
    kv = mapped_t
    release = stall_updates(monkeypatch, request, wait_s=10)
    kv.push_update("t", np.array([1]), np.ones((1, 2), np.float32), "sgd",
                   SGDHyper(lr=1.0))
    with pytest.raises(ServerUnavailableError, match="not applied within 0.2 s"):
        kv.servers.applying.settle(0, timeout=0.2)
    assert kv.servers.applying.reads_slot(0)  # the server may still read the update
    release.set()
    assert kv.pull("t", np.array([1])).tolist() == [[-1, -1]]  # in step after it


def test_a_prefetched_lookup_reads_the_rows_written_first_while_the_rest_are(
        mapped_t, monkeypatch, request):
    """A prefetch names the next lookup's rows; the update puts them first, its server
    writes them first and says so in the header, and the lookup reads them then: while
    the server still writes the update's other rows (held here until the lookup is
    done). Without the order, the lookup would wait for the whole update."""
    kv = mapped_t
    rest_begun, rest_done, release = threading.Event(), threading.Event(), threading.Event()
    request.addfinalizer(release.set)  # before the client closes
    calls, apply = [], DenseStore.update

    def rest_waits(self, rule, keys, grads, hyper, num_threads=1):
        calls.append(np.array(keys).tolist())
        if len(calls) == 2:
            rest_begun.set()
            release.wait(10)
        try:
            return apply(self, rule, keys, grads, hyper, num_threads)
        finally:
            if len(calls) == 2:
                rest_done.set()
    monkeypatch.setattr(DenseStore, "update", rest_waits)
    kv.prefetch("t", np.array([7, 3, 3]))
    sums = kv._sum_buffer("t", 4, 2)[:4]  # the optimizer sums into the request slot
    sums[:] = np.array([[1], [2], [3], [4]], np.float32)
    kv.push_update("t", np.array([1, 3, 5, 7]), sums, "sgd", SGDHyper(lr=1.0))
    assert rest_begun.wait(10), "the server never began the update's other rows"
    got = kv.pull("t", np.array([3, 7, 4]))
    assert not rest_done.is_set(), "the lookup waited for the whole update"
    release.set()
    assert got.tolist() == [[-2, -2], [-4, -4], [0, 0]]
    assert sorted(calls[0]) == [3, 7] and sorted(calls[1]) == [1, 5]
    assert kv.servers.applying.first_read == 1
    assert kv.pull("t", np.array([1, 5, 3])).tolist() == [[-1, -1], [-3, -3], [-2, -2]]
    kv.push_update("t", np.array([3]), np.ones((1, 2), np.float32), "sgd",
                   SGDHyper(lr=1.0))  # no prefetch since: applied whole, in one call
    assert kv.pull("t", np.array([3])).tolist() == [[-3, -3]] and len(calls) == 3


def test_summing_into_the_slot_spares_the_update_the_server_reads_there(clusters):
    """The optimizer sums a table's gradients into the request slot (no copy to the
    server), table after table: the second table's sums must not overwrite the first's
    while its server, which answered early, still applies them from the slot."""
    kv = RemoteKVClient(clusters("shm1x1").cfg, 0)
    n, d = 100_000, 32
    rng = np.random.default_rng(7)
    try:
        for name in ("a", "b"):
            kv.init_data(name, (n, d), "float32", range_policy(n, 1))
            kv.init_optimizer(name, "sgd", {})
        weight = np.zeros((n, d), np.float32)
        for _ in range(4):
            ids = np.unique(rng.integers(0, n, 60_000)).astype(np.int64)
            grads = rng.standard_normal((len(ids), d)).astype(np.float32)
            sums = kv._sum_buffer("a", len(ids), d)[:len(ids)]
            sums[:] = grads
            kv.push_update("a", ids, sums, "sgd", SGDHyper(lr=1.0))
            kv._sum_buffer("b", len(ids), d)[:len(ids)] = 1e6  # the next table's sums
            reference.sgd_update(weight, ids, grads, 1.0)
            kv.push_update("b", ids[:1], np.zeros((1, d), np.float32), "sgd",
                           SGDHyper(lr=1.0))
            np.testing.assert_array_equal(kv.pull("a", np.arange(n)), weight)
    finally:
        for name in ("a", "b"):
            kv.delete_data(name)
        kv.close(goodbye=False)


def test_a_refused_update_is_raised_at_the_next_lookup(mapped_t):
    """The trainer reads a co-located server's answer to an update when it first needs
    it (its next lookup of the table, or request to the server), not before its next
    step starts: a refusal is raised there, nothing of it written, and the connection
    stays in step."""
    kv = mapped_t
    ones = np.ones((2, 2), np.float32)
    for then in (lambda: kv.pull("t", np.array([1])),  # a lookup of its rows
                 lambda: kv.push("t", np.array([5]), ones[:1])):  # any request
        # Adagrad's state was never made: the server refuses before it locks
        kv.push_update("t", np.array([1, 3]), ones, "adagrad",
                       AdagradHyper(clr=0.1, eps=1e-10))
        with pytest.raises(KVStoreError, match="no shard 0 of .t~opt~sum."):
            then()
    kv.push_update("t", np.array([3]), ones[:1], "sgd", SGDHyper(lr=1.0))
    assert kv.pull("t", np.array([1, 3, 5])).tolist() == [[0, 0], [-1, -1], [0, 0]]

def refuse_next(kv, ids=(1, 3)):
    """An update the server refuses (Adagrad, whose state was never made) before it
    locks anything; its answer is left for later."""
    kv.push_update("t", np.array(ids), np.ones((len(ids), 2), np.float32), "adagrad",
                   AdagradHyper(clr=0.1, eps=1e-10))


REFUSED = "no shard 0 of 't~opt~sum'"


def test_a_table_dropped_with_its_update_answer_unread_is_dropped(mapped_t):
    kv = mapped_t
    kv.push_update("t", np.array([1]), np.ones((1, 2), np.float32), "sgd", SGDHyper(lr=1.0))
    kv.delete_data("t")  # reads the answer (and the outcome) first, then drops
    kv.init_data("t", (4, 2), "float32", range_policy(4, 1))  # a new table of the name
    assert kv.pull("t", np.arange(4)).tolist() == [[0, 0]] * 4


def test_a_refusal_raised_while_replies_travel_leaves_the_connections_in_step(clusters):
    """A lookup copies the rows of co-located shards while other servers' replies
    travel; an update one of those shards' server refused is raised there, after every
    reply is read (server 1's reply would otherwise be read as the next request's)."""
    cfg = clusters("tcp_shm").cfg
    kv = RemoteKVClient(cfg, 0)
    try:
        kv.init_data("w", (10, 2), "float32", range_policy(10, 2))  # 0-4 on server 0
        kv.init_optimizer("w", "sgd", {})
        kv.pull("w", np.arange(10))  # both shards mapped
        kv.push_update("w", np.array([1]), np.ones((1, 2), np.float32), "adagrad",
                       AdagradHyper(clr=0.1, eps=1e-10))  # refused by server 0, unread
        with pytest.raises(KVStoreError, match="no shard 0 of 'w~opt~sum'"):
            kv.servers.call({1: Barrier(rank=0)},
                            while_waiting=lambda: kv.pull("w", np.array([1])))
        hello = kv.servers.call({1: Hello(rank=0, token=cfg.job_token or "")})[1]
        assert hello.fields.get("server_id") == 1, "an earlier request's reply: out of step"
        # refused by server 1: raised before anything goes to server 0 either
        kv.push_update("w", np.array([7]), np.ones((1, 2), np.float32), "adagrad",
                       AdagradHyper(clr=0.1, eps=1e-10))
        with pytest.raises(KVStoreError, match="no shard 1 of 'w~opt~sum'"):
            kv.servers.call({0: Barrier(rank=0), 1: Barrier(rank=0)})
        hello = kv.servers.call({0: Hello(rank=0, token=cfg.job_token or "")})[0]
        assert hello.fields.get("server_id") == 0, "an earlier request's reply: out of step"
    finally:
        kv.delete_data("w")
        kv.close(goodbye=False)


def test_closing_with_a_refused_update_unread_says_goodbye_then_raises(served):
    cfg, stop = served
    kv = RemoteKVClient(cfg, 0)
    kv.init_data("t", (10, 2), "float32", range_policy(10, 1))
    kv.init_optimizer("t", "sgd", {})
    kv.pull("t", np.array([0]))  # mapped now
    refuse_next(kv)
    with pytest.raises(KVStoreError, match=REFUSED):
        kv.close()
    assert stop.wait(10), "the server never heard the goodbye"
    assert kv.servers.closed


def test_a_prefetch_of_a_table_dropped_and_made_again_is_forgotten(mapped_t):
    kv = mapped_t
    kv.prefetch("t", np.array([7, 9]))
    kv.delete_data("t")
    kv.init_data("t", (4, 2), "float32", range_policy(4, 1))  # fewer rows than 7 and 9
    kv.init_optimizer("t", "sgd", {})
    kv.pull("t", np.array([0]))  # mapped again
    sums = kv._sum_buffer("t", 2, 2)[:2]
    sums[:] = 1
    kv.push_update("t", np.array([1, 3]), sums, "sgd", SGDHyper(lr=1.0))
    assert kv.pull("t", np.arange(4)).tolist() == [[0, 0], [-1, -1], [0, 0], [-1, -1]]


def test_stochastic_rounding_does_not_depend_on_a_prefetch(clusters):
    """Each update of a stochastically rounded bfloat16 table takes the next rounding
    seed, so the server does not split one in two when a prefetch asks for rows first:
    the rows equal those of the same updates without prefetch, bit for bit."""
    kv = RemoteKVClient(clusters("shm1x1").cfg, 0)
    n, d = 2_000, 8
    rng = np.random.default_rng(3)
    try:
        for name in ("ahead", "plain"):
            kv.create_table(name, DenseSpec((n, d), dtype="bfloat16", rounding_seed=11))
            kv.init_optimizer(name, "sgd", {})
            kv.pull(name, np.array([0]))  # mapped
        for _ in range(6):
            ids = np.unique(rng.integers(0, n, 500)).astype(np.int64)
            grads = rng.standard_normal((len(ids), d)).astype(np.float32) * 1e-3
            nxt = rng.integers(0, n, 300)
            for name in ("ahead", "plain"):
                if name == "ahead":
                    kv.prefetch(name, nxt)
                sums = kv._sum_buffer(name, len(ids), d)[:len(ids)]
                sums[:] = grads
                kv.push_update(name, ids, sums, "sgd", SGDHyper(lr=1.0))
                kv.pull(name, nxt)
        np.testing.assert_array_equal(kv.pull("ahead", np.arange(n)),
                                      kv.pull("plain", np.arange(n)))
    finally:
        for name in ("ahead", "plain"):
            kv.delete_data(name)
        kv.close(goodbye=False)
