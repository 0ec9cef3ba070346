"""TCP transport (the default): length-prefixed frames over one socket per peer.

Payloads go out as memoryviews of the arrays (``sendmsg``, no pickling, no copy into a
bytes object) and come in with ``recv_into`` straight into preallocated numpy arrays.

Example:
    >>> import numpy as np, socket
    >>> a, b = socket.socketpair()
    >>> ca, cb = TcpConnection(a), TcpConnection(b)
    >>> ca.send(Frame(4, "w", {}, [np.arange(3)]))
    >>> cb.recv().arrays[0].tolist()
    [0, 1, 2]
"""
import errno
import socket
import threading
import time

import numpy as np

from distemb.errors import ServerUnavailableError, TransportError
from distemb.transport.base import (HEADER, MAX_MESSAGE_BYTES, Connection, Frame,
                                    encode_head, parse_body, parse_descriptors,
                                    parse_header, payload_views)
from distemb.transport.messages import Error

_IOV_MAX = 512


class TcpConnection(Connection):
    """Frames over a connected stream socket.

    Args:
        sock: a connected socket.
        timeout: seconds one send or receive may block (None: forever).
        max_bytes: largest payload accepted from the peer.
        peer: a description of the peer for error messages.
    """

    def __init__(self, sock, timeout=None, max_bytes=MAX_MESSAGE_BYTES, peer="peer"):
        self.sock, self.max_bytes, self.peer = sock, max_bytes, peer
        self.timeout = timeout
        sock.settimeout(timeout)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _fail(self, e, doing):
        if isinstance(e, socket.timeout):
            raise ServerUnavailableError(f"{self.peer}: no answer within {self.timeout} s "
                                         f"while {doing}") from None
        raise ServerUnavailableError(f"{self.peer}: connection lost while {doing} "
                                     f"({e})") from None

    def send(self, frame):
        bufs = [memoryview(encode_head(frame))] + payload_views(frame)
        try:
            while bufs:
                sent = self.sock.sendmsg(bufs[:_IOV_MAX])
                while bufs and sent >= len(bufs[0]):
                    sent -= len(bufs[0])
                    bufs.pop(0)
                if sent:
                    bufs[0] = bufs[0][sent:]
        except OSError as e:
            self._fail(e, "sending")

    def _read_into(self, view):
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionResetError("peer closed the connection")
            got += n

    def _read(self, n):
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return bytes(buf)

    def recv(self):
        """The next frame.

        Raises:
            ServerUnavailableError: the peer closed, reset or timed out.
            TransportError: the frame is malformed (the stream cannot be trusted after).
        """
        try:
            header = parse_header(self._read(HEADER.size), self.max_bytes)
            specs = parse_descriptors(self._read, header)
            name, fields = parse_body(self._read(header.name_len),
                                      self._read(header.fields_len))
            arrays = []
            for dtype, shape in specs:
                a = np.empty(shape, dtype=dtype)
                if a.nbytes:
                    self._read_into(memoryview(a).cast("B"))
                arrays.append(a)
        except TransportError:
            raise
        except OSError as e:
            self._fail(e, "receiving")
        return Frame(header.service, name, fields, arrays, header.flags)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def connect(host, port, timeout, max_bytes=MAX_MESSAGE_BYTES, peer=None):
    """Connect to ``host:port``, retrying while the server starts, for up to ``timeout`` s.

    Raises:
        ServerUnavailableError: nothing accepted within ``timeout`` seconds.
    """
    peer = peer or f"{host}:{port}"
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            return TcpConnection(sock, timeout, max_bytes, peer)
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise ServerUnavailableError(f"{peer}: could not connect within {timeout} s "
                                             f"({e})") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def listen(host, port, backlog=128):
    """A listening socket on ``host:port``.

    Raises:
        TransportError: the port is in use or the address cannot be bound.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Lets a restarted server reuse its port while old connections sit in TIME_WAIT;
    # a port another process listens on still fails with EADDRINUSE.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise TransportError(f"port {port} on {host} is already in use") from None
        raise TransportError(f"cannot listen on {host}:{port}: {e}") from None
    sock.listen(backlog)
    return sock


class _InFlight:
    """Requests being answered, so a stopping server first sends the replies it owes."""

    def __init__(self):
        self._n, self._cond = 0, threading.Condition()

    def __enter__(self):
        with self._cond:
            self._n += 1

    def __exit__(self, *exc):
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout):
        with self._cond:
            self._cond.wait_for(lambda: self._n == 0, timeout)


def _serve_connection(conn, handle, inflight):
    """Answer requests on ``conn`` until the peer leaves or sends a malformed frame."""
    try:
        while True:
            try:
                frame = conn.recv()
            except ServerUnavailableError:
                return  # the peer closed or reset: nothing to answer
            except TransportError as e:
                # The stream is out of step after a bad frame: answer, then hang up.
                conn.send(Error(kind=type(e).__name__, message=str(e)).encode())
                return
            with inflight:
                reply = handle(frame)
                if reply is not None:
                    conn.send(reply)
    except TransportError:
        pass  # the peer went away while we answered
    finally:
        conn.close()


def serve(listener, handle, stop, max_bytes=MAX_MESSAGE_BYTES):
    """Accept clients on ``listener`` until ``stop`` (a threading.Event) is set.

    Each client gets a thread that reads frames and sends back ``handle(frame)`` (None:
    no reply). A malformed frame gets an error reply and its connection is closed; other
    clients are unaffected. Replies under way when ``stop`` is set are still sent.
    """
    listener.settimeout(0.1)
    inflight = _InFlight()
    while not stop.is_set():
        try:
            sock, addr = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            if stop.is_set():
                break
            raise
        conn = TcpConnection(sock, None, max_bytes, peer=f"client {addr[0]}:{addr[1]}")
        threading.Thread(target=_serve_connection, args=(conn, handle, inflight),
                         daemon=True).start()
    listener.close()
    inflight.wait_idle(timeout=2.0)
