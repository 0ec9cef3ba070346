"""CollectiveKVClient: tables sharded across the ranks of a torch.distributed job.

No servers: rank ``r`` of a ``W``-process job (torchrun, mpirun, or a group the user
made) holds, in its own in-process :class:`~distemb.kvstore.server.KVServer` (one
:class:`~distemb.kvstore.shard.ShardTable` per shard), the partitions ``p`` of every dense
table with ``p % W == r`` (the default policy has one range per rank; any partition policy
works, as with servers) and a store of every keyed table holding the keys its router
sends to ``r`` (:mod:`~distemb.kvstore.collective_keyed`). The ranks exchange rows over
their own gloo group with ``all_to_all_single``, as torchrec and SOK do:

- ``pull``: a header (operation, tables, sequence number, bytes for each owner) is
  exchanged first, then the ids go to their owners, each owner gathers its rows, and the
  rows come back;
- ``push`` and ``push_update``: the header, then ids and rows together in one exchange.
  The gradients of a rank's duplicate ids are already summed (``coalesce``); each owner
  sums the contributions of all ranks per id (in rank order) and applies the fused update
  once. Every step is therefore the step of one process on the concatenated batch.

**Grouped calls**: ``pull_many`` (:func:`~distemb.embedding.grouped_lookup`) and
``apply_gradients`` (an optimizer's ``step()``, every table of it) move every table of
the call in those same rounds (:mod:`distemb.kvstore.exchange`): a step of T tables is
five all-to-alls, not 5 T.

Every storage call is collective: every rank makes the same calls on the same tables in
the same order (a rank without gradients still takes part in the step: it sends nothing
for the table, and a flag saying so; the table steps when any rank had gradients for it).
The header catches ranks that went apart (a clear error on every
rank, not rows of another table). A rank that dies or stops answering makes the others
raise :class:`~distemb.errors.KVStoreError` within the group's timeout, naming the ranks
that did not report after the failure (through the job's rendezvous store).

Not in this mode yet (each is a KVStoreError, never a silent bypass): a table on a store
object the user made (one process's; pass a spec), lookups onto a GPU
(``emb(ids, device=...)``) and caches. Checkpoints (``opt.save``/``opt.load``) are
collective: each rank writes and reads its own shards, in the format of every other
placement (a checkpoint of W ranks loads into W' ranks, servers or one process, and back).

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
import datetime
import uuid

import numpy as np
import torch.distributed as dist

from distemb import kernels
from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kvstore import snapshot
from distemb.kvstore.exchange import PULL, PUSH, UPDATE, Exchange, Payload, Routed, padded
from distemb.kvstore.collective_keyed import CollectiveKeyedTables
from distemb.kernels.hashtable import table_keys
from distemb.kvstore.local import init_shard
from distemb.kvstore.server import KVServer
from distemb.kvstore.types import (DataMeta, KVClient, check_entry_rows, check_new_name,
                                   check_rounding, refuse_non_finite)
from distemb.routers import PolicyRouter


#: The flag of a table in a step's round whose gradients on the sending rank are not
#: finite (1: it has gradients, 0: none).
_NOT_FINITE = 2


class CollectiveKVClient(CollectiveKeyedTables, KVClient):
    """Every rank of a torch.distributed job holds one shard of every table.

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
        self.num_servers = self.world_size  # tables default to one range per rank
        self.num_trainers = self.world_size
        self.server = KVServer(server_id=self.rank, num_threads=num_threads)
        self.num_threads = self.server.num_threads
        self._meta = {}
        self._routers = {}  # every table's, dense (a policy's) and keyed (its spec's)
        self._init_collective_keyed()
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

    # -- the rounds of a call --------------------------------------------------------------

    def _rows_of(self, name):
        """(dtype of ``name``'s rows between ranks, row shape, dtype callers read and write
        them in): a table's storage dtype (half rows travel in 16 bits and are read as
        float32), a state's own."""
        _, shape, dtype = self._rows(name)
        return half.storage_dtype(dtype), shape, np.dtype(half.row_dtype(dtype))

    def _routed(self, name, ids):
        """``ids`` (global) of table ``name`` grouped by owning rank: partition ``p`` of a
        dense table lives on rank ``p % W``, a keyed table's keys on the rank its router
        names.

        Raises:
            PartitionError: an id outside a fixed key space.
            TypeError, ValueError: keys of a keyed table that are not int64 keys.
        """
        table = self._rows(name)[0]
        if self.is_keyed(table):
            ids = table_keys(ids, f"keys of {name!r}")
        ids = np.ascontiguousarray(ids, np.int64)
        owners = self._routers[table].part_of(ids)
        return Routed(owners % self.world_size if self.world_size > 1 else owners * 0,
                      ids, self.world_size)

    def _at_owner(self, name, ids):
        """Global ids of ``name`` received by their owner (this rank) as
        ``[(part, positions or None for all, local ids)]`` of the parts held here."""
        name = self._rows(name)[0]
        router = self._routers[name]
        if router.num_parts == self.world_size or self.is_keyed(name):
            return [(self.rank, None, router.to_local(self.rank, ids))]
        return [(part, pos, router.to_local(part, keys))
                for part, (pos, keys) in sorted(router.split(ids).items())]

    def _parts_here(self, name):
        """The partitions of dense table ``name`` this rank holds (``p % W == rank``)."""
        return [p for p in range(self._meta_of(name).policy.num_partitions)
                if p % self.world_size == self.rank]

    def _pull_here(self, name, ids):
        """This rank's rows of global ``ids`` of ``name`` (the owner's answer to a pull)."""
        where = self._at_owner(name, ids)
        dtype, shape, _ = self._rows_of(name)
        out = np.empty((len(ids),) + shape, dtype)
        if len(where) == 1 and where[0][1] is None:
            return self.server.pull(name, where[0][0], where[0][2], out=out)
        for part, pos, local in where:  # rows as they travel (a keyed half table's too)
            out[pos] = self.server.pull(name, part, local,
                                        out=np.empty((len(local),) + shape, dtype))
        return out

    def _agree(self, what, name, sig):
        """Collective: every rank's ``sig`` (a dict) of table ``name`` must equal rank 0's.

        Raises:
            KVStoreError: on every rank, naming the first rank that differs and how.
        """
        sigs = self._x.gather_objects(f"{what} of {name!r}", sig)
        for r, other in enumerate(sigs):
            if other != sigs[0]:
                diff = sorted(k for k in sig if other.get(k) != sigs[0].get(k))
                raise KVStoreError(f"table {name!r}: rank {r} defines it differently from "
                                   f"rank 0 ({', '.join(diff)}: {[other[k] for k in diff]} "
                                   f"vs {[sigs[0][k] for k in diff]}); every rank must create "
                                   "the same tables in the same order")

    def _ask(self, op, names, ids, answer, reply, label=None):
        """A call that sends each table's ids to their owners and brings one answer row
        per id back: three rounds for all the tables (header, ids, answers).

        Args:
            names, ids: the tables and each one's ids (global).
            answer: ``answer(t, local ids from every rank in rank order)`` -> the owner's
                answer rows for them, in order.
            reply: ``reply(t)`` -> (dtype, row shape) of table ``t``'s answers.

            label: what the header names (default: ``names``).

        Returns:
            per table, the answers in the order of its ids.
        """
        label = names if label is None else label
        routes = [self._routed(n, i) for n, i in zip(names, ids)]
        got, _ = self._send(op, names, routes, [[] for _ in names], label=label)
        shapes = [reply(t) for t in range(len(names))]
        payload = Payload(self.world_size)
        answers = [answer(t, local) for t, (local, _, _) in enumerate(got)]
        for src in range(self.world_size):
            for (_, _, counts), rows in zip(got, answers):
                lo = int(counts[:src].sum())
                payload.add(src, rows[lo:lo + counts[src]])
        sizes = [sum(padded(int(r.counts[d]) * np.dtype(dt).itemsize *
                            int(np.prod(shape, dtype=np.int64)))
                     for r, (dt, shape) in zip(routes, shapes))
                 for d in range(self.world_size)]
        back = self._x.reply(op, label, payload, sizes)
        out = []
        for r, (dt, shape) in zip(routes, shapes):
            rows = np.empty((int(r.counts.sum()),) + tuple(shape), dt)
            if len(r.pos):
                rows[r.pos] = np.concatenate([back.take(d, dt, (int(r.counts[d]),) + shape)
                                              for d in range(self.world_size)])
            out.append(rows)
        return out

    def _send(self, op, names, routes, columns, flags=None, label=None):
        """One round: to each rank, the counts of ids of every table (and ``flags``, one
        int64 per table, when given), each table's ids, then each table's rows of every
        column of ``columns`` (a list of arrays per table, in the caller's id order; the
        same number, dtypes and row shapes on every rank).

        Returns:
            per table ``(local ids received in rank order, [each column's rows received],
            ids from each rank)``, and the (tables, W) flags each rank sent (zeros without
            ``flags``).
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
        got = self._x.round(op, names if label is None else label, payload)
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
        for src in range(w):
            for t, cols in enumerate(taken):
                for j, c in enumerate(cols):
                    rows[t][j].append(got.take(src, c.dtype, (counts[t, src],) + c.shape[1:]))
        out = [(np.concatenate(ids[t]), [np.concatenate(c) for c in rows[t]], counts[t])
               for t in range(n)]
        return out, sent

    # -- storage -------------------------------------------------------------------------

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        """Collective: every rank makes table ``name`` and keeps its partitions (``p`` with
        ``p % W == rank``, as servers hold them: one each for the default policy).

        Raises:
            KVStoreError: the ranks define ``name`` differently (every rank raises, naming
                the first that differs), or ``name`` exists.
        """
        check_rounding(dtype, rounding_seed)
        self._agree("creation", name, {
            "shape": tuple(int(s) for s in shape), "dtype": str(dtype),
            "policy": policy.policy_str, "partitions": policy.num_partitions,
            "ranges": [policy.id_progression(p) for p in range(policy.num_partitions)],
            "rounding_seed": rounding_seed, "exists": name in self.names()})
        if self.is_keyed(name):
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        check_new_name(self._meta, name)
        self._meta[name] = DataMeta(tuple(shape), dtype, policy)
        for part in self._parts_here(name):
            sshape = (policy.get_part_size(part),) + tuple(shape[1:])
            self.server.create(name, part, init_shard(init_func, sshape, dtype, name),
                               rounding_seed=rounding_seed)
        self._routers[name] = PolicyRouter(policy)

    def delete_data(self, name):
        """Drop this rank's shard of ``name`` (local: every rank drops its own)."""
        self._meta.pop(name, None)
        self._routers.pop(name, None)
        self._forget(name)
        self.server.drop(name)  # a keyed table's store is closed (a file flushes)

    def pull(self, name, ids):
        return self.pull_many([(name, ids)])[0]

    def init_optimizer(self, name, rule, options):
        """Optimizer state of table ``name``: state tensors sharded like a dense table
        (collective creation), state columns in each rank's store of a keyed table."""
        if not self.is_keyed(name):
            return super().init_optimizer(name, rule, options)
        states = self._shard(name).init_states(rule, options)  # every rank the same call
        self.server.attach_states(name, self.rank, states)
        return self._state_names(name, rule)

    def pull_many(self, requests):
        """Rows of every ``(table, ids)`` of ``requests``, in three rounds for all of them:
        a header, the ids to their owners, the rows back (each owner gathers its rows of
        every table between the last two; a keyed table's lookup inserts absent keys)."""
        names = [n for n, _ in requests]
        specs = [self._rows_of(n) for n in names]
        got = self._ask(PULL, names, [i for _, i in requests],
                        lambda t, ids: self._pull_here(names[t], ids),
                        lambda t: specs[t][:2])
        return [half.as_rows(rows) for rows in got]

    def push(self, name, ids, values):
        """Collective write; for an id written by several ranks the highest rank's wins."""
        _, shape, dtype = self._rows_of(name)
        values = np.asarray(values, dtype)
        (got, (rows,), _), = self._send(PUSH, [name], [self._routed(name, ids)],
                                          [[values.reshape((len(ids),) + tuple(shape))]])[0]
        for part, pos, local in self._at_owner(name, got):
            self.server.push(name, part, local, rows if pos is None else rows[pos])

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
        cols, routes = [], []
        for name, summed in zip(names, sums):
            if summed is None:
                summed = np.empty(0, np.int64), np.empty((0, self.row_dim(name)), np.float32)
            routes.append(self._routed(name, summed[0]))
            cols.append([np.ascontiguousarray(summed[1], np.float32)])
        got, flags = self._send(UPDATE, names, routes, cols,
                                flags=[_NOT_FINITE if not f else s is not None
                                       for s, f in zip(sums, finite)])
        ranks = sorted({int(r) for f in flags for r in np.flatnonzero(f == _NOT_FINITE)})
        # every rank refuses, before any update
        refuse_non_finite([n for n, f in zip(names, flags) if (f == _NOT_FINITE).any()],
                          f" (from rank(s) {ranks})" if ranks else "")
        for name, (ids, (rows,), _), rule, hyper in zip(names, got, rules, hypers):
            if len(ids):
                uniq, summed = kernels.dedup_sum(ids, rows, num_threads=self.num_threads)
                for part, pos, local in self._at_owner(name, uniq):
                    self.server.update(name, part, local, summed if pos is None else
                                       summed[pos], rule, hyper)
        return [bool(f.any()) for f in flags]

    # -- checkpoints: every rank writes and reads its own shard --------------------------

    #: ``opt.save``/``opt.load`` run on every rank (checkpoint.save_items' ``writer``).
    all_ranks_checkpoint = True

    def _held(self, name):
        """``[(part, start, step)]`` of this rank's shards of ``name`` (see
        :meth:`KVServer.save <distemb.kvstore.server.KVServer.save>`)."""
        if self.is_keyed(name):
            return [(self._shard(name).part, 0, 1)]
        policy = self._meta_of(name).policy
        return [(p, *policy.id_progression(p)[:2]) for p in self._parts_here(name)]

    def save_table(self, name, directory, save_id, columns):
        """Collective: every rank writes its shards of ``name`` (its partitions of a dense
        table, its store of a keyed one, keys global) as records of rank 0's save
        ``save_id``; every rank gets the entry with the records of all (partition order)."""
        what = f"save of {name!r}"
        save_id = self._x.gather_objects(what, save_id)[0]
        recs = self.server.save(name, self._held(name), directory, save_id, columns)
        recs = sorted((r for rs in self._x.gather_objects(what, recs) for r in rs),
                      key=lambda r: r["part"])
        if self.is_keyed(name):  # a hash table's key count is None: any int64 key
            spec = self._spec(name)
            return snapshot.new_entry((self._routers[name].num_keys, spec.dim), spec.dtype,
                                      recs)
        meta = self._meta_of(name)
        return snapshot.new_entry(meta.shape, meta.dtype, recs, meta.policy)

    def load_table(self, name, directory, entry, columns):
        """Every rank fills its shards of ``name`` from the checkpoint's records (saved
        under any partitioning: by W ranks, servers or one process), reading only the
        blocks that hold its rows; a keyed table's store then holds the saved keys its
        router gives this rank."""
        if not self.is_keyed(name):
            check_entry_rows(entry, self._meta_of(name).shape[0], name, directory)
        self.server.load(name, self._held(name), directory, entry, columns)

    def barrier(self):
        self._x.barrier()

    def close(self):
        """Drop this rank's shards and this client's group (and the default group when
        distemb made it; a group the user made stays theirs). Not collective: a rank may
        close while others have failed. Without it, gloo's threads may abort the process
        at exit ("terminate called without an active exception")."""
        for name in list(self._meta) + self.keyed_names():
            self.delete_data(name)
        self.server.close()
        if self._group is not None:
            self._x.leave()  # a rank still in a call hears that this one closed
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            if self._own_group:
                dist.destroy_process_group()
        self._group = None
        self.closed = True

    # -- what this mode does not do yet: refused, never bypassed --------------------------

    def _refuse(self, what):
        return KVStoreError(f"{what} is not available in collective mode yet "
                            "(docs/cluster.md, 'Collective mode'); use the server mode "
                            "(distemb-launch) for it")

    def view_on(self, device):
        if device is None or str(device) == "cpu":
            return self
        raise self._refuse(f"looking rows up onto {device!r}")
