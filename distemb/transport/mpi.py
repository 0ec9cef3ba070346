"""MPI transport (mpi4py point-to-point) for jobs started under ``mpirun``.

Ranks ``0..S-1`` of ``MPI.COMM_WORLD`` are the servers and ranks ``S..`` the trainers
(``distemb-launch --launcher mpirun`` maps them). A frame is one message with tag
:data:`TAG_HEAD` (the bytes of :func:`~distemb.transport.base.encode_head`) followed by one
:data:`TAG_DATA` message per non-empty array, received straight into a preallocated
numpy array; MPI keeps messages between two ranks in order, so payloads follow their head.

Only one thread per process calls MPI (this machine's MPI is slow with THREAD_MULTIPLE;
one-sided windows do not work over TCP here): a trainer calls it from the thread using its
client, a server from its communication loop (:func:`serve`), which hands requests to one
worker thread per trainer and sends the workers' replies with non-blocking sends.

Example (under mpirun, a trainer talking to server rank 0)::

    conn = MpiConnection(0, timeout=60)
    conn.send(Hello(rank=0, token="").encode()); conn.recv()
"""
import queue
import threading
import time

import mpi4py

mpi4py.rc.thread_level = "serialized"  # one thread at a time calls MPI (see above)
from mpi4py import MPI  # noqa: E402  (rc must be set before MPI initialises)

import numpy as np  # noqa: E402

from distemb.errors import ServerUnavailableError, TransportError  # noqa: E402
from distemb.transport.base import (HEADER, MAX_MESSAGE_BYTES, Connection,  # noqa: E402
                                    EarlyReply, Frame, Session, encode_head, parse_body,
                                    parse_descriptors, parse_header, payload_views)
from distemb.transport.messages import Error  # noqa: E402

TAG_HEAD, TAG_DATA = 11, 12
POLL_S = 0.0002


def _decode(comm, source, head, max_bytes):
    """The frame whose head bytes came from ``source``; its payloads are received here."""
    header = parse_header(head[:HEADER.size], max_bytes)
    pos = [HEADER.size]

    def read(n):
        if pos[0] + n > len(head):
            raise TransportError(f"frame from rank {source}: head shorter than it says")
        out = head[pos[0]:pos[0] + n]
        pos[0] += n
        return out

    specs = parse_descriptors(read, header)
    name, fields = parse_body(read(header.name_len), read(header.fields_len))
    arrays = []
    for dtype, shape in specs:
        a = np.empty(shape, dtype=dtype)
        if a.nbytes:
            comm.Recv([memoryview(a).cast("B"), MPI.BYTE], source=source, tag=TAG_DATA)
        arrays.append(a)
    return Frame(header.service, name, fields, arrays, header.flags)


def _recv_head(comm, status, source=MPI.ANY_SOURCE):
    n = status.Get_count(MPI.BYTE)
    buf = bytearray(n)
    comm.Recv([buf, MPI.BYTE], source=source, tag=TAG_HEAD)
    return bytes(buf)


class MpiConnection(Connection):
    """Frames to and from one server rank, with a timeout on every receive.

    Args:
        dest: the server's rank in ``MPI.COMM_WORLD``.
        timeout: seconds to wait for a reply before raising ServerUnavailableError.
    """

    def __init__(self, dest, timeout, max_bytes=MAX_MESSAGE_BYTES):
        self.comm, self.dest, self.timeout, self.max_bytes = MPI.COMM_WORLD, dest, timeout, \
            max_bytes
        self.peer = f"server rank {dest}"

    def send(self, frame):
        self.comm.Send([encode_head(frame), MPI.BYTE], dest=self.dest, tag=TAG_HEAD)
        for view in payload_views(frame):
            self.comm.Send([view, MPI.BYTE], dest=self.dest, tag=TAG_DATA)

    def pending(self):
        return bool(self.comm.Iprobe(source=self.dest, tag=TAG_HEAD))

    def recv(self, timeout=None):
        status = MPI.Status()
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        while not self.comm.Iprobe(source=self.dest, tag=TAG_HEAD, status=status):
            if time.monotonic() > deadline:
                raise ServerUnavailableError(f"{self.peer}: no answer within "
                                             f"{timeout} s")
            time.sleep(POLL_S)
        head = _recv_head(self.comm, status, self.dest)
        return _decode(self.comm, self.dest, head, self.max_bytes)


def connect_all(num_servers, timeout, max_bytes=MAX_MESSAGE_BYTES):
    """One MpiConnection per server rank 0..num_servers-1."""
    return [MpiConnection(r, timeout, max_bytes) for r in range(num_servers)]


def _worker(inbox, outbox, handle, source, done):
    session = Session(peer=f"rank {source}")  # MPI ranks are fixed: one session each
    while True:
        frame = inbox.get()
        if frame is None:
            return
        reply = handle(frame, session)
        if isinstance(reply, EarlyReply):  # one frame per request here: finished first
            reply = reply.whole()
        session.closing = False  # MPI has no connection to close; the rank stays known
        if reply is not None:
            outbox.put((source, reply))
        done.put(1)


def serve(handle, stop, max_bytes=MAX_MESSAGE_BYTES):
    """Answer frames from any rank with ``handle(frame, session)`` until ``stop`` is set.

    Handlers run in one worker thread per source rank (a barrier or a sync_exact step
    may block one trainer's requests, never the communication loop); malformed frames
    get an error reply.
    """
    comm, status = MPI.COMM_WORLD, MPI.Status()
    outbox, inboxes, pending = queue.SimpleQueue(), {}, []
    done, inflight = queue.SimpleQueue(), 0  # requests handed to workers, not yet answered
    while not stop.is_set() or inflight or not outbox.empty() or pending:
        while not done.empty():
            inflight -= done.get()
        busy = False
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HEAD, status=status):
            busy, source = True, status.Get_source()
            head = _recv_head(comm, status, source)
            try:
                frame = _decode(comm, source, head, max_bytes)
            except TransportError as e:
                outbox.put((source, Error(kind=type(e).__name__, message=str(e)).encode()))
                continue
            if source not in inboxes:
                inboxes[source] = queue.SimpleQueue()
                threading.Thread(target=_worker, args=(inboxes[source], outbox, handle,
                                                       source, done), daemon=True).start()
            inboxes[source].put(frame)
            inflight += 1
        while not outbox.empty():
            busy = True
            dest, frame = outbox.get()
            bufs = [encode_head(frame)] + payload_views(frame)
            reqs = [comm.Isend([bufs[0], MPI.BYTE], dest=dest, tag=TAG_HEAD)]
            reqs += [comm.Isend([v, MPI.BYTE], dest=dest, tag=TAG_DATA) for v in bufs[1:]]
            pending.append((reqs, bufs))  # buffers live until their sends complete
        pending = [(reqs, bufs) for reqs, bufs in pending if not MPI.Request.Testall(reqs)]
        if not busy:
            time.sleep(POLL_S)
    for box in inboxes.values():
        box.put(None)
