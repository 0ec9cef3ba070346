"""Co-located writes through shared memory: request slots, their reader, and the client path.

A trainer on the machine of the owning server writes an update's (or a push's) arrays into
its request slot, a sealed memory file whose descriptor its first InShm frame carries over
the server's local socket; the server maps it, views the arrays in place and applies the
request. The oracle is the reference update rule (and plain TCP). Descriptors that are
not sealed memory files of the declared size are refused before they are mapped.
"""
import fcntl
import gc
import mmap
import os
import socket
import subprocess
import tempfile

import numpy as np
import pytest

from mp_helper import memory_files, shm_files

from distemb.stores.dense import DenseSpec
from distemb.errors import PartitionError, TransportError
from distemb.kernels import reference
from distemb.kvstore.remote import RemoteKVClient
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.server.service import KVService
from distemb.partition import range_policy
from distemb.rules import AdagradHyper, SGDHyper
from distemb.stores.file import FileTableSpec
from distemb.stores.spec import HashTableSpec
from distemb.transport.base import Connection, Session
from distemb.transport.connections import local_address, open_connections
from distemb.transport.messages import Create, InShm, Push, Service
from distemb.transport.shm import SEALS, ShmArena, attach
from distemb.transport.slots import RequestSlot, SlotReader

pytestmark = pytest.mark.timeout(60)


def sealed(size, seals=SEALS, flags=os.MFD_ALLOW_SEALING):
    """A memory file of ``size`` bytes with ``seals`` (a read-write descriptor)."""
    fd = os.memfd_create("test-slot", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_slot_round_trip_then_growth_hands_over_a_new_file():
    slot = RequestSlot("job", 3, 1)
    ids = np.array([5, 1, 9], np.int64)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    layout = slot.write([ids, rows])
    fd = slot.take_fd()
    assert fd is not None and slot.take_fd() is None  # handed over once
    reader = SlotReader(fd, slot.size)
    got = reader.arrays(slot.size, layout)
    np.testing.assert_array_equal(got[0], ids)
    np.testing.assert_array_equal(got[1], rows)
    # ids are copied out of the slot (checked and used as one value: the trainer cannot
    # swap a checked id for another before the server indexes with it); rows stay in it
    slot_ids = np.ndarray(ids.shape, ids.dtype, buffer=slot._map, offset=layout[0][2])
    slot_ids[0] = 1 << 40  # the trainer writes its slot after the server read it
    assert got[0].tolist() == [5, 1, 9]
    slot._map[layout[1][2]:layout[1][2] + 4] = np.frombuffer(np.float32(7).tobytes(), np.uint8)
    assert got[1][0, 0] == 7  # the float rows are read in place (no copy)
    first = slot.size
    big = np.ones((1 << 18, 8), np.float32)  # 8 MiB: past the first file's size
    layout2 = slot.write([ids, big])
    assert slot.size > first
    with pytest.raises(TransportError, match="the frame says"):
        reader.arrays(slot.size, layout2)  # the server has not been given the new file
    reader = SlotReader(slot.take_fd(), slot.size)
    np.testing.assert_array_equal(reader.arrays(slot.size, layout2)[1], big)
    slot.close()
    reader.close()


@pytest.mark.parametrize("layout,match", [
    ([[99, [1], 0]], "invalid descriptor"),
    ([[4, [1], 8]], "invalid descriptor"),        # not aligned
    ([[4, [-1], 0]], "invalid descriptor"),
    ([[4, [1 << 40], 0]], "past the end"),
    ([[4, [1 << 40, 1 << 40, 1 << 40], 0]], "past the end"),  # no int64 overflow
    ("nope", "expected a list"),
])
def test_slot_reader_rejects_hostile_layouts(layout, match):
    slot = RequestSlot("job", 0, 0)
    slot.write([np.arange(4)])
    reader = SlotReader(slot.take_fd(), slot.size)
    with pytest.raises(TransportError, match=match):
        reader.arrays(slot.size, layout)
    with pytest.raises(TransportError, match="the frame says"):
        reader.arrays(slot.size + 64, [[4, [1], 0]])
    slot.close()


def hostile_fd(kind, tmp):
    """(descriptor, size to declare) of each kind of hostile descriptor."""
    size = 1 << 16
    if kind == "disk file":
        fd = os.open(os.path.join(tmp, "f"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
    elif kind == "/dev/shm file":
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="test-harden-")
        os.unlink(path)
        os.ftruncate(fd, size)
    elif kind == "unsealed memfd":
        fd = sealed(size, 0)
    elif kind == "memfd that cannot be sealed":
        fd = sealed(size, 0, flags=0)
    elif kind == "memfd sealed against shrinking only":
        fd = sealed(size, fcntl.F_SEAL_SHRINK)
    elif kind == "memfd that can still be unsealed":
        fd = sealed(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    elif kind == "sealed memfd, declared larger":
        fd, size = sealed(size), size + 64
    elif kind == "sealed memfd, declared smaller":
        fd, size = sealed(size), size - 64
    elif kind == "empty sealed memfd":
        fd, size = sealed(0), 0
    elif kind == "huge-page memfd":
        fd = os.memfd_create("test-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size := 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    elif kind == "O_PATH of a sealed memfd":
        inner = sealed(size)
        fd = os.open(f"/proc/self/fd/{inner}", os.O_PATH)
        os.close(inner)
    elif kind == "write-only sealed memfd":
        inner = sealed(size)
        fd = os.open(f"/proc/self/fd/{inner}", os.O_WRONLY)
        os.close(inner)
    elif kind == "directory":
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    elif kind == "pipe":
        fd, w = os.pipe()
        os.close(w)
    elif kind == "socket":
        a, b = socket.socketpair()
        fd = a.detach()
        b.close()
    elif kind == "/dev/zero":
        fd = os.open("/dev/zero", os.O_RDONLY)
    elif kind == "eventfd":
        fd = os.eventfd(0)
    return fd, size


HOSTILE_FDS = {
    "disk file": "cannot be sealed|seals 0x1$", "/dev/shm file": "seals 0x1$",
    "unsealed memfd": "seals 0x0$", "memfd that cannot be sealed": "seals 0x1$",
    "memfd sealed against shrinking only": "seals 0x2$",
    "memfd that can still be unsealed": "seals 0x6$",
    "sealed memfd, declared larger": "has 65536 bytes, the peer declared 65600",
    "sealed memfd, declared smaller": "has 65536 bytes, the peer declared 65472",
    "empty sealed memfd": "expected 1..", "huge-page memfd": "pages of 2097152 bytes",
    "O_PATH of a sealed memfd": "cannot be sealed", "write-only sealed memfd": "cannot map",
    "directory": "got a directory", "pipe": "got a pipe", "socket": "got a socket",
    "/dev/zero": "got a character device", "eventfd": "got an anonymous or special file",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_FDS))
def test_a_descriptor_that_is_not_a_sealed_slot_of_its_size_is_refused(tmp_path, kind):
    """Only a memory file sealed against shrinking, growing and unsealing, of exactly the
    declared size, is mapped: nothing else can shrink under the server (no SIGBUS) or
    block it; the descriptor is closed either way."""
    fd, size = hostile_fd(kind, str(tmp_path))
    with pytest.raises(TransportError, match=HOSTILE_FDS[kind]):
        SlotReader(fd, size)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the reader
    if kind.startswith("sealed memfd"):  # the shard side checks the same way
        with pytest.raises(TransportError, match="has 65536 bytes"):
            attach(sealed(1 << 16), (2, (size - 64) // 8), "float32")


def test_a_sealed_slot_cannot_shrink_or_grow_under_the_server():
    """The truncation race of issue 18 cannot happen: the trainer's own descriptor may
    not shrink or grow the file once it is sealed (the kernel says EPERM)."""
    slot = RequestSlot("job", 0, 0)
    layout = slot.write([np.arange(1 << 15, dtype=np.int64)])
    ro = slot.take_fd()
    rw = os.open(f"/proc/self/fd/{ro}", os.O_RDWR)  # as a hostile trainer would
    reader = SlotReader(ro, slot.size)
    for size in (0, 4096, slot.size + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(rw, size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(rw, fcntl.F_ADD_SEALS, 0)  # nor remove or change the seals (F_SEAL_SEAL)
    assert os.fstat(rw).st_size == slot.size
    assert reader.arrays(slot.size, layout)[0][-1] == (1 << 15) - 1
    os.close(rw)
    slot.close()
    reader.close()


def test_server_without_shared_memory_rejects_in_shm_requests():
    svc = KVService(KVServer(), 0, 1, 1)
    frame = InShm(name="w", service=int(Service.PUSH), fields={"parts": [0], "counts": [1]},
                  size=4096, layout=[]).encode()
    reply = svc.handle(frame)
    assert reply.service == Service.ERROR and "shared memory off" in reply.fields["message"]


def test_server_applies_pushes_from_a_slot_handed_over_once():
    arena = ShmArena("jobx", 0)
    svc = KVService(KVServer(), 0, 1, 1, arena=arena)
    svc.handle(Create.of_spec("w", DenseSpec((4, 2))).encode())
    slot, session = RequestSlot("jobx", 0, 0), Session(peer="test", trusted=True)

    def push(ids, values, hand_over=True):
        msg = Push(name="w", parts=[0], counts=[len(ids)], ids=np.array(ids),
                   values=np.array(values, np.float32)).encode()
        layout = slot.write(msg.arrays)
        frame = InShm(name="w", service=msg.service, fields=msg.fields, size=slot.size,
                      layout=layout).encode()
        fd = slot.take_fd()
        if fd is not None:
            frame.fds.append(fd) if hand_over else os.close(fd)
        return svc.handle(frame, session)
    assert push([3, 1], [[1, 2], [3, 4]], hand_over=False).service == Service.ERROR
    assert session.slot is None  # no slot on this connection yet: nothing read
    slot, session = RequestSlot("jobx", 0, 0), Session(peer="test", trusted=True)
    assert push([3, 1], [[1, 2], [3, 4]]).service == Service.REPLY
    assert push([0], [[5, 6]]).service == Service.REPLY  # the same slot, no descriptor
    assert svc.server.shard("w", 0).tolist() == [[5, 6], [3, 4], [0, 0], [1, 2]]
    session.close()
    slot.close()
    arena.close()


class Recording(Connection):
    """A real connection that also records the service, payload and descriptors of each
    frame sent."""

    def __init__(self, conn):
        self.conn, self.peer, self.sent = conn, conn.peer, []
        self.passes_fds = conn.passes_fds

    def send(self, frame):
        self.sent.append((frame.service, sum(a.nbytes for a in frame.arrays)))
        self.conn.send(frame)

    def recv(self, timeout=None):
        return self.conn.recv(timeout)

    def pending(self):
        return self.conn.pending()

    def close(self):
        self.conn.close()


def connect(cfg):
    conns = [Recording(c) for c in open_connections(cfg, rank=0)]
    assert all(c.passes_fds for c in conns), [c.peer for c in conns]  # local sockets
    return conns


def fence(kv):
    """A synchronous request to every server: each connection's earlier (asynchronous)
    requests have been applied once it returns (a server serves a connection in order)."""
    kv.init_data("fence", (2, 1), "float32", range_policy(2, 2))
    kv.delete_data("fence")


@pytest.mark.multiprocess
@pytest.mark.parametrize("consistency", ["sync", "async"])
def test_colocated_updates_travel_in_shared_memory(clusters, consistency):
    """sync: updates and pushes go as InShm frames with no payload; async: in the frame.
    Nothing of the job is in /dev/shm, even with a link planted where the old named
    files went: no path is ever opened."""
    cluster = clusters("tcp_shm")
    job = cluster.cfg.job_id
    planted = tempfile.NamedTemporaryFile(prefix="test-harden-target-")
    planted.write(b"someone else's")
    planted.flush()
    link = f"/dev/shm/distemb-p{os.getpid()}-{job}-t0-s0-0123456789ab-0"
    os.symlink(planted.name, link)
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
        # the rows were read from the servers' memory files, mapped here read-only
        mapped = memory_files(os.getpid(), job)
        assert any("-s0-" in m for m in mapped) and any("-s1-" in m for m in mapped), mapped
        assert [f for f in shm_files(job) if f != os.path.basename(link)] == []
        with open(planted.name, "rb") as f:
            assert f.read() == b"someone else's"
    finally:
        os.unlink(link)
        planted.close()
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
    dyn = kv
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


@pytest.mark.multiprocess
def test_colocated_file_table_rows_are_read_in_place(clusters, tmp_path):
    """A file table's rows never move: a co-located trainer maps each server's file
    read-only, beside a seqlock counter in a memory file, and a lookup sends nothing;
    updates still go in the request slot. The oracle is the reference rule on a copy of
    the rows. Dropping the table frees the counters' memory files."""
    cluster = clusters("tcp_shm")
    conns = connect(cluster.cfg)
    kv = RemoteKVClient(cluster.cfg, 0, connections=conns, consistency="sync")
    rows, d = 40, 4
    rng = np.random.default_rng(8)
    try:
        kv.create_table("f", FileTableSpec(str(tmp_path / "f"), num_rows=rows, dim=d))
        assert sorted(k for k in kv.servers.mapped if k[0] == "f") == [("f", 0), ("f", 1)]
        weight = rng.standard_normal((rows, d)).astype(np.float32)
        kv.push("f", np.arange(rows), weight)
        kv.init_optimizer("f", "adagrad", {"initial_accumulator_value": 0.0})
        state = np.zeros_like(weight)
        hyper = AdagradHyper(clr=0.1, eps=1e-10)
        for conn in conns:
            conn.sent.clear()
        for _ in range(5):
            ids = rng.integers(0, rows, 30)  # duplicates, on both servers
            np.testing.assert_array_equal(kv.pull("f", ids), weight[ids])
            pos = np.unique(ids)  # an update's ids come coalesced
            grads = rng.standard_normal((len(pos), d)).astype(np.float32)
            kv.push_update("f", pos, grads, "adagrad", hyper)
            reference.adagrad_update(weight, state, pos, grads, hyper.clr, hyper.eps)
        np.testing.assert_allclose(kv.pull("f", np.arange(rows)), weight, rtol=1e-6,
                                   atol=1e-6)
        sent = {s[0] for conn in conns for s in conn.sent}
        assert Service.PULL not in sent and sent == {Service.IN_SHM}, sent
        with pytest.raises(PartitionError):  # a key outside the table, as over a socket
            kv.pull("f", np.array([rows]))
        mapped = {f for f in memory_files(os.getpid(), cluster.cfg.job_id)
                  if f.startswith(f"distemb-{cluster.cfg.job_id}-s")}  # not its own slots
        assert len(mapped) == 2, mapped  # the two servers' counters, nothing else
    finally:
        kv.delete_data("f")
    assert not [k for k in kv.servers.mapped if k[0] == "f"]
    gc.collect()
    assert not mapped & set(memory_files(os.getpid(), cluster.cfg.job_id))
    for proc in cluster.servers:
        assert not mapped & set(memory_files(proc.pid, cluster.cfg.job_id))
    kv.close(goodbye=False)


def test_a_rows_file_is_mapped_only_as_the_read_only_file_of_the_size_declared(tmp_path):
    """The file of a file table's rows cannot be sealed: a trainer maps it only when it is
    a regular file of this user, opened read-only, of exactly the rows' size (a smaller
    one would fault past its end), and never writable."""
    arena = ShmArena("jobf", 0)
    counter = arena.allocate((0,), "int64")
    path = tmp_path / "weight.bin"
    np.arange(24, dtype=np.float32).tofile(path)

    def rows_fd(flags=os.O_RDONLY):
        return os.open(path, flags)
    shard = attach(arena.dup_segment(counter), (6, 4), "float32", rows_fd())
    assert shard.array[5].tolist() == [20.0, 21.0, 22.0, 23.0] and \
        not shard.array.flags.writeable
    arena.version_of(counter)[0] = 1  # a write under way: no copy is kept
    assert shard.read(lambda a: a[[1]].copy(), tries=2) is None
    arena.version_of(counter)[0] = 2
    assert shard.read(lambda a: a[[1]].copy()).tolist() == [[4.0, 5.0, 6.0, 7.0]]
    r, w = os.pipe()
    os.close(w)
    for fd, want in ((rows_fd(), "has 96 bytes, expected 128"),
                     (rows_fd(os.O_RDWR), "read-only descriptor"),
                     (r, "regular file, got a pipe")):
        with pytest.raises(TransportError, match=want):
            attach(arena.dup_segment(counter), (8 if "128" in want else 6, 4), "float32", fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed, refused or not
    with pytest.raises(TransportError, match="memory file"):  # the counter must be sealed
        attach(rows_fd(), (6, 4), "float32", rows_fd())
    arena.close()


def test_a_shard_handed_to_a_trainer_cannot_be_written_by_it():
    """The descriptor a trainer gets for a shard is read-only: it cannot be mapped
    writable nor written, so only the server writes its rows."""
    arena = ShmArena("jobw", 0)
    arr = arena.allocate((10, 4), "float32")
    fd = arena.dup_segment(arr)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, 64 + arr.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.pwrite(fd, b"x", 64)
    shard = attach(fd, (10, 4), "float32")
    arr[3] = 5
    assert shard.array[3].tolist() == [5.0] * 4 and not shard.array.flags.writeable
    arena.close()


@pytest.mark.multiprocess
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as user nobody")
def test_another_user_cannot_connect_to_a_servers_local_socket(clusters):
    """A process of another user that found the local socket's address (it is visible
    in /proc/net/unix once bound) is refused before it can say anything."""
    cluster = clusters("tcp_shm")
    address = local_address(cluster.cfg, 0)
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(10); "
            "s.connect('\\0' + sys.argv[1][1:]); data = b''\n"
            "while True:\n    b = s.recv(65536)\n    if not b: break\n    data += b\n"
            "print('REFUSED' if b'uid' in data else data)")
    assert address.startswith("\0")  # abstract: passed on without its NUL
    out = subprocess.run(["/usr/bin/python3", "-c", code, "@" + address[1:]], user=65534,
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "REFUSED", (out.stdout, out.stderr)
    kv = cluster.client()  # the job's own trainer still gets in
    assert kv.server_info[0]["shared_memory"]
    kv.close(goodbye=False)
