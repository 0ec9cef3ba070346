"""CachedKeys: what only keyed tables have, for a cache that owns copies of their rows.

A cache that is the one writer of the rows it holds (the device cache,
:mod:`distemb.kvstore.caches.device`) passes a keyed table's key management and whole-table
moves to the client it wraps, settling its own copies first, so every call sees the
current rows:

- reads of the stored rows (``get``, ``export``, ``table_state``, a checkpoint) first write
  the dirty copies back (they stay cached);
- ``remove`` forgets the copies of the removed keys (their rows go);
- ``evict`` writes every dirty copy back, tells the store the lookups the cache served
  (the cached keys, least used first), lets it choose its victims, and forgets their
  copies;
- writes of whole rows (``import_``, ``load_table_state``, a checkpoint's restore) write
  the copies back and forget them, then write.

Why the cache can own the rows of a keyed table at all: its store keeps every key it was
given until told otherwise, so a key the cache holds is never gone from the store behind
its back. A hash table with a ``capacity`` evicts on its own (on a lookup or an update of
other keys), and could drop a key whose current row only the cache holds; such tables are
refused by the owning cache (:func:`keeps_its_keys`), naming both.

Example:
    >>> from distemb.stores.spec import HashTableSpec
    >>> keeps_its_keys(object(), "dyn", HashTableSpec(4))
    >>> try:
    ...     keeps_its_keys(object(), "dyn", HashTableSpec(4, capacity=10))
    ... except KVStoreError as e:
    ...     print(str(e)[:60])
    object: cannot hold table 'dyn' on a hash store with a capac
"""
from abc import abstractmethod
from typing import Dict, List, Optional, Tuple

import numpy as np

from distemb.errors import KVStoreError
from distemb.kvstore.types import refuse_store


def keeps_its_keys(client, name: str, spec) -> None:
    """Refuse, for the owning cache ``client``, a keyed table whose store evicts on its own
    (see the module docstring).

    Raises:
        KVStoreError: ``spec`` (a table spec or a RowStore) has a capacity; the message
            names the cache and the store.
    """
    if spec.capacity is not None:
        kind = getattr(spec, "kind", type(spec).__name__)
        raise refuse_store(
            client, name, f"a {kind} store with a capacity ({spec.capacity} keys)",
            "such a store evicts keys on its own, and could drop a key whose current row "
            "only this cache holds; give the table no capacity (evict() it yourself), or "
            "use the trainer cache ('cache'), which writes every update through")


class CachedKeys:
    """Mixin of a cache client holding copies of keyed tables' rows (module docstring).

    The cache calls :meth:`_init_cached_keys` when made, has ``inner`` and ``config`` (a
    :class:`~distemb.config.CacheConfig`), and implements :meth:`_write_back_copies` and
    :meth:`_forget_copies`; the keyed methods here settle them and hand the call to
    ``inner``. Listed before the client's other bases.

    Example:
        >>> from distemb.kvstore.caches.device import DeviceCachedKVClient
        >>> issubclass(DeviceCachedKVClient, CachedKeys)
        True
    """

    # -- what the cache implements ------------------------------------------------------

    @abstractmethod
    def _write_back_copies(self, name: str, keys: Optional[np.ndarray] = None) -> None:
        """Write the dirty cached rows of ``keys`` (every key when None) of table
        ``name`` back to the wrapped client; they stay cached."""

    @abstractmethod
    def _copies_by_use(self, name: str) -> List[np.ndarray]:
        """The keys of table ``name``'s cached rows in groups, least recently (or least
        often) used first: the lookups this cache served, which its store did not see."""

    @abstractmethod
    def _forget_copies(self, name: str, keys: Optional[np.ndarray], write_back: bool) -> None:
        """Forget the cached rows of ``keys`` (every key when None) of table ``name``,
        writing the dirty ones back first when ``write_back``."""

    # -- keyed tables: the wrapped client's --------------------------------------------

    def is_keyed(self, name: str) -> bool:
        return self.inner.is_keyed(name)

    def keyed_names(self) -> List[str]:
        return self.inner.keyed_names()

    def dim(self, name: str) -> int:
        return self.inner.dim(name)

    def storage_dtype(self, name: str) -> str:
        return self.inner.storage_dtype(name)

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def capacity(self, name: str) -> Optional[int]:
        return self.inner.capacity(name)

    def contains(self, name: str, keys) -> np.ndarray:
        return self.inner.contains(name, keys)

    def get(self, name: str, keys) -> np.ndarray:
        self._write_back_copies(name, np.asarray(keys, np.int64))
        return self.inner.get(name, keys)

    def export(self, name: str, columns=None) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        self._write_back_copies(name)
        return self.inner.export(name, columns)

    def remove(self, name: str, keys) -> int:
        self._forget_copies(name, np.asarray(keys, np.int64), write_back=False)
        return self.inner.remove(name, keys)

    def evict(self, name: str, target_size: int, policy=None) -> np.ndarray:
        """The store's eviction, by its LRU/LFU order once the cached keys' uses are told:
        each group of :meth:`_copies_by_use` is looked up in turn, least used first (the
        cache holds the keys used last, so an LRU order is the uncached one; an LFU count
        gains one per cached key). The evicted keys' copies are forgotten."""
        self._write_back_copies(name)
        for keys in self._copies_by_use(name):
            self.inner.pull(name, keys)
        evicted = self.inner.evict(name, target_size, policy)
        self._forget_copies(name, evicted, write_back=False)
        return evicted

    def import_(self, name: str, keys, columns) -> None:
        self._forget_copies(name, np.asarray(keys, np.int64), write_back=True)
        self.inner.import_(name, keys, columns)

    def table_state(self, name: str, state_names):
        if self.is_keyed(name):
            self._write_back_copies(name)
            return self.inner.table_state(name, state_names)
        return super().table_state(name, state_names)

    def load_table_state(self, name: str, state_names, entry) -> None:
        if self.is_keyed(name):
            self._forget_copies(name, None, write_back=True)
            return self.inner.load_table_state(name, state_names, entry)
        return super().load_table_state(name, state_names, entry)

    def create_table(self, name: str, spec) -> None:
        """Make keyed table ``name`` in the wrapped client.

        Raises:
            KVStoreError: its store evicts on its own (a capacity), or the cache is sized
                as a ``fraction`` of a table whose keys have no bound (naming both).
        """
        keeps_its_keys(self, name, spec)
        self._bound(name, spec.num_rows if spec.fixed_keys else None)
        self.inner.create_table(name, spec)

    def add_table(self, name: str, store) -> None:
        keeps_its_keys(self, name, store)
        self._bound(name, store.size() if store.fixed_keys else None)
        self.inner.add_table(name, store)

    def _init_cached_keys(self):
        self._key_bounds = {}  # keyed table -> keys it holds at most (fixed keys)

    def key_bound(self, name: str) -> int:
        """Keys keyed table ``name`` holds at most (int64's max: no bound), to size the
        cache."""
        return self._key_bounds.get(name, np.iinfo(np.int64).max)

    def _bound(self, name, num_keys):
        if num_keys is None and self.config.fraction is not None:
            raise KVStoreError(f"{type(self).__name__}: cannot hold table {name!r} on a store "
                               "of any int64 key: 'fraction' is a share of a table's rows, "
                               "and this table's keys have no bound; give the cache 'rows' "
                               "or 'bytes'")
        if num_keys is not None:
            self._key_bounds[name] = int(num_keys)


__all__ = ["CachedKeys", "keeps_its_keys"]
