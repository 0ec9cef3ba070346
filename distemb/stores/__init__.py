"""Row stores: where a shard's rows and optimizer state physically live.

:class:`RowStore` is the interface (:mod:`distemb.stores.types`); :class:`DenseStore`
(in memory, keys 0..N-1), :class:`HashStore` (any int64 key) and :class:`FileStore`
(memory-mapped files) implement it, and :mod:`distemb.stores.init` has key-deterministic
initialisers. Stores use numpy only.

Example:
    >>> import numpy as np
    >>> s = HashStore(3, init=key_uniform(3, seed=1))
    >>> s.gather(np.array([2**40])).shape, s.size()
    ((1, 3), 1)
"""
from distemb.stores.dense import DenseStore
from distemb.stores.file import FileStore
from distemb.enums import EvictPolicy, Rounding
from distemb.stores.hash import HashStore
from distemb.stores.init import KeyInit, init_from_spec, key_normal, key_uniform
from distemb.stores.types import WEIGHT, RowStore

__all__ = ["RowStore", "DenseStore", "HashStore", "FileStore", "EvictPolicy", "Rounding",
           "WEIGHT",
           "key_uniform", "key_normal", "KeyInit", "init_from_spec"]
