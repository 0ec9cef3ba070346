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
2. It applies the update and releases the lock (the counter moves on). If the update
   fails, the server sends the trainer an Error frame *before* it releases the lock. A
   trainer that maps the shard (it said so: ``FLAG_OUTCOME_IN_SHARD``) reads the outcome
   there: once the counter moved on, a frame waiting on its connection is that Error,
   and none means success (a word in the shared header would be one for all trainers:
   another trainer's later failure would overwrite it). To any other trainer the server
   sends the outcome as a second frame, a Reply or an Error. A successful update
   answered early costs one frame, not two (a send here cost ~81 us of the server's
   time, and the trainer's wake-up waited for it).
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

from distemb.errors import KVStoreError, ServerUnavailableError, TransportError
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
    counter, apply = server.update_later(m.name, part, ids, m.grads, m.rule, m.hyper,
                                         m.first)
    if counter is None:
        apply()  # no shared memory to read it from: it is applied now, as usual
        return Reply().encode()

    quiet = m.flags & FLAG_OUTCOME_IN_SHARD  # the trainer reads success in the header

    def finish(send):
        def tell(e):  # before the lock is released: the trainer raises it next request
            try:
                send(Error(kind=type(e).__name__, message=f"server {server_id}: the update "
                           f"of {m.name!r} answered early then failed: {e}").encode())
            except TransportError:
                pass  # the trainer is gone: nobody to tell
        try:
            apply(on_failure=tell)
        except Exception:
            log.exception("distemb server %d: update of %r after its early answer",
                          server_id, m.name)
            return
        if not quiet:
            send(Reply().encode())
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
        self._marks = {}  # (table, shard) -> a cleared byte per row: which rows it touches
        self._next = {}  # (table, shard) -> the keys its next lookup reads (a prefetch's)
        self._unread = {}  # sid -> reads its answer to an update (read when first needed)
        #: lookups that copied rows while an update of the table was being applied
        self.beside = 0
        #: of those, lookups that read the rows the update wrote as soon as the server had
        #: written them first, while it wrote the others
        self.first_read = 0

    def expect(self, name, part, router, keys):
        """The next lookup of ``name`` reads ``keys`` (the table's keys, as ``router``
        routes them) of mapped shard ``part`` (a prefetch said so): the next update of
        that shard asks its server to apply those rows first (:meth:`prepare`)."""
        # a copy: the caller's ids may be a loader's buffer, filled again before the update
        self._next[(name, part)] = (router, np.array(router.to_local(part, keys), np.int64))

    def prepare(self, sid, m, in_place):
        """Make update ``m`` to server ``sid`` ready to go: the flag it carries,
        ``FLAG_OUTCOME_IN_SHARD`` when its one shard is mapped here (an early answer's
        outcome is then read in the shard's header), else 0. When a prefetch named the
        rows the next lookup of that shard reads (:meth:`expect`) and ``in_place`` (its
        gradients are this trainer's own buffer, the request slot: the sums are
        ``push_update``'s to consume, and may be reordered), those rows go first
        (``m.first``): the server writes them first."""
        one = len(m.parts) == 1
        shard = self._mapped.get((m.name, m.parts[0])) if one else None
        expected = self._next.pop((m.name, m.parts[0]), None) if one else None
        self._headers[sid] = None if shard is None else shard.version
        if shard is None:
            return 0
        if expected is not None and in_place and may_answer_early(m, True):
            router, wanted = expected
            part = m.parts[0]
            hit = self._among(m.name, part, len(shard.array), router.to_local(part, m.ids),
                              wanted)
            m.ids, m.first = _put_first(m.ids, m.grads, hit)
        return FLAG_OUTCOME_IN_SHARD

    def _among(self, name, part, num_rows, ids, wanted):
        """Bool per row of ``ids``: among ``wanted`` (both rows of a shard of
        ``num_rows``, as :meth:`_touched` finds them)."""
        marks = self._marks_of(name, part, num_rows)
        if marks is None:
            return np.isin(ids, wanted)
        marks[wanted] = 1
        hit = marks[ids].view(bool)
        marks[wanted] = 0
        return hit

    def _marks_of(self, name, part, num_rows):
        """The cleared byte per row of shard ``part`` of ``name``, or None past
        MARK_ROWS rows."""
        if num_rows > MARK_ROWS:
            return None
        marks = self._marks.get((name, part))
        if marks is None or len(marks) != num_rows:
            marks = self._marks[(name, part)] = np.zeros(num_rows, np.uint8)
        return marks

    def may_read_later(self, m, frame):
        """Whether the answer to request ``m`` (sent as ``frame``) may be read later
        (:meth:`read_later`): an update the server may answer early whose outcome this
        trainer reads in the shard's header, naming no prefetched rows (whose answer
        patches them before the next lookup)."""
        return m.SERVICE == Update.SERVICE and bool(frame.flags & FLAG_OUTCOME_IN_SHARD) \
            and m.watch is None and may_answer_early(m, True)

    def read_later(self, sid, m, read):
        """Server ``sid``'s answer to update ``m``, just sent, is read by ``read()`` when
        first needed: before the next request to it (:meth:`settle`) or a lookup of its
        rows (:meth:`gather`). Until then the trainer goes on."""
        self._unread[sid] = (read, m.name, m.parts[0])

    def forget(self, name):
        """Drop what is kept of table ``name`` (deleted): its expected keys, its marks."""
        for kept in (self._next, self._marks):
            for key in [k for k in kept if k[0] == name]:
                del kept[key]

    def reads_slot(self, sid):
        """Whether server ``sid`` may still be reading this trainer's request slot (an
        update answered early, or whose answer is unread)."""
        return sid in self._by_server or sid in self._unread

    def _answer(self, sid):
        unread = self._unread.get(sid)
        if unread is None:
            return
        try:
            unread[0]()
        except ServerUnavailableError:
            raise  # nothing read: the answer may still come, the server still read the slot
        except BaseException:
            del self._unread[sid]
            raise
        del self._unread[sid]

    def drop(self, sid):
        """Forget what server ``sid`` may still answer or apply (its connection is being
        closed: nothing more is read from it)."""
        for kept in (self._unread, self._by_server, self._headers):
            kept.pop(sid, None)

    def note(self, sid, router, m, reply):
        """Remember update ``m`` (of keys ``router`` routes) sent to server ``sid`` if the
        server answered it early (``reply``)."""
        counter = reply.fields.get(APPLYING)
        header = self._headers.pop(sid, None)
        if counter is not None:
            part = m.parts[0] if len(m.parts) == 1 else None
            ids = m.ids if part is None else router.to_local(part, m.ids)
            self._by_server[sid] = (m.name, part, int(counter), np.array(ids, np.int64),
                                    header, m.first)

    def settle(self, sid, timeout=None):
        """Wait for the outcome of server ``sid``'s update answered early, if any.

        Raises:
            KVStoreError: the update failed after its early answer.
            ServerUnavailableError: the server died or timed out meanwhile.
        """
        self._answer(sid)
        pending = self._by_server.get(sid)
        if pending is None:
            return
        _, _, counter, _, header, _ = pending
        conn = self._conns[sid]
        # pending until known applied: a server past the timeout may still read the slot
        if header is not None and not _failed(header, counter, conn, timeout):
            del self._by_server[sid]
            return  # applied: the server sends nothing more
        frame = conn.recv(timeout)  # not in within the wait: the update stays pending
        del self._by_server[sid]
        if frame.service == Error.SERVICE:
            raise KVStoreError(str(frame.fields.get("message")))

    def gather(self, sid, name, part, shard, ids, copy):
        """Rows ``ids`` of shard ``part`` of ``name`` (server ``sid``'s, mapped here),
        copied with ``copy(array, ids)``, while an update of it answered early may run;
        None when none of that shard is pending (read as usual), or when another write
        got in between (the outcome is then awaited, and the caller reads as usual).

        When the answer to that update is still to be read, the rows are copied first,
        while it travels: the counter before and after the copy then says whether they
        can be kept (it held the value before the update's, or the update's own).
        """
        early = None
        if self._unread.get(sid, (None,))[1:] == (name, part):
            before = int(shard.version[0])
            early = copy(shard.array, ids)
            after = int(shard.version[0])
        self._answer(sid)
        pending = self._by_server.get(sid)
        if pending is None or pending[:2] != (name, part):
            return None  # another shard's counter says nothing of this one's writers
        _, _, counter, updated, header, first = pending
        if early is not None and before in (counter - 1, counter, counter + 1) and \
                after in (counter - 1, counter, counter + 1):
            rows = early  # no write but the update's ran meanwhile
        else:
            if int(shard.version[0]) not in (counter, counter + 1):
                self.settle(sid)
                return None
            rows = copy(shard.array, ids)
            if int(shard.version[0]) not in (counter, counter + 1):
                self.settle(sid)
                return None
        self.beside += 1
        # found while the server may still be writing, then read again once done
        touched, later = self._touched(name, part, len(shard.array), updated, first, ids)
        if len(touched) and not later and header is not None and \
                self._read_first(sid, shard, counter, ids[touched], rows, touched, copy):
            return rows
        self.settle(sid)
        if len(touched):
            again = shard.read(lambda a: copy(a, ids[touched]))
            if again is None:
                return None
            rows[touched] = again
        return rows

    def _read_first(self, sid, shard, counter, ids, rows, at, copy):
        """Copy rows ``ids`` (all written first by the update pending at ``counter``)
        into ``rows[at]`` once the server has written them, while it writes the others;
        False when the update was done (or failed) by then: read them as usual."""
        header = shard.version
        if not _wait(header, counter, self._conns[sid], first=True) or \
                int(header[0]) != counter:
            return False
        again = copy(shard.array, ids)
        if int(header[0]) not in (counter, counter + 1):
            return False  # another write began after it: read as usual
        rows[at] = again
        self.first_read += 1
        return True

    def _touched(self, name, part, num_rows, updated, first, ids):
        """(positions in ``ids`` of rows in ``updated``, whether any of them is past its
        first ``first`` rows), both rows of a shard of ``num_rows``: marked in a byte per
        row, kept per shard and cleared after (~25 us at 4,096 ids, where a binary search
        took ~300 us; a shard of more rows than MARK_ROWS is searched with np.isin
        instead, to keep a trainer's marks small)."""
        marks = self._marks_of(name, part, num_rows)
        if marks is None:
            touched = np.flatnonzero(np.isin(ids, updated))
            later = not first or not np.isin(ids[touched], updated[:first]).all()
            return touched, later
        marks[updated] = 2
        marks[updated[:first]] = 1
        found = marks[ids]
        touched = np.flatnonzero(found)
        later = bool((found == 2).any())
        marks[updated] = 0
        return touched, later


def _put_first(ids, grads, hit):
    """Reorder an update's ``ids`` and ``grads`` (rows in place: the caller's buffer) so
    that the rows ``hit`` (bool per row) says come first; (the new ids, how many came
    first). Only the hit rows not yet in front move, each swapped with one that is."""
    k = int(np.count_nonzero(hit))
    if k == 0 or k == len(ids):
        return ids, 0  # nothing to put first, or all of it
    ahead, behind = np.flatnonzero(~hit[:k]), np.flatnonzero(hit[k:]) + k
    ids = ids.copy()
    ids[ahead], ids[behind] = ids[behind], ids[ahead]
    swapped = grads[ahead]
    grads[ahead] = grads[behind]
    grads[behind] = swapped
    return ids, k


def _failed(header, counter, conn, timeout=None):
    """Wait until the update a server answered early at seqlock ``counter`` is applied
    (the shard's ``header`` counter moved on); whether it failed: its Error frame is
    then on ``conn`` (sent before the counter moved). Also True when ``conn`` has
    something to read before that (the server gone: the caller's read says so).

    Raises:
        ServerUnavailableError: not applied within ``timeout`` s (default: the
            connection's wait for a frame).
    """
    return not _wait(header, counter, conn, timeout) or conn.pending()


def _wait(header, counter, conn, timeout=None, first=False):
    """Wait until the update answered early at seqlock ``counter`` is applied (the
    ``header``'s counter moved on), or with ``first`` until its first rows are
    (its second word holds ``counter``): True; False when ``conn`` has something to
    read before that (the server gone: the caller's read says so).

    Raises:
        ServerUnavailableError: not done within ``timeout`` s (default: the
            connection's wait for a frame).
    """
    if timeout is None:
        timeout = getattr(conn, "idle_timeout", None)
    start, spins = time.monotonic(), 0
    while header[0] == counter and not (first and header[1] == counter):
        spins += 1
        if not spins & 63:
            if conn.pending():
                return False
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                raise ServerUnavailableError(f"{getattr(conn, 'peer', 'server')}: an update "
                                             f"answered early not applied within {timeout} s")
            if waited > SPIN_S:
                time.sleep(NAP_S)
                continue
        os.sched_yield()  # a server sharing this core runs now
    return True
