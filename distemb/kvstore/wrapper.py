"""Wrapper: a client in front of another, handing it every call it does not change.

The views of :mod:`distemb.kvstore.views` (a table looked up onto another device) change
only the placement half; the caches of :mod:`distemb.kvstore.caches` change how rows are
read and written. Everything else (tables, key management, checkpoints, barriers) is
the wrapped client's, through its public interface.

Example:
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.partition import range_policy
    >>> inner = LocalKVClient()
    >>> view = Wrapper(inner)
    >>> view.init_data("t", (3, 2), "float32", range_policy(3))
    >>> import numpy as np
    >>> inner.names(), view.pull("t", np.array([2])).shape
    (['t'], (1, 2))
"""
from distemb.kvstore.types import KVClient


class Wrapper(KVClient):
    """A client that hands everything to ``inner``; subclasses change what they need.

    Args:
        inner: the client holding the rows.
    """

    def __init__(self, inner: KVClient):
        self.inner = inner

    # what the wrapped client is
    ops = property(lambda self: self.inner.ops)
    tables = property(lambda self: self.inner.tables)
    num_servers = property(lambda self: self.inner.num_servers)
    num_trainers = property(lambda self: self.inner.num_trainers)
    num_threads = property(lambda self: self.inner.num_threads)
    all_ranks_checkpoint = property(lambda self: self.inner.all_ranks_checkpoint)
    closed = property(lambda self: self.inner.closed)

    # -- storage: the wrapped client's -----------------------------------------------

    def create_table(self, name, spec):
        self.inner.create_table(name, spec)

    def delete_data(self, name):
        self.inner.delete_data(name)

    def pull(self, name, ids):
        return self.inner.pull(name, ids)

    def prefetch(self, name, ids):
        self.inner.prefetch(name, ids)

    def push(self, name, ids, values):
        self.inner.push(name, ids, values)

    def init_optimizer(self, name, rule, options):
        return self.inner.init_optimizer(name, rule, options)

    def push_update(self, name, ids, grads, rule, hyper):
        self.inner.push_update(name, ids, grads, rule, hyper)

    def size(self, name):
        return self.inner.size(name)

    def capacity(self, name):
        return self.inner.capacity(name)

    def contains(self, name, keys):
        return self.inner.contains(name, keys)

    def get(self, name, keys):
        return self.inner.get(name, keys)

    def remove(self, name, keys):
        return self.inner.remove(name, keys)

    def evict(self, name, target_size, policy=None):
        return self.inner.evict(name, target_size, policy)

    def export(self, name, columns=None):
        return self.inner.export(name, columns)

    def import_(self, name, keys, columns):
        self.inner.import_(name, keys, columns)

    def flush(self, name):
        self.inner.flush(name)

    def table_state(self, name, state_names):
        return self.inner.table_state(name, state_names)

    def load_table_state(self, name, state_names, entry):
        self.inner.load_table_state(name, state_names, entry)

    def save_table(self, name, directory, save_id, columns, parent=None):
        return self.inner.save_table(name, directory, save_id, columns, parent)

    def load_table(self, name, directory, entry, columns):
        self.inner.load_table(name, directory, entry, columns)

    def barrier(self):
        self.inner.barrier()

    def close(self):
        """Nothing: the wrapped client belongs to whoever made it."""

    # -- placement: the wrapped client's ---------------------------------------------

    def from_host(self, array):
        return self.inner.from_host(array)

    def to_host(self, array):
        return self.inner.to_host(array)

    def tensor_in(self, x, F):
        return self.inner.tensor_in(x, F)

    def ids_in(self, name, ids, F):
        return self.inner.ids_in(name, ids, F)

    def values_in(self, name, values, F, ids_shape):
        return self.inner.values_in(name, values, F, ids_shape)

    def rows_out(self, rows, F):
        return self.inner.rows_out(rows, F)

    def coalesce(self, name, ids, grads, F):
        return self.inner.coalesce(name, ids, grads, F)

    def view_on(self, device):
        return self.inner.view_on(device)


__all__ = ["Wrapper"]
