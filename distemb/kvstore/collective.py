"""CollectiveKVClient: tables sharded across the ranks of a torch.distributed job.

No servers: rank ``r`` of a ``W``-process job (torchrun, mpirun, or a group the user
made) holds partition ``r`` of every table in its own in-process
:class:`~distemb.kvstore.server.KVServer` (one :class:`~distemb.kvstore.shard.ShardTable`
per table), and the ranks exchange rows over their own gloo group with
``all_to_all_single``, as torchrec and SOK do:

- ``pull``: a header (operation, table, sequence number, count of ids for each owner) is
  exchanged first, then the ids go to their owners, each owner gathers its rows, and the
  rows come back;
- ``push`` and ``push_update``: the header, then ids and rows together in one exchange.
  The gradients of a rank's duplicate ids are already summed (``coalesce``); each owner
  sums the contributions of all ranks per id (in rank order) and applies the fused update
  once. Every step is therefore the step of one process on the concatenated batch.

Every storage call is collective: every rank makes the same calls on the same tables in
the same order (an empty ``push_update`` included: ``coalesce`` gives empty arrays when a
rank has no gradients). The header catches ranks that went apart (a clear error on every
rank, not rows of another table). A rank that dies or stops answering makes the others
raise :class:`~distemb.errors.KVStoreError` within the group's timeout, naming the ranks
that did not report after the failure (through the job's rendezvous store).

Not in this mode yet (each is a KVStoreError, never a silent bypass): tables on row
stores (DynamicEmbedding, StoreEmbedding), lookups onto a GPU (``emb(ids, device=...)``)
and caches. Checkpoints (``opt.save``/``opt.load``) are collective: each rank writes and
reads its own shard, in the format of every other placement (a checkpoint of W ranks
loads into W' ranks, servers or one process, and back).

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
import os
import time
import uuid
import zlib

import numpy as np
import torch
import torch.distributed as dist

from distemb import kernels
from distemb.errors import DistEmbError, KVStoreError
from distemb.kernels import half
from distemb.kvstore import snapshot
from distemb.kvstore.local import init_shard
from distemb.kvstore.server import KVServer
from distemb.kvstore.types import (DataMeta, KVClient, check_entry_rows, check_new_name,
                                   check_rounding)
from distemb.routers import PolicyRouter

#: Operation codes of the exchange header.
PULL, PUSH, UPDATE = 1, 2, 3
OP_NAMES = {PULL: "pull", PUSH: "push", UPDATE: "push_update"}
#: Longest wait, after a failed exchange, for the other ranks to report in.
REPORT_GRACE_S = 5.0


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


def _crc(name):
    return zlib.crc32(name.encode("utf-8"))


def _pack(ids, rows):
    """(n,) int64 ids and (n, ...) rows as one (n, 8 + row bytes) uint8 array."""
    n = len(ids)
    rows = np.ascontiguousarray(rows)
    width = rows.dtype.itemsize * int(np.prod(rows.shape[1:], dtype=np.int64))
    out = np.empty((n, 8 + width), np.uint8)
    out[:, :8] = np.ascontiguousarray(ids, np.int64).view(np.uint8).reshape(n, 8)
    out[:, 8:] = rows.view(np.uint8).reshape(n, width)
    return out


def _unpack(buf, dtype, trailing):
    """The (ids, rows) of a :func:`_pack` array."""
    n = buf.shape[0]
    ids = np.ascontiguousarray(buf[:, :8]).view(np.int64).reshape(n)
    rows = np.ascontiguousarray(buf[:, 8:]).view(dtype).reshape((n,) + tuple(trailing))
    return ids, rows


class CollectiveKVClient(KVClient):
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
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        self.num_servers = self.world_size  # tables default to one range per rank
        self.server = KVServer(server_id=self.rank, num_threads=num_threads)
        self.num_threads = self.server.num_threads
        self._meta = {}
        self._routers = {}
        self._seq = 0  # exchanges so far: equal on every rank while they agree
        #: Bytes this rank has sent to other ranks (headers, ids, rows, gradients).
        self.bytes_sent = 0
        try:  # the rendezvous store, to name the ranks that died (see _failure)
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a private API: without it, ranks go unnamed
            self._store = None
        tags = self._gather_objects("initialize", uuid.uuid4().hex)
        self._tag = f"distemb-collective/{tags[0]}"

    # -- the exchanges -------------------------------------------------------------------

    def _gather_objects(self, what, obj):
        out = [None] * self.world_size
        self._guard(what, lambda: dist.all_gather_object(out, obj, group=self._group))
        return out

    def _guard(self, what, fn):
        """Run collective ``fn``; a failure of the group becomes a KVStoreError naming
        the ranks that did not report."""
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
            raise self._failure(what, e) from e

    def _failure(self, what, error):
        """The error of a failed exchange: every rank still alive writes its key in the
        job's store; those missing after a short wait are named."""
        msg = f"collective {what} failed on rank {self.rank} of {self.world_size}"
        if self._store is None:
            return KVStoreError(f"{msg}: {error}")
        key = f"{self._tag}/failed/{self._seq}"
        try:
            self._store.set(f"{key}/{self.rank}", "1")
            grace = min(REPORT_GRACE_S, self.timeout_s)
            deadline = time.monotonic() + grace
            missing = list(range(self.world_size))
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not self._store.check([f"{key}/{r}"])]
                if missing:
                    time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - the store's own host may be the dead one
            return KVStoreError(f"{msg}: {error}; the job's rendezvous store is unreachable "
                                f"too ({e}): the rank or launcher hosting it (rank 0 under "
                                "a tcp:// init) has likely died")
        if not missing:
            return KVStoreError(f"{msg}: every rank is alive, the exchange itself failed: "
                                f"{error}")
        return KVStoreError(f"{msg}: rank(s) {missing} did not report within {grace} s "
                            f"of the failure (dead or hung); cause: {error}")

    def _a2a(self, what, send, counts_out, counts_in, trailing, dtype):
        """all_to_all_single of ``send`` (rows for each rank, in rank order)."""
        recv = torch.empty((int(sum(counts_in)),) + tuple(trailing), dtype=dtype)
        row_bytes = send.element_size() * int(np.prod(trailing, dtype=np.int64))
        self.bytes_sent += (int(sum(counts_out)) - int(counts_out[self.rank])) * row_bytes
        self._guard(what, lambda: dist.all_to_all_single(
            recv, send, list(counts_in), list(counts_out), group=self._group))
        return recv

    def _header(self, op, name, counts):
        """Exchange (op, table, sequence, count) with every rank; the counts each rank
        sends here. Every rank raises if any is in another operation."""
        self._seq += 1
        what = f"{OP_NAMES[op]} of {name!r}"
        mine = np.array([op, _crc(name), self._seq], np.int64)
        send = np.empty((self.world_size, 4), np.int64)
        send[:, :3] = mine
        send[:, 3] = counts
        recv = self._a2a(what, torch.from_numpy(send), [1] * self.world_size,
                         [1] * self.world_size, (4,), torch.int64).numpy()
        apart = [r for r in range(self.world_size) if not np.array_equal(recv[r, :3], mine)]
        if apart:
            r = apart[0]
            op_r = OP_NAMES.get(int(recv[r, 0]), f"operation {int(recv[r, 0])}")
            raise KVStoreError(
                f"collective {what}: rank {r} is in {op_r} of another or the same table "
                f"(exchange {int(recv[r, 2])}, this rank's {self._seq}): every rank must "
                "make the same distemb calls in the same order (e.g. state_dict() or a "
                "lookup on one rank only)")
        return recv[:, 3], what

    def _route(self, name, ids):
        """(counts per owner, positions in rank order, local ids in rank order)."""
        split = self._routers[name].split(np.ascontiguousarray(ids, np.int64))
        counts = np.zeros(self.world_size, np.int64)
        pos, local = [], []
        for part in sorted(split):
            p, keys = split[part]
            counts[part] = len(p)
            pos.append(p)
            local.append(self._routers[name].to_local(part, keys))
        empty = np.empty(0, np.int64)
        return (counts, np.concatenate(pos) if pos else empty,
                np.concatenate(local) if local else empty)

    def _send_rows(self, op, name, ids, rows):
        """Header, then ids and rows to their owners: (local ids, rows) received here,
        in rank order."""
        meta = self._meta_of(name)
        counts, pos, local = self._route(name, ids)
        counts_in, what = self._header(op, name, counts)
        rows = np.asarray(rows)
        packed = _pack(local, rows[pos] if len(pos) else rows[:0])
        recv = self._a2a(what, torch.from_numpy(packed), counts, counts_in,
                         packed.shape[1:], torch.uint8).numpy()
        return _unpack(recv, rows.dtype, meta.shape[1:])

    # -- storage -------------------------------------------------------------------------

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        """Collective: every rank makes table ``name`` and keeps its own partition.

        Raises:
            KVStoreError: the ranks define ``name`` differently (every rank raises, naming
                the first that differs), the policy does not have one partition per
                rank, or ``name`` exists.
        """
        check_rounding(dtype, rounding_seed)
        sig = {"name": name, "shape": tuple(int(s) for s in shape), "dtype": str(dtype),
               "policy": policy.policy_str, "partitions": policy.num_partitions,
               "ranges": [policy.id_progression(p) for p in range(policy.num_partitions)],
               "rounding_seed": rounding_seed, "exists": name in self._meta}
        sigs = self._gather_objects(f"creation of {name!r}", sig)
        for r, other in enumerate(sigs):
            if other != sigs[0]:
                diff = sorted(k for k in sig if other.get(k) != sigs[0].get(k))
                raise KVStoreError(f"table {name!r}: rank {r} defines it differently from "
                                   f"rank 0 ({', '.join(diff)}: {[other[k] for k in diff]} "
                                   f"vs {[sigs[0][k] for k in diff]}); every rank must create "
                                   "the same tables in the same order")
        check_new_name(self._meta, name)
        if policy.num_partitions != self.world_size:
            raise KVStoreError(f"table {name!r}: its policy {policy.policy_str} has "
                               f"{policy.num_partitions} partitions; a collective job of "
                               f"{self.world_size} ranks needs one per rank")
        sshape = (policy.get_part_size(self.rank),) + tuple(shape[1:])
        self.server.create(name, self.rank, init_shard(init_func, sshape, dtype, name),
                           rounding_seed=rounding_seed)
        self._meta[name] = DataMeta(tuple(shape), dtype, policy)
        self._routers[name] = PolicyRouter(policy)

    def delete_data(self, name):
        """Drop this rank's shard of ``name`` (local: every rank drops its own)."""
        self._meta.pop(name, None)
        self._routers.pop(name, None)
        self.server.drop(name)

    def pull(self, name, ids):
        meta = self._meta_of(name)
        counts, pos, local = self._route(name, ids)
        counts_in, what = self._header(PULL, name, counts)
        asked = self._a2a(what, torch.from_numpy(local), counts, counts_in, (),
                          torch.int64).numpy()
        rows = self.server.pull(name, self.rank, asked)
        rows_dtype = np.dtype(half.row_dtype(meta.dtype))
        got = self._a2a(what, torch.from_numpy(np.ascontiguousarray(rows, rows_dtype)),
                        counts_in, counts, meta.shape[1:], torch.from_numpy(
                            np.empty(0, rows_dtype)).dtype).numpy()
        out = np.empty((len(ids),) + meta.shape[1:], rows_dtype)
        out[pos] = got
        return out

    def push(self, name, ids, values):
        """Collective write; for an id written by several ranks the highest rank's wins."""
        local, rows = self._send_rows(PUSH, name, ids, values)
        self.server.push(name, self.rank, local, rows)

    def push_update(self, name, ids, grads, rule, hyper):
        """Collective update: each owner sums every rank's gradients per id, then applies
        ``rule`` once (``hyper`` of the owner's own call: ranks must agree)."""
        local, rows = self._send_rows(UPDATE, name, ids,
                                      np.ascontiguousarray(grads, np.float32))
        if not len(local):
            return
        uniq, summed = kernels.dedup_sum(local, rows, num_threads=self.num_threads)
        self.server.update(name, self.rank, uniq, summed, rule, hyper)

    def coalesce(self, name, ids, grads, F):
        """As the host clients, but a rank without gradients still takes part in the step
        (empty arrays, never None): the owners wait for every rank's exchange."""
        summed = super().coalesce(name, ids, grads, F)
        if summed is None:
            return np.empty(0, np.int64), np.empty((0, self.row_dim(name)), np.float32)
        return summed

    # -- checkpoints: every rank writes and reads its own shard --------------------------

    #: ``opt.save``/``opt.load`` run on every rank (checkpoint.save_items' ``writer``).
    all_ranks_checkpoint = True

    def save_table(self, name, directory, save_id, columns):
        """Collective: every rank writes its shard of ``name`` as a record of rank 0's
        save ``save_id``; every rank gets the entry with the records of all (rank order)."""
        meta = self._meta_of(name)
        what = f"save of {name!r}"
        save_id = self._gather_objects(what, save_id)[0]
        start, step, _ = meta.policy.id_progression(self.rank)
        rec = self.server.table(name, self.rank).save(directory, save_id, name, columns,
                                                      start, step)
        return snapshot.new_entry(meta.shape, meta.dtype, self._gather_objects(what, rec),
                                  meta.policy)

    def load_table(self, name, directory, entry, columns):
        """Every rank fills its shard of ``name`` from the checkpoint's records (saved
        under any partitioning: by W ranks, servers or one process), reading only the
        blocks that hold its rows."""
        meta = self._meta_of(name)
        check_entry_rows(entry, meta.shape[0], name, directory)
        start, step, _ = meta.policy.id_progression(self.rank)
        self.server.table(name, self.rank).load(directory, entry, columns, start, step,
                                                name=name)

    def barrier(self):
        self._guard("barrier", lambda: dist.barrier(group=self._group))

    def close(self):
        """Drop this rank's shards and this client's group (and the default group when
        distemb made it; a group the user made stays theirs). Not collective: a rank may
        close while others have failed. Without it, gloo's threads may abort the process
        at exit ("terminate called without an active exception")."""
        for name in list(self._meta):
            self.delete_data(name)
        self.server.close()
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            if self._own_group:
                dist.destroy_process_group()
        self._group = None

    # -- what this mode does not do yet: refused, never bypassed --------------------------

    def _refuse(self, what):
        return KVStoreError(f"{what} is not available in collective mode yet "
                            "(docs/cluster.md, 'Collective mode'); use the server mode "
                            "(distemb-launch) for it")

    def store_client(self):
        raise self._refuse("a table on a row store (DynamicEmbedding, StoreEmbedding)")

    def view_on(self, device):
        if device is None or str(device) == "cpu":
            return self
        raise self._refuse(f"looking rows up onto {device!r}")
