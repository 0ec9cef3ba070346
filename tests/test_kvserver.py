"""KVServer and KVService on their own: shard ownership, request errors, sync_exact order
(clients: test_kvclient_suite)."""
import numpy as np
import pytest

from distemb.errors import KVStoreError
from distemb.kvstore import KVServer
from distemb.kvstore.server.service import KVService
from distemb.rules import SGDHyper
from distemb.stores.dense import DenseSpec


def _dense(srv, name, shape, parts=(0,)):
    spec = DenseSpec(shape)
    return srv.create_table(name, spec, spec.router(), list(parts))


def test_server_pull_push_update_in_place():
    srv = KVServer(num_threads=2)
    table, = _dense(srv, "w", (4, 2))
    w = table.store.column("weight")
    srv.push("w", 0, np.array([3]), np.ones((1, 2), np.float32))
    srv.update("w", 0, np.array([3]), np.ones((1, 2), np.float32), "sgd", SGDHyper(lr=0.5))
    assert w[3].tolist() == [0.5, 0.5], "the server must update its shard in place"
    assert srv.pull("w", 0, np.array([3, 0])).tolist() == [[0.5, 0.5], [0, 0]]
    srv.drop("w")
    assert not srv.has("w", 0)


def test_server_rejects_unknown_rule_and_shard():
    srv = KVServer()
    _dense(srv, "w", (2, 2))
    with pytest.raises(KVStoreError, match="rule: expected one of"):
        srv.update("w", 0, np.array([0]), np.ones((1, 2), np.float32), "lion", SGDHyper(lr=0.5))
    with pytest.raises(KVStoreError, match="no shard 1 of 'w'"):
        srv.pull("w", 1, np.array([0]))
    with pytest.raises(KVStoreError, match="already exists"):
        _dense(srv, "w", (2, 2))


def _exact_service(num_trainers):
    from distemb.kvstore.server.service import KVService
    from distemb.transport.messages import Create
    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=num_trainers,
                    timeout_s=30)
    svc.handle(Create.of_spec("w", DenseSpec((1, 1))).encode())
    return svc


def _exact_step(svc, arrival, grads, seq=0):
    """Ranks ``arrival`` push step ``seq`` in that order (each one's push buffered before
    the next is sent); returns the replies, in arrival order."""
    import threading

    from distemb.transport.base import Session
    from distemb.transport.messages import Service, Update

    replies, threads = {}, []
    for n, rank in enumerate(arrival):
        frame = Update(name="w", rule="sgd", hyper={"lr": 1.0}, seq=seq, exact=True,
                       parts=[0], counts=[1], ids=np.array([0]),
                       grads=np.full((1, 1), grads[rank], np.float32)).encode()
        t = threading.Thread(target=lambda f=frame, r=rank: replies.__setitem__(
            r, svc.handle(f, Session(peer=f"t{r}", rank=r))))
        t.start()
        threads.append(t)
        while n + 1 < len(arrival) and (not svc.exact_steps.pending() or next(iter(
                svc.exact_steps.pending().values())) <= n):
            threading.Event().wait(0.001)  # wait until this push is buffered
    for t in threads:
        t.join(30)
    assert all(r.service != Service.ERROR for r in replies.values()), replies
    return replies


def test_sync_exact_sums_in_rank_order_whatever_the_arrival_order():
    """Three trainers' gradients of one row: 1 + 2**-24 + 2**-24 rounds to 1 when added
    from rank 0 on, to 1 + 2**-23 from rank 2 on. Every arrival order gives rank order's
    result (a one-process run's order), so runs repeat bit for bit."""
    grads = {0: 1.0, 1: 2.0 ** -24, 2: 2.0 ** -24}
    in_order = np.float32(np.float32(1.0) + np.float32(2.0 ** -24)) + np.float32(2.0 ** -24)
    assert in_order != np.float32(2.0 ** -23) + np.float32(1.0)  # the order matters
    for arrival in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        svc = _exact_service(3)
        _exact_step(svc, arrival, grads)
        assert svc.server.shard("w", 0)[0, 0] == -in_order, arrival


def test_sync_exact_refuses_a_second_push_of_one_rank():
    from distemb.transport.base import Session
    from distemb.transport.messages import Service, Update
    svc = _exact_service(2)
    frame = Update(name="w", rule="sgd", hyper={"lr": 1.0}, seq=0, exact=True, parts=[0],
                   counts=[1], ids=np.array([0]), grads=np.ones((1, 1), np.float32)).encode()
    import threading
    first = threading.Thread(target=svc.handle, args=(frame, Session(peer="a", rank=0)))
    first.start()
    while not svc.exact_steps.pending():
        threading.Event().wait(0.001)
    reply = svc.handle(frame, Session(peer="b", rank=0))
    assert reply.service == Service.ERROR
    assert "rank 0 sent step 0 of 'w' twice" in reply.fields["message"]
    _exact_step(svc, [1], {1: 1.0})  # the real second trainer completes the step
    first.join(30)
    assert svc.server.shard("w", 0)[0, 0] == -2.0


def test_sync_exact_refuses_a_reserved_key_before_it_is_buffered():
    """An exact update naming a key the hash index reserves is refused when it arrives,
    naming the key, and never buffered: the step is the trainers' valid pushes alone. (It
    was buffered, then the whole step failed when it was applied.)"""
    import threading

    from distemb.stores.spec import HashTableSpec
    from distemb.transport.base import Session
    from distemb.transport.messages import Create, Service, Update

    svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=2, timeout_s=30)
    svc.handle(Create.of_spec("d", HashTableSpec(2)).encode())
    svc.server.pull("d", 0, np.array([7, 9, 10]))  # looked up: held, rows of zeros

    def push(rank, ids):
        return Update(name="d", rule="sgd", hyper={"lr": 1.0}, seq=0, exact=True, parts=[0],
                      counts=[len(ids)], ids=np.array(ids, np.int64),
                      grads=np.ones((len(ids), 2), np.float32)).encode()

    for bad in (np.iinfo(np.int64).min, np.iinfo(np.int64).min + 1):
        replies = []
        t = threading.Thread(target=lambda: replies.append(
            svc.handle(push(1, [7, bad]), Session(peer="t1", rank=1))))
        t.start()
        while t.is_alive() and not svc.exact_steps.pending():
            threading.Event().wait(0.001)
        buffered = svc.exact_steps.pending()
        if buffered:  # complete the step, so the thread ends
            svc.handle(push(0, [7]), Session(peer="t0", rank=0))
        t.join(30)
        assert not buffered, f"key {bad} was buffered: {buffered}"
        assert replies[0].service == Service.ERROR
        assert f"{bad} is reserved by the hash table" in replies[0].fields["message"]
    replies = {}
    threads = [threading.Thread(target=lambda r=r: replies.__setitem__(
        r, svc.handle(push(r, [7, 9 + r]), Session(peer=f"t{r}", rank=r)))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r.service == Service.REPLY for r in replies.values()), replies
    assert svc.server.pull("d", 0, np.array([7, 9, 10])).tolist() == \
        [[-2.0, -2.0], [-1.0, -1.0], [-1.0, -1.0]]
