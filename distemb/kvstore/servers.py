"""Servers: a trainer's connections to the servers of its job, and what moves on them.

One object per cluster trainer (its :class:`~distemb.kvstore.remote.RemoteKVClient`'s):

- :meth:`Servers.call` sends requests to several servers and then reads every reply
  (servers work concurrently; every reply is read even after an error, so the
  connections stay in step): the one send-then-collect routine of a trainer;
- with shared memory on, a server on this trainer's machine is spoken to over its local
  (Unix-domain) socket, which hands over shared memory as file descriptors
  (:mod:`distemb.transport.shm`): the rows of its shards are gathered straight from their
  memory files or the files of a file table (:meth:`Servers.gather`, never torn: the
  seqlock, and beside an update answered early, :class:`~distemb.kvstore.server.early.
  Applying`); writes still go to the owning server, the only writer of its rows, but
  their arrays travel through this trainer's request slot
  (:class:`~distemb.transport.slots.RequestSlot`): the frame on the socket only says
  where they lie.

Example (servers started by ``distemb-launch``)::

    servers = Servers(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
    servers.call({0: Barrier(rank=0)})
"""
import numpy as np

from distemb import kernels
from distemb.errors import (KVStoreError, MissingKeyError, PartitionError, StoreError,
                            TransportError)
from distemb.kernels import half
from distemb.kvstore.ahead import Ahead, AsideReaders
from distemb.kvstore.server.early import Applying
from distemb.transport.base import FLAG_NO_REPLY, MAX_FDS, close_fds
from distemb.transport.connections import open_connections
from distemb.transport.messages import Bye, Hello, InShm, Reply, Service, ShmInfo
from distemb.transport.shm import attach_all
from distemb.transport.slots import RequestSlot

#: Error kinds a server reports that reach the user as their own type (else KVStoreError).
ERRORS = {"PartitionError": PartitionError, "StoreError": StoreError,
          "MissingKeyError": MissingKeyError, "ValueError": ValueError}


def _error(kind, message):
    """The exception of an error a server reported (its own type where the user knows it)."""
    return ERRORS.get(kind, KVStoreError)(message)


class Servers:
    """A trainer's connections to its job's servers (see the module docstring).

    Args:
        cfg: the job's :class:`~distemb.config.ClusterConfig`.
        rank: this trainer's rank.
        connections: one :class:`~distemb.transport.base.Connection` per server (default:
            :func:`~distemb.transport.connections.open_connections`).
        num_threads: OpenMP threads of shared-memory gathers.

    Raises:
        ServerUnavailableError: a server cannot be reached within ``cfg.timeout_s``.
        KVStoreError: a server answers as another server, or refuses the Hello.
    """

    def __init__(self, cfg, rank, connections=None, num_threads=1):
        self.rank, self.num_threads = rank, num_threads
        self.count = len(cfg.servers)
        self.connections = list(connections) if connections is not None else \
            open_connections(cfg, rank)
        self.mapped = {}  # (table, part) -> ShmShard of a co-located server's rows
        self._slots = {}
        self.applying = Applying(self.connections, self.mapped)
        self._aside = AsideReaders(self.connections)
        self.closed = False
        hello = {sid: Hello(rank=rank, token=cfg.job_token or "") for sid in range(self.count)}
        self.info = [r.fields for r in self.call(hello).values()]
        for sid, info in enumerate(self.info):
            if info.get("server_id") != sid or info.get("num_servers") != self.count:
                raise KVStoreError(f"server {sid}: answers as server {info.get('server_id')} "
                                   f"of {info.get('num_servers')}, the config lists "
                                   f"{self.count} servers")
        # Servers on this machine's local sockets hand over (and take) shared memory.
        self.local = {sid for sid, conn in enumerate(self.connections) if conn.passes_fds and
                      self.info[sid].get("shared_memory")}
        # Updates and pushes to them hand their arrays over in a request slot.
        self._slots = {sid: RequestSlot(cfg.job_id, rank, sid) for sid in self.local}

    def call(self, requests, wait=True, on_reply=None, while_waiting=None, timeout=None,
             later=False):
        """Send ``{server id: message}`` to all, then read every reply.

        Args:
            requests: {server id: message, or a list of messages}: a list goes to its
                server back to back, its replies read in order (one round trip for all,
                as a lookup of several tables on the servers is; its arrays travel in the
                frames, never in the request slot, which one request at a time uses).
            wait: False for asynchronous updates (no reply is sent or read).
            on_reply: ``on_reply(sid, frame)`` for each successful reply frame (in order,
                for a list); it may raise KVStoreError to report a malformed reply
                (collected like a server's).
            while_waiting: work to do after sending, before reading (e.g. shared-memory
                gathers while the remote rows travel).
            timeout: seconds to wait for each reply to begin (default: the connection's).
            later: an update a co-located server may answer before it applies it (one
                shard, mapped here: :class:`~distemb.kvstore.server.early.Applying`) has
                its reply read when first needed, by the next request to that server or
                lookup of its rows (``on_reply`` is called then, and a refusal raised
                there), not now: the trainer's next step starts while it travels.

        Returns:
            {server id: Reply, or the list of Replies of a list}.

        Raises:
            KVStoreError, PartitionError, StoreError, MissingKeyError, ValueError: a
                server answered with an error (the first one, after all replies were read).
            ServerUnavailableError: a server died or timed out.
        """
        if self.closed:
            raise KVStoreError("this RemoteKVClient is closed")
        for sid in requests:  # each slot free, each failure raised, before anything goes
            self.applying.settle(sid, timeout)
        deferred, unread = {}, {}  # {sid: update answered later}, {sid: replies to read}
        try:
            for sid, msgs in requests.items():
                for msg in msgs if isinstance(msgs, list) else [msgs]:
                    if not wait:
                        msg.flags |= FLAG_NO_REPLY
                    frame = None
                    try:
                        frame = self._frame_for(sid, msg, wait and not isinstance(msgs, list))
                        self.connections[sid].send(frame)
                    finally:
                        if frame is not None:
                            close_fds(frame)  # a new slot's descriptor: the server has its own
                    if later and self.applying.may_read_later(msg, frame):
                        deferred[sid] = msg
                    else:
                        unread[sid] = unread.get(sid, 0) + 1
        except BaseException:
            if wait:  # what went is answered: those connections stay in step
                self._drain(unread, deferred, on_reply, timeout)
            raise
        for sid, msg in deferred.items():  # known before any read below can fail
            self.applying.read_later(sid, msg, self._reader(sid, on_reply, timeout))
        waited = None
        if while_waiting is not None:
            try:
                while_waiting()
            except Exception as e:  # raised once every reply is read: connections in step
                waited = e
        if not wait:
            if waited is not None:
                raise waited
            return {}
        replies, failed = {}, []
        try:
            for sid, msgs in requests.items():
                if sid in deferred:
                    continue
                self._aside.settle(sid)  # replies to requests sent ahead come first
                for _ in msgs if isinstance(msgs, list) else [msgs]:
                    reply, error = self._take(sid, on_reply, timeout)
                    unread[sid] -= 1
                    if error is not None:
                        failed.append(error)
                    elif isinstance(msgs, list):
                        replies.setdefault(sid, []).append(reply)
                    else:
                        replies[sid] = reply
        except BaseException:  # server sid's read failed: the others' are still read
            self._drain({s: n for s, n in unread.items() if s != sid}, {}, on_reply, timeout)
            raise
        if waited is not None:
            raise waited
        if failed:
            raise _error(*failed[0])
        return replies

    def _take(self, sid, on_reply, timeout):
        """Read server ``sid``'s reply to one request: (its Reply, after
        ``on_reply(sid, frame)``, None), or (None, (kind, message)) of the error it
        reports (or ``on_reply`` raised).

        Raises:
            TransportError: the frame is not a reply.
        """
        frame = self.connections[sid].recv(timeout)
        if frame.service == Service.ERROR:
            return None, (frame.fields.get("kind"), str(frame.fields.get("message")))
        if frame.service != Service.REPLY:
            raise TransportError(f"server {sid}: unexpected reply service {frame.service}")
        try:
            if on_reply is not None:
                on_reply(sid, frame)  # it takes the descriptors it keeps
            return Reply.decode(frame), None
        except KVStoreError as e:
            return None, (type(e).__name__, str(e))
        finally:
            close_fds(frame)

    def _drain(self, unread, deferred, on_reply, timeout):
        """After a send or a read failed: read the replies still due (``unread``:
        {server id: how many}), their errors dropped (the failure is what is raised),
        and leave the deferred answers (``deferred``) to be read when first needed."""
        for sid, msg in deferred.items():
            self.applying.read_later(sid, msg, self._reader(sid, on_reply, timeout))
        for sid, count in unread.items():
            try:
                self._aside.settle(sid)
                for _ in range(count):
                    self._take(sid, on_reply, timeout)
            except KVStoreError:
                pass  # that server is gone too: its connection says so next time

    def _reader(self, sid, on_reply, timeout):
        """A function that reads server ``sid``'s reply to one request as :meth:`call`
        does, raising the error it reports."""
        def read():
            self._aside.settle(sid)  # replies to requests sent ahead come first
            _, error = self._take(sid, on_reply, timeout)
            if error is not None:
                raise _error(*error)
        return read

    def ahead(self, requests, on_reply=None):
        """Send ``{server id: message}`` now and read the replies while the caller goes
        on (:mod:`distemb.kvstore.ahead`): on a helper thread per connection where it
        ``reads_aside``, else when they are first needed. Later calls on a connection
        read their own replies after these.

        The arrays travel in the frames (never in a request slot, which the next request
        may reuse before this one is answered).

        Args:
            on_reply: ``on_reply(sid, frame)`` for each successful reply frame, on the
                thread that reads it.

        Returns:
            an :class:`~distemb.kvstore.ahead.Ahead`; its ``wait()`` gives the replies.
        """
        if self.closed:
            raise KVStoreError("this RemoteKVClient is closed")
        out = Ahead(self._aside, on_reply)
        for sid, msg in requests.items():
            self.applying.settle(sid)  # an update's outcome frame is read before this
            self.connections[sid].send(msg.encode())
            self._aside.expect(sid, out)
        return out

    @property
    def errors(self):
        """{error kind: exception type} of the errors servers report (for
        :meth:`Ahead.wait <distemb.kvstore.ahead.Ahead.wait>`)."""
        return ERRORS

    def all(self, make, timeout=None):
        """:meth:`call` of ``make(sid)`` on every server."""
        return self.call({sid: make(sid) for sid in range(self.count)}, timeout=timeout)

    def _frame_for(self, sid, msg, wait):
        """The frame of ``msg``; an update or push to a co-located server goes through
        its request slot (the frame carries the slot's descriptor when it is new).

        Only when the reply is awaited: the slot is reused by the next request, so the
        server must be done with it first (asynchronous updates travel in the frame).
        """
        slot = self._slots.get(sid) if wait else None
        if slot is None or msg.SERVICE not in (Service.UPDATE, Service.PUSH):
            return msg.encode()
        flags = self.applying.prepare(sid, msg, slot.holds(msg.grads)) \
            if msg.SERVICE == Service.UPDATE else 0
        frame = msg.encode()
        layout = slot.write(frame.arrays)
        out = InShm(name=frame.name, flags=frame.flags | flags, service=frame.service,
                    fields=frame.fields, size=slot.size, layout=layout).encode()
        fd = slot.take_fd()
        if fd is not None:
            out.fds.append(fd)
        return out

    # -- the rows of co-located servers -------------------------------------------------

    def map(self, name, parts_by_server):
        """Map the shards of table ``name`` that servers on this machine hold in shared
        memory or in files (``{server id: its parts}``)."""
        local = {sid: parts for sid, parts in parts_by_server.items() if sid in self.local}
        for at in range(0, max(map(len, local.values()), default=0), MAX_FDS):
            asked = {sid: p[at:at + MAX_FDS] for sid, p in local.items() if p[at:at + MAX_FDS]}
            fds = {}

            def take(sid, frame):
                fds[sid] = frame.fds[:]
                frame.fds.clear()
            replies = self.call({sid: ShmInfo(name=name, parts=parts)
                                 for sid, parts in asked.items()}, on_reply=take)
            for sid, reply in replies.items():
                f = reply.fields
                shards = attach_all(fds[sid], f["segments"], f["shapes"],
                                    [half.storage_dtype(dt) for dt in f["dtypes"]],
                                    f.get("files"))
                self.mapped.update({(name, part): shard
                                    for part, shard in zip(asked[sid], shards)
                                    if shard is not None})

    def expect(self, name, router, keys):
        """The next lookup of table ``name`` reads ``keys`` (as ``router`` routes them):
        the next update of each shard of it mapped here writes those rows first
        (:meth:`Applying.expect <distemb.kvstore.server.early.Applying.expect>`).

        Returns:
            the table's shards mapped here, or None when every key is in one of them.
        """
        mapped = {p for (n, p) in self.mapped if n == name}
        if not mapped:
            return mapped
        split = router.split(keys)
        for part, (_, held) in split.items():
            if part in mapped:
                self.applying.expect(name, part, router, held)
        return None if mapped.issuperset(split) else mapped

    def forget(self, name):
        """Unmap the shards of table ``name`` (and forget what a prefetch expected)."""
        for key in [k for k in self.mapped if k[0] == name]:
            del self.mapped[key]
        self.applying.forget(name)

    def gather(self, name, part, local):
        """Rows ``local`` (store keys) of mapped shard ``part`` of ``name``, never torn;
        None if writes kept it busy. Beside this trainer's update of it that the server
        answered early, while it is applied (:class:`~distemb.kvstore.server.early.
        Applying`)."""
        shard = self.mapped[(name, part)]
        sid = part % self.count
        rows = self.applying.gather(sid, name, part, shard, local, self._copy_rows)
        return rows if rows is not None else \
            shard.read(lambda a: self._copy_rows(a, local))

    def _copy_rows(self, a, local):
        if a.dtype == np.float32 and a.ndim == 2:
            return kernels.gather_rows(a, local, None, self.num_threads)
        if half.is_half(half.dtype_name(a)):  # decoded in the gather
            return half.gather_rows(a, local, None, self.num_threads)
        return a[local]

    def slot_buffer(self, sid, shape):
        """A buffer of float32 ``shape`` in the request slot of co-located server ``sid``
        (an update handed over from it needs no copy), or None. It never overlaps the
        last update's arrays while the server may still read them (an update answered
        early): the next sums are made while the server applies the last ones."""
        slot = self._slots.get(sid)
        return None if slot is None else \
            slot.view(shape, np.float32, clear_of_last=self.applying.reads_slot(sid))

    def close(self, goodbye=True):
        """Disconnect; with ``goodbye``, first tell every server this trainer is done.

        Raises:
            KVStoreError: an update answered early failed or was refused (after the
                goodbyes: the servers still learn this trainer is done).
        """
        if self.closed:
            return
        failed = []
        try:
            for sid in range(self.count) if goodbye else ():
                try:
                    self.applying.settle(sid)
                except TransportError:  # gone, or still applying: no goodbye, nothing read
                    self.applying.drop(sid)
                    continue
                except KVStoreError as e:
                    failed.append(e)
                try:
                    self.call({sid: Bye(rank=self.rank)})
                except TransportError:
                    pass  # a server gone meanwhile needs no goodbye
        finally:
            self.closed = True
            self._aside.close()
            self.mapped.clear()
            for slot in self._slots.values():
                slot.close()
            for conn in self.connections:
                conn.close()
        if failed:
            raise failed[0]
