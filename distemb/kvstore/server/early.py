"""Early answers: a co-located server answers an update before it applies it, so the
trainer's next step runs while the server works, and the trainer reads the rows it
did not update while they are being written.

A trainer that reads a server's shard through shared memory waits, each step, for the
server to apply its update (the server's Python and kernel: most of the co-located
step's excess over the embedded one, benchmarks/README.md). Instead, for an update that
came in the trainer's request slot:

1. The server checks it as always (a bad one is answered with an error, nothing
   written), takes the shard's write lock (its seqlock counter turns odd) and answers
   at once with that counter's value (``applying``).
2. It applies the update and releases the lock (the counter moves on). A trainer that
   maps the shard (it said so: ``FLAG_OUTCOME_IN_SHARD``) reads the outcome there: the
   counter moved on, and the header's second word holds the counter's value only if the
   update failed (written before the lock is released), in which case the server sends
   an Error frame; otherwise the server sends the outcome as a second frame, a Reply or
   an Error. A successful update answered early costs one frame, not two (a send here
   cost ~81 us of the server's time, and the trainer's wake-up waited for it).
3. The trainer learns the outcome before its next request to that server
   (:meth:`Applying.settle`), so the server has finished with the request slot before
   the trainer writes it again, and a failure is raised there, naming the table.
4. A lookup of the same table meanwhile (:meth:`Applying.gather`): while the counter
   still holds the value the server sent (or the next, even one), the only rows being
   written are that update's (the server holds the shard's write lock for it alone), so
   every other row is copied as it is; the rows the update touches are read again after
   the outcome came, as any read would see them. Rows equal those of a step that waited.

Only what needs nothing more from the server is answered early: one shard's update,
not in sync_exact mode, asking no versions (a trainer cache asks for them), of a table
whose rows never move and are read in place (an array table's shared-memory segment, a
file table's file).

Example (the server half; the trainer half is :class:`Applying`):
    >>> may_answer_early(Update(name="t", rule="sgd", hyper={}, seq=1, exact=False,
    ...                         parts=[0], counts=[0], ids=np.empty(0, np.int64),
    ...                         grads=np.empty((0, 2), np.float32)), in_slot=False)
    False
"""
import logging
import os
import time

import numpy as np

from distemb.errors import KVStoreError, ServerUnavailableError
from distemb.transport.base import FLAG_NO_REPLY, FLAG_OUTCOME_IN_SHARD, EarlyReply
from distemb.transport.messages import Error, Reply, Update  # noqa: F401 (the example)

log = logging.getLogger("distemb.server")

#: The reply field of an early answer: the shard's seqlock counter while it is applied.
APPLYING = "applying"

#: Shards of up to this many rows find the rows a lookup shares with a pending update
#: through a bool per row (1 byte each, kept per shard the trainer updates early).
MARK_ROWS = 1 << 26
#: A trainer waiting for an update to be applied spins (yielding its core) this long,
#: then naps NAP_S at a time, looking at its connection meanwhile (a server gone).
SPIN_S = 0.005
NAP_S = 0.0001


def may_answer_early(m, in_slot) -> bool:
    """Whether update ``m`` may be answered before it is applied (see the module)."""
    return in_slot and not m.exact and not m.versions and len(m.parts) == 1 and \
        not m.flags & FLAG_NO_REPLY


def answer_early(server, server_id, m, part, ids):
    """The :class:`~distemb.transport.base.EarlyReply` of update ``m`` of shard ``part``
    (store keys ``ids``), or None when the shard has no seqlock counter (not in shared
    memory: then it is applied as usual).

    Raises:
        KVStoreError: the update is invalid (nothing locked, nothing written).
    """
    table = server.table(m.name, part)
    if not table.store.fixed_keys:
        return None  # rows that move (a hash store's) are never read in place
    counter, apply = server.update_later(m.name, part, ids, m.grads, m.rule, m.hyper)
    if counter is None:
        apply()  # no shared memory to read it from: it is applied now, as usual
        return Reply().encode()

    quiet = m.flags & FLAG_OUTCOME_IN_SHARD  # the trainer reads success in the header

    def finish():
        try:
            apply()
            return None if quiet else Reply().encode()
        except Exception as e:  # the trainer raises it at its next request
            log.exception("distemb server %d: update of %r after its early answer",
                          server_id, m.name)
            return Error(kind=type(e).__name__, message=f"server {server_id}: the update "
                         f"of {m.name!r} answered early then failed: {e}").encode()
    return EarlyReply(Reply(fields={APPLYING: counter}).encode(), finish)


class Applying:
    """A trainer's updates that co-located servers answered early and may still apply
    (one per server at most: a server's next request waits for :meth:`settle`).

    Args:
        conns: the client's connection per server (the outcome frames come on them).
        mapped: ``{(table, part): ShmShard}`` of the shards mapped here (their headers
            say when an update of them is applied).
    """

    def __init__(self, conns, mapped):
        self._conns, self._mapped = conns, mapped
        self._by_server = {}  # sid -> (table, shard, counter value, store keys, header)
        self._headers = {}  # sid -> the header its last update's outcome is read in
        self._marks = {}  # (table, shard) -> a cleared bool per row: which rows it touches
        #: lookups that copied rows while an update of the table was being applied
        self.beside = 0

    def flags(self, sid, m):
        """The flag update ``m`` to server ``sid`` carries: ``FLAG_OUTCOME_IN_SHARD``
        when its one shard is mapped here (an early answer's outcome is then read in
        the shard's header), else 0."""
        shard = self._mapped.get((m.name, m.parts[0])) if len(m.parts) == 1 else None
        self._headers[sid] = None if shard is None else shard.version
        return 0 if shard is None else FLAG_OUTCOME_IN_SHARD

    def note(self, sid, name, router, route, reply):
        """Remember the update of ``name`` sent to server ``sid`` along ``route`` (a
        :class:`~distemb.kvstore.routes.Route` of keys ``router`` routes) if the server
        answered it early (``reply``)."""
        counter = reply.fields.get(APPLYING)
        header = self._headers.pop(sid, None)
        if counter is not None:
            part = route.parts[0] if len(route.parts) == 1 else None
            ids = route.ids if part is None else router.to_local(part, route.ids)
            self._by_server[sid] = (name, part, int(counter), np.array(ids, np.int64),
                                    header)

    def settle(self, sid, timeout=None):
        """Wait for the outcome of server ``sid``'s update answered early, if any.

        Raises:
            KVStoreError: the update failed after its early answer.
            ServerUnavailableError: the server died or timed out meanwhile.
        """
        pending = self._by_server.pop(sid, None)
        if pending is None:
            return
        _, _, counter, _, header = pending
        conn = self._conns[sid]
        if header is not None and not _failed(header, counter, conn, timeout):
            return  # applied: the server sends nothing more
        frame = conn.recv(timeout)
        if frame.service == Error.SERVICE:
            raise KVStoreError(str(frame.fields.get("message")))

    def gather(self, sid, name, part, shard, ids, copy):
        """Rows ``ids`` of shard ``part`` of ``name`` (server ``sid``'s, mapped here),
        copied with ``copy(array, ids)``, while an update of it answered early may run;
        None when none of that shard is pending (read as usual), or when another write
        got in between (the outcome is then awaited, and the caller reads as usual)."""
        pending = self._by_server.get(sid)
        if pending is None or pending[:2] != (name, part):
            return None  # another shard's counter says nothing of this one's writers
        _, _, counter, updated, _ = pending
        before = int(shard.version[0])
        if before in (counter, counter + 1):
            rows = copy(shard.array, ids)
            if int(shard.version[0]) in (counter, counter + 1):
                self.beside += 1
                # found while the server may still be writing, then read again once done
                touched = self._touched(name, part, len(shard.array), updated, ids)
                self.settle(sid)
                if len(touched):
                    again = shard.read(lambda a: copy(a, ids[touched]))
                    if again is None:
                        return None
                    rows[touched] = again
                return rows
        self.settle(sid)
        return None

    def _touched(self, name, part, num_rows, updated, ids):
        """Positions in ``ids`` of rows in ``updated`` (both rows of a shard of
        ``num_rows``): marked in a bool per row, kept per shard and cleared after (~25 us
        at 4,096 ids, where a binary search took ~300 us; a shard of more rows than
        MARK_ROWS is searched with np.isin instead, to keep a trainer's marks small)."""
        if num_rows > MARK_ROWS:
            return np.flatnonzero(np.isin(ids, updated))
        marks = self._marks.get((name, part))
        if marks is None or len(marks) != num_rows:
            marks = self._marks[(name, part)] = np.zeros(num_rows, bool)
        marks[updated] = True
        touched = np.flatnonzero(marks[ids])
        marks[updated] = False
        return touched


def _failed(header, counter, conn, timeout=None):
    """Wait until the update a server answered early at seqlock ``counter`` is applied
    (the shard's ``header`` counter moved on); whether it failed (an Error frame then
    follows on ``conn``). Also True when ``conn`` has something to read before that
    (the server gone: the caller's read says so).

    Raises:
        ServerUnavailableError: not applied within ``timeout`` s (default: the
            connection's wait for a frame).
    """
    if timeout is None:
        timeout = getattr(conn, "idle_timeout", None)
    start, spins = time.monotonic(), 0
    while header[0] == counter:
        spins += 1
        if not spins & 63:
            if conn.pending():
                return True
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                raise ServerUnavailableError(f"{getattr(conn, 'peer', 'server')}: an update "
                                             f"answered early not applied within {timeout} s")
            if waited > SPIN_S:
                time.sleep(NAP_S)
                continue
        os.sched_yield()  # a server sharing this core runs now
    return int(header[1]) == counter
