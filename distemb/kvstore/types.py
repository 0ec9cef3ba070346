"""The KVClient interface: what trainers need from wherever the rows live.

Arrays crossing this interface are numpy for host clients (the common ground of
trainers, servers and kernels; trainers convert with the backend's zero-copy
``from_numpy``/``to_numpy``), and torch tensors on the client's ``device`` for
:class:`~distemb.kvstore.device.DeviceKVClient` (GPU-resident tables). ``ops`` is the
kernel module of those arrays, ``from_host``/``to_host`` convert numpy to and from them.
Ids are global (type-wise) int64 ids, already validated against the table's policy.

Example:
    >>> import numpy as np
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.partition import range_policy
    >>> kv: KVClient = LocalKVClient()
    >>> kv.init_data("t", (3, 2), "float32", range_policy(3))
    >>> kv.data_meta("t").shape
    (3, 2)
"""
from dataclasses import dataclass

import numpy as np

from distemb import kernels
from distemb.errors import KVStoreError
from distemb.kvstore import snapshot
from distemb.partition import PartitionPolicy
from distemb.rules import RULES, state_init, state_name


@dataclass(frozen=True)
class DataMeta:
    """Shape, dtype name and partition policy of one named tensor."""

    shape: tuple
    dtype: str
    policy: PartitionPolicy


class KVClient:
    """Interface of a key-value store client; implementations share one test suite.

    Implementations: :class:`~distemb.kvstore.local.LocalKVClient` (embedded, in
    process), the remote client of the multi-process store, and
    :class:`~distemb.kvstore.device.DeviceKVClient` (embedded, tables on a GPU).
    """

    #: The kernel module of this client's arrays (:mod:`distemb.kernels` for numpy).
    ops = kernels
    #: The torch device of this client's arrays; None for numpy arrays in host memory.
    device = None
    num_servers = 1
    #: True when every trainer must push one update per table per optimizer step, even an
    #: empty one (synchronous-exact mode: servers wait for all trainers' contributions).
    needs_every_step = False

    def init_data(self, name, shape, dtype, policy, init_func=None):
        """Create ``name``; ``init_func(shard_shape, dtype_name)`` fills each shard (zeros if None)."""
        raise NotImplementedError

    # Implementations keep the DataMeta of every tensor they know in ``self._meta``.

    def data_meta(self, name):
        """The :class:`DataMeta` of ``name``, or None if absent."""
        return self._meta.get(name)

    def names(self):
        """Names of all tensors this client knows."""
        return list(self._meta)

    def delete_data(self, name):
        """Drop ``name`` and its shards."""
        raise NotImplementedError

    def pull(self, name, ids):
        """Rows ``ids`` of ``name`` as a new numpy array (len(ids),) + shape[1:]."""
        raise NotImplementedError

    def push(self, name, ids, values):
        """Write ``values`` into rows ``ids`` of ``name`` (last write wins for duplicates)."""
        raise NotImplementedError

    def init_optimizer(self, name, rule, options):
        """Create the optimizer state of table ``name`` for update rule ``rule``.

        The default creates each state tensor with :meth:`init_data`, sharded like the
        table; a state that exists is replaced (a new optimizer starts fresh, as torch's).

        Returns:
            dict state name -> KVStore name of that state tensor.
        """
        meta = self._meta_of(name)
        if rule not in RULES:
            raise KVStoreError(f"rule: expected one of {sorted(RULES)}, got {rule!r}")
        names = {}
        for spec in RULES[rule].states:
            sname = state_name(name, spec.name)
            self.delete_data(sname)
            shape = (meta.shape[0],) + spec.shape(meta.shape[1])
            self.init_data(sname, shape, spec.dtype, meta.policy,
                           lambda s, d, spec=spec: state_init(spec, s, options))
            names[spec.name] = sname
        return names

    def push_update(self, name, ids, grads, rule, hyper):
        """Apply update ``rule`` with ``hyper`` to rows ``ids`` (unique) of ``name``.

        ``grads`` is consumed (applied, or copied into a message) before this returns:
        the caller may reuse its buffer right after.
        """
        raise NotImplementedError

    def save_tensor(self, name, directory, save_id):
        """Write ``name`` into checkpoint ``directory`` as segment files of save
        ``save_id`` (:mod:`distemb.kvstore.snapshot`); the manifest is the caller's.

        The default pulls the rows in blocks into one segment; clients that own their
        shards (embedded, servers) write one segment per shard, where the shard is.

        Returns:
            the segment records (list of dicts) for the manifest.
        """
        meta = self._meta_of(name)

        def read_block(lo, hi):
            return self.to_host(self.pull(name, self.from_host(np.arange(lo, hi,
                                                                         dtype=np.int64))))
        return [snapshot.write_segment(directory, save_id, name, 0, 0, 1, meta.shape,
                                       meta.dtype, read_block)]

    def load_tensor(self, name, directory):
        """Fill ``name`` from checkpoint ``directory`` (saved under any partitioning);
        only the segment blocks holding this client's rows are read.

        Raises:
            KVStoreError: no such tensor in the checkpoint, other rows or dtype, or a
                corrupt segment.
        """
        meta = self._meta_of(name)
        entry = snapshot.tensor_entry(snapshot.read_manifest(directory), name, directory)

        def write_rows(ids, rows):
            self.push(name, self.from_host(ids), self.from_host(np.ascontiguousarray(rows)))
        snapshot.read_segments(directory, entry["segments"], meta.dtype, meta.shape[1:], 0,
                               1, meta.shape[0], write_rows)

    def _meta_of(self, name):
        """The DataMeta of ``name``; KVStoreError when absent."""
        try:
            return self._meta[name]
        except KeyError:
            raise KVStoreError(f"name {name!r} is not in the KVStore "
                               f"(known: {sorted(self._meta)[:10]})") from None

    def from_host(self, array):
        """A numpy array as an array of this client (the array itself for host clients)."""
        return array

    def to_host(self, array):
        """An array of this client as a numpy array (the array itself for host clients)."""
        return array

    def barrier(self):
        """Wait for every trainer (no-op with one)."""

    def close(self):
        """Release connections and, for an embedded store, its memory."""
