"""A server process against hostile peers: forged ranks, strangers without the job's
token, absurd shapes, idle and stalled connections, and a fuzzer of 560 frames built
with the message classes (so they reach validation) plus 140 of raw garbage. The server
must answer each with an error (or a reply), keep serving the real trainers, and exit
only when they say goodbye."""
import io
import re
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

from mp_helper import ProcessGroup, cluster_dict, memory_files, shm_files, write_json

from distemb.layouts import layout_policy
from distemb.stores.dense import DenseSpec
from distemb.config import parse_cluster_config
from distemb.errors import TransportError
from distemb.kvstore.remote import RemoteKVClient
from distemb.partition import range_policy
from distemb.transport.base import HEADER, MAGIC, VERSION, encode_head, parse_descriptors, \
    parse_header
from distemb.transport import tcp
from distemb.transport.connections import local_address
from distemb.transport.messages import (Barrier, Bye, Create, Drop, Hello, OptInit, Pull,
                                        Push, Service, ShmInfo, Update)
from distemb.transport.tcp import TcpConnection

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


class Server:
    """One server process of a 2-trainer job with a token, and its config."""

    def __init__(self, tmp_path, group, **fields):
        self.raw = cluster_dict(1, num_trainers=2, **{"timeout_s": 2.0, **fields})
        self.cfg = parse_cluster_config(self.raw)
        self.proc = group.spawn_servers(write_json(tmp_path / "c.json", self.raw), 1)[0]
        self.real = RemoteKVClient(self.cfg, 0)  # also waits until the server listens
        self.other = RemoteKVClient(self.cfg, 1)  # the second trainer: barriers need both

    def init_data(self, name, rows, dim):
        """Create a table collectively, as both real trainers."""
        t = threading.Thread(target=self.other.init_data,
                             args=(name, (rows, dim), "float32", range_policy(rows)))
        t.start()
        self.real.init_data(name, (rows, dim), "float32", range_policy(rows))
        t.join(30)

    def connect(self, hello_rank=1, token=None, local=False):
        """A connection (over TCP, or the server's local socket), after a Hello."""
        entry = self.cfg.servers[0]
        if local:
            conn = tcp.connect(entry.host, entry.port, 10, peer="fuzzer",
                               local=local_address(self.cfg, 0))
            assert conn.passes_fds, "the server's local socket is not reachable"
        else:
            conn = TcpConnection(socket.create_connection((entry.host, entry.port),
                                                          timeout=10), timeout=10, peer="fuzzer")
        if hello_rank is not None:
            conn.send(Hello(rank=hello_rank, token=self.cfg.job_token if token is None
                            else token).encode())
            assert conn.recv().service == Service.REPLY
        return conn

    def shm_files(self):
        """The job's shared memory: the server's memory files, and any file of the job in
        /dev/shm (there should be none)."""
        return memory_files(self.proc.pid, self.cfg.job_id) + shm_files(self.cfg.job_id)

    def finish(self, group):
        """Both real trainers say goodbye; the server must exit 0 with no traceback."""
        assert self.proc.poll() is None, "the server exited before its trainers left"
        self.real.close()
        self.other.close()
        out = group.wait_all(30)[self.proc.pid]
        assert "Traceback" not in out and "Exception in thread" not in out, out
        assert self.shm_files() == []
        return out


def SpecCreate(name, flags=0, **fields):
    """The Create of table ``name`` from a spec's fields (``spec.fields()``, each one a
    keyword: fuzzers replace them one by one)."""
    return Create(name=name, flags=flags, spec=fields)


def ask(conn, msg):
    """Send ``msg``; the server's answer frame, or None when it hung up."""
    try:
        conn.send(msg.encode() if hasattr(msg, "encode") else msg)
        return conn.recv()
    except TransportError:
        return None


def closed(conn):
    """True once the server has closed ``conn`` (reads EOF or a reset)."""
    try:
        conn.sock.settimeout(10)
        return conn.sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_zero_dim_descriptor_with_a_huge_other_dim_is_rejected_before_allocation():
    header = parse_header(HEADER.pack(MAGIC, VERSION, Service.PULL, 0, 0, 1, 0, 0), 1 << 30)
    stream = io.BytesIO(struct.pack("<BB2Q", 1, 2, 0, (1 << 63) - 1))
    with pytest.raises(TransportError, match="dimension over the limit"):
        parse_descriptors(stream.read, header)


def test_forged_ranks_and_strangers_are_refused(tmp_path):
    with ProcessGroup() as group:
        srv = Server(tmp_path, group)
        # The attack: a Bye for rank -1 from a connection that never said Hello.
        stranger = srv.connect(hello_rank=None)
        err = ask(stranger, Bye(rank=-1))
        assert err.service == Service.ERROR and "before Hello" in err.fields["message"]
        assert closed(stranger)
        # Hello with the wrong token: refused at the handshake.
        outsider = srv.connect(hello_rank=None)
        err = ask(outsider, Hello(rank=1, token="0" * 32))
        assert "wrong job token" in err.fields["message"] and closed(outsider)
        # An insider may only speak for its own rank.
        for msg, match in [(Bye(rank=0), "may only speak for that rank"),
                           (Bye(rank=-1), r"rank: expected 0..1, got -1"),
                           (Barrier(rank=99), r"rank: expected 0..1, got 99"),
                           (Hello(rank=0, token=srv.cfg.job_token), "this connection is rank 1"),
                           (Hello(rank=5, token=srv.cfg.job_token), "expected 0..1, got 5")]:
            conn = srv.connect(hello_rank=1)
            err = ask(conn, msg)
            assert err.service == Service.ERROR and re.search(match, err.fields["message"]), \
                (msg, err.fields)
            assert closed(conn)
        srv.init_data("w", 4, 2)
        srv.real.push("w", np.array([1]), np.ones((1, 2), np.float32))
        assert srv.real.pull("w", np.array([1])).tolist() == [[1.0, 1.0]]
        srv.finish(group)


def test_a_trainer_whose_config_has_no_token_is_told_so_not_a_wrong_token(tmp_path):
    with ProcessGroup() as group:
        srv = Server(tmp_path, group)
        raw = {k: v for k, v in srv.raw.items() if k != "job_token"}
        with pytest.raises(Exception, match=r"Hello: no job token, and this server's job has "
                                            r"one: the process's cluster config has no "
                                            r"job_token") as err:
            RemoteKVClient(parse_cluster_config(raw), 1)
        assert "wrong job token" not in str(err.value)
        srv.finish(group)


def test_tables_the_server_cannot_hold_are_refused_and_leave_no_shared_memory(tmp_path):
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, shared_memory=True)
        conn = srv.connect()
        before = srv.shm_files()
        err = ask(conn, Create.of_spec("overflow", DenseSpec((1 << 41, 1 << 15))))
        assert err.service == Service.ERROR and "more than" in err.fields["message"]
        # 2 TiB on this machine: refused with the bytes asked for and the bytes left.
        err = ask(conn, Create.of_spec("huge", DenseSpec((1 << 32, 128))))
        msg = err.fields["message"]
        assert "needs 2,199,023,255,552 bytes" in msg and "left in" in msg, msg
        # A small first shard and a huge second one: nothing is allocated at all.
        uneven = layout_policy(("range", (0, 10, 10 + (1 << 38))), 10 + (1 << 38))
        err = ask(conn, Create.of_spec("half", DenseSpec((10 + (1 << 38), 4), policy=uneven)))
        assert "needs 4,398,046,511,264 bytes" in err.fields["message"], err.fields
        assert srv.shm_files() == before
        reply = ask(conn, Create.of_spec("ok", DenseSpec((10, 4), "float32")))
        assert reply.service == Service.REPLY and len(srv.shm_files()) == len(before) + 1
        assert ask(conn, Drop(name="ok")).service == Service.REPLY
        srv.finish(group)


def test_idle_and_stalled_connections_time_out(tmp_path):
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, idle_timeout_s=1.0, timeout_s=1.0)
        idle = srv.connect()
        stalled = srv.connect()
        stalled.sock.sendall(HEADER.pack(MAGIC, VERSION, Service.PULL, 0, 0, 0, 0, 0)[:10])
        start = time.monotonic()
        assert closed(idle) and closed(stalled)
        assert time.monotonic() - start < 8
        for kv in (srv.real, srv.other):  # idle too: the server closed theirs as well
            kv.close(goodbye=False)
        srv.real, srv.other = RemoteKVClient(srv.cfg, 0), RemoteKVClient(srv.cfg, 1)
        srv.init_data("w", 2, 2)
        srv.finish(group)


# --- the fuzzer --------------------------------------------------------------------------

BAD_INTS = [-1, -(1 << 62) + 1, (1 << 62) - 1, 1 << 63, 1 << 40, 0, 3]
BAD_VALUES = BAD_INTS + [1.5, "x", None, True, [], {}, [1, -1], [0, 0], [1 << 62] * 3,
                         ["a"], {"lr": "x"}, "A" * 300, [[1]], [0] * 5000]
NAMES = ["", "f", "w~opt~sum", "x" * 300, "\x00\x01", "名前", "f~opt~exp_avg", "zz"]
DTYPES = [np.int64, np.int32, np.float32, np.float64, np.uint8, np.bool_, np.float16]


def _array(rng):
    dt = DTYPES[rng.integers(len(DTYPES))]
    shape = [tuple(rng.integers(0, 5, rng.integers(0, 4))), (0, 1 << 20), (3,), (1, 7)][
        rng.integers(4)]
    a = np.zeros(shape, dt)
    if a.size and np.issubdtype(dt, np.integer):
        a.flat[:] = rng.choice([-1, 0, 1, 2, 1 << 40, np.iinfo(dt).max], a.size)
    return a


def hostile_message(rng):
    """A message of a random request class with some fields and arrays made hostile."""
    valid = {
        Create: dict(spec=DenseSpec((8, 4)).fields()),
        Pull: dict(parts=[0], counts=[2], ids=np.array([0, 1])),
        Push: dict(parts=[0], counts=[1], ids=np.array([0]),
                   values=np.ones((1, 4), np.float32)),
        OptInit: dict(rule="adagrad", options={"initial_accumulator_value": 0.0}, parts=[0]),
        Update: dict(rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10}, seq=1, exact=False,
                     parts=[0], counts=[1], ids=np.array([0]),
                     grads=np.ones((1, 4), np.float32)),
        ShmInfo: dict(parts=[0]), Drop: {},
        Barrier: dict(rank=-1), Bye: dict(rank=99),
        Hello: dict(rank=1, token="wrong-token-wrong-token"),
    }
    cls = list(valid)[rng.integers(len(valid))]
    kw = dict(valid[cls])
    for key in list(kw):
        if rng.random() < 0.4:
            kw[key] = _array(rng) if isinstance(kw[key], np.ndarray) else \
                BAD_VALUES[rng.integers(len(BAD_VALUES))]
    if cls in (Barrier, Bye):  # never this connection's own rank: that would be legitimate
        kw["rank"] = [-1, 0, 2, 99, 1 << 40][rng.integers(5)]
    if cls is Update and kw.get("exact") is True:
        kw["exact"] = "yes"  # a legitimate exact step would wait for the other trainer
    return cls(name=NAMES[rng.integers(len(NAMES))], **kw)


def garbage(rng, msg):
    """Raw bytes: random, or an encoded message with flipped bytes, cut short, or lying."""
    head = encode_head(msg.encode())
    kind = rng.integers(4)
    if kind == 0:
        return rng.bytes(int(rng.integers(1, 200)))
    if kind == 1:
        b = bytearray(head)
        for _ in range(int(rng.integers(1, 6))):
            b[rng.integers(len(b))] = rng.integers(256)
        return bytes(b)
    if kind == 2:
        return head[:rng.integers(1, len(head))]
    b = bytearray(head)  # a header that lies about its lengths
    struct.pack_into("<HHIQ", b, 8, int(rng.integers(0, 1 << 16)), int(rng.integers(0, 9)),
                     int(rng.integers(0, 1 << 17)), int(rng.integers(0, 1 << 31)))
    return bytes(b)


def test_fuzz_700_hostile_frames_then_the_real_trainers_still_work(tmp_path):
    rng = np.random.default_rng(20261123)
    with ProcessGroup() as group:
        srv = Server(tmp_path, group, shared_memory=True)
        srv.init_data("keep", 6, 4)
        srv.real.push("keep", np.arange(6), np.full((6, 4), 2.0, np.float32))
        tried, built, answers = 0, 0, {"error": 0, "reply": 0, "closed": 0}
        conn = srv.connect()
        for i in range(700):
            msg = hostile_message(rng)
            if i % 5 == 4:  # raw garbage: the stream is out of step, the server hangs up
                try:
                    conn.sock.sendall(garbage(rng, msg))
                    conn.sock.shutdown(socket.SHUT_WR)
                    closed(conn)
                except OSError:
                    pass  # the server hung up before reading all of it: allowed
                conn.close()
                answers["closed"] += 1
                conn = srv.connect()
            else:
                built += 1
                frame = ask(conn, msg)
                if frame is None or frame.service == Service.ERROR:
                    answers["error"] += 1
                else:
                    assert frame.service == Service.REPLY
                    answers["reply"] += 1
                if frame is None or closed_after_error(frame):
                    conn.close()
                    conn = srv.connect()
            tried += 1
            assert srv.proc.poll() is None, f"server died at frame {i}: {msg.__dict__}"
        conn.close()
        print(f"fuzz: {tried} hostile frames ({built} built with the message classes), "
              f"answers {answers}")
        assert built >= 500 and answers["error"] > 300
        np.testing.assert_array_equal(srv.real.pull("keep", np.arange(6)),
                                      np.full((6, 4), 2.0, np.float32))
        srv.real.push("keep", np.array([5]), np.zeros((1, 4), np.float32))
        assert srv.real.pull("keep", np.array([5])).tolist() == [[0.0] * 4]
        srv.real.delete_data("keep")
        srv.finish(group)


def closed_after_error(frame):
    """Decode errors and refusals close the connection (see KVService.handle)."""
    return frame.service == Service.ERROR and frame.fields.get("kind") in (
        "TransportError", "RefusedError")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_strangers_who_never_say_hello_neither_stay_nor_starve_a_trainer(tmp_path):
    """Issue 18: 1,030 silent connections made the server answer 'server busy' to a
    trainer, and each stayed for the idle timeout (an hour). Now at most 64 wait for
    their Hello (a newcomer closes the oldest) and each must say it within 10 s."""
    from distemb.transport.tcp import HELLO_TIMEOUT_S, MAX_UNAUTHENTICATED
    with ProcessGroup() as group:
        srv = Server(tmp_path, group)
        entry = srv.cfg.servers[0]
        silent = [socket.create_connection((entry.host, entry.port), timeout=10)
                  for _ in range(2 * MAX_UNAUTHENTICATED + 10)]
        start = time.monotonic()
        conn = srv.connect(hello_rank=0)  # a trainer gets in, and is served
        reply = ask(conn, Pull(name="nothing", parts=[0], counts=[0],
                               ids=np.empty(0, np.int64)))
        assert reply is not None and reply.service == Service.ERROR  # served: no such table
        conn.close()
        for s in silent:  # every stranger is closed, the oldest at once, all in time
            s.settimeout(HELLO_TIMEOUT_S + 10)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - start < HELLO_TIMEOUT_S + 10
        srv.finish(group)
