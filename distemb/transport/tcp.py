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
import collections
import errno
import logging
import socket
import threading
import time

import numpy as np

from distemb.errors import ServerUnavailableError, TransportError
from distemb.transport.base import (HEADER, MAX_MESSAGE_BYTES, Connection, Frame, Session,
                                    encode_head, parse_body, parse_descriptors,
                                    parse_header, payload_views)
from distemb.transport.messages import Error

_IOV_MAX = 512
MAX_CONNECTIONS = 1024  # per server: a connection storm cannot exhaust threads
#: Seconds a new connection has for its first frame, which must be its Hello (a
#: trainer's client says Hello as it connects): a peer that never does is closed then,
#: not after the idle timeout.
HELLO_TIMEOUT_S = 10.0
#: Connections still waiting for their Hello, at most. Past it the oldest of them is
#: closed to admit the newcomer, so strangers can hold neither the connection slots nor
#: the door: a trainer's connection is authenticated within a round trip of opening.
MAX_UNAUTHENTICATED = 64
#: Largest array payload of a frame before the connection's Hello (a Hello has none).
MAX_HELLO_BYTES = 4096
log = logging.getLogger("distemb")


class TcpConnection(Connection):
    """Frames over a connected stream socket.

    Args:
        sock: a connected socket.
        timeout: seconds one send, or the rest of a frame once it began, may take (None:
            forever).
        max_bytes: largest payload accepted from the peer.
        peer: a description of the peer for error messages.
        idle_timeout: seconds to wait for the first byte of the next frame (default:
            ``timeout``); a server sets it so an idle peer cannot hold a thread forever.
    """

    def __init__(self, sock, timeout=None, max_bytes=MAX_MESSAGE_BYTES, peer="peer",
                 idle_timeout=None):
        self.sock, self.max_bytes, self.peer = sock, max_bytes, peer
        self.timeout = timeout
        self.idle_timeout = timeout if idle_timeout is None else idle_timeout
        sock.settimeout(timeout)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _fail(self, e, doing, timeout=None):
        if isinstance(e, socket.timeout):
            raise ServerUnavailableError(f"{self.peer}: no answer within "
                                         f"{timeout or self.timeout} s while {doing}") from None
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

    def recv(self, timeout=None):
        """The next frame; ``timeout`` (s) overrides the wait for its first byte.

        Raises:
            ServerUnavailableError: the peer closed, reset or timed out.
            TransportError: the frame is malformed (the stream cannot be trusted after).
        """
        head = bytearray(HEADER.size)
        view = memoryview(head)
        idle = self.idle_timeout if timeout is None else timeout
        try:
            if idle != self.timeout:  # wait for a frame, then read it briskly
                self.sock.settimeout(idle)
                try:
                    got = self.sock.recv_into(view)
                finally:
                    self.sock.settimeout(self.timeout)
                if got == 0:
                    raise ConnectionResetError("peer closed the connection")
                view = view[got:]
        except OSError as e:
            self._fail(e, "waiting for a frame", idle)
        try:
            self._read_into(view)
            header = parse_header(bytes(head), self.max_bytes)
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
        except Exception as e:  # anything else a hostile frame provokes is its fault
            raise TransportError(f"frame from {self.peer}: cannot decode "
                                 f"({type(e).__name__}: {e})") from None
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


def _refuse(conn, e):
    """Send an error frame for ``e`` if the peer still listens; never raise."""
    try:
        conn.send(Error(kind=type(e).__name__, message=str(e)[:4096]).encode())
    except Exception:  # the peer is gone or stuck: nothing more to tell it
        pass


class _Doorway:
    """The connections that have not completed their Hello yet, oldest first."""

    def __init__(self, cap, hello_timeout):
        self.cap, self.hello_timeout = cap, hello_timeout
        self._lock = threading.Lock()
        self._waiting = collections.OrderedDict()  # id(conn) -> conn

    def enter(self, conn):
        """Admit ``conn``; past the cap, shut the oldest waiting one (its thread ends)."""
        with self._lock:
            self._waiting[id(conn)] = conn
            oldest = self._waiting.popitem(last=False)[1] if \
                len(self._waiting) > self.cap else None
        if oldest is not None:
            log.info("%s: closed unauthenticated to admit a newer connection", oldest.peer)
            try:
                oldest.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # it went away meanwhile

    def leave(self, conn):
        """``conn`` said Hello (or closed)."""
        with self._lock:
            self._waiting.pop(id(conn), None)


def _serve_connection(conn, handle, inflight, slots, doorway):
    """Answer requests on ``conn`` until the peer leaves, idles out, sends a malformed
    frame or fails its handshake. Never raises: one client cannot kill the server."""
    session = Session(peer=conn.peer)
    max_bytes = conn.max_bytes
    try:
        while not session.closing:
            waiting = session.rank is None and not session.trusted
            # Before its Hello a peer may send small frames only: 64 strangers must not
            # make the server buffer 64 frames of max_message_bytes.
            conn.max_bytes = min(max_bytes, MAX_HELLO_BYTES) if waiting else max_bytes
            try:
                frame = conn.recv(min(doorway.hello_timeout, conn.idle_timeout or
                                      doorway.hello_timeout) if waiting else None)
            except ServerUnavailableError as e:
                log.debug("%s", e)  # closed, reset, or idle past the limit
                return
            except Exception as e:
                # The stream is out of step after a bad frame: answer, then hang up.
                log.info("%s: malformed frame, closing: %s", conn.peer, e)
                _refuse(conn, e)
                return
            with inflight:
                reply = handle(frame, session)
                if reply is not None:
                    conn.send(reply)
            if waiting and session.rank is not None:
                doorway.leave(conn)
    except TransportError:
        pass  # the peer went away while we answered
    except Exception:  # a handler bug: log it, drop this client, keep serving the others
        log.exception("%s: request handler failed", conn.peer)
    finally:
        doorway.leave(conn)
        conn.close()
        slots.release()


def serve(listener, handle, stop, max_bytes=MAX_MESSAGE_BYTES, timeout=None,
          idle_timeout=None, max_connections=MAX_CONNECTIONS,
          hello_timeout=HELLO_TIMEOUT_S, max_unauthenticated=MAX_UNAUTHENTICATED):
    """Accept clients on ``listener`` until ``stop`` (a threading.Event) is set.

    Each client gets a thread and a :class:`~distemb.transport.base.Session`; it reads
    frames and sends back ``handle(frame, session)`` (None: no reply). A malformed frame
    gets an error reply and its connection is closed, as does a request after which the
    handler set ``session.closing``; other clients are unaffected. A frame must arrive
    within ``timeout`` s once begun, the next one within ``idle_timeout`` s (None:
    forever), except that a connection whose session has no rank yet (no Hello) must
    send its first frame within ``hello_timeout`` s; of those, at most
    ``max_unauthenticated`` are kept (a newcomer closes the oldest). Past
    ``max_connections`` open connections, new ones are refused. Replies under way when
    ``stop`` is set are still sent.
    """
    listener.settimeout(0.1)
    inflight = _InFlight()
    slots = threading.BoundedSemaphore(max_connections)
    doorway = _Doorway(max_unauthenticated, hello_timeout)
    while not stop.is_set():
        try:
            sock, addr = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            if stop.is_set():
                break
            log.warning("accept failed; retrying", exc_info=True)
            time.sleep(0.1)  # e.g. out of file descriptors: wait for some to close
            continue
        conn = TcpConnection(sock, timeout, max_bytes, peer=f"client {addr[0]}:{addr[1]}",
                             idle_timeout=idle_timeout)
        if not slots.acquire(blocking=False):
            conn.sock.settimeout(1.0)
            _refuse(conn, TransportError(f"server busy: {max_connections} connections "
                                         f"open, the limit"))
            conn.close()
            continue
        doorway.enter(conn)
        threading.Thread(target=_serve_connection,
                         args=(conn, handle, inflight, slots, doorway), daemon=True).start()
    listener.close()
    inflight.wait_idle(timeout=2.0)
