"""The transport of a collective job: its all-to-all exchange over torch.distributed, with
its header, payloads and failures.

Every storage call of :class:`~distemb.kvstore.collective.CollectiveKVClient` is one or
two rounds of an exchange over the client's own gloo group:

- a **header** round: each rank sends every rank (operation, checksum of the tables it
  names, sequence number, bytes of the payload to follow); every rank checks that all are
  in the same call (the same operation on the same tables, the same sequence number), so
  ranks whose calls went apart raise on every rank instead of mixing rows of two tables;
- a **payload** round: one flat byte buffer per destination, built by :class:`~distemb.transport.sections.Payload`
  from sections (ids, rows, counts) each padded to 8 bytes, so a receiver reads every
  section in place (:class:`~distemb.transport.sections.Received`) at an aligned offset.

A call naming several tables (a grouped lookup, the update of every table of an
optimizer) is one header and one payload per direction for all of them, whatever their
row lengths and dtypes: the payload to a rank holds each table's section in turn.

Failures: a rank that dies or stops answering makes the others' round fail within the
group's timeout; :meth:`Exchange.failure` then names the ranks that did not report in the
job's rendezvous store within :data:`REPORT_GRACE_S`, and those that closed their client
(:meth:`Exchange.leave`) after fewer calls than this rank: they are not dead, they made
fewer calls (took fewer steps, say).

It also joins the job's process group (:func:`join_process_group`) and groups a call's
ids by owning rank (:class:`Routed`). Everything here is torch.distributed's ``all_to_all_single``/``all_gather_object``/
``barrier`` on CPU tensors (gloo). The same calls run on an NCCL group with the buffers
on the group's device.

The byte layout of a payload is :mod:`distemb.transport.sections`.

Example (the grouping; an :class:`Exchange` needs a process group):
    >>> r = Routed(np.array([1, 0, 1]), np.array([7, 8, 9]), world_size=2)
    >>> r.counts.tolist(), r.ids.tolist(), r.of(1, r.ids).tolist()
    ([1, 2], [8, 7, 9], [7, 9])
"""
import datetime
import os
import time
import zlib
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from distemb.errors import DistEmbError, KVStoreError
from distemb.transport.sections import Payload, Received, padded

#: Operation codes of the header.
PULL, PUSH, UPDATE, KEYS = 1, 2, 3, 4
OP_NAMES = {PULL: "pull", PUSH: "push", UPDATE: "push_update", KEYS: "key request"}
#: Longest wait, after a failed round, for the other ranks to report in.
REPORT_GRACE_S = 5.0
def names_crc(names: Sequence[str]) -> int:
    """Checksum of the table names a call is about (in order)."""
    return zlib.crc32("\x00".join(names).encode("utf-8"))


def describe(op: int, names: Sequence[str]) -> str:
    """'pull of 'a'' or 'push_update of ['a', 'b']': a call, for error messages."""
    what = repr(names[0]) if len(names) == 1 else repr(list(names))
    return f"{OP_NAMES.get(op, f'operation {op}')} of {what}"


class Exchange:
    """The rounds of a collective client over ``group`` (gloo, this process's rank in it).

    Args:
        group: the process group of the client (its own: no other traffic on it).
        timeout_s: the group's timeout (a round waits that long for the other ranks).
        store: the job's rendezvous store (naming dead ranks), or None.
        tag: a prefix of this client's keys in ``store``, the same on every rank.

    Attributes:
        bytes_sent: bytes this rank has sent to other ranks (headers and payloads).
        seq: rounds of headers so far (equal on every rank while they agree).
    """

    def __init__(self, group, timeout_s: float, store=None, tag: str = "distemb-collective"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.store, self.tag = store, tag
        self.bytes_sent = 0
        self.seq = 0

    def guard(self, what: str, fn):
        """Run collective ``fn``; a failure of the group becomes a KVStoreError naming
        the ranks that did not report."""
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
            raise self.failure(what, e) from e

    def failure(self, what: str, error: Exception) -> KVStoreError:
        """The error of a failed round: every rank still alive writes its key in the
        job's store; those missing after a short wait are named."""
        msg = f"collective {what} failed on rank {self.rank} of {self.world_size}"
        if self.store is None:
            return KVStoreError(f"{msg}: {error}")
        key = f"{self.tag}/failed/{self.seq}"
        try:
            self.store.set(f"{key}/{self.rank}", "1")
            self._abort_group()
            grace = min(REPORT_GRACE_S, self.timeout_s)
            missing, closed = self._wait_reports(key, grace)
        except Exception as e:  # noqa: BLE001 - the store's own host may be the dead one
            return KVStoreError(f"{msg}: {error}; the job's rendezvous store is unreachable "
                                f"too ({e}): the rank or launcher hosting it (rank 0 under "
                                "a tcp:// init) has likely died")
        if not missing:
            return KVStoreError(f"{msg}: every rank is alive, the exchange itself failed: "
                                f"{error}")
        said = []
        if closed:
            after = ", ".join(f"rank {r} after {n} exchange(s)" for r, n in closed.items())
            said.append(f"{after} closed distemb, and this rank is in exchange {self.seq} "
                        f"({what}): every rank must make the same distemb calls, so a rank "
                        "with fewer batches must still take part in every step (a step "
                        "with no lookups is fine)")
        silent = [r for r in missing if r not in closed]
        if silent:
            said.append(f"rank(s) {silent} did not report within {grace} s of the failure "
                        "(dead or hung, or busy elsewhere without closing distemb)")
        return KVStoreError(f"{msg}: {'; '.join(said)}; cause: {error}")

    def _wait_reports(self, key: str, grace: float):
        """(ranks that did not report within ``grace``, {closed rank: its exchanges}),
        leaving early once every rank missing has closed distemb (it never will). Rank 0,
        which hosts the store under torchrun and a tcp:// init, then waits for every rank
        that reported to have read its answer before it returns (and its process may exit,
        taking the store with it)."""
        deadline = time.monotonic() + grace
        missing, closed = list(range(self.world_size)), {}
        while True:
            missing = [r for r in missing if not self.store.check([f"{key}/{r}"])]
            closed = {r: int(self.store.get(self._closed_key(r))) for r in missing
                      if self.store.check([self._closed_key(r)])}
            if len(closed) == len(missing) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.store.set(f"{key}/read/{self.rank}", "1")
        if self.rank == 0:
            readers = [r for r in range(self.world_size) if r not in missing]
            while readers and time.monotonic() < deadline + grace:
                readers = [r for r in readers if not self.store.check([f"{key}/read/{r}"])]
                if readers:
                    time.sleep(0.05)
        return missing, closed

    def _abort_group(self) -> None:
        """Drop this rank's connections of the failed group, so a rank blocked on this one
        in the same exchange (gloo's all_to_all waits on its peers in turn) fails now and
        reports within the grace, rather than when this process exits and takes the
        store it hosts with it. The group is unusable after a failed round anyway."""
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - a backend without abort: the peers time out
            pass

    def _closed_key(self, rank: int) -> str:
        return f"{self.tag}/closed/{rank}"

    def leave(self) -> None:
        """Say in the job's store that this rank closed its client after :attr:`seq`
        exchanges, so that a rank still waiting for it is told it made fewer calls, not
        that it died. Best effort: without a store, or with its host gone, nothing."""
        if self.store is None:
            return
        try:
            self.store.set(self._closed_key(self.rank), str(self.seq))
        except Exception:  # noqa: BLE001 - the store's host may have gone first
            pass

    def gather_objects(self, what: str, obj) -> list:
        """``obj`` of every rank, in rank order (``all_gather_object``)."""
        out = [None] * self.world_size
        self.guard(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self) -> None:
        self.guard("barrier", lambda: dist.barrier(group=self.group))

    def all_to_all(self, what: str, send: np.ndarray, sizes_out, sizes_in) -> np.ndarray:
        """``send`` (flat uint8, ``sizes_out[r]`` bytes for rank r in rank order) to every
        rank; the bytes received (``sizes_in[r]`` from rank r)."""
        recv = torch.empty(int(np.sum(sizes_in)), dtype=torch.uint8)
        self.bytes_sent += int(np.sum(sizes_out)) - int(sizes_out[self.rank])
        self.guard(what, lambda: dist.all_to_all_single(
            recv, torch.from_numpy(send), [int(s) for s in sizes_in],
            [int(s) for s in sizes_out], group=self.group))
        return recv.numpy()

    def header(self, op: int, names: Sequence[str], sizes_out) -> np.ndarray:
        """Exchange (op, tables, sequence, payload bytes) with every rank; the payload
        bytes each rank will send here.

        Raises:
            KVStoreError: a rank is in another call (every rank raises, naming the first).
        """
        self.seq += 1
        what = describe(op, names)
        mine = np.array([op, names_crc(names), self.seq], np.int64)
        send = np.empty((self.world_size, 4), np.int64)
        send[:, :3] = mine
        send[:, 3] = sizes_out
        size = np.full(self.world_size, send[0].nbytes, np.int64)
        recv = self.all_to_all(what, send.view(np.uint8).reshape(-1), size,
                               size).view(np.int64).reshape(self.world_size, 4)
        apart = [r for r in range(self.world_size) if not np.array_equal(recv[r, :3], mine)]
        if apart:
            r = apart[0]
            op_r = OP_NAMES.get(int(recv[r, 0]), f"operation {int(recv[r, 0])}")
            raise KVStoreError(
                f"collective {what}: rank {r} is in {op_r} of other or the same tables "
                f"(exchange {int(recv[r, 2])}, this rank's {self.seq}): every rank must "
                "make the same distemb calls in the same order (e.g. state_dict() or a "
                "lookup on one rank only)")
        return recv[:, 3].copy()

    def round(self, op: int, names: Sequence[str], payload: Payload):
        """A header, then ``payload``: the :class:`Received` sections of every rank."""
        buf, sizes = payload.build()
        sizes_in = self.header(op, names, sizes)
        return Received(self.all_to_all(describe(op, names), buf, sizes, sizes_in), sizes_in)

    def reply(self, op: int, names: Sequence[str], payload: Payload, sizes_in) -> "Received":
        """The second round of a call (no header): ``payload`` back, ``sizes_in`` bytes
        expected from each rank (both sides know them from the first round)."""
        buf, sizes = payload.build()
        return Received(self.all_to_all(describe(op, names), buf, sizes, sizes_in), sizes_in)

    def reply_later(self, op: int, names: Sequence[str], payload: Payload, sizes_in):
        """:meth:`reply`, started now and finished in the background (the prefetched rows
        of a step travel while the next batch is prepared).

        Returns:
            a callable that waits for the round and returns its :class:`Received`.
        """
        buf, sizes = payload.build()
        recv = torch.empty(int(np.sum(sizes_in)), dtype=torch.uint8)
        send = torch.from_numpy(buf)
        self.bytes_sent += int(np.sum(sizes)) - int(sizes[self.rank])
        what = describe(op, names)
        work = self.guard(what, lambda: dist.all_to_all_single(
            recv, send, [int(x) for x in sizes_in], [int(x) for x in sizes],
            group=self.group, async_op=True))
        done, keep = [], [send]  # the send buffer lives until the round is over

        def wait():
            if not done:
                self.guard(what, work.wait)
                done.append(Received(recv.numpy(), sizes_in))
                keep.clear()
            return done[0]
        return wait

    def anyone(self, op: int, names: Sequence[str], flag: bool) -> bool:
        """One header round (so ranks in other calls raise): whether any rank's ``flag``
        is set."""
        got = self.header(op, names, np.full(self.world_size, int(bool(flag)), np.int64))
        return bool(got.any())


    # -- the routed rounds of a call: each table's ids to their owners ------------------

    def send(self, op, names, routes, columns, flags=None, label=None, more=None):
        """One round: to each rank, the counts of ids of every table (and ``flags``, one
        int64 per table, when given), each table's ids, then each table's rows of every
        column of ``columns`` (a list of arrays per table, in the caller's id order; the
        same number, dtypes and row shapes on every rank), then ``more`` ids per table.

        Args:
            routes: a :class:`Routed` per table.
            label: what the header names (default: ``names``).
            more: a second :class:`Routed` per table (keys a step's owners answer after
                it: a prefetch's), or None.

        Returns:
            per table ``(ids received in rank order, [each column's rows received], ids
            from each rank)``, and the (tables, W) flags each rank sent (zeros without
            ``flags``); with ``more``, a third item: per table ``(its more ids received
            in rank order, the count from each rank)``.
        """
        w, n = self.world_size, len(names)
        payload = Payload(w)
        for d in range(w):
            payload.add(d, np.array([r.counts[d] for r in routes], np.int64))
            if flags is not None:
                payload.add(d, np.asarray(flags, np.int64))
            for r in routes:
                payload.add(d, r.of(d, r.ids))
        taken = [[c[r.pos] for c in cols] for r, cols in zip(routes, columns)]
        for d in range(w):
            for r, cols in zip(routes, taken):
                for c in cols:
                    payload.add(d, r.of(d, c))
            if more is not None:
                payload.add(d, np.array([r.counts[d] for r in more], np.int64))
                for r in more:
                    payload.add(d, r.of(d, r.ids))
        got = self.round(op, names if label is None else label, payload)
        counts = np.empty((n, w), np.int64)
        sent = np.zeros((n, w), np.int64)
        ids = [[] for _ in range(n)]
        for src in range(w):
            counts[:, src] = got.take(src, np.int64, (n,))
            if flags is not None:
                sent[:, src] = got.take(src, np.int64, (n,))
            for t in range(n):
                ids[t].append(got.take(src, np.int64, (counts[t, src],)))
        rows = [[[] for _ in cols] for cols in taken]
        extra = [[] for _ in range(n)]
        extra_counts = np.zeros((n, w), np.int64)
        for src in range(w):
            for t, cols in enumerate(taken):
                for j, c in enumerate(cols):
                    rows[t][j].append(got.take(src, c.dtype, (counts[t, src],) + c.shape[1:]))
            if more is not None:
                extra_counts[:, src] = got.take(src, np.int64, (n,))
                for t in range(n):
                    extra[t].append(got.take(src, np.int64, (extra_counts[t, src],)))
        out = [(np.concatenate(ids[t]), [np.concatenate(c) for c in rows[t]], counts[t])
               for t in range(n)]
        if more is None:
            return out, sent
        return out, sent, [(np.concatenate(extra[t]), extra_counts[t]) for t in range(n)]

    def ask(self, op, names, routes, answer, reply, label=None):
        """A call that sends each table's ids to their owners and brings one answer row
        per id back: three rounds for all the tables (header, ids, answers).

        Args:
            routes: a :class:`Routed` per table.
            answer: ``answer(t, ids from every rank in rank order)`` -> the owner's answer
                rows for them, in order.
            reply: ``reply(t)`` -> (dtype, row shape) of table ``t``'s answers.
            label: what the header names (default: ``names``).

        Returns:
            per table, the answers in the order of its ids.
        """
        label = names if label is None else label
        got, _ = self.send(op, names, routes, [[] for _ in names], label=label)
        shapes = [reply(t) for t in range(len(names))]
        payload = Payload(self.world_size)
        answers = [answer(t, ids) for t, (ids, _, _) in enumerate(got)]
        for src in range(self.world_size):
            for (_, _, counts), rows in zip(got, answers):
                lo = int(counts[:src].sum())
                payload.add(src, rows[lo:lo + counts[src]])
        sizes = [sum(padded(int(r.counts[d]) * np.dtype(dt).itemsize *
                            int(np.prod(shape, dtype=np.int64)))
                     for r, (dt, shape) in zip(routes, shapes))
                 for d in range(self.world_size)]
        back = self.reply(op, label, payload, sizes)
        out = []
        for r, (dt, shape) in zip(routes, shapes):
            rows = np.empty((int(r.counts.sum()),) + tuple(shape), dt)
            if len(r.pos):
                rows[r.pos] = np.concatenate([back.take(d, dt, (int(r.counts[d]),) + shape)
                                              for d in range(self.world_size)])
            out.append(rows)
        return out

    def everyone(self, what, name, arrays):
        """Send ``arrays`` (this rank's) to every rank: each rank's, in rank order (a
        header round, so ranks in other calls raise)."""
        payload = Payload(self.world_size)
        head = np.array([len(a) for a in arrays], np.int64)
        for d in range(self.world_size):
            payload.add(d, head)
            for a in arrays:
                payload.add(d, a)
        got = self.round(KEYS, [f"{what} of", name], payload)
        out = []
        for src in range(self.world_size):
            n = got.take(src, np.int64, (len(arrays),))
            out.append([got.take(src, a.dtype, (int(k),) + a.shape[1:]).copy()
                        for a, k in zip(arrays, n)])
        return out


def join_process_group(timeout_s=60.0):
    """Make the default process group (gloo) from torchrun's environment unless one
    exists: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Returns
    whether it made one (its maker destroys it: see ``CollectiveKVClient(own_group=)``).

    Raises:
        DistEmbError: no group, and the environment lacks one of them (the message
            names it and says how to launch).
    """
    if dist.is_initialized():
        return False
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if not os.environ.get(v)]
    if missing:
        raise DistEmbError(f"mode='collective': no torch.distributed process group, and "
                           f"{', '.join(missing)} not set to make one; start every rank with "
                           "`torchrun --nproc-per-node N train.py`, or call "
                           "torch.distributed.init_process_group() first")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


class Routed:
    """The ids of one table of a call, grouped by owning rank.

    Args:
        owners: (N,) int64 rank owning each id.
        ids: (N,) int64 global ids.
        world_size: the number of ranks.

    Attributes:
        counts: (W,) int64 ids for each rank.
        pos: positions in the caller's ids, in rank order.
        ids: the ids, in rank order.
        bounds: (W + 1,) offsets of each rank's ids in ``pos`` and ``ids``.
    """

    def __init__(self, owners, ids, world_size):
        self.counts = np.bincount(owners, minlength=world_size).astype(np.int64)
        if world_size == 1:
            self.pos = np.arange(len(ids))
        else:
            self.pos = np.argsort(owners, kind="stable")
        self.ids = ids[self.pos]
        self.bounds = np.concatenate([[0], np.cumsum(self.counts)])

    def of(self, rank, array):
        """The rows of ``array`` (in rank order) that go to ``rank``."""
        return array[self.bounds[rank]:self.bounds[rank + 1]]
