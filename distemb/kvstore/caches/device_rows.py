"""What the device cache (:mod:`distemb.kvstore.caches.device`) keeps of one table: its
cached rows and their optimizer state on the device, dirty flags, and the slot
bookkeeping of a :class:`~distemb.kvstore.caches.table.TableCache` on the host; and the
one kind of table such a cache refuses (:func:`keeps_its_keys`).
"""
import numpy as np
import torch

from distemb.kernels.hashtable import keys_array
from distemb.kvstore.caches.table import TableCache
from distemb.kvstore.types import refuse_store
from distemb.rules import rule_of


class DeviceRows:
    """The cached rows of one table on the device: values, state, dirty flags, slots.

    Args:
        num_rows, dim: the table's shape; capacity: cached rows; device: where they live.
        rule: the table's update rule, or None before an optimizer made its state.

    Example:
        >>> rows = DeviceRows(100, 4, 10, "cpu", "adagrad")
        >>> tuple(rows.values.shape), sorted(rows.states), rows.dirty.any()
        ((10, 4), ['sum'], False)
    """

    def __init__(self, num_rows: int, dim: int, capacity: int, device, rule=None):
        # dim 0: the TableCache keeps only the slot bookkeeping; rows live in self.values
        self.map = TableCache(num_rows, 0, capacity)
        self.rule = None if rule is None else rule_of(rule)
        self.values = torch.zeros((capacity, dim), dtype=torch.float32, device=device)
        self.states = {}
        for spec in (self.rule.states if self.rule else ()):
            self.states[spec.name] = torch.zeros((capacity,) + spec.shape(dim),
                                                 dtype=getattr(torch, spec.dtype),
                                                 device=device)
        self.dirty = np.zeros(capacity, bool)


def keeps_its_keys(client, name: str, spec) -> None:
    """Refuse, for the owning cache ``client``, a table whose store evicts on its own:
    a key the cache holds must never be gone from its store behind its back (a hash
    table with a ``capacity`` could drop a key whose current row only the cache holds).

    Raises:
        KVStoreError: ``spec`` is of any key and has a capacity; the message names the
            cache and the store.
    """
    if spec.num_keys is None and spec.capacity is not None:
        raise refuse_store(
            client, name, f"a {spec.kind} store with a capacity ({spec.capacity} keys)",
            "such a store evicts keys on its own, and could drop a key whose current row "
            "only this cache holds; give the table no capacity (evict() it yourself), or "
            "use the trainer cache ('cache'), which writes every update through")


def slots_of(cache: DeviceRows, keys) -> np.ndarray:
    """Cache slots of ``keys`` held (every held slot when None), unique."""
    slots = np.flatnonzero(cache.map.held) if keys is None else cache.map.slot_of.get(keys)
    return np.unique(slots[slots >= 0])


def host_ids(ids) -> np.ndarray:
    """Ids (a tensor on any device, or an array) as host int64 ids.

    Raises:
        TypeError: ids that are not integers.
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.cpu().numpy()
    return keys_array(ids, "ids")
