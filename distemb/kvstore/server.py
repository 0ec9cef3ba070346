"""KVServer: owns named shards and runs the pull, push and update handlers.

A shard is one partition of one named tensor, held as a numpy array. The server uses
numpy only (it never imports torch): embedded, it lives inside the trainer process and
its arrays are shared zero-copy with torch; in a cluster it runs in its own process.

Example:
    >>> import numpy as np
    >>> srv = KVServer()
    >>> srv.create("w", 0, np.zeros((4, 2), np.float32))
    >>> srv.push("w", 0, np.array([1]), np.ones((1, 2), np.float32))
    >>> srv.pull("w", 0, np.array([1, 0])).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
"""
import threading

import numpy as np

from distemb import kernels
from distemb.errors import KVStoreError
from distemb.rules import Hyper, rule_of, state_name


class KVServer:
    """Holds shards ``(name, part) -> array`` and applies requests to them.

    Args:
        server_id: this server's rank among the servers.
        num_threads: OpenMP threads for gather and update kernels.
    """

    def __init__(self, server_id=0, num_threads=1):
        self.server_id = server_id
        self.num_threads = num_threads
        self._shards = {}
        # One writer per row (DESIGN.md): updates to a shard never interleave.
        self._lock = threading.Lock()

    def create(self, name, part, array):
        """Own ``array`` as shard ``part`` of ``name``."""
        key = (name, part)
        if key in self._shards:
            raise KVStoreError(f"shard {part} of {name!r} already exists on server "
                               f"{self.server_id}")
        self._shards[key] = array

    def drop(self, name):
        """Forget every shard of ``name``."""
        for key in [k for k in self._shards if k[0] == name]:
            del self._shards[key]

    def drop_shard(self, name, part):
        """Forget shard ``part`` of ``name`` (no-op when absent)."""
        self._shards.pop((name, part), None)

    def has(self, name, part):
        return (name, part) in self._shards

    def parts_of(self, name):
        """Partition ids of ``name`` held here."""
        return [p for (n, p) in list(self._shards) if n == name]

    def shard(self, name, part):
        """The array of shard ``part`` of ``name`` (shared, not copied)."""
        try:
            return self._shards[(name, part)]
        except KeyError:
            raise KVStoreError(f"server {self.server_id} has no shard {part} of "
                               f"{name!r}") from None

    def pull(self, name, part, local_ids, out=None):
        """Rows ``local_ids`` of the shard, into ``out`` when given."""
        arr = self.shard(name, part)
        if arr.dtype == np.float32 and arr.ndim == 2:
            return kernels.gather_rows(arr, local_ids, out, self.num_threads)
        if out is None:
            return arr[local_ids]
        np.take(arr, local_ids, axis=0, out=out)
        return out

    def push(self, name, part, local_ids, values):
        """Write rows ``local_ids`` of the shard."""
        arr = self.shard(name, part)
        with self._lock:
            arr[local_ids] = values

    def update(self, name: str, part: int, local_ids, grads, rule, hyper: Hyper) -> None:
        """Apply optimizer rule ``rule`` in place to unique rows ``local_ids``.

        Raises:
            KVStoreError: no such shard or rule, or ``hyper`` is not the rule's type.
        """
        impl = rule_of(rule)
        hyper = impl.check_hyper(hyper)
        weight = self.shard(name, part)
        states = {s.name: self.shard(state_name(name, s.name), part) for s in impl.states}
        with self._lock:
            impl.apply(kernels, weight, states, local_ids, grads, hyper, self.num_threads)
