"""KVServer: owns named shards and runs the pull, push and update handlers.

A shard is one partition of one named tensor, held as a numpy array. The server uses
numpy only (it never imports torch): embedded, it lives inside the trainer process and
its arrays are shared zero-copy with torch; in a cluster it runs in its own process.

Concurrency: each shard (with its optimizer-state shards, which share its guard) has a
reader/writer lock. Pulls hold it shared, pushes and updates exclusive, so a pull never
sees a row between an update's read and its write (no torn rows), pulls of one shard run
in parallel, and shards are updated in parallel. Readers outside the process (trainers
mapping the shard from /dev/shm) cannot take the lock: each write also makes the shard's
version counters odd while it runs (a seqlock, see :mod:`distemb.transport.shm`).

Example:
    >>> import numpy as np
    >>> srv = KVServer()
    >>> srv.create("w", 0, np.zeros((4, 2), np.float32))
    >>> srv.push("w", 0, np.array([1]), np.ones((1, 2), np.float32))
    >>> srv.pull("w", 0, np.array([1, 0])).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
"""
import threading
from contextlib import contextmanager

import numpy as np

from distemb import kernels
from distemb.kernels import half
from distemb.errors import KVStoreError
from distemb.kvstore import snapshot
from distemb.rules import Hyper, rule_of, state_name, state_owner

#: Distance between the first versions of two version arrays of one server, so a
#: table dropped and made again never repeats a version a trainer's cache holds.
VERSION_EPOCH = 1 << 40
#: Row dtypes a checkpoint converts between on load.
CONVERTIBLE = ("float32", "bfloat16", "float16")


class RWLock:
    """Many readers or one writer; waiting writers go first (updates never starve)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers, self._writer, self._waiting = 0, False, 0

    @contextmanager
    def read(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Guard:
    """The lock of a shard and its state shards, and their shared-memory versions."""

    def __init__(self):
        self.lock = RWLock()
        self.versions = {}  # (name, part) -> 1-element int64 array (seqlock counter)

    @contextmanager
    def write(self):
        with self.lock.write():
            counters = list(self.versions.values())
            for v in counters:
                v[0] += 1  # odd: a write is under way
            try:
                yield
            finally:
                for v in counters:
                    v[0] += 1  # even again: the rows are consistent


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
        # One writer per row (DESIGN.md) and no torn reads: see the module docstring.
        self._guards = {}  # (name, part) -> _Guard, shared by a table's state shards
        self._meta_lock = threading.Lock()  # the two dicts above
        # Per-row write counters of shards that trainer caches validate against, made on
        # the first versioned pull (KVService): every write of a row (or of its optimizer
        # state) after that bumps its version, under the shard's write lock.
        self._versions = {}
        self._epochs = 0
        self._ops = {}  # (name, part) -> kernels of a weight shard other than float32 ones

    def create(self, name, part, array, owner=None, version=None, rounding_seed=None):
        """Own ``array`` as shard ``part`` of ``name``.

        Args:
            owner: the table whose shard ``part`` this one belongs with (optimizer state):
                they share one lock, so an update of both is one critical section.
            version: a 1-element int64 array this server makes odd while it writes the
                shard (the counter of a shared-memory shard), or None.
            rounding_seed: for a bfloat16 shard, round its updates stochastically from
                this seed (mixed with ``part``); None rounds half rows to nearest-even.

        Half-precision shards (``numpy.float16``, or :data:`~distemb.kernels.half.BFLOAT16`
        bits) are updated by the half kernels: float32 maths and state, rounded on store.
        """
        ops = half.ops_for(half.dtype_name(array), None if rounding_seed is None
                           else half.shard_seed(rounding_seed, part))
        key = (name, part)
        with self._meta_lock:
            if key in self._shards:
                raise KVStoreError(f"shard {part} of {name!r} already exists on server "
                                   f"{self.server_id}")
            guard = self._guards.get((owner, part) if owner else key) or _Guard()
            self._guards[key] = guard
            if version is not None:
                guard.versions[key] = version
            self._shards[key] = array
            if ops is not kernels:
                self._ops[key] = ops

    def drop(self, name):
        """Forget every shard of ``name``."""
        for name_, part in [k for k in self._shards if k[0] == name]:
            self.drop_shard(name_, part)

    def drop_shard(self, name, part):
        """Forget shard ``part`` of ``name`` (no-op when absent)."""
        with self._meta_lock:
            self._shards.pop((name, part), None)
            self._versions.pop((name, part), None)
            self._ops.pop((name, part), None)
            guard = self._guards.pop((name, part), None)
            if guard is not None:
                guard.versions.pop((name, part), None)

    def _guard(self, name, part):
        self.shard(name, part)  # the error for a missing shard
        return self._guards[(name, part)]

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
        """Rows ``local_ids`` of the shard, into ``out`` when given.

        Rows come in the shard's dtype, except that a half shard's rows are decoded to
        float32 (in the gather, one pass) when ``out`` is a float32 array.
        """
        arr = self.shard(name, part)
        with self._guard(name, part).lock.read():
            if out is not None and out.dtype == np.float32 and arr.dtype != np.float32:
                return half.gather_rows(arr, local_ids, out, self.num_threads)
            if arr.dtype == np.float32 and arr.ndim == 2:
                return kernels.gather_rows(arr, local_ids, out, self.num_threads)
            if out is None:
                return arr[local_ids]
            np.take(arr, local_ids, axis=0, out=out)
            return out

    def versions(self, name, part):
        """Write counters of the rows of shard ``part`` of ``name`` (made on first use).

        A row's version changes with every write of the row or of its optimizer state;
        an update adds the number of trainers' gradients it applied (sync_exact sums).
        """
        key = (name, part)
        ver = self._versions.get(key)
        if ver is None:
            rows = self.shard(name, part).shape[0]
            with self._meta_lock:
                ver = self._versions.get(key)
                if ver is None:
                    self._epochs += 1
                    ver = np.full(rows, self._epochs * VERSION_EPOCH, np.int64)
                    self._versions[key] = ver
        return ver

    def bump_all(self, name, part):
        """Change every version of shard ``part`` of ``name`` (its state was reset)."""
        ver = self._versions.get((name, part))
        if ver is not None:
            with self._guard(name, part).write():
                ver += 1

    def _bump(self, name, part, local_ids, by=1):
        ver = self._versions.get((name, part))
        if ver is not None:
            ver[local_ids] += by  # duplicate ids (a push) change once: enough

    def push(self, name, part, local_ids, values):
        """Write rows ``local_ids`` of the shard (float32 values into a half shard are
        rounded to nearest-even)."""
        arr = self.shard(name, part)
        if arr.dtype != values.dtype and half.is_half(half.dtype_name(arr)):
            values = half.encode(values, half.dtype_name(arr))
        with self._guard(name, part).write():
            arr[local_ids] = values
            self._bump(name, part, local_ids)
            owner = state_owner(name)
            if owner is not None:
                self._bump(owner, part, local_ids)

    def update(self, name: str, part: int, local_ids, grads, rule, hyper: Hyper,
               contributions=1) -> None:
        """Apply optimizer rule ``rule`` in place to unique rows ``local_ids``.

        ``contributions`` (an int, or one per id) is how many trainers' gradients each
        row's sum holds; it is added to the rows' versions.

        Raises:
            KVStoreError: no such shard or rule, or ``hyper`` is not the rule's type.
        """
        impl = rule_of(rule)
        hyper = impl.check_hyper(hyper)
        weight = self.shard(name, part)
        states = {s.name: self.shard(state_name(name, s.name), part) for s in impl.states}
        with self._guard(name, part).write():
            impl.apply(self._ops.get((name, part), kernels), weight, states, local_ids, grads, hyper, self.num_threads)
            self._bump(name, part, local_ids, contributions)

    def save_shard(self, name, part, directory, save_id, start, step):
        """Write shard ``part`` of ``name`` as a checkpoint segment (see
        :mod:`distemb.kvstore.snapshot`); each block is copied under the shard's read
        lock. Returns the segment's manifest record."""
        arr, guard = self.shard(name, part), self._guard(name, part)

        def read_block(lo, hi):
            with guard.lock.read():
                return arr[lo:hi].copy()
        return snapshot.write_segment(directory, save_id, name, part, start, step,
                                      arr.shape, half.dtype_name(arr), read_block)

    def load_shard(self, name, part, directory, entry, start, step):
        """Fill shard ``part`` of ``name`` (global ids ``start + step * k``) from the
        segments of manifest record ``entry``, reading only the blocks it needs."""
        arr, guard = self.shard(name, part), self._guard(name, part)
        saved, live = entry.get("dtype"), half.dtype_name(arr)
        # float32, bfloat16 and float16 rows convert into each other on load (to float32
        # exactly, to half rounded to nearest-even); any other difference is an error.
        convert = saved != live and {saved, live} <= set(CONVERTIBLE)
        if (saved != live and not convert) or \
                list(entry.get("shape", [])[1:]) != list(arr.shape[1:]):
            raise KVStoreError(f"checkpoint: tensor {name!r} was saved as "
                               f"{entry.get('shape')} {saved}, the live one has "
                               f"rows {arr.shape[1:]} {live}")

        owner = state_owner(name)

        def write_rows(local, rows):
            if convert:
                rows = half.decode(rows) if half.is_half(saved) else rows
                rows = half.encode(rows, live) if half.is_half(live) else rows
            with guard.write():
                arr[local] = rows
                self._bump(name, part, local)  # cached copies of these rows are void
                if owner is not None:
                    self._bump(owner, part, local)
        snapshot.read_segments(directory, entry["segments"], half.storage_dtype(saved),
                               arr.shape[1:], start, step, arr.shape[0], write_rows)
