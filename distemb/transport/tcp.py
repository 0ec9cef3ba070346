"""TCP transport (the default): length-prefixed frames over one socket per peer.

Payloads go out as memoryviews of the arrays (``sendmsg``, no pickling, no copy into a
bytes object) and come in with ``recv_into`` straight into preallocated numpy arrays.

A trainer on a server's machine (with shared memory on) talks to it over a Unix-domain
socket instead, in the abstract namespace (no file): its address is derived from the
job's token, the server's port and id (:func:`local_address`), so a process without the
token cannot tell it or take it first; each side checks that the other runs as the same
user (``SO_PEERCRED``) before anything is said. Frames on it may carry file descriptors
(the shared-memory segments of :mod:`distemb.transport.shm`).

Example:
    >>> import numpy as np, socket
    >>> a, b = socket.socketpair()
    >>> ca, cb = TcpConnection(a), TcpConnection(b)
    >>> ca.send(Frame(4, "w", {}, [np.arange(3)]))
    >>> cb.recv().arrays[0].tolist()
    [0, 1, 2]
"""
import array
import collections
import errno
import hashlib
import logging
import os
import selectors
import socket
import struct
import threading
import time

import numpy as np

from distemb.errors import ServerUnavailableError, TransportError
from distemb.transport.base import (HEADER, MAX_FDS, MAX_MESSAGE_BYTES, Connection,
                                    EarlyReply, Frame, Session, close_fds, encode_head,
                                    parse_body, parse_descriptors, parse_header,
                                    payload_views)
from distemb.transport.messages import Error
from distemb.transport.stream import StreamReader

_IOV_MAX = 512
RECV_BUFFER = 65536  # bytes of a TCP connection's receive buffer (StreamReader)
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
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)  # room for MAX_FDS descriptors (+1 truncates)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
log = logging.getLogger("distemb")


class TcpConnection(Connection):
    """Frames over a connected stream socket (TCP, or Unix-domain: then with descriptors).

    One thread may :meth:`recv` while another sends (``reads_aside``): the
    socket's two directions are independent, and a receive with the connection's own
    timeout changes nothing a send uses.

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
        self.passes_fds = sock.family == socket.AF_UNIX
        self.reads_aside = True
        # a frame's small reads out of one buffer; a Unix socket's exact (its descriptors)
        self.reader = StreamReader(sock, 0 if self.passes_fds else RECV_BUFFER)
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
        """Send ``frame`` (its descriptors stay open: the caller closes them)."""
        if frame.fds and not self.passes_fds:
            raise TransportError(f"{self.peer}: a TCP connection cannot carry file "
                                 f"descriptors (a Unix-domain socket can)")
        bufs = [memoryview(encode_head(frame))] + payload_views(frame)
        # The descriptors go with the first bytes: the receiver takes them with the head.
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", frame.fds))] \
            if frame.fds else []
        try:
            while bufs:
                sent = self.sock.sendmsg(bufs[:_IOV_MAX], anc)
                anc = []
                while bufs and sent >= len(bufs[0]):
                    sent -= len(bufs[0])
                    bufs.pop(0)
                if sent:
                    bufs[0] = bufs[0][sent:]
        except OSError as e:
            self._fail(e, "sending")

    def pending(self):
        """Whether the next frame has begun to arrive, or the peer closed (a
        :meth:`recv` would not wait for its first byte)."""
        return self.reader.waiting()

    def _recv_head(self, view, fds):
        """Read the first bytes of a frame into ``view``; descriptors that came with them
        are appended to ``fds`` (any sent with later bytes are dropped by the kernel)."""
        if not self.passes_fds:
            return self.reader.first(view)
        got, anc, flags, _ = self.sock.recvmsg_into([view], _FD_SPACE)
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
        if flags & socket.MSG_CTRUNC:
            raise TransportError(f"frame from {self.peer}: more than {MAX_FDS} file "
                                 f"descriptors")
        return got

    def recv(self, timeout=None):
        """The next frame; ``timeout`` (s) overrides the wait for its first byte.

        Raises:
            ServerUnavailableError: the peer closed, reset or timed out.
            TransportError: the frame is malformed (the stream cannot be trusted after).
        """
        idle = self.idle_timeout if timeout is None else timeout
        fds = []
        try:
            return self._recv(idle, fds)
        except BaseException:
            close_fds(Frame(0, fds=fds))  # a frame that failed owns nothing
            raise

    def _recv(self, idle, fds):
        head = bytearray(HEADER.size)
        view = memoryview(head)
        try:
            if idle != self.timeout:  # wait for a frame, then read it briskly
                self.sock.settimeout(idle)
            try:
                got = self._recv_head(view, fds)
            finally:
                if idle != self.timeout:
                    self.sock.settimeout(self.timeout)
            if got == 0:
                raise ConnectionResetError("peer closed the connection")
            view = view[got:]
        except OSError as e:
            self._fail(e, "waiting for a frame", idle)
        try:
            self.reader.read_into(view)
            header = parse_header(bytes(head), self.max_bytes)
            specs = parse_descriptors(self.reader.read, header)
            name, fields = parse_body(self.reader.read(header.name_len),
                                      self.reader.read(header.fields_len))
            arrays = []
            for dtype, shape in specs:
                a = np.empty(shape, dtype=dtype)
                if a.nbytes:
                    self.reader.read_into(memoryview(a).cast("B"))
                arrays.append(a)
        except TransportError:
            raise
        except OSError as e:
            self._fail(e, "receiving")
        except Exception as e:  # anything else a hostile frame provokes is its fault
            raise TransportError(f"frame from {self.peer}: cannot decode "
                                 f"({type(e).__name__}: {e})") from None
        return Frame(header.service, name, fields, arrays, header.flags, fds)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def local_address(secret, port, server_id):
    """The abstract Unix-socket address of server ``server_id`` (listening on TCP
    ``port``) of the job whose token (or id, without one) is ``secret``.

    Only a process that knows the secret can tell it; the port makes it unique on the
    machine (two servers on one port cannot both run).
    """
    digest = hashlib.sha256(f"distemb-local:{secret}:{port}:{server_id}".encode())
    return "\0distemb-" + digest.hexdigest()[:32]


def peer_credentials(sock):
    """(pid, uid, gid) of the process at the other end of Unix-domain socket ``sock``."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def _connect_local(address, timeout, max_bytes, peer):
    """A connection to a server's local socket, or None when nothing listens there.

    Raises:
        TransportError: the process listening there is another user's.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
    except OSError:
        sock.close()
        return None
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():  # never show the job's token to another user's process
        sock.close()
        raise TransportError(f"{peer}: the process at its local socket (pid {pid}) runs as "
                             f"uid {uid}, not as this user ({os.getuid()}); refusing it")
    return TcpConnection(sock, timeout, max_bytes, f"{peer} (local socket)")


def connect(host, port, timeout, max_bytes=MAX_MESSAGE_BYTES, peer=None, local=None):
    """Connect to ``host:port``, retrying while the server starts, for up to ``timeout`` s.

    Args:
        local: the server's :func:`local_address` when it runs on this machine: the
            connection is made there when the server listens on it (it binds it before
            its TCP port, so a server that answers on TCP but not there is out of reach
            of this machine's local sockets, e.g. in another network namespace, and is
            spoken to over TCP).

    Raises:
        ServerUnavailableError: nothing accepted within ``timeout`` seconds.
        TransportError: the local socket is another user's.
    """
    peer = peer or f"{host}:{port}"
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        conn = _connect_local(local, timeout, max_bytes, peer) if local else None
        if conn is not None:
            return conn
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise ServerUnavailableError(f"{peer}: could not connect within {timeout} s "
                                             f"({e})") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        conn = _connect_local(local, timeout, max_bytes, peer) if local else None
        if conn is None:
            if local:
                log.info("%s: no local socket reachable; talking over TCP without shared "
                         "memory", peer)
            return TcpConnection(sock, timeout, max_bytes, peer)
        sock.close()  # it started meanwhile: the local socket it is
        return conn


def listen_local(address, backlog=128):
    """A listening Unix-domain socket at the abstract ``address``.

    Raises:
        TransportError: the address is taken (a server of the same job, port and id).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise TransportError(f"cannot listen on this server's local socket: {e}") from None
    sock.listen(backlog)
    return sock


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


def _answer_early(conn, reply):
    """Send an :class:`~distemb.transport.base.EarlyReply`'s frame, then finish its work
    (also when the peer is gone: it holds a lock until then), which sends the outcome,
    if any."""
    try:
        conn.send(reply.frame)
    finally:
        reply.finish(conn.send)


def _serve_connection(conn, handle, inflight, slots, doorway):
    """Answer requests on ``conn`` until the peer leaves, idles out, sends a malformed
    frame or fails its handshake. Never raises: one client cannot kill the server."""
    session = Session(peer=conn.peer, passes_fds=conn.passes_fds)
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
                try:
                    reply = handle(frame, session)
                    if isinstance(reply, EarlyReply):
                        _answer_early(conn, reply)
                    elif reply is not None:
                        try:
                            conn.send(reply)
                        finally:
                            close_fds(reply)
                finally:
                    close_fds(frame)  # descriptors the handler did not take
            if waiting and session.rank is not None:
                doorway.leave(conn)
    except TransportError:
        pass  # the peer went away while we answered
    except Exception:  # a handler bug: log it, drop this client, keep serving the others
        log.exception("%s: request handler failed", conn.peer)
    finally:
        doorway.leave(conn)
        session.close()
        conn.close()
        slots.release()


def _accept(listener, timeout, max_bytes, idle_timeout):
    """The connection of the next peer of ``listener``, or None: a peer of a local
    socket that runs as another user is refused (and closed) at once."""
    sock, addr = listener.accept()
    if sock.family != socket.AF_UNIX:
        return TcpConnection(sock, timeout, max_bytes, peer=f"client {addr[0]}:{addr[1]}",
                             idle_timeout=idle_timeout)
    pid, uid, _ = peer_credentials(sock)
    conn = TcpConnection(sock, timeout, max_bytes, peer=f"local process {pid}",
                         idle_timeout=idle_timeout)
    if uid != os.getuid():
        log.warning("refused a local connection of pid %d, uid %d (not this user)", pid, uid)
        conn.sock.settimeout(1.0)
        _refuse(conn, TransportError(f"local socket: uid {uid} is not this server's user"))
        conn.close()
        return None
    return conn


def serve(listeners, handle, stop, max_bytes=MAX_MESSAGE_BYTES, timeout=None,
          idle_timeout=None, max_connections=MAX_CONNECTIONS,
          hello_timeout=HELLO_TIMEOUT_S, max_unauthenticated=MAX_UNAUTHENTICATED):
    """Accept clients on ``listeners`` (a listening socket or a list of them: the TCP
    port and the local socket) until ``stop`` (a threading.Event) is set.

    Each client gets a thread and a :class:`~distemb.transport.base.Session`; it reads
    frames and sends back ``handle(frame, session)`` (None: no reply). A malformed frame
    gets an error reply and its connection is closed, as does a request after which the
    handler set ``session.closing``; other clients are unaffected. A frame must arrive
    within ``timeout`` s once begun, the next one within ``idle_timeout`` s (None:
    forever), except that a connection whose session has no rank yet (no Hello) must
    send its first frame within ``hello_timeout`` s; of those, at most
    ``max_unauthenticated`` are kept (a newcomer closes the oldest). Past
    ``max_connections`` open connections, new ones are refused. Descriptors a frame
    carries and its handler did not take are closed after it. Replies under way when
    ``stop`` is set are still sent.
    """
    listeners = list(listeners) if isinstance(listeners, (list, tuple)) else [listeners]
    ready_to_accept = selectors.DefaultSelector()  # epoll: any descriptor number
    for listener in listeners:
        listener.settimeout(0)  # accept only what the selector found ready
        ready_to_accept.register(listener, selectors.EVENT_READ)
    inflight = _InFlight()
    slots = threading.BoundedSemaphore(max_connections)
    doorway = _Doorway(max_unauthenticated, hello_timeout)
    while not stop.is_set():
        try:
            for key, _ in ready_to_accept.select(0.1):
                conn = _accept(key.fileobj, timeout, max_bytes, idle_timeout)
                if conn is None:
                    continue
                if not slots.acquire(blocking=False):
                    conn.sock.settimeout(1.0)
                    _refuse(conn, TransportError(f"server busy: {max_connections} "
                                                 f"connections open, the limit"))
                    conn.close()
                    continue
                doorway.enter(conn)
                threading.Thread(target=_serve_connection,
                                 args=(conn, handle, inflight, slots, doorway),
                                 daemon=True).start()
        except (BlockingIOError, InterruptedError, socket.timeout):
            continue  # the peer gave up before we accepted
        except OSError:
            if stop.is_set():
                break
            log.warning("accept failed; retrying", exc_info=True)
            time.sleep(0.1)  # e.g. out of file descriptors: wait for some to close
    ready_to_accept.close()
    for listener in listeners:
        listener.close()
    inflight.wait_idle(timeout=2.0)
