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
2. It applies the update, releases the lock (the counter turns even) and sends a second
   frame, the outcome: a Reply, or an Error if the update failed.
3. The trainer reads the outcome before its next request to that server
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

import numpy as np

from distemb.errors import KVStoreError
from distemb.transport.base import FLAG_NO_REPLY, EarlyReply
from distemb.transport.messages import Error, Reply, Update  # noqa: F401 (the example)

log = logging.getLogger("distemb.server")

#: The reply field of an early answer: the shard's seqlock counter while it is applied.
APPLYING = "applying"

#: Shards of up to this many rows find the rows a lookup shares with a pending update
#: through a bool per row (1 byte each, kept per shard the trainer updates early).
MARK_ROWS = 1 << 26


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

    def finish():
        try:
            apply()
            return Reply().encode()
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
    """

    def __init__(self, conns):
        self._conns = conns
        self._by_server = {}  # sid -> (table, shard, counter value, its store keys)
        self._marks = {}  # (table, shard) -> a cleared bool per row: which rows it touches
        #: lookups that copied rows while an update of the table was being applied
        self.beside = 0

    def note(self, sid, name, router, route, reply):
        """Remember the update of ``name`` sent to server ``sid`` along ``route`` (a
        :class:`~distemb.kvstore.routes.Route` of keys ``router`` routes) if the server
        answered it early (``reply``)."""
        counter = reply.fields.get(APPLYING)
        if counter is not None:
            part = route.parts[0] if len(route.parts) == 1 else None
            ids = route.ids if part is None else router.to_local(part, route.ids)
            self._by_server[sid] = (name, part, int(counter), np.array(ids, np.int64))

    def settle(self, sid, timeout=None):
        """Wait for the outcome of server ``sid``'s update answered early, if any.

        Raises:
            KVStoreError: the update failed after its early answer.
            ServerUnavailableError: the server died or timed out meanwhile.
        """
        if self._by_server.pop(sid, None) is None:
            return
        frame = self._conns[sid].recv(timeout)
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
        _, _, counter, updated = pending
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
