"""Frames and messages: round trips, and hostile bytes that a server must survive."""
import json
import os
import socket
import struct
import threading

import numpy as np
import pytest

from distemb.errors import (KVStoreError, PartitionError, ServerUnavailableError,
                            TransportError)
from distemb.partition import range_policy
from distemb.transport.base import HEADER, MAGIC, VERSION, EarlyReply, Frame, encode_head
from distemb.transport.messages import (Error, Pull, Push, Reply, Service, Update,
                                       decode_request)
from distemb.transport.tcp import TcpConnection

pytestmark = pytest.mark.timeout(60)


def pair():
    a, b = socket.socketpair()
    return TcpConnection(a, timeout=5), TcpConnection(b, timeout=5)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "int8",
                                   "uint8", "bool"])
def test_frame_round_trip_keeps_dtype_shape_and_bytes(dtype):
    a, b = pair()
    arr = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)
    a.send(Frame(Service.PUSH, "näme", {"parts": [1], "x": 2.5}, [arr, arr[:0]], flags=1))
    f = b.recv()
    assert (f.service, f.name, f.fields, f.flags) == (Service.PUSH, "näme",
                                                      {"parts": [1], "x": 2.5}, 1)
    assert f.arrays[0].dtype == arr.dtype and f.arrays[1].shape == (0, 3, 4)
    np.testing.assert_array_equal(f.arrays[0], arr)


def test_large_payload_arrives_intact():
    a, b = pair()
    arr = np.random.default_rng(0).standard_normal((3000, 128)).astype(np.float32)
    t = threading.Thread(target=a.send, args=(Frame(Service.PULL, arrays=[arr]),))
    t.start()
    got = b.recv().arrays[0]
    t.join()
    np.testing.assert_array_equal(got, arr)


def tcp_pair():
    """Two TcpConnections over TCP on 127.0.0.1 (socketpair's Unix socket reads exactly)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return TcpConnection(a, timeout=5), TcpConnection(b, timeout=5)


def test_tcp_frames_back_to_back_and_dribbled_arrive_whole():
    a, b = tcp_pair()
    rng = np.random.default_rng(0)
    frames = [Frame(Service.PULL, f"t{i}", {"i": i}, [
        rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(0, 40_000, k)])
        for i, k in enumerate(rng.integers(0, 5, 60))]
    t = threading.Thread(target=lambda: [a.send(f) for f in frames])
    t.start()  # many frames in one read: the bytes past a frame are the next one's
    for f in frames:
        got = b.recv()
        assert (got.name, got.fields, len(got.arrays)) == (f.name, f.fields, len(f.arrays))
        for x, y in zip(got.arrays, f.arrays):
            np.testing.assert_array_equal(x, y)
    t.join()
    f = frames[7]
    data = encode_head(f) + b"".join(x.tobytes() for x in f.arrays)
    t = threading.Thread(target=lambda: [a.sock.sendall(data[i:i + 7])
                                         for i in range(0, len(data), 7)])
    t.start()  # a frame in pieces of 7 bytes
    got = b.recv()
    t.join()
    assert got.name == f.name and all(np.array_equal(x, y) for x, y in
                                      zip(got.arrays, f.arrays))
    a.close()
    with pytest.raises(ServerUnavailableError, match="connection lost"):
        b.recv()


def raw_header(service=Service.PULL, name_len=0, num_arrays=0, fields_len=0, payload=0,
               magic=MAGIC, version=VERSION):
    return HEADER.pack(magic, version, service, 0, name_len, num_arrays, fields_len, payload)


@pytest.mark.parametrize("data,match", [
    (raw_header(magic=b"EVIL"), "bad magic"),
    (raw_header(version=9), "protocol version 9"),
    (raw_header(payload=1 << 62), "over the limit"),
    (raw_header(name_len=5000), "over the limits"),
    (raw_header(num_arrays=1, payload=8) + struct.pack("<BB", 99, 1) + struct.pack("<Q", 1),
     "unknown dtype code 99"),
    (raw_header(num_arrays=1, payload=8) + struct.pack("<BB", 1, 1) + struct.pack("<Q", 1 << 40),
     "needs more bytes"),
    (raw_header(num_arrays=1, payload=16) + struct.pack("<BB", 1, 1) + struct.pack("<Q", 2),
     "arrays hold 8 bytes"),
    (raw_header(name_len=2) + b"\xff\xfe", "UTF-8"),
    (raw_header(fields_len=2) + b"[]", "JSON object"),
])
def test_malformed_frames_are_rejected_before_allocation(data, match):
    a, b = pair()
    a.sock.sendall(data)
    with pytest.raises(TransportError, match=match):
        b.recv()


@pytest.mark.parametrize("frame,match", [
    (Frame(77), "unknown request service id 77"),
    (Frame(Service.PULL, "w", {"parts": [0]}, [np.arange(2)]), "Pull.counts"),
    (Frame(Service.PULL, "w", {"parts": [0], "counts": [3]}, [np.arange(2)]), "Pull.ids"),
    (Frame(Service.PULL, "w", {"parts": [0], "counts": ["x"]}, [np.arange(2)]), "Pull.counts"),
    (Frame(Service.PULL, "w", {"parts": [0, 0], "counts": [1, 1]}, [np.arange(2)]), "unique"),
    (Frame(Service.UPDATE, "w", {"rule": "sgd", "hyper": {"lr": "x"}, "seq": 1, "exact": False,
                                 "parts": [0], "counts": [1]},
           [np.arange(1), np.ones((1, 2), np.float32)]), "Update.hyper"),
    # issue 37: a 2-d ``have`` got past the decode and failed deep in the handler
    (Frame(Service.VERSIONED_PULL, "w", {"parts": [0], "counts": [2], "states": []},
           [np.arange(2), np.zeros((2, 1), np.int64)]),
     r"VersionedPull.have: expected int64 of shape \(2,\), got int64 \(2, 1\)"),
    (Frame(Service.VERSIONED_PULL, "w", {"parts": [0], "counts": [2], "states": []},
           [np.arange(2), np.zeros((2, 0), np.int64)]), "VersionedPull.have"),
])
def test_invalid_messages_are_rejected(frame, match):
    with pytest.raises(TransportError, match=match):
        decode_request(frame)


def test_message_encode_decode_round_trip():
    m = Update(name="w", rule="adagrad", hyper={"clr": 0.1, "eps": 1e-10}, seq=3, exact=True,
               parts=[0, 2], counts=[1, 1], ids=np.array([4, 0]),
               grads=np.ones((2, 3), np.float32))
    d = decode_request(m.encode())
    assert (d.rule, d.hyper, d.seq, d.exact, d.parts) == ("adagrad", m.hyper, 3, True, [0, 2])


HOSTILE = [
    os.urandom(4096),
    raw_header(payload=1 << 62),
    raw_header(num_arrays=1, payload=8) + struct.pack("<BB", 200, 1) + struct.pack("<Q", 1),
    raw_header(num_arrays=1, payload=1 << 29) + struct.pack("<BB", 1, 1)
    + struct.pack("<Q", 1 << 27) + b"short",  # promises 512 MiB, then hangs up
    raw_header(service=250) + b"",
    raw_header(fields_len=9) + b'{"a":[[[[',
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("data", HOSTILE, ids=["random", "huge", "dtype", "short", "service",
                                                "json"])
def test_server_survives_hostile_frames_and_serves_others(clusters, data):
    cluster = clusters("tcp")
    kv = cluster.client()
    try:
        kv.init_data("h", (4, 2), "float32", range_policy(4, 2))
        entry = cluster.cfg.servers[0]
        with socket.create_connection((entry.host, entry.port), timeout=10) as evil:
            evil.sendall(data)
            try:
                evil.shutdown(socket.SHUT_WR)
            except OSError:  # the server already closed on us (ENOTCONN): allowed
                pass
            reply = b""
            try:
                while chunk := evil.recv(65536):
                    reply += chunk
            except ConnectionResetError:
                pass  # closed with our junk unread: a reset, which is allowed
        if reply:  # an error frame, never a crash or silence on a half-read stream
            assert reply[:4] == MAGIC and reply[5] == Service.ERROR
        kv.push("h", np.array([0, 3]), np.ones((2, 2), np.float32))
        assert kv.pull("h", np.array([0, 3])).tolist() == [[1.0, 1.0]] * 2
    finally:
        kv.delete_data("h")
        kv.close(goodbye=False)


@pytest.mark.multiprocess
def test_bad_request_gets_error_reply_and_connection_goes_on(clusters):
    """Ids out of range and unknown tables: error replies on a connection that stays usable."""
    kv = clusters("tcp").client()
    try:
        kv.init_data("r", (4, 2), "float32", range_policy(4, 2))
        conn = kv.servers.connections[0]
        conn.send(Pull(name="r", parts=[0], counts=[1], ids=np.array([99])).encode())
        err = conn.recv()
        assert err.service == Service.ERROR and "ids of shard 0 of 'r': id 99 is out of range" \
            in err.fields["message"]
        conn.send(Pull(name="zz", parts=[0], counts=[1], ids=np.array([0])).encode())
        assert "no shard 0 of 'zz'" in conn.recv().fields["message"]
        conn.send(Pull(name="r", parts=[1], counts=[1], ids=np.array([0])).encode())
        assert "server 0 has no shard 1 of 'r'" in conn.recv().fields["message"]
        with pytest.raises(PartitionError, match="id 4 is out of range"):
            kv.pull("r", np.array([4]))
        assert kv.pull("r", np.array([1, 2])).shape == (2, 2)
    finally:
        kv.delete_data("r")
        kv.close(goodbye=False)


@pytest.mark.multiprocess
def test_server_errors_reach_the_user_as_the_same_type_from_every_request(clusters):
    """Pulls, pushes and updates share one send-then-collect routine: one error mapping."""
    kv = clusters("tcp").client()
    try:
        kv.init_data("m", (4, 2), "float32", range_policy(4, 2))
        bad = dict(name="m", parts=[0], counts=[1], ids=np.array([99]))
        requests = [Pull(**bad), Push(**bad, values=np.ones((1, 2), np.float32)),
                    Update(**bad, rule="sgd", hyper={"lr": 1.0}, seq=1, exact=False,
                           grads=np.ones((1, 2), np.float32))]
        kv.init_optimizer("m", "sgd", {})
        for msg in requests:
            with pytest.raises(PartitionError,
                               match="ids of shard 0 of 'm': id 99 is out of range"):
                kv._call({0: msg})
        assert kv.pull("m", np.array([3])).shape == (1, 2)  # the connection stayed in step
    finally:
        kv.delete_data("m")
        kv.close(goodbye=False)
    with pytest.raises(KVStoreError, match="this RemoteKVClient is closed"):
        kv.pull("m", np.array([0]))


def test_fields_are_json_not_pickle():
    head = encode_head(Frame(Service.HELLO, fields={"rank": 0}))
    assert json.loads(head[HEADER.size:]) == {"rank": 0}


def test_an_early_reply_answered_in_one_frame_is_its_error_else_its_early_frame():
    """A transport that answers once (MPI) finishes an early reply first: the peer gets
    the error its work sent, or the early frame when the work succeeded (told or not)."""
    early = Reply(fields={"applying": 3}).encode()
    quiet = EarlyReply(early, lambda send: None)
    told = EarlyReply(early, lambda send: send(Reply().encode()))
    failed = EarlyReply(early, lambda send: send(Error(kind="MemoryError",
                                                         message="no room").encode()))
    assert quiet.whole() is early and told.whole() is early
    got = failed.whole()
    assert got.service == Service.ERROR and got.fields["message"] == "no room"
