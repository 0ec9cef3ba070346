"""DeviceCachedKVClient: hot rows and their optimizer state kept on a GPU, in front of a
host table (embedded, or on the servers of a one-trainer job).

A lookup gathers the cached rows on the device and copies only the misses in; ``opt.step()``
updates cached rows there with the device kernels (the owner's fused rules), so results
equal the uncached job's. The cache is a cached row's one writer: dirty rows are written
back at eviction and before anything reads or moves the whole table. One trainer only; a
store that evicts on its own is refused (:func:`~distemb.kvstore.caches.device_rows.
keeps_its_keys`); tables of other than float32 rows pass through. Bookkeeping: the trainer
cache's :class:`~distemb.kvstore.caches.table.TableCache`, on the host. Prefetch admits rows
and pins their slots until the table's next update. ``docs/caches.md``, ``docs/prefetch.md``.
"""
from typing import Dict, Optional

import numpy as np
import torch

from distemb.config import CacheConfig, check_device_cache
from distemb.enums import CachePolicy
from distemb.errors import KVStoreError
from distemb.kernels import cuda
from distemb.kvstore.caches.device_rows import DeviceRows, host_ids, keeps_its_keys, slots_of
from distemb.kvstore.prefetch import Prefetch, Prefetches
from distemb.kvstore.tables import refuse_fixed
from distemb.kvstore.types import KVClient
from distemb.kvstore import views
from distemb.kvstore.views import CacheOnDevice
from distemb.kvstore.wrapper import Wrapper
from distemb.rules import rule_of, state_name, state_owner


class DeviceCachedKVClient(Wrapper):
    """A device cache of hot rows and optimizer state in front of a host client.

    The client of host tables (``DistContext.embedded(device_cache=...)`` or a cluster
    config's ``device_cache``): its storage half keeps host semantics (numpy arrays, see
    :mod:`distemb.kvstore.types`) and sees the cached rows; ``view_on(device)`` is the
    view through which ``emb(ids, device=...)`` looks rows up via the cache. Owns
    ``inner`` (closing this closes it). Exact only: ``config.staleness`` must be 0.

    Args:
        inner: the host client holding the tables (LocalKVClient, RemoteKVClient or a
            trainer cache in front of one).
        config: a :class:`~distemb.config.CacheConfig` (capacity per table, policy).
        device: the CUDA device of the cache ('cuda', 'cuda:N'); with ``ops`` given, any
            torch device (tests run the cache on 'cpu' with a CPU stand-in of the kernels).
        ops: the device kernels (default :mod:`distemb.kernels.cuda`).

    Raises:
        CudaUnavailableError: ``device`` cannot be used here (the message says why).
        ConfigError: ``config.staleness`` is not 0, or ``inner``'s tables have other
            writers (its ``num_trainers`` > 1: other trainers or collective ranks).
        TypeError: ``config`` is not a CacheConfig.

    Example:
        >>> from distemb.config import parse_cache_config
        >>> from distemb.kernels.cuda import CudaUnavailableError
        >>> from distemb.kvstore import LocalKVClient
        >>> try:
        ...     kv = DeviceCachedKVClient(LocalKVClient(), parse_cache_config({"fraction": 0.05}))
        ... except CudaUnavailableError:  # no GPU here: says why, before any allocation
        ...     kv = None
    """

    #: The kernels of the cached rows (a test may swap in a CPU stand-in).
    device_ops = cuda

    def __init__(self, inner: KVClient, config: CacheConfig, device="cuda", ops=None):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        check_device_cache(config, inner.num_trainers)
        self.device = None  # the storage half holds numpy arrays (see the class docstring)
        if torch.device(device).type == "cuda" or ops is None:
            self.cache_device = views.cuda_device(device)
        else:  # a test's stand-in: ``ops`` runs the device kernels on this device
            self.cache_device = torch.device(device)
        if ops is not None:
            self.device_ops = ops
        super().__init__(inner)
        self.config = config
        self._tables: Dict[str, Optional[DeviceRows]] = {}
        self._tick = 0
        self._stats = dict(lookups=0, rows=0, unique_rows=0, hit_rows=0, miss_rows=0,
                           admitted_rows=0, written_back_rows=0, device_updated_rows=0,
                           host_updated_rows=0, h2d_bytes=0, d2h_bytes=0)
        self._view = CacheOnDevice(self)
        #: per table, the slots prefetched for coming lookups, pinned (:meth:`prefetch`)
        self.prefetches = Prefetches()

    def view_on(self, device):
        """The cache's view for the cache's device; itself for None (and 'cpu').

        Raises:
            ValueError: ``device`` is another device than the cache's.
            CudaUnavailableError: ``device`` is a CUDA device that cannot be used here.
        """
        if device is None or (str(device) == "cpu" and self.cache_device.type != "cpu"):
            return self
        dev = views.cuda_device(device) if str(device).startswith("cuda") else \
            torch.device(device)
        if dev != self.cache_device:
            raise ValueError(f"device: this context's device cache is on "
                             f"{self.cache_device}, got {device!r} (look rows up there)")
        return self._view

    def prefetch_stats(self):
        """Counters of :meth:`prefetch`, ``pinned_rows`` (slots pinned now) and the
        wrapped client's (``remote_*``: of tables this cache does not hold)."""
        inner = getattr(self.inner, "prefetch_stats", None)
        inner = {} if inner is None else {f"remote_{k}": v for k, v in inner().items()}
        return dict(self.prefetches.stats, **inner, pinned_rows=sum(
            c.map.pinned for c in self._tables.values() if c is not None))

    def prefetch(self, name, ids):
        """Admit rows ``ids`` of ``name`` now (misses fetched with their state), pin their
        slots and record them for the next lookup; rows that find no slot (every one
        pinned) are left to it. A table this cache does not hold: the owner's client's."""
        cache = self._table(name)
        if cache is None:
            self.inner.prefetch(name, ids)
            return
        ids = host_ids(ids)
        self.inner.table(name).router.check(ids, f"ids of {name!r}")
        uniq = np.unique(ids)
        m = cache.map
        slots = m.slot_of.get(uniq)
        cached = slots >= 0
        new = np.flatnonzero(~cached)
        if len(new):
            fetched = self.inner.pull(name, uniq[new])
            self._stats["h2d_bytes"] += fetched.nbytes
            self._admit(name, cache, uniq, new, slots, cached, fetched)
        held = slots >= 0
        m.pin(slots[held])
        self._tick += 1
        m.stamp[slots[held]] = self._tick if self.config.policy == CachePolicy.LRU else \
            m.seen.get(uniq[held])
        p = Prefetch(uniq, slots, held)
        p.unpin = lambda at: m.unpin(slots[at])
        self.prefetches.add(name, p)

    def stats(self):
        """Counters since construction: rows looked up, hits, rows and bytes moved.

        ``h2d_bytes``/``d2h_bytes`` count every array copied to/from the device: slot
        indices, missed rows and the state of admitted ones, written-back rows and
        state, ids and gradients of updates, dirty rows read by host pulls.
        """
        return dict(self._stats)

    # -- the cache -----------------------------------------------------------------------

    def _cacheable(self, name) -> bool:
        """Float32 (N, D) rows (a half store rounds every update: not cached)."""
        if state_owner(name) is not None:
            return False
        table = self.inner.table(name)
        return table.dtype == "float32" and len(table.row_shape) == 1

    def _table(self, name) -> Optional[DeviceRows]:
        """The cache of ``name``, made on first use; None for tensors it does not cache."""
        if name not in self._tables:
            self._tables[name] = self._new_rows(name, None) if self._cacheable(name) else None
        return self._tables[name]

    def _new_rows(self, name, rule):
        table = self.inner.table(name)  # keys 0..N-1 by id; any int64 key: hashed
        row_bytes = 4 * table.dim
        for spec in (rule_of(rule).states if rule is not None else ()):
            row_bytes += int(np.prod(spec.shape(table.dim), dtype=np.int64)) * \
                np.dtype(spec.dtype).itemsize
        cap = self.config.capacity(table.num_keys or np.iinfo(np.int64).max, row_bytes)
        return DeviceRows(table.num_keys, table.dim, cap, self.cache_device, rule)

    # -- tables and their keys: the wrapped client's, the cached copies settled first ---

    def create_table(self, name, spec):
        """Make table ``name`` in the wrapped client.

        Raises:
            KVStoreError: its store evicts on its own (a capacity), or the cache is sized
                as a ``fraction`` of a table whose keys have no bound (naming both).
        """
        keeps_its_keys(self, name, spec)
        if spec.num_keys is None and self.config.fraction is not None:
            raise KVStoreError(f"{type(self).__name__}: cannot hold table {name!r} on a store "
                               "of any int64 key: 'fraction' is a share of a table's rows, "
                               "and this table's keys have no bound; give the cache 'rows' "
                               "or 'bytes'")
        self.inner.create_table(name, spec)

    def get(self, name, keys):
        self._write_back_copies(name, host_ids(keys))
        return self.inner.get(name, keys)

    def export(self, name, columns=None):
        self._write_back_copies(name)
        return self.inner.export(name, columns)

    def remove(self, name, keys):
        self._forget_copies(name, host_ids(keys), write_back=False)
        return self.inner.remove(name, keys)

    def evict(self, name, target_size, policy=None):
        """The store's eviction, by its LRU/LFU order once the cached keys' uses are told:
        each group of cached keys is looked up in turn, least used first (the cache holds
        the keys used last, so an LRU order is the uncached one; an LFU count gains one
        per cached key). The evicted keys' copies are forgotten."""
        self.inner.table(name)
        refuse_fixed(self.inner.table(name), "evict")
        self._write_back_copies(name)
        for keys in self._copies_by_use(name):
            self.inner.pull(name, keys)
        evicted = self.inner.evict(name, target_size, policy)
        self._forget_copies(name, evicted, write_back=False)
        return evicted

    def import_(self, name, keys, columns):
        self._forget_copies(name, host_ids(keys), write_back=True)
        self.inner.import_(name, keys, columns)

    def table_state(self, name, state_names):
        self._write_back_copies(name)
        return self.inner.table_state(name, state_names)

    def load_table_state(self, name, state_names, entry):
        self._forget_copies(name, None, write_back=True)
        self.inner.load_table_state(name, state_names, entry)

    def _write_back(self, name, cache: DeviceRows, slots: np.ndarray,
                    ids: Optional[np.ndarray] = None) -> None:
        """Copy the dirty rows (and state) among ``slots`` to the owner; mark them clean.

        ``ids``: the rows' ids, when the slots' bookkeeping already names new ones.
        """
        dirty = cache.dirty[slots]
        slots = slots[dirty]
        if not len(slots):
            return
        ids = cache.map.ids[slots] if ids is None else ids[dirty]
        at = torch.from_numpy(slots).to(self.cache_device)
        arrays = [(name, cache.values)] + [(state_name(name, s), t)
                                           for s, t in cache.states.items()]
        for tname, tensor in arrays:
            host = tensor.index_select(0, at).cpu().numpy()
            self._stats["d2h_bytes"] += host.nbytes
            self.inner.push(tname, ids, host)
        cache.dirty[slots] = False
        self._stats["written_back_rows"] += len(slots)

    def flush(self, name: Optional[str] = None) -> None:
        """Write every dirty cached row (and its state) back to the owner; keep them cached.
        A keyed table's store then makes its writes durable (a file store).

        Args:
            name: the table (or one of its state tensors); every table when None.
        """
        for table in ([state_owner(name) or name] if name is not None else list(self._tables)):
            self._write_back_copies(table)
        if name is not None and state_owner(name) is None:
            self.inner.flush(name)

    def _write_back_copies(self, name, keys=None):
        cache = self._tables.get(name)
        if cache is not None:
            self._write_back(name, cache, slots_of(cache, keys))

    def _copies_by_use(self, name):
        cache = self._tables.get(name)
        if cache is None:
            return []
        m = cache.map
        slots = np.flatnonzero(m.held)
        slots = slots[np.argsort(m.stamp[slots], kind="stable")]
        cuts = np.flatnonzero(np.diff(m.stamp[slots])) + 1
        return [m.ids[g] for g in np.split(slots, cuts)] if len(slots) else []

    def _forget_copies(self, name, keys, write_back):
        cache = self._tables.get(name)
        if cache is not None:
            if keys is None:
                self.prefetches.drop(name)
            else:
                self.prefetches.void(name, keys)  # unpinned: looked up again
            slots = slots_of(cache, keys)
            if write_back:
                self._write_back(name, cache, slots)
            cache.map.evict(slots)

    def _drop(self, table, write_back=True):
        """Forget the cache of ``table`` (after writing its dirty rows back)."""
        if write_back:
            self.flush(table)
        self.prefetches.drop(table)
        self._tables.pop(table, None)

    def delete_data(self, name):
        owner = state_owner(name)
        if owner is None:
            self._drop(name, write_back=False)  # the table goes: nothing to keep
        else:
            self._drop(owner)
        self.inner.delete_data(name)

    def init_optimizer(self, name, rule, options):
        """A new optimizer: write the rows back, then cache them again with new state."""
        self._drop(name)
        names = self.inner.init_optimizer(name, rule, options)
        if self._cacheable(name):
            self._tables[name] = self._new_rows(name, rule)
        return names

    def pull(self, name, ids):
        """Rows ``ids`` as the host client returns them, the dirty cached ones from the cache."""
        out = self.inner.pull(name, ids)
        owner = state_owner(name)
        cache = self._tables.get(owner or name)
        if cache is None or not len(ids):
            return out
        src = cache.values if owner is None else cache.states.get(name.partition("~opt~")[2])
        if src is None:
            return out
        slots = cache.map.slot_of.get(host_ids(ids))
        at = np.flatnonzero(slots >= 0)
        at = at[cache.dirty[slots[at]]]
        if len(at):
            rows = src.index_select(0, torch.from_numpy(slots[at]).to(self.cache_device))
            rows = rows.cpu().numpy()
            self._stats["d2h_bytes"] += rows.nbytes
            if not out.flags.writeable:
                out = out.copy()
            out[at] = rows
        return out

    def push(self, name, ids, values):
        """Write rows: cached copies of them are written back and forgotten first."""
        self._forget_copies(state_owner(name) or name, host_ids(ids), write_back=True)
        self.inner.push(name, ids, values)

    def save_table(self, name, directory, save_id, columns, parent=None):
        self.flush(name)
        return self.inner.save_table(name, directory, save_id, columns, parent)

    def load_table(self, name, directory, entry, columns):
        self._drop(name)
        self.inner.load_table(name, directory, entry, columns)

    def barrier(self):
        """Write dirty rows back, so what others read after the barrier is current."""
        self.flush()
        self.inner.barrier()

    def close(self, **kw):
        """Write every dirty row back, then close the wrapped client (``kw`` go to it)."""
        self.flush()
        self._tables.clear()
        self.inner.close(**kw)

    def lookup(self, name, ids) -> torch.Tensor:
        """Rows ``ids`` (host int64) on the cache's device; misses are fetched and admitted.

        Tensors the cache does not hold are pulled from the owner and copied whole.
        """
        cache = self._table(name)
        if cache is None:
            rows = self.pull(name, ids)  # a state tensor's dirty rows are in the cache
            self._stats["h2d_bytes"] += rows.nbytes
            return torch.from_numpy(np.ascontiguousarray(rows)).to(self.cache_device)
        # the slot map indexes by id (keys 0..N-1) or hashes them (any key but two):
        # keys it cannot hold are refused, named
        ids = host_ids(ids)
        self.inner.table(name).router.check(ids, f"ids of {name!r}")
        m, st = cache.map, self._stats
        uniq, inverse = np.unique(ids, return_inverse=True)
        self._tick += 1
        m.count(uniq)
        prefetched = self.prefetches.take(name, uniq)
        if prefetched is not None and prefetched[0].all():
            slots = np.empty(len(uniq), np.int64)  # every row where its prefetch put it
        else:
            slots = m.slot_of.get(uniq)
        if prefetched is not None:
            slots[prefetched[0]] = prefetched[1]  # pinned since: still these rows
        cached = slots >= 0
        new = np.flatnonzero(~cached)
        st["lookups"] += 1
        st["rows"] += len(ids)
        st["unique_rows"] += len(uniq)
        st["hit_rows"] += len(uniq) - len(new)
        st["miss_rows"] += len(new)
        fetched = None
        if len(new):
            fetched = self.inner.pull(name, uniq[new])  # only the misses cross PCIe
            st["h2d_bytes"] += fetched.nbytes
            keep, victims = (np.ones(len(new), bool), None) if \
                self.config.policy == CachePolicy.LRU else \
                m.worth_keeping(uniq[new], slots[cached])
            self._admit(name, cache, uniq, new[keep], slots, cached, fetched[keep], victims)
        used = slots[slots >= 0]
        m.stamp[used] = self._tick if self.config.policy == CachePolicy.LRU else \
            m.seen.get(uniq[slots >= 0])
        per_id = slots[inverse]
        gather = torch.from_numpy(np.maximum(per_id, 0)).to(self.cache_device)
        st["h2d_bytes"] += per_id.nbytes
        out = self.device_ops.gather_rows(cache.values, gather)
        outside = np.flatnonzero(per_id < 0)  # misses the cache did not keep
        if len(outside):
            row_of_new = np.full(len(uniq), -1, np.int64)
            row_of_new[new] = np.arange(len(new))
            rows = fetched[row_of_new[inverse[outside]]]
            pos = torch.from_numpy(outside).to(self.cache_device)
            out[pos] = torch.from_numpy(rows).to(self.cache_device)
            st["h2d_bytes"] += rows.nbytes + outside.nbytes
        return out

    def _admit(self, name, cache, uniq, new, slots, cached, rows, victims=None):
        """Put rows ``uniq[new]`` (fetched as ``rows``) in slots, writing victims back
        (``victims``: LFU's choice, :meth:`TableCache.worth_keeping
        <distemb.kvstore.caches.table.TableCache.worth_keeping>`)."""
        if not len(new):
            return
        before = cache.map.ids.copy()  # admit() evicts: the victims' ids are needed
        held = cache.map.held.copy()
        fresh = cache.map.admit(uniq[new], slots[cached], victims)
        k = len(fresh)
        if not k:
            return
        victims = fresh[held[fresh]]
        self._write_back(name, cache, victims, before[victims])
        at = torch.from_numpy(fresh).to(self.cache_device)
        cache.values[at] = torch.from_numpy(np.ascontiguousarray(rows[:k])).to(self.cache_device)
        for sname, tensor in cache.states.items():
            state = self.inner.pull(state_name(name, sname), uniq[new[:k]])
            tensor[at] = torch.from_numpy(np.ascontiguousarray(state)).to(self.cache_device)
            self._stats["h2d_bytes"] += state.nbytes
        cache.dirty[fresh] = False
        slots[new[:k]] = fresh
        self._stats["admitted_rows"] += k

    def push_update(self, name, ids, grads, rule, hyper):
        """Update cached rows on the device; the rest goes to the owner. The prefetches
        lookups used are released (their slots unpinned).

        ``ids``/``grads`` are the unique ids and summed gradients of a coalesce: torch
        tensors on the cache's device (the view's) or numpy arrays (host lookups).
        """
        try:
            self._push_update(name, ids, grads, rule, hyper)
        finally:
            self.prefetches.stepped(name)

    def _push_update(self, name, ids, grads, rule, hyper):
        impl = rule_of(rule)
        cache = self._tables.get(name)
        keys = host_ids(ids)
        if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
            self._stats["d2h_bytes"] += keys.nbytes
        if cache is None or cache.rule is None or cache.rule.name != impl.name:
            if cache is not None:  # another rule than the cached state's: the owner's
                # copied first: a remote client may have summed into its request slot,
                # which the write-back's requests reuse
                grads = np.array(self._host_grads(grads))
                self._forget_copies(name, keys, write_back=True)
            self.inner.push_update(name, keys, self._host_grads(grads), rule, hyper)
            return
        slots = cache.map.slot_of.get(keys)
        hit = np.flatnonzero(slots >= 0)
        miss = np.flatnonzero(slots < 0)
        if len(hit):
            g = grads if len(hit) == len(keys) else grads[self._index(grads, hit)]
            if not isinstance(g, torch.Tensor):
                g = torch.from_numpy(np.ascontiguousarray(g))
                self._stats["h2d_bytes"] += g.numel() * 4
            g = g.to(self.cache_device, torch.float32).contiguous()
            at = torch.from_numpy(slots[hit]).to(self.cache_device)
            impl.apply(self.device_ops, cache.values, cache.states, at, g,
                       impl.check_hyper(hyper))
            cache.dirty[slots[hit]] = True
            self._stats["device_updated_rows"] += len(hit)
        if len(miss):
            g = grads if len(miss) == len(keys) else grads[self._index(grads, miss)]
            self.inner.push_update(name, keys[miss], self._host_grads(g), rule, hyper)
            self._stats["host_updated_rows"] += len(miss)

    def _index(self, grads, positions):
        if isinstance(grads, torch.Tensor):
            return torch.from_numpy(positions).to(grads.device)
        return positions

    def _host_grads(self, grads):
        if isinstance(grads, torch.Tensor):
            host = grads.cpu().numpy()
            if grads.device.type != "cpu":
                self._stats["d2h_bytes"] += host.nbytes
            return np.ascontiguousarray(host, dtype=np.float32)
        return grads


__all__ = ["DeviceCachedKVClient", "CacheOnDevice", "DeviceRows"]
