"""KVService: turns protocol requests into calls on a KVServer (the server side of a job).

One service runs in each server process, behind any transport: ``handle(frame)`` takes a
request frame and returns the reply frame (None for a no-reply asynchronous update).
Every request is decoded and checked (:mod:`distemb.transport.messages`), and every id is
range-checked against its shard before a kernel sees it, so a bad request gets an error
reply and the server keeps serving.

Consistency of ``UPDATE`` (chosen by the trainers, see ``ClusterConfig.consistency``):

- ``sync`` / ``async``: applied on arrival, in arrival order (one writer per row).
- ``sync_exact`` (requests with ``exact``): the contributions of all trainers to step
  ``seq`` of a table are buffered, concatenated, their duplicate ids summed, and applied
  once; every trainer's request is answered after that one update, so two trainers on
  half batches equal one trainer on the whole batch.

An update may name rows its trainer prefetched (``watch``): the reply then carries
those the update (in ``sync_exact``, the step) wrote, as they are after it, so the
prefetched rows equal what a lookup after the update reads.

Example:
    >>> import numpy as np
    >>> from distemb.stores.dense import DenseSpec
    >>> from distemb.transport.messages import Create, Pull
    >>> svc = KVService(KVServer(), server_id=0, num_servers=1, num_trainers=1)
    >>> _ = svc.handle(Create.of_spec("w", DenseSpec((3, 2))).encode())
    >>> svc.handle(Pull(name="w", parts=[0], counts=[1], ids=np.array([2])).encode()).arrays[0]
    array([[0., 0.]], dtype=float32)
"""
import hmac
import logging
import math
import os
import sys
import threading

import numpy as np

from distemb import kernels
from distemb.config import ClusterConfig
from distemb.errors import KVStoreError, MissingKeyError, TransportError
from distemb.kernels.half import dtype_name
from distemb.kvstore.server.catalog import Catalog
from distemb.stores.dense import WEIGHT_DTYPES
from distemb.kvstore.server.early import answer_early, may_answer_early
from distemb.kvstore.server.exact import ExactSteps, held_reply
from distemb.kvstore.limits import check_request
from distemb.kvstore.server.kvserver import KVServer  # noqa: F401 (the docstring example uses it)
from distemb.rules import rule_of, state_name
from distemb.schema import default_of
from distemb.transport.base import FLAG_NO_REPLY, MAX_MESSAGE_BYTES, EarlyReply, Session
from distemb.transport.messages import Error, InShm, Reply, Service, decode_request
from distemb.transport.slots import SlotReader

log = logging.getLogger("distemb")


#: Tries of a versioned pull of a table whose lookups insert and evict keys: another
#: trainer's lookup may evict a key between its version and its row (then read again).
VERSIONED_PULL_TRIES = 5

class RefusedError(KVStoreError):
    """A request this connection may not make (no or failed handshake, another's rank)."""


class KVService:
    """Request handler of one KVStore server.

    Args:
        server: the :class:`KVServer` holding this server's shards.
        server_id, num_servers: this server's id; part p belongs to server p % num_servers.
        num_trainers: trainers that must say BYE (and join barriers and exact steps).
        timeout_s: how long a sync_exact step or a barrier waits for the other trainers.
        arena: a :class:`~distemb.transport.shm.ShmArena` to allocate shards in shared
            memory (and take co-located trainers' requests from their slots), or None
            for private memory.
        on_all_bye: called once every trainer has said BYE.
        token: the job's secret; a Hello without it is refused (None: no check).
        max_request_bytes: the most memory one request other than a Create or OptInit
            (bounded by the machine's memory) may make this server allocate: a reply's
            rows, the keys a lookup inserts (:func:`~distemb.kvstore.limits.check_request`).

    Trust: a connection's first request must be a Hello with the job's token and a rank
    in 0..num_trainers-1; that rank is the connection's for good, and a Barrier or Bye
    naming another is refused. A frame that does not decode, or a failed handshake, gets
    an error reply and the connection is closed.
    """

    def __init__(self, server, server_id, num_servers, num_trainers,
                 timeout_s=default_of(ClusterConfig, "timeout_s"), arena=None, on_all_bye=None,
                 token=None, max_request_bytes=MAX_MESSAGE_BYTES):
        self.server, self.server_id, self.num_servers = server, server_id, num_servers
        self.num_trainers, self.timeout_s = num_trainers, timeout_s
        self.arena, self.on_all_bye, self.token = arena, on_all_bye, token
        self.max_request_bytes = max_request_bytes
        self._cond = threading.Condition()  # barriers and byes
        self.exact_steps = ExactSteps(num_trainers, timeout_s)  # sync_exact buffers
        self._barrier_gen, self._barrier_count = 0, 0
        self._byes = set()
        # The tables themselves: creation, optimizer state, checkpoints, keys.
        self.catalog = Catalog(server, server_id, num_servers, arena, max_request_bytes)
        self._handlers = {Service.HELLO: self._hello, Service.PULL: self._pull,
                          Service.PUSH: self._push, Service.UPDATE: self._update,
                          Service.BARRIER: self._barrier, Service.BYE: self._bye,
                          Service.VERSIONED_PULL: self._versioned_pull,
                          **self.catalog.handlers()}

    def handle(self, frame, session=None):
        """The reply frame to request ``frame`` (an Error frame when it fails).

        Args:
            frame: the request.
            session: the :class:`~distemb.transport.base.Session` of the connection it
                came on (None: an in-process caller, trusted without a Hello).
        """
        session = session or Session(peer="in-process", trusted=True)
        session.in_slot = frame.service == Service.IN_SHM
        try:
            if session.in_slot:
                if session.rank is None and not session.trusted:
                    raise RefusedError("IN_SHM before Hello: a connection must first say "
                                       "Hello with its rank and the job's token")
                frame = self._from_slot(frame, session)
            msg = decode_request(frame)
            if msg.SERVICE != Service.HELLO and session.rank is None and not session.trusted:
                raise RefusedError(f"{msg.SERVICE.name} before Hello: a connection must "
                                   f"first say Hello with its rank and the job's token")
            reply = self._handlers[msg.SERVICE](msg, session)
            if isinstance(reply, EarlyReply):  # an update answered before it is applied
                return reply
        except Exception as e:  # any failure is the client's answer; the server goes on
            if isinstance(e, (TransportError, RefusedError)):
                session.closing = True  # undecodable or unauthorised: hang up after this
            if frame.flags & FLAG_NO_REPLY and not session.closing:
                log.warning("distemb server %d: asynchronous request failed: %s",
                            self.server_id, e)
                return None
            return Error(kind=type(e).__name__, message=f"server {self.server_id}: {e}"
                         ).encode()
        if frame.flags & FLAG_NO_REPLY:
            return None
        return (reply or Reply()).encode()

    # -- helpers ------------------------------------------------------------------------

    def _from_slot(self, frame, session):
        """The request an InShm frame wraps, its arrays viewed in the trainer's slot.

        A frame carrying a descriptor hands over a new slot (checked, then mapped, in
        place of the connection's last one); one without uses the connection's slot.
        The views are read while the trainer waits for the reply (it reuses the slot
        only after it), so the request is applied as if its arrays had come in the frame.
        """
        if self.arena is None:
            raise KVStoreError("request in shared memory, but this server has shared "
                               "memory off")
        msg = InShm.decode(frame)
        if len(frame.fds) > 1:
            raise TransportError(f"InShm: {len(frame.fds)} descriptors, expected at most "
                                 f"one (a new request slot)")
        if frame.fds:
            session.close()  # the previous slot: its mapping goes with its last view
            session.slot = SlotReader(frame.fds.pop(), msg.size)
        elif session.slot is None:
            raise TransportError("InShm: this connection has handed over no request slot "
                                 "(its first InShm frame must carry the slot's descriptor)")
        return msg.inner(session.slot.arrays(msg.size, msg.layout))

    def _rank(self, m, session):
        """Check that ``m.rank`` is this connection's rank (and a trainer's at all)."""
        if not 0 <= m.rank < self.num_trainers:
            raise RefusedError(f"rank: expected 0..{self.num_trainers - 1}, got {m.rank}")
        if not session.trusted and m.rank != session.rank:
            raise RefusedError(f"rank {m.rank}: this connection said Hello as rank "
                               f"{session.rank}; it may only speak for that rank")

    def _rows(self, m):
        """(part, store keys, slice) per part of a rows message: the table's keys checked
        against its router and mapped to each shard's store keys
        (:meth:`~distemb.kvstore.server.shard.ShardTable.local_keys`)."""
        out, start = [], 0
        for part, n in zip(m.parts, m.counts):
            sl = slice(start, start + n)
            start += n
            table = self.server.table(m.name, part)
            out.append((part, table.local_keys(m.ids[sl], f"shard {part} of {m.name!r}"), sl))
        return out

    def _row_bytes(self, name, part):
        """Bytes of one row of shard ``part`` of ``name`` in a reply."""
        shape = self.server.shard(name, part).shape[1:]
        return self.server.row_dtype(name, part).itemsize * math.prod(shape)  # exact ints

    # -- handlers -----------------------------------------------------------------------

    def _hello(self, m, session):
        if self.token is not None and not m.token:
            raise RefusedError("Hello: no job token, and this server's job has one: the "
                               "process's cluster config has no job_token (use the config "
                               "the job's launcher wrote, which distemb-launch hands every "
                               "process in $DISTEMB_CONFIG)")
        if self.token is not None and not hmac.compare_digest(m.token.encode(),
                                                              self.token.encode()):
            raise RefusedError("Hello: wrong job token (this process is not part of the "
                               "job that started this server)")
        if not 0 <= m.rank < self.num_trainers:
            raise RefusedError(f"Hello.rank: expected 0..{self.num_trainers - 1}, got "
                               f"{m.rank}")
        if session.rank is not None and session.rank != m.rank:
            raise RefusedError(f"Hello.rank {m.rank}: this connection is rank "
                               f"{session.rank}")
        session.rank = m.rank
        return Reply(fields={"server_id": self.server_id, "num_servers": self.num_servers,
                             "pid": os.getpid(), "torch_imported": "torch" in sys.modules,
                             "shared_memory": self.arena is not None})

    def _pull(self, m, session):
        rows = self._rows(m)
        first = self.server.shard(m.name, m.parts[0]) if m.parts else None
        if first is None:
            return Reply(arrays=[np.empty((0,), np.float32)])
        dtype = self.server.row_dtype(m.name, m.parts[0])
        for part in m.parts[1:]:
            arr = self.server.shard(m.name, part)
            if arr.shape[1:] != first.shape[1:] or \
                    self.server.row_dtype(m.name, part) != dtype:
                raise KVStoreError(f"shards {m.parts[0]} and {part} of {m.name!r} differ in "
                                   f"row shape or dtype")
        check_request(m.ids.shape[0] * self._row_bytes(m.name, m.parts[0]),
                      self.max_request_bytes, f"pull of {m.ids.shape[0]} rows of {m.name!r}")
        out = np.empty((m.ids.shape[0],) + first.shape[1:], dtype=dtype)
        for part, ids, sl in rows:
            self.server.pull(m.name, part, ids, out=out[sl])
        return Reply(arrays=[out])

    def _push(self, m, session):
        for part, ids, sl in self._rows(m):
            shard = self.server.shard(m.name, part)
            want = self.server.row_dtype(m.name, part)
            if m.values.dtype != want or m.values.shape[1:] != shard.shape[1:]:
                raise KVStoreError(f"values of {m.name!r}: expected {dtype_name(np.empty(0, want))} "
                                   f"rows of shape {shard.shape[1:]}, got "
                                   f"{dtype_name(m.values)} {m.values.shape[1:]}")
            self.server.push(m.name, part, ids, m.values[sl])

    def _update(self, m, session):
        if m.grads.dtype != np.float32 or m.grads.ndim != 2:
            raise KVStoreError(f"grads of {m.name!r}: expected 2-d float32, got "
                               f"{m.grads.dtype} {m.grads.ndim}-d")
        # The wire carries the hyperparameters' fields: check them against the rule now,
        # naming a missing, unknown or mistyped field, before any row is touched.
        m.hyper = rule_of(m.rule).hyper_from(m.hyper)
        for part in m.parts:
            weight = self.server.shard(m.name, part)
            if dtype_name(weight) not in WEIGHT_DTYPES or weight.ndim != 2 or \
                    weight.shape[1] != m.grads.shape[1]:
                raise KVStoreError(f"grads of {m.name!r}: expected rows of {weight.shape[1:]} "
                                   f"for a {dtype_name(weight)} table, got "
                                   f"{m.grads.shape[1:]}")
        if m.exact:
            self._rows(m)  # reject bad ids before they are buffered
            self._watched(m)
            return self.exact_steps.join(m, session, self._apply_summed)
        rows = self._rows(m)
        watched = self._watched(m)
        if watched is None and may_answer_early(m, session is not None and session.in_slot):
            (part, ids, _), = rows
            early = answer_early(self.server, self.server_id, m, part, ids)
            if early is not None:
                return early
        for part, ids, sl in rows:
            self.server.update(m.name, part, ids, m.grads[sl], m.rule, m.hyper)
        return self._with_watch(m, self._versions_reply(m), watched,
                                {part: ids for part, ids, _ in rows})

    def _watched(self, m):
        """``[(part, store keys, slice)]`` of update ``m``'s watched keys (checked as its
        ids are), or None when it watches none."""
        if m.watch is None:
            return None
        out, start = [], 0
        for part, n in zip(m.watch_parts, m.watch_counts):
            sl = slice(start, start + n)
            start += n
            table = self.server.table(m.name, part)
            out.append((part, table.local_keys(m.watch[sl], f"shard {part} of {m.name!r}"),
                        sl))
        return out

    def _with_watch(self, m, reply, watched, written):
        """``reply`` with the answer to ``m.watch`` appended (see
        :class:`~distemb.transport.messages.Update`): ``written`` is {part: the store keys
        the update wrote}."""
        if watched is None:
            return reply
        dim = tuple(m.grads.shape[1:])
        pos, rows, gone = [np.empty(0, np.int64)], [np.empty((0,) + dim, np.float32)], \
            [np.empty(0, np.int64)]
        for part, keys, sl in watched:
            hit = np.flatnonzero(np.isin(keys, written.get(part, ())))
            if not len(hit):
                continue
            table = self.server.table(m.name, part)
            held = table.contains(keys[hit])
            pos.append(hit[held] + sl.start)
            gone.append(hit[~held] + sl.start)
            rows.append(table.get(keys[hit[held]]).astype(np.float32, copy=False))
        reply = reply or Reply()
        reply.arrays = list(reply.arrays) + [np.concatenate(pos), np.concatenate(rows),
                                             np.concatenate(gone)]
        return reply

    def _versions_reply(self, m):
        """The versions of ``m``'s rows, when it asked for them (a trainer cache): -1 for
        a key its update dropped (gone since the lookup), which stays gone."""
        if not m.versions:
            return None
        out = np.empty(m.ids.shape[0], np.int64)
        for part, ids, sl in self._rows(m):
            out[sl] = self.server.versions(m.name, part, ids, insert=False)
        return Reply(arrays=[out])

    def _versioned_pull(self, m, session=None):
        """Rows (and optimizer states) whose version differs from the trainer's copy."""
        if not m.parts:
            raise KVStoreError(f"versioned pull of {m.name!r}: no partitions named")
        parts = self._rows(m)
        row_bytes = 16 + sum(self._row_bytes(name, m.parts[0]) for name in  # position, version
                             [m.name] + [state_name(m.name, s) for s in m.states])
        what = f"versioned pull of {m.ids.shape[0]} rows of {m.name!r}"
        inserting = any(self.server.table(m.name, p).inserts_on_read for p in m.parts)
        if inserting:  # its versions insert absent keys: every row may be new, check first
            check_request(m.ids.shape[0] * row_bytes, self.max_request_bytes, what)
        found = []
        for part, ids, sl in parts:
            # Versions first: a row written meanwhile then carries an older version than
            # its contents, which the next validation refetches (never the reverse).
            cur = self.server.versions(m.name, part, ids)
            found.append((part, ids, sl, cur, np.flatnonzero(cur != m.have[sl])))
        check_request(sum(len(f[4]) for f in found) * row_bytes, self.max_request_bytes, what)
        pos, vers, rows, states = [], [], [], [[] for _ in m.states]
        for part, ids, sl, cur, stale in found:
            have = m.have[sl]
            for attempt in range(VERSIONED_PULL_TRIES):
                try:
                    # the versions counted the lookup of every row, those the trainer holds too
                    got = self.server.pull(m.name, part, ids[stale], access=False)
                    keep = ids[stale[have[stale] != -1]]  # -1: the trainer keeps only the row
                    got_states = [self.server.pull(state_name(m.name, sname), part, keep)
                                  for sname in m.states]
                    break
                except MissingKeyError:
                    # Another trainer's lookup evicted a key the versions had inserted
                    # (versions and rows are two holds of the shard's lock): insert again.
                    if not inserting or attempt == VERSIONED_PULL_TRIES - 1:
                        raise
                    cur = self.server.versions(m.name, part, ids)
                    stale = np.flatnonzero(cur != have)
            pos.append(stale + sl.start)
            vers.append(cur[stale])
            rows.append(got)
            for i, st in enumerate(got_states):
                states[i].append(st)
        return Reply(arrays=[np.concatenate(pos), np.concatenate(vers), np.concatenate(rows)]
                     + [np.concatenate(st) for st in states])

    def _apply_summed(self, contribs):
        """Sum every trainer's rows of each part (duplicates added) and update once."""
        rows = {id(m): self._rows(m) for m in contribs}
        per_part = {}
        for m in contribs:
            for part, ids, sl in rows[id(m)]:
                per_part.setdefault(part, []).append((ids, m.grads[sl]))
        first = contribs[0]
        applied = {}
        for part, pieces in per_part.items():
            ids = np.concatenate([p[0] for p in pieces])
            grads = np.concatenate([p[1] for p in pieces])
            uniq, summed = kernels.dedup_sum(ids, grads, num_threads=self.server.num_threads)
            # Each trainer's ids are unique: a row's count is its number of contributors.
            counts = np.bincount(np.searchsorted(uniq, ids), minlength=len(uniq))
            before = self.server.update(first.name, part, uniq, summed, first.rule,
                                        first.hyper, contributions=counts)
            applied[part] = (uniq, summed, counts, before)
        written = {part: a[0] for part, a in applied.items()}
        return {id(c): self._with_watch(
            c, self._versions_reply(c) if c.have is None else
            Reply(arrays=held_reply(c, rows[id(c)], applied)), self._watched(c), written)
            for c in contribs}

    def _barrier(self, m, session):
        self._rank(m, session)
        with self._cond:
            gen = self._barrier_gen
            self._barrier_count += 1
            if self._barrier_count == self.num_trainers:
                self._barrier_gen, self._barrier_count = gen + 1, 0
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._barrier_gen != gen, self.timeout_s):
                self._barrier_count -= 1
                raise KVStoreError(f"barrier: not every one of {self.num_trainers} trainers "
                                   f"arrived within {self.timeout_s} s")

    def _bye(self, m, session):
        self._rank(m, session)
        with self._cond:
            self._byes.add(m.rank)
            done = len(self._byes) >= self.num_trainers
        if done and self.on_all_bye:
            self.on_all_bye()

