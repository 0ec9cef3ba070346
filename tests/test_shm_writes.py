"""Co-located writes through shared memory: request slots, their reader, and the client path.

A trainer on the machine of the owning server writes an update's (or a push's) arrays into
its request slot in /dev/shm and sends a small InShm frame; the server views them in place
and applies the request. The oracle is the reference update rule (and plain TCP).
"""
import os

import numpy as np
import pytest

from distemb.errors import TransportError
from distemb.kernels import reference
from distemb.kvstore.remote import RemoteKVClient
from distemb.kvstore.server import KVServer
from distemb.kvstore.service import KVService
from distemb.partition import range_policy
from distemb.rules import AdagradHyper, SGDHyper
from distemb.stores.spec import HashTableSpec
from distemb.transport import tcp
from distemb.transport.base import Connection
from distemb.transport.messages import InShm, Push, Service
from distemb.transport.shm import RequestSlot, ShmArena, SlotReader, create_private

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slot_dir(tmp_path):
    return str(tmp_path)


def test_slot_round_trip_then_growth_remaps(slot_dir):
    slot, reader = RequestSlot("job", 3, 1, slot_dir), SlotReader("job", slot_dir)
    ids = np.array([5, 1, 9], np.int64)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    path, layout = slot.write([ids, rows])
    got = reader.arrays(path, layout)
    np.testing.assert_array_equal(got[0], ids)
    np.testing.assert_array_equal(got[1], rows)
    # ids are copied out of the slot (checked and used as one value: the trainer cannot
    # swap a checked id for another before the server indexes with it); rows stay in it
    slot_ids = np.ndarray(ids.shape, ids.dtype, buffer=slot._map, offset=layout[0][2])
    slot_ids[0] = 1 << 40  # the trainer writes its slot after the server read it
    assert got[0].tolist() == [5, 1, 9]
    slot._map[layout[1][2]:layout[1][2] + 4] = np.frombuffer(np.float32(7).tobytes(), np.uint8)
    assert got[1][0, 0] == 7  # the float rows are read in place (no copy)
    big = np.ones((1 << 18, 8), np.float32)  # 8 MiB: past the first file's size
    path2, layout2 = slot.write([ids, big])
    assert path2 != path and not os.path.exists(path)  # old generation unlinked
    got = reader.arrays(path2, layout2)
    np.testing.assert_array_equal(got[1], big)
    slot.close()
    assert not os.path.exists(path2)


@pytest.mark.parametrize("path,layout,match", [
    ("/etc/passwd", [[4, [1], 0]], "not a request slot"),
    ("{dir}/distemb-p1-otherjob-t0-s0-0123456789ab-0", [[4, [1], 0]], "not a request slot"),
    ("{dir}/distemb-job-t0-s0-0123456789ab-0", [[4, [1], 0]], "not a request slot"),
    ("{slot}", [[99, [1], 0]], "invalid descriptor"),
    ("{slot}", [[4, [1], 8]], "invalid descriptor"),        # not aligned
    ("{slot}", [[4, [-1], 0]], "invalid descriptor"),
    ("{slot}", [[4, [1 << 40], 0]], "past the end"),
    ("{slot}", "nope", "expected a list"),
])
def test_slot_reader_rejects_hostile_paths_and_layouts(slot_dir, path, layout, match):
    slot, reader = RequestSlot("job", 0, 0, slot_dir), SlotReader("job", slot_dir)
    real, _ = slot.write([np.arange(4)])
    with pytest.raises(TransportError, match=match):
        reader.arrays(path.format(dir=slot_dir, slot=real), layout)
    slot.close()


def test_server_without_shared_memory_rejects_in_shm_requests():
    svc = KVService(KVServer(), 0, 1, 1)
    frame = InShm(name="w", service=int(Service.PUSH), fields={"parts": [0], "counts": [1]},
                  path="/dev/shm/x", layout=[]).encode()
    reply = svc.handle(frame)
    assert reply.service == Service.ERROR and "shared memory off" in reply.fields["message"]


def test_server_applies_a_push_from_a_slot(tmp_path):
    arena = ShmArena("jobx", 0, str(tmp_path))
    svc = KVService(KVServer(), 0, 1, 1, arena=arena)
    svc.server.create("w", 0, np.zeros((4, 2), np.float32))
    slot = RequestSlot("jobx", 0, 0, str(tmp_path))
    msg = Push(name="w", parts=[0], counts=[2], ids=np.array([3, 1]),
               values=np.array([[1, 2], [3, 4]], np.float32)).encode()
    path, layout = slot.write(msg.arrays)
    reply = svc.handle(InShm(name="w", service=msg.service, fields=msg.fields, path=path,
                             layout=layout).encode())
    assert reply.service == Service.REPLY
    assert svc.server.shard("w", 0).tolist() == [[0, 0], [3, 4], [0, 0], [1, 2]]
    slot.close()
    arena.close()


class Recording(Connection):
    """A real TCP connection that also records the service and payload of each frame sent."""

    def __init__(self, conn):
        self.conn, self.peer, self.sent = conn, conn.peer, []

    def send(self, frame):
        self.sent.append((frame.service, sum(a.nbytes for a in frame.arrays)))
        self.conn.send(frame)

    def recv(self, timeout=None):
        return self.conn.recv(timeout)

    def close(self):
        self.conn.close()


def connect(cfg):
    return [Recording(tcp.connect(s.host, s.port, cfg.timeout_s)) for s in cfg.servers]


def fence(kv):
    """A synchronous request to every server: each connection's earlier (asynchronous)
    requests have been applied once it returns (a server serves a connection in order)."""
    kv.init_data("fence", (2, 1), "float32", range_policy(2, 2))
    kv.delete_data("fence")


@pytest.mark.multiprocess
@pytest.mark.parametrize("consistency", ["sync", "async"])
def test_colocated_updates_travel_in_shared_memory(clusters, consistency):
    """sync: updates and pushes go as InShm frames with no payload; async: in the frame."""
    cluster = clusters("tcp_shm")
    conns = connect(cluster.cfg)
    kv = RemoteKVClient(cluster.cfg, 0, connections=conns, consistency=consistency)
    try:
        n, d = 50, 8
        rng = np.random.default_rng(3)
        init = rng.standard_normal((n, d)).astype(np.float32)
        kv.init_data("w", (n, d), "float32", range_policy(n, 2))
        kv.push("w", np.arange(n), init)
        kv.init_optimizer("w", "adagrad", {"initial_accumulator_value": 0.0})
        weight, state = init.copy(), np.zeros_like(init)
        hyper = AdagradHyper(clr=0.1, eps=1e-10)
        for conn in conns:
            conn.sent.clear()
        for _ in range(6):
            ids = np.unique(rng.integers(0, n, 30)).astype(np.int64)
            grads = rng.standard_normal((len(ids), d)).astype(np.float32)
            kv.push_update("w", ids, grads, "adagrad", hyper)
            reference.adagrad_update(weight, state, ids, grads, hyper.clr, hyper.eps)
        fence(kv)
        np.testing.assert_allclose(kv.pull("w", np.arange(n)), weight, rtol=1e-6, atol=1e-6)
        sent = [s for conn in conns for s in conn.sent if s[0] in (Service.UPDATE, Service.PUSH, Service.IN_SHM)]
        if consistency == "sync":
            assert sent and all(s == (Service.IN_SHM, 0) for s in sent), sent
        else:
            assert sent and all(s[0] == Service.UPDATE and s[1] > 0 for s in sent), sent
        kv.push("w", np.array([4, 40]), np.full((2, d), 7.0, np.float32))
        assert (kv.pull("w", np.array([40, 4])) == 7.0).all()
        kv.push_update("w", np.array([4]), np.ones((1, d), np.float32), "sgd",
                       SGDHyper(lr=1.0))
        fence(kv)
        assert (kv.pull("w", np.array([4])) == 6.0).all()
    finally:
        for name in kv.names():
            kv.delete_data(name)
        kv.close(goodbye=False)


@pytest.mark.multiprocess
def test_colocated_dynamic_table_writes_travel_in_shared_memory(clusters):
    """A table made from a spec (any int64 key) takes the requests of every table: its
    pushes and updates to a co-located server go in the request slot, as InShm frames with
    no payload; the oracle is the reference rule on a copy of the rows."""
    cluster = clusters("tcp_shm")
    conns = connect(cluster.cfg)
    kv = RemoteKVClient(cluster.cfg, 0, connections=conns, consistency="sync")
    dyn = kv.store_client()
    try:
        d = 4
        rng = np.random.default_rng(5)
        keys = np.array([2 ** 40, -3, 7, 2 ** 62, -(2 ** 50), 11], np.int64)
        init = rng.standard_normal((len(keys), d)).astype(np.float32)
        dyn.create_table("dyn", HashTableSpec(d))
        for conn in conns:
            conn.sent.clear()
        dyn.push("dyn", keys, init)
        dyn.init_optimizer("dyn", "adagrad", {"initial_accumulator_value": 0.0})
        weight, state = init.copy(), np.zeros_like(init)
        hyper = AdagradHyper(clr=0.1, eps=1e-10)
        for _ in range(5):
            pos = np.unique(rng.integers(0, len(keys), 4))
            grads = rng.standard_normal((len(pos), d)).astype(np.float32)
            dyn.push_update("dyn", keys[pos], grads, "adagrad", hyper)
            reference.adagrad_update(weight, state, pos, grads, hyper.clr, hyper.eps)
        np.testing.assert_allclose(dyn.pull("dyn", keys), weight, rtol=1e-6, atol=1e-6)
        sent = [s for conn in conns for s in conn.sent
                if s[0] in (Service.UPDATE, Service.PUSH, Service.IN_SHM)]
        assert len(sent) >= 6 and all(s == (Service.IN_SHM, 0) for s in sent), sent
    finally:
        dyn.delete_data("dyn")
        kv.close(goodbye=False)


def test_shared_memory_files_are_private_to_their_user(slot_dir):
    """Shards and request slots are mode 0600: another local user cannot read a table."""
    arena = ShmArena("jobp", 0, slot_dir)
    arr = arena.allocate((10, 4), "float32")
    slot = RequestSlot("jobp", 0, 0, slot_dir)
    path, _ = slot.write([np.arange(3)])
    for p in (arena.path_of(arr), path):
        assert os.stat(p).st_mode & 0o777 == 0o600, (p, oct(os.stat(p).st_mode))
    slot.close()
    arena.close()


def test_a_file_already_in_a_shared_memory_files_place_is_never_opened(slot_dir):
    planted = os.path.join(slot_dir, "target")
    with open(planted, "w") as f:
        f.write("someone else's")
    os.symlink(planted, os.path.join(slot_dir, "distemb-pX-j-s0-0"))
    with pytest.raises(FileExistsError):
        create_private(os.path.join(slot_dir, "distemb-pX-j-s0-0"))
    assert open(planted).read() == "someone else's"


def test_slot_reader_refuses_links_fifos_and_a_file_truncated_after_mapping(slot_dir):
    """Issue 18's token-holder attacks on a server's slot reader: each is a TransportError
    (an error reply), never a SIGBUS, a blocked thread or a read of another file."""
    reader = SlotReader("jobq", slot_dir)
    slot = RequestSlot("jobq", 0, 0, slot_dir)
    path, layout = slot.write([np.arange(8, dtype=np.int64)])
    assert reader.arrays(path, layout)[0].tolist() == list(range(8))
    # truncated after the server mapped it, then named again with an array further in
    os.truncate(path, 0)
    far = [[layout[0][0], [8], 8192]]
    with pytest.raises(TransportError, match="shrank"):
        reader.arrays(path, far)
    with pytest.raises(TransportError, match="not a non-empty regular file"):
        reader.arrays(path, far)  # and re-opened: empty now
    prefix = os.path.basename(path).rsplit("-", 1)[0]
    secret = os.path.join(slot_dir, "secret")
    np.arange(2048, dtype=np.int64).tofile(secret)
    link = os.path.join(slot_dir, f"{prefix}-7")
    os.symlink(secret, link)
    with pytest.raises(TransportError, match="cannot open"):
        reader.arrays(link, layout)
    fifo = os.path.join(slot_dir, f"{prefix}-8")
    os.mkfifo(fifo)
    with pytest.raises(TransportError, match="not a non-empty regular file"):
        reader.arrays(fifo, layout)  # returns at once: nobody writes the FIFO
    path2, layout2 = RequestSlot("jobq", 1, 0, slot_dir).write([np.arange(3)])
    assert reader.arrays(path2, layout2)[0].tolist() == [0, 1, 2]
    reader.close()
    slot.close()
