"""Requests sent ahead: their replies are read while the trainer does other work.

A prefetch (:meth:`~distemb.kvstore.types.KVClient.prefetch`) sends its Pulls now and
needs their rows only at the next lookup. :meth:`Servers.ahead
<distemb.kvstore.servers.Servers.ahead>` sends such requests and hands back an
:class:`Ahead`, whose replies are received on one helper thread per connection where
the connection allows it (``reads_aside``, a socket: the rows arrive while the trainer
computes, and while it sends its update the other way) and otherwise by the first
thread that needs them (MPI, which one thread calls). A connection's replies come in
the order its requests went, so :class:`AsideReaders` keeps, per connection, the
aheads not read yet; a later call on that connection first waits for them.

Example:
    >>> import numpy as np, socket
    >>> from distemb.transport.tcp import TcpConnection
    >>> from distemb.transport.messages import Reply
    >>> a, b = socket.socketpair()
    >>> readers = AsideReaders([TcpConnection(a)])
    >>> ahead = Ahead(readers, on_reply=None)
    >>> readers.expect(0, ahead)
    >>> TcpConnection(b).send(Reply(arrays=[np.arange(3)]).encode())
    >>> ahead.wait()[0].arrays[0].tolist()
    [0, 1, 2]
    >>> readers.close()
"""
import collections
import queue
import threading
from concurrent.futures import Future

from distemb.errors import KVStoreError, TransportError
from distemb.transport.base import close_fds
from distemb.transport.messages import Reply, Service


class Ahead:
    """The replies to requests sent ahead, one per server (see the module docstring).

    Args:
        readers: the :class:`AsideReaders` of the connections they come on.
        on_reply: ``on_reply(sid, frame)`` for each successful reply frame, on the thread
            that reads it; it may raise KVStoreError to report a malformed reply.
    """

    def __init__(self, readers, on_reply=None):
        self._readers, self.on_reply = readers, on_reply
        self.replies, self.failed = {}, []
        self._done = {}  # sid -> Future, set once its reply is read

    def take(self, sid, frame):
        """Keep ``frame``, the reply of server ``sid`` (called by whoever read it)."""
        try:
            if frame.service == Service.ERROR:
                self.failed.append((frame.fields.get("kind"), str(frame.fields.get("message"))))
            elif frame.service != Service.REPLY:
                raise TransportError(f"server {sid}: unexpected reply service "
                                     f"{frame.service}")
            else:
                try:
                    if self.on_reply is not None:
                        self.on_reply(sid, frame)
                    self.replies[sid] = Reply.decode(frame)
                except KVStoreError as e:
                    self.failed.append((type(e).__name__, str(e)))
        finally:
            close_fds(frame)

    def wait(self, errors=None):
        """Every reply, once read: ``{sid: Reply}``.

        Args:
            errors: {error kind: exception type} of the errors servers report (the first
                is raised; default KVStoreError).

        Raises:
            KVStoreError (or the type ``errors`` names): a server answered with an error.
            ServerUnavailableError: a server died or timed out.
        """
        for sid, done in self._done.items():
            self._readers.settle(sid, until=self)
            done.result()
        if self.failed:
            kind, message = self.failed[0]
            raise (errors or {}).get(kind, KVStoreError)(message)
        return self.replies


class AsideReaders:
    """Per connection, the aheads whose replies are not read yet, and the helper thread
    that reads them where the connection ``reads_aside``.

    Args:
        connections: one :class:`~distemb.transport.base.Connection` per server.
    """

    _STOP = object()

    def __init__(self, connections):
        self._conns = connections
        self._pending = {sid: collections.deque() for sid in range(len(connections))}
        self._queues = {}
        self._lock = threading.Lock()

    def expect(self, sid, ahead):
        """The next reply on connection ``sid`` not yet expected (its request just went)
        is ``ahead``'s."""
        done = Future()
        ahead._done[sid] = done
        with self._lock:
            self._pending[sid].append((ahead, done))
        if self._conns[sid].reads_aside:
            self._queue(sid).put(sid)

    def _queue(self, sid):
        if sid not in self._queues:
            q = self._queues[sid] = queue.Queue()
            threading.Thread(target=self._read_aside, args=(q,), daemon=True,
                             name=f"distemb-ahead-{sid}").start()
        return self._queues[sid]

    def _read_aside(self, q):
        """A helper thread: one reply read per request expected, until told to stop."""
        while True:
            sid = q.get()
            if sid is self._STOP:
                return
            self._read_next(sid)

    def _read_next(self, sid):
        """Read the first pending reply of connection ``sid`` into its ahead."""
        with self._lock:
            ahead, done = self._pending[sid][0]
        error = None
        try:
            ahead.take(sid, self._conns[sid].recv())
        except BaseException as e:  # noqa: BLE001 - the ahead's waiter raises it
            error = e
        with self._lock:
            self._pending[sid].popleft()
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def settle(self, sid, until=None):
        """Return once connection ``sid`` has no reply pending (every later read on it is
        then the caller's), or with ``until``, once that ahead's reply is in; replies no
        helper thread reads are read here."""
        while True:
            with self._lock:
                pending = list(self._pending[sid])
            if until is not None:
                pending = pending[:1 + next((i for i, (a, _) in enumerate(pending)
                                             if a is until), -1)]
            if not pending:
                return
            if not self._conns[sid].reads_aside:
                self._read_next(sid)
                continue
            try:
                pending[-1][1].result()  # in order: the earlier ones are read too
            except BaseException:  # noqa: BLE001 - the ahead's waiter raises it
                pass
            return

    def close(self):
        """Stop the helper threads (the connections are closed by their owner, which ends
        a read under way)."""
        for q in self._queues.values():
            q.put(self._STOP)
        self._queues.clear()
