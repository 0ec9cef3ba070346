"""CollectiveKVClient: tables sharded across the ranks of a torch.distributed job.

No servers: rank ``r`` of a ``W``-process job (torchrun, mpirun, or a group the user
made) is holder ``r`` of ``W`` of every table's shards (shard ``p`` on rank ``p % W``,
as servers hold them: one range per rank for the default policy, the keys its router
sends to ``r`` for a hash or file table), in its own in-process
:class:`~distemb.kvstore.server.kvserver.KVServer`: an embedded
:class:`~distemb.kvstore.local.LocalKVClient` of its shards. The ranks exchange rows
over their own gloo group with ``all_to_all_single``, as torchrec and SOK do
(:mod:`distemb.transport.collective`).

Every storage call is collective (the same calls on the same tables in the same order on
every rank): a pull exchanges a header, then the ids, then the rows; a push or update the
header, then ids and rows together, each owner summing the ranks' contributions per id in
rank order and stepping once, so every step is the step of one process on the
concatenated batch. ``pull_many`` and ``apply_gradients`` move every table of the call in
those same rounds. A header that disagrees, or a rank that dies, raises
:class:`~distemb.errors.KVStoreError` on every rank within the group's timeout. Key
management, checkpoints (the format of every placement) and what this mode refuses (store
objects, GPU lookups, caches) are described in ``docs/cluster.md``; prefetch
(the keys ride in the step's round, the rows come back in a background round) in
``docs/prefetch.md``.

This module imports torch: server processes never import it.

Example:
    >>> import tempfile
    >>> from distemb.partition import range_policy
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdv",
    ...                         rank=0, world_size=1)
    >>> kv = CollectiveKVClient(timeout_s=10)
    >>> kv.init_data("t", (4, 2), "float32", range_policy(4, kv.world_size))
    >>> kv.push("t", np.array([3]), np.ones((1, 2), np.float32))
    >>> kv.pull("t", np.array([3, 0])).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
    >>> kv.close(); dist.destroy_process_group()
"""
import dataclasses
import datetime
import uuid

import numpy as np
import torch.distributed as dist

from distemb import kernels
from distemb.errors import KVStoreError, MissingKeyError
from distemb.kernels import half
from distemb.kernels.hashtable import keys_array
from distemb.transport.collective import KEYS, PULL, PUSH, UPDATE, Exchange, Routed
from distemb.transport.sections import Payload, padded
from distemb.kvstore.local import LocalKVClient, column_name
from distemb.kvstore.prefetch import Prefetch, Prefetches
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.types import refuse_non_finite
from distemb.stores.init import KeyInit, ShardInit
from distemb.stores.types import WEIGHT


#: The flag of a table in a step's round whose gradients on the sending rank are not
#: finite (1: it has gradients, 0: none).
_NOT_FINITE = 2


def signature(name, spec, exists):
    """What every rank's creation of table ``name`` must agree on: the spec's fields (a
    policy by its partitions, an initialiser by its parameters or its function's name)."""
    sig = {"kind": spec.kind, "exists": exists}
    for f in dataclasses.fields(spec) if dataclasses.is_dataclass(spec) else ():
        value = getattr(spec, f.name)
        if f.name == "init":
            fn = value.fn if isinstance(value, ShardInit) else value
            value = repr(value.spec()) if isinstance(value, KeyInit) else \
                getattr(fn, "__qualname__", type(fn).__name__)
        elif f.name == "policy":
            try:
                value = (value.policy_str, [value.id_progression(p)
                                            for p in range(value.num_partitions)])
            except NotImplementedError:
                value = (value.policy_str, value.num_partitions, value.get_size())
        sig[f.name] = value
    return sig


class CollectiveKVClient(LocalKVClient):
    """Every rank of a torch.distributed job holds its shards of every table.

    Args:
        timeout_s: how long an exchange waits for the other ranks before it is an error
            (the timeout of this client's own gloo group).
        num_threads: OpenMP threads of this rank's kernels.
        group: the ranks sharing the tables (default: the whole default group; it must
            be initialized). This client makes its own gloo group over them, so its
            exchanges never interleave with the user's (e.g. DDP's NCCL) collectives.
        own_group: destroy the default group on :meth:`close` (distemb made it).

    Raises:
        KVStoreError: torch.distributed is not initialized.
    """

    sharded = True
    shard_holders = "ranks"
    #: ``opt.save``/``opt.load`` run on every rank (checkpoint.save_items' ``writer``).
    all_ranks_checkpoint = True

    def __init__(self, timeout_s=60.0, num_threads=1, group=None, own_group=False):
        if not dist.is_available() or not dist.is_initialized():
            raise KVStoreError("CollectiveKVClient: torch.distributed is not initialized "
                               "(distemb.initialize(mode='collective') creates the group "
                               "from torchrun's environment)")
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.timeout_s = float(timeout_s)
        self._own_group = own_group
        self._group = dist.new_group(ranks=ranks, backend="gloo",
                                     timeout=datetime.timedelta(seconds=self.timeout_s))
        try:  # the rendezvous store, to name the ranks that died (Exchange.failure)
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a private API: without it, ranks go unnamed
            store = None
        self._x = Exchange(self._group, self.timeout_s, store)
        self.rank, self.world_size = self._x.rank, self._x.world_size
        # tables default to one range per rank; rank r holds shards p % W == r
        self.num_servers = self.num_trainers = self.num_holders = self.world_size
        super().__init__(KVServer(server_id=self.rank, num_threads=num_threads))
        #: keys prefetched for coming lookups, read at the next step (:meth:`prefetch`)
        self.prefetches = Prefetches()
        tags = self._x.gather_objects("initialize", uuid.uuid4().hex)
        self._x.tag = f"distemb-collective/{tags[0]}"

    @property
    def exchanges(self):
        """Calls that exchanged so far (each a header round and one or two payload rounds:
        a lookup of any number of tables is one, a step of any number of tables one)."""
        return self._x.seq

    @property
    def bytes_sent(self):
        """Bytes this rank has sent to other ranks (headers, ids, rows, gradients)."""
        return self._x.bytes_sent

    def _routed(self, table, ids):
        """``ids`` (the table's keys) grouped by owning rank."""
        ids = keys_array(ids)
        owners = table.router.part_of(ids) % self.world_size if self.world_size > 1 else \
            np.zeros(len(ids), np.int64)
        return Routed(owners, ids, self.world_size)

    def _agree(self, what, name, sig):
        """Collective: every rank's ``sig`` (a dict) of table ``name`` must equal rank 0's.

        Raises:
            KVStoreError: on every rank, naming the first rank that differs and how.
        """
        sigs = self._x.gather_objects(f"{what} of {name!r}", sig)
        for r, other in enumerate(sigs):
            if other != sigs[0]:
                diff = sorted(k for k in set(sig) | set(other)
                              if other.get(k) != sigs[0].get(k))
                raise KVStoreError(f"table {name!r}: rank {r} defines it differently from "
                                   f"rank 0 ({', '.join(diff)}: {[other.get(k) for k in diff]} "
                                   f"vs {[sigs[0].get(k) for k in diff]}); every rank must "
                                   "create the same tables in the same order")

    # -- tables -----------------------------------------------------------------------

    def create_table(self, name, spec):
        """Collective: every rank makes its shards of table ``name`` from ``spec``.

        Raises:
            KVStoreError: the ranks define ``name`` differently (every rank raises, naming
                the first that differs), ``name`` exists with another spec, or ``spec``
                is a store object (one process's).
        """
        self.check_spec(name, spec)
        self._agree("creation", name, signature(name, spec, name in self.tables))
        super().create_table(name, spec)

    def _write_initial(self, table, keys, rows):
        LocalKVClient._write(self, table, WEIGHT, keys, rows)  # this rank's own shards

    def delete_data(self, name):
        """Drop this rank's shards of ``name`` (local: every rank drops its own)."""
        self.prefetches.drop(name)
        super().delete_data(name)

    # -- rows: exchanged with their owners --------------------------------------------

    def prefetch(self, name, ids):
        """Collective: keep keys ``ids`` of ``name`` for the table's next step, whose
        owners send their rows back right after applying it (module docstring).

        Raises:
            KVStoreError: no table ``name``.
            PartitionError: an id outside a fixed key space.
        """
        table = self.tables.table(name)
        keys = np.unique(keys_array(ids, "ids"))
        table.router.check(keys, f"ids of {name!r}")
        self.prefetches.add(name, Prefetch(keys, None))

    def prefetch_stats(self):
        """Counters of :meth:`prefetch` (:class:`~distemb.kvstore.prefetch.Prefetches`)."""
        return dict(self.prefetches.stats)

    def _read(self, table, column, ids):
        return self._pull_rows([(table, column, ids)])[0]

    def pull_many(self, requests):
        """Rows of every ``(table, ids)`` of ``requests``, in three rounds for all of them:
        a header, the ids to their owners, the rows back (each owner gathers its rows of
        every table between the last two)."""
        return self._pull_rows([self.tables.rows(n) + (ids,) for n, ids in requests])

    def _pull_rows(self, requests):
        """Rows of each ``(table, column, ids)``: those a table's prefetch holds from
        there, the others from their owners (every rank takes part in the exchange)."""
        names = [column_name(t, c) for t, c, _ in requests]

        def rest(asked):  # every rank prefetched the same tables (collective calls): one
            # round says whether any rank misses rows, instead of three that bring none
            if self._x.anyone(PULL, ["prefetched lookup of"] + names,
                              any(len(ids) for _, _, ids in asked)):
                return self._ask_rows(asked, names)
            return [np.empty((0,) + t.row_shape, half.row_dtype(t.columns()[c][1]))
                    for t, c, _ in asked]
        return self.prefetches.serve(requests, lambda asked: self._ask_rows(asked, names),
                                     rest)

    def _owner_rows(self, table, column, ids):
        """This rank's rows ``ids`` (its shards' keys, any table key order) of ``column``,
        as stored: half rows travel in 16 bits."""
        shape, dtype = tuple(table.columns()[column][0]), \
            half.storage_dtype(table.columns()[column][1])
        out = np.empty((len(ids),) + shape, dtype)
        for part, pos, local in self._split(table, ids):
            out[slice(None) if pos is None else pos] = self.server.pull(
                column_name(table, column), part, local,
                out=np.empty((len(local),) + shape, dtype))
        return out

    def _ask_rows(self, requests, names):
        shapes = [(half.storage_dtype(t.columns()[c][1]), tuple(t.columns()[c][0]))
                  for t, c, _ in requests]
        got = self._x.ask(PULL, names, [self._routed(t, ids) for t, _, ids in requests],
                          lambda i, ids: self._owner_rows(*requests[i][:2], ids),
                          lambda i: shapes[i])
        return [half.as_rows(rows) for rows in got]

    def _write(self, table, column, ids, rows):
        """Collective write; for an id written by several ranks the highest rank's wins.
        The table's prefetches are dropped (every rank's: any rank may write any row)."""
        if column == WEIGHT:
            self.prefetches.drop(table.name)
        (got, (received,), _), = self._x.send(PUSH, [column_name(table, column)],
                                                [self._routed(table, ids)], [[rows]])[0]
        LocalKVClient._write(self, table, column, got, received)

    def push_update(self, name, ids, grads, rule, hyper):
        """Collective update of one table (:meth:`apply_gradients` does every table of a
        step in one round)."""
        self._update([name], [(ids, grads)], [rule], [hyper])

    def apply_gradients(self, tables, F):
        """Every table of a step in one round: each rank sums its own duplicates
        (:meth:`coalesce`), sends the sums to their owners with one flag per table (it had
        gradients, or gradients that are not finite); each owner sums every rank's
        contributions per id in rank order and applies the rule once. A table steps when
        any rank had gradients for it, as one process stepping on the concatenated batch
        would; when any rank's gradients of any table are not finite, every rank refuses
        the whole step (NonFiniteGradientError) before applying anything."""
        sums = [self.coalesce(t.name, t.ids, t.grads, F) if t.finite else None
                for t in tables]
        return self._update([t.name for t in tables], sums, [t.rule for t in tables],
                            [t.hyper for t in tables], [t.finite for t in tables])

    def _update(self, names, sums, rules, hypers, finite=None):
        """The round of :meth:`apply_gradients`: ``sums`` per table (unique ids, summed
        rows) or None (no gradients here, or ``finite`` says they are not finite).
        Returns per table whether any rank had some."""
        finite = [True] * len(names) if finite is None else finite
        cols, routes, tables = [], [], [self.tables.table(n) for n in names]
        for table, summed in zip(tables, sums):
            if summed is None:
                summed = np.empty(0, np.int64), np.empty((0, table.dim), np.float32)
            routes.append(self._routed(table, summed[0]))
            cols.append([np.ascontiguousarray(summed[1], np.float32)])
        for name in names:  # the lookups of this step used these
            self.prefetches.stepped(name)
        # The keys prefetched for coming lookups ride in the same round (every rank has
        # the same prefetches: its calls are collective), answered after the update.
        waiting = [self.prefetches.waiting(n) for n in names]
        more = None
        if any(waiting):
            more = [self._routed(t, np.concatenate([np.empty(0, np.int64)] +
                                                   [p.keys for p in w]))
                    for t, w in zip(tables, waiting)]
        sent = self._x.send(UPDATE, names, routes, cols,
                            flags=[_NOT_FINITE if not f else s is not None
                                   for s, f in zip(sums, finite)], more=more)
        got, flags = sent[:2]
        ranks = sorted({int(r) for f in flags for r in np.flatnonzero(f == _NOT_FINITE)})
        # every rank refuses, before any update
        refuse_non_finite([n for n, f in zip(names, flags) if (f == _NOT_FINITE).any()],
                          f" (from rank(s) {ranks})" if ranks else "")
        for table, (ids, (rows,), _), rule, hyper in zip(tables, got, rules, hypers):
            if len(ids):
                uniq, summed = kernels.dedup_sum(ids, rows, num_threads=self.num_threads)
                LocalKVClient.push_update(self, table.name, uniq, summed, rule, hyper)
        if more is not None:
            self._answer_prefetches(names, tables, waiting, more, sent[2])
        return [bool(f.any()) for f in flags]

    def _answer_prefetches(self, names, tables, waiting, more, asked):
        """After a step's updates: each owner's rows of the keys prefetched of it
        (``asked``: per table, the keys from every rank in rank order and their counts),
        sent back in a round that finishes in the background; the waiting prefetches
        (``more``: their keys routed per table) take them when a lookup needs them."""
        payload = Payload(self.world_size)
        answers = [self._owner_rows(t, WEIGHT, ids) for t, (ids, _) in zip(tables, asked)]
        for src in range(self.world_size):
            for (_, counts), rows in zip(asked, answers):
                lo = int(counts[:src].sum())
                payload.add(src, rows[lo:lo + counts[src]])
        shapes = [(half.storage_dtype(t.dtype), t.row_shape) for t in tables]
        sizes = [sum(padded(int(r.counts[d]) * np.dtype(dt).itemsize *
                            int(np.prod(shape, dtype=np.int64)))
                     for r, (dt, shape) in zip(more, shapes))
                 for d in range(self.world_size)]
        back = self._x.reply_later(UPDATE, names, payload, sizes)
        rows = [np.empty((len(r.ids),) + t.row_shape, t.row_dtype)
                for r, t in zip(more, tables)]
        arrived = []

        def arrival():  # the first lookup that needs any of them takes them all
            if arrived:
                return
            got = back()
            for r, (dt, shape), out in zip(more, shapes, rows):
                parts = [got.take(d, dt, (int(r.counts[d]),) + shape)
                         for d in range(self.world_size)]
                if len(r.pos):
                    out[r.pos] = half.as_rows(np.concatenate(parts))
            arrived.append(True)
        for w, out in zip(waiting, rows):
            start = 0
            for p in w:
                p.rows = out[start:start + len(p.keys)]
                p.after_arrival(arrival)
                start += len(p.keys)

    # -- keys: asked of their owners --------------------------------------------------

    def size(self, name):
        """Keys held by every rank (collective)."""
        mine = np.array([super().size(name)], np.int64)
        return int(sum(a[0][0] for a in self._x.everyone("size", name, [mine])))

    def _ask_keys(self, what, table, keys, answer, dtype, shape=()):
        return self._x.ask(KEYS, [table.name], [self._routed(table, keys)],
                           lambda _, ids: answer(ids), lambda _: (np.dtype(dtype), shape),
                           label=[what, table.name])[0]

    def contains(self, name, keys):
        """Whether each key is held (False outside a fixed key space: every rank still
        takes part in the exchange, asking about the others)."""
        table = self.tables.table(name)
        keys = keys_array(keys)
        out = table.router.inside(keys)
        out[out] = self._ask_keys("contains", table, keys[out],
                                  lambda ids: LocalKVClient.contains(self, name, ids), bool)
        return out

    def get(self, name, keys):
        """Rows of ``keys`` without inserting them (each rank asks about its own).

        Raises:
            MissingKeyError: on the ranks that asked about a key no rank holds.
        """
        table = self.tables.table(name)
        keys = keys_array(keys)
        table.router.check(keys, "keys")
        dim = table.dim

        def answer(ids):
            out = np.zeros((len(ids), dim + 1), np.float32)
            found = LocalKVClient.contains(self, name, ids)
            if found.any():
                out[found, :dim] = LocalKVClient.get(self, name, ids[found])
            out[:, dim] = found
            return out
        got = self._ask_keys("get", table, keys, answer, np.float32, (dim + 1,))
        missing = np.flatnonzero(got[:, dim] == 0)
        if len(missing):
            raise MissingKeyError(f"get: key {int(keys[missing[0]])} is not in the store of "
                                  f"table {name!r} ({len(missing)} of {len(keys)} keys "
                                  "missing)")
        return np.ascontiguousarray(got[:, :dim])

    def _remove(self, table, keys):
        """Remove each rank's ``keys``; how many of them were present (a key asked by
        several ranks counts for the first, in rank order)."""
        self.prefetches.drop(table.name)

        def answer(ids):
            present = LocalKVClient.contains(self, table.name, ids)
            first = np.zeros(len(ids), bool)
            first[np.unique(ids, return_index=True)[1]] = True
            LocalKVClient._remove(self, table, ids)
            return present & first
        return int(self._ask_keys("remove", table, keys, answer, bool).sum())

    def _evict(self, table, target_size, policy):
        """Every rank evicts its shards down to its share of ``target_size`` by its own
        order (as each server does); every rank gets all the evicted keys."""
        self.prefetches.drop(table.name)
        share = target_size // self.world_size + (self.rank < target_size % self.world_size)
        mine = LocalKVClient._evict(self, table, share, policy)
        return np.concatenate([a[0] for a in self._x.everyone("evict", table.name, [mine])])

    def _export(self, table, columns):
        """Every rank's shards (collective: every rank gets the whole table)."""
        mine = super()._export(table, columns)
        keys = np.concatenate([np.empty(0, np.int64)] + [k for k, _ in mine])
        rows = [np.concatenate([r[c] for _, r in mine]) if mine else np.empty(
            (0,) + tuple(table.columns()[c][0]), half.row_dtype(table.columns()[c][1]))
            for c in columns]
        parts = self._x.everyone("export", table.name, [keys] + rows)
        return [(p[0], dict(zip(columns, p[1:]))) for p in parts]

    # -- checkpoints: every rank writes and reads its own shards ----------------------

    def save_table(self, name, directory, save_id, columns, parent=None):
        """Collective: every rank writes its shards of ``name`` as records of rank 0's
        save ``save_id`` (a delta of rank 0's ``parent``); every rank gets the entry with
        the records of all."""
        save_id, parent = self._x.gather_objects(f"save of {name!r}", (save_id, parent))[0]
        return super().save_table(name, directory, save_id, columns, parent)

    def _load(self, table, directory, entry, columns):
        self.prefetches.drop(table.name)
        super()._load(table, directory, entry, columns)

    def _save(self, table, directory, save_id, columns, parent):
        recs = super()._save(table, directory, save_id, columns, parent)
        return sorted((r for rs in self._x.gather_objects(f"save of {table.name!r}", recs)
                       for r in rs), key=lambda r: r["part"])

    def barrier(self):
        self._x.barrier()

    def close(self):
        """Drop this rank's shards and this client's group (and the default group when
        distemb made it; a group the user made stays theirs). Not collective: a rank may
        close while others have failed. Without it, gloo's threads may abort the process
        at exit ("terminate called without an active exception")."""
        super().close()
        self.server.close()
        if self._group is not None:
            self._x.leave()  # a rank still in a call hears that this one closed
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            if self._own_group:
                dist.destroy_process_group()
        self._group = None

    # -- what this mode does not do yet: refused, never bypassed ----------------------

    def view_on(self, device):
        if device is None or str(device) == "cpu":
            return self
        raise KVStoreError(f"looking rows up onto {device!r} is not available in "
                           "collective mode yet (docs/cluster.md, 'Collective mode'); use "
                           "the server mode (distemb-launch) for it")
