"""A co-located trainer's connections stay in step when something fails around an update
answered early (distemb/kvstore/servers.py, distemb/kvstore/server/early.py): a send or a
read that fails midway through a request to several servers, an answer that comes later
than the trainer waits, a client closed while a server is still applying. The oracle is
the connection itself: the next request's reply must be that request's (a Hello's names
its server), never an earlier answer left unread, and the rows must be the reference
rule's.
"""
import threading

import numpy as np
import pytest

from mp_helper import cluster_dict
from served import serving, stall_updates

from distemb.config import parse_cluster_config
from distemb.errors import ServerUnavailableError, TransportError
from distemb.kvstore.remote import RemoteKVClient
from distemb.kvstore.server.shard import ShardTable
from distemb.partition import range_policy
from distemb.rules import SGDHyper
from distemb.transport.messages import Barrier, Hello, Pull, Update

pytestmark = pytest.mark.timeout(120)
ONES = np.ones((2, 2), np.float32)


@pytest.fixture
def two(clusters):
    """A client of two co-located servers with table "w" (rows 0-4 on server 0, 5-9 on
    server 1), both shards mapped: its updates are answered early."""
    cfg = clusters("tcp_shm").cfg
    kv = RemoteKVClient(cfg, 0)
    kv.hello = Hello(rank=0, token=cfg.job_token or "")
    try:
        kv.init_data("w", (10, 2), "float32", range_policy(10, 2))
        kv.init_optimizer("w", "sgd", {})
        kv.pull("w", np.arange(10))
        yield kv
    finally:
        kv.delete_data("w")
        kv.close(goodbye=False)


def in_step(kv, sid):
    """Whether server ``sid``'s answer to a Hello now is that Hello's."""
    return kv.servers.call({sid: kv.hello})[sid].fields.get("server_id") == sid


def unavailable(*args, **kw):
    raise ServerUnavailableError("connection reset (a test)")


def test_a_send_that_fails_leaves_the_other_servers_connections_in_step(two, monkeypatch):
    """A request goes to servers 0 and 1, and the send to server 1 fails: server 0's
    answer (a reply, or an update's early answer read when first needed) is still read,
    not taken later as the answer to another request."""
    kv = two
    for send in ({0: Barrier(rank=0), 1: Barrier(rank=0)},
                 lambda: kv.push_update("w", np.array([1, 7]), ONES, "sgd", SGDHyper(lr=1.0))):
        with monkeypatch.context() as m:
            m.setattr(kv.servers.connections[1], "send", unavailable)
            with pytest.raises(ServerUnavailableError, match="a test"):
                kv.servers.call(send) if isinstance(send, dict) else send()
        assert in_step(kv, 0), "an earlier request's reply: out of step"
    assert kv.pull("w", np.array([1, 7])).tolist() == [[-1, -1], [0, 0]]  # 7 never went


def test_a_frame_that_cannot_be_made_leaves_the_others_in_step(two, monkeypatch):
    kv = two
    made = kv.servers._frame_for

    def broken(sid, msg, wait):
        if sid == 1:
            raise TransportError("request slot: cannot map (a test)")
        return made(sid, msg, wait)
    with monkeypatch.context() as m:
        m.setattr(kv.servers, "_frame_for", broken)
        with pytest.raises(TransportError, match="a test"):
            kv.servers.call({0: Barrier(rank=0), 1: Barrier(rank=0)})
    assert in_step(kv, 0), "server 0's Barrier reply was left unread"


def test_a_read_that_fails_leaves_the_later_servers_early_answers_known(two, monkeypatch):
    """Server 0's reply cannot be read; server 1's update, answered early, is still
    known: its slot is spared and its answer read before the next request's."""
    kv = two
    shard1 = Update(name="w", rule="sgd", hyper={"lr": 1.0}, seq=1, exact=False, parts=[1],
                    counts=[1], ids=np.array([7]), grads=np.ones((1, 2), np.float32))
    conn0 = kv.servers.connections[0]
    with monkeypatch.context() as m:
        m.setattr(conn0, "recv", unavailable)
        with pytest.raises(ServerUnavailableError, match="a test"):
            kv.servers.call({0: Barrier(rank=0), 1: shard1}, later=True)
    assert kv.servers.applying.reads_slot(1), "the server may still read the slot"
    assert in_step(kv, 1), "the early answer was taken as the Hello's"
    conn0.recv()  # the Barrier's reply, which the failed read left (its connection's)
    assert kv.pull("w", np.array([7])).tolist() == [[-1, -1]]


def test_an_update_answered_later_waits_behind_the_rows_sent_ahead(two, monkeypatch):
    """A prefetch's Pull is in flight to server 0 when an update's send to server 1
    fails: server 0's early answer, read later, comes after the Pull's rows."""
    kv = two
    kv.servers.connections[0].reads_aside = False  # the Pull's reply read when needed
    ahead = kv.servers.ahead({0: Pull(name="w", parts=[0], counts=[1], ids=np.array([3]))})
    with monkeypatch.context() as m:
        m.setattr(kv.servers.connections[1], "send", unavailable)
        with pytest.raises(ServerUnavailableError, match="a test"):
            kv.push_update("w", np.array([1, 7]), ONES, "sgd", SGDHyper(lr=1.0))
    assert in_step(kv, 0), "an earlier request's reply: out of step"
    assert ahead.wait()[0].arrays[0].tolist() == [[0, 0]], "the Pull got another's reply"


@pytest.fixture
def stalled(monkeypatch, request):
    """Updates of dense stores wait until the returned event is set."""
    return stall_updates(monkeypatch, request)


def test_an_early_answer_later_than_the_wait_keeps_the_slot_spared(monkeypatch, request):
    """The server takes the shard's lock only after another writer's: its early answer
    comes after the trainer stopped waiting. The update is still pending (the server
    will read the slot), and its answer is read before the next request's."""
    cfg = parse_cluster_config(cluster_dict(1, shared_memory=True, timeout_s=20.0))
    release = threading.Event()
    request.addfinalizer(release.set)
    later = ShardTable.update_later

    def behind(self, *args, **kw):
        release.wait(20)  # the write lock still held by another
        return later(self, *args, **kw)
    with serving(cfg):
        kv = RemoteKVClient(cfg, 0)
        try:
            kv.hello = Hello(rank=0, token=cfg.job_token or "")
            kv.init_data("t", (10, 2), "float32", range_policy(10, 1))
            kv.init_optimizer("t", "sgd", {})
            kv.pull("t", np.array([0]))  # mapped
            monkeypatch.setattr(ShardTable, "update_later", behind)
            kv.push_update("t", np.array([1, 3]), ONES, "sgd", SGDHyper(lr=1.0))
            conn = kv.servers.connections[0]
            conn.idle_timeout = 0.2  # how long a reply is waited for
            with pytest.raises(ServerUnavailableError):
                kv.servers.applying.settle(0)
            assert kv.servers.applying.reads_slot(0), "the server may still read the slot"
            release.set()
            conn.idle_timeout = cfg.timeout_s
            assert in_step(kv, 0), "the early answer was taken as the Hello's"
            assert kv.pull("t", np.array([1, 3])).tolist() == [[-1, -1], [-1, -1]]
        finally:
            release.set()
            kv.close(goodbye=False)


def test_closing_beside_a_stalled_update_says_goodbye_to_the_other_servers(stalled):
    """Server 0 still applies an update when the trainer closes and stops waiting for
    it; server 1 still hears the trainer's goodbye (it ends the job there)."""
    cfg = parse_cluster_config(cluster_dict(2, shared_memory=True, timeout_s=20.0))
    with serving(cfg) as stops:
        kv = RemoteKVClient(cfg, 0)
        kv.init_data("w", (10, 2), "float32", range_policy(10, 2))
        kv.init_optimizer("w", "sgd", {})
        kv.pull("w", np.arange(10))  # both mapped
        kv.push_update("w", np.array([1]), ONES[:1], "sgd", SGDHyper(lr=1.0))
        for conn in kv.servers.connections:
            conn.idle_timeout = 0.3
        kv.close()
        assert stops[1].wait(10), "server 1 never heard the goodbye"
        assert kv.servers.closed
        stalled.set()
