"""CachedKVClient: a trainer-side cache of hot rows in front of a RemoteKVClient.

Graph mini-batches touch a few hot rows most of the time, so a trainer keeps a copy of
them, each with its optimizer state and the *version* its owning server gave it
(:meth:`KVServer.versions <distemb.kvstore.server.KVServer.versions>`). The cache is a
view of the remote client (storage calls, key management and coalescing go to it); it
changes how rows of float32 (N, D) tables, dense or keyed (the slot map is then hashed,
:mod:`distemb.kvstore.caches.table`), are pulled and what follows an update:

- a pull sends the versions held, one request per server; the server returns only the
  rows whose version differs, with their state (a hot row costs 16 bytes, not a row);
- ``push_update`` writes through to the owner and applies the same rule and kernels to
  the copy; in sync_exact the owner answers the summed gradient of each held row others
  reached too, otherwise the rows' new versions (a copy is kept only if its version
  moved by exactly one). The copy stays bit-identical to the server's.

Modes (``staleness`` 0 is exact, ``s`` is HET's bounded staleness), policies (lru, lfu
with TinyLFU admission, a cache that empties itself when it does not help) and their
tested bounds are in ``docs/caches.md``.

Prefetch (``emb.prefetch(next_ids)``): the copies it holds of the next batch's rows are
pinned until the table's next update, the rest prefetched by the remote client
(``docs/prefetch.md``).

Example (servers started by ``distemb-launch``)::

    client = CachedKVClient(RemoteKVClient(cfg, rank), parse_cache_config({"fraction": 0.1}))
"""
from time import perf_counter as clock
from typing import Dict, Optional

import numpy as np

from distemb import kernels
from distemb.config import CacheConfig
from distemb.enums import Consistency
from distemb.errors import KVStoreError
from distemb.kernels import cachebook
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.caches.table import TableCache
from distemb.kvstore.caches.versions import pull_versioned, push_update_held
from distemb.kvstore.prefetch import Prefetch, Prefetches
from distemb.kvstore.types import KVClient
from distemb.kvstore.views import view_on_host
from distemb.kvstore.wrapper import Wrapper
from distemb.rules import rule_of, state_owner

#: The version of a cached copy someone else may have changed (bounded staleness): it is
#: refetched, with its state, at its next validation. Servers' versions are >= 0, and
#: -1/-2 mean "not held" in a versioned pull.
UNKNOWN = -3
class CachedKVClient(Wrapper):
    """A cache of hot rows in front of a :class:`~distemb.kvstore.remote.RemoteKVClient`.

    Owns ``inner`` (closing the cache closes it). Tables other than float32 (N, D) and
    optimizer state tensors pass straight through.

    Args:
        inner: the remote client (it must offer ``pull_versioned`` and
            ``push_update_versions``).
        config: a :class:`~distemb.config.CacheConfig`.

    Raises:
        TypeError: ``inner`` cannot validate cached rows, or ``config`` is not a CacheConfig.

    Example::

        kv = CachedKVClient(RemoteKVClient(cfg, 0), parse_cache_config({"policy": "lfu",
                                                                   "rows": 10_000}))
        kv.init_data("w", (10**6, 64), "float32", range_policy(10**6, kv.num_servers))
        rows = kv.pull("w", np.array([3, 3, 7]))     # misses: rows come with versions
        kv.stats()["hit_rows"]
    """

    def __init__(self, inner: KVClient, config: CacheConfig):
        if not (hasattr(inner, "servers") and hasattr(inner, "update_requests")):
            raise TypeError(f"inner: expected a client whose servers version rows (a "
                            f"RemoteKVClient), got {type(inner).__name__}")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig, got {type(config).__name__}")
        super().__init__(inner)
        self.config = config
        self._tables: Dict[str, Optional[TableCache]] = {}
        self._tick = 0
        self._stats = dict(pulls=0, rows=0, unique_rows=0, hit_rows=0, fetched_rows=0,
                           bytes_pulled=0, bytes_sent=0, evicted_replicas=0, summed_rows=0)
        #: per table, the cached copies pinned for coming lookups (:meth:`prefetch`)
        self.prefetches = Prefetches()

    @property
    def consistency(self):
        return self.inner.consistency

    # -- what the cache settles before the wrapped client's calls ------------------------

    def create_table(self, name, spec):
        """Make table ``name`` (see the wrapped client's).

        Raises:
            KVStoreError: the cache's size is a ``fraction`` of a table's rows and the
                table sets no bound on its keys (the table is not made).
        """
        self._check_bounded(name, spec.num_keys or spec.capacity)
        self.inner.create_table(name, spec)

    def _check_bounded(self, name, bound):
        if bound is None and self.config.fraction is not None:
            raise KVStoreError(f"cache of {name!r}: 'fraction' is a share of a table's rows, "
                               "and this table takes any int64 key without bound; give the "
                               "cache 'rows' or 'bytes', or the table a capacity")

    def delete_data(self, name):
        self.inner.delete_data(name)
        self.prefetches.drop(state_owner(name) or name)
        self._tables.pop(name, None)
        self._tables.pop(state_owner(name), None)

    def prefetch(self, name, ids):
        """Pin the copies of rows ``ids`` this cache holds until their lookup, and have
        the remote client prefetch the others (module docstring).

        Raises:
            KVStoreError: see :meth:`RemoteKVClient.prefetch
                <distemb.kvstore.remote.RemoteKVClient.prefetch>`.
        """
        cache = self._table(name)
        if cache is None:
            self.inner.prefetch(name, ids)
            return
        uniq = np.unique(keys_array(ids, "ids"))
        self.inner.table(name).router.check(uniq, f"ids of {name!r}")
        slots = cache.slots(uniq)
        held = slots >= 0
        cache.pin(slots[held])
        p = Prefetch(uniq, slots, held)
        p.unpin = lambda at: cache.unpin(slots[at])
        self.prefetches.add(name, p)
        self.inner.prefetch(name, uniq[~held])

    def prefetch_stats(self):
        """Counters of the pins (:class:`~distemb.kvstore.prefetch.Prefetches`, and
        ``pinned_rows``: the slots pinned now) and of the remote client's prefetches
        (``remote_*``)."""
        inner = {f"remote_{k}": v for k, v in self.inner.prefetch_stats().items()}
        return dict(self.prefetches.stats, **inner, pinned_rows=sum(
            c.pinned for c in self._tables.values() if c is not None))

    def remove(self, name, keys):
        removed = self.inner.remove(name, keys)
        self._forget(name, keys)
        return removed

    def evict(self, name, target_size, policy=None):
        evicted = self.inner.evict(name, target_size, policy)
        self._forget(name, evicted)
        return evicted

    def import_(self, name, keys, columns):
        self.inner.import_(name, keys, columns)
        self._forget(name, keys)

    def _forget(self, name, keys):
        """Cached copies of ``keys`` are void (the server's versions would tell at the
        next validation; a bounded-staleness copy must not wait for it)."""
        cache = self._tables.get(name)
        if cache is not None:
            self.prefetches.void(name, np.asarray(keys, dtype=np.int64))
            cache.forget(np.asarray(keys, dtype=np.int64))

    def load_table_state(self, name, state_names, entry):
        self.inner.load_table_state(name, state_names, entry)
        if name in self._tables:
            self.invalidate(name)

    def load_table(self, name, directory, entry, columns):
        """The owners load; every cached copy of the table is void."""
        self.inner.load_table(name, directory, entry, columns)
        if name in self._tables:
            self.invalidate(name)

    def close(self, **kw):
        """Close the wrapped client (keywords go to its ``close``)."""
        self._tables.clear()
        self.inner.close(**kw)

    def view_on(self, device):
        """Itself on the host; on a GPU, a view of the cache (rows still come through it)."""
        return view_on_host(self, device)

    def stats(self):
        """Counters since construction: rows asked, rows served without data, bytes.

        ``unique_rows`` counts each pull's distinct ids (every id of a pull an idle
        cache passed through, which it does not make unique); ``bytes_pulled`` counts
        every array of the pull replies (rows, states, versions,
        positions); ``bytes_sent`` the ids and versions of the pull requests;
        ``evicted_replicas`` the cached copies found void after an update (another
        writer's gradient reached them outside what the owner answered for);
        ``summed_rows`` the held rows kept current with the owner's summed gradient
        (sync_exact: other trainers wrote them in the same step).
        """
        return dict(self._stats)

    # -- the cache ----------------------------------------------------------------------

    def _table(self, name, rule=None) -> Optional[TableCache]:
        """The cache of ``name``, made on first use; None for tables it does not cache."""
        if name in self._tables and rule is None:
            return self._tables[name]
        cache = None
        if state_owner(name) is None:
            table = self.inner.table(name)
            # float32 (N, D) rows: a half store rounds every update, not cached
            if table.dtype == "float32" and len(table.row_shape) == 1:
                states, row_bytes = {}, 4 * table.dim
                if rule is not None:
                    for spec in rule_of(rule).states:
                        shape = spec.shape(table.dim)
                        states[spec.name] = (shape, np.dtype(spec.dtype))
                        row_bytes += int(np.prod(shape, dtype=np.int64)) * \
                            np.dtype(spec.dtype).itemsize
                bound = table.num_keys or table.spec.capacity
                self._check_bounded(name, bound)
                cap = self.config.capacity(bound or np.iinfo(np.int64).max, row_bytes)
                # keys 0..N-1: arrays by id; any int64 key: hashed (TableCache)
                cache = TableCache(table.num_keys, table.dim, cap, states,
                                   None if rule is None else rule_of(rule).name,
                                   timed=self.config.idle_when_slower)
        self._tables[name] = cache
        return cache

    def init_optimizer(self, name, rule, options):
        names = self.inner.init_optimizer(name, rule, options)
        self.prefetches.drop(name)  # its pins are the old cache's
        self._table(name, rule=rule)  # fresh: cached copies of the old state are void
        return names

    def push(self, name, ids, values):
        self.inner.push(name, ids, values)
        cache = self._tables.get(state_owner(name) or name)
        if cache is not None:
            cache.forget(np.asarray(ids, dtype=np.int64))

    def pull(self, name, ids):
        cache = self._table(name)
        if cache is None:
            return self.inner.pull(name, ids)
        start = clock()
        cache.begin_pull()
        try:
            return self._pull(name, cache, ids)
        finally:
            cache.spend(clock() - start)

    def _pull(self, name, cache, ids):
        ids = keys_array(ids, "ids")
        self.inner.table(name).router.check(ids, f"ids of {name!r}")
        self.prefetches.take(name, ids)  # its pins hold until the table's next update
        self._tick += 1
        if cache.idle and not cache.used:
            return self._pass(name, cache, ids)
        uniq, inverse, slots = cache.lookup(ids)
        # -1: not held, passes through; -2 (below): not held, will be kept (its state too)
        have, ask, held = cachebook.held_versions(slots, cache.version, cache.checked,
                                                  cache.step, self.config.staleness)
        cached = slots >= 0
        new = np.flatnonzero(~cached) if held else np.arange(len(uniq))
        victims = None
        if cache.idle:  # it could not help these ids lately (TableCache.served)
            keep_new = np.zeros(len(new), bool)
        elif self.config.policy == "lru":
            keep_new = np.ones(len(new), bool)
        else:
            keep_new, victims = cache.worth_keeping(uniq[new], slots[cached])
        have[new[keep_new]] = -2
        if not held and not keep_new.any():
            # Nothing held or to keep (a cache that cannot help these ids): a plain pull
            # of each row once, no versions either way (prefetched rows from there).
            rows = self.inner.pull(name, uniq)
            self._count(ids, uniq, np.arange(len(uniq)), [], [rows], sent=8 * len(uniq))
            cache.served(0, len(uniq))
            return rows[inverse]
        # rows passing through (not held, not kept) the remote client prefetched: taken
        # from there, as current as a pull (its prefetch is used either way)
        passing = new[~keep_new]
        near = self.inner.prefetches.take(name, uniq[passing])
        if near is not None:
            ready, ready_rows = passing[near[0]], near[1]
            ask[ready] = False
        else:
            ready = np.empty(0, np.int64)
            ready_rows = np.empty((0, cache.values.shape[1]), np.float32)
        asked = np.flatnonzero(ask)
        if len(asked):
            pos, vers, rows, states = pull_versioned(self.inner, name, uniq[asked],
                                                     have[asked], list(cache.states))
        else:  # every row fresh enough (bounded staleness): no request at all
            pos, vers = np.empty(0, np.int64), np.empty(0, np.int64)
            rows = np.empty((0, cache.values.shape[1]), np.float32)
            states = [np.empty((0,) + a.shape[1:], a.dtype) for a in cache.states.values()]
        got = asked[pos]
        self._count(ids, uniq, got, asked, [pos, vers, rows] + list(states))
        self._stats["hit_rows"] -= len(ready)  # rows of the prefetch, not copies
        admit = got[have[got] == -2]
        if len(admit):
            fresh = cache.admit(uniq[admit], slots[cached], victims)
            slots[admit[:len(fresh)]] = fresh
        out = cachebook.settle(slots, got, vers, rows, states, have, ask, inverse, ready,
                               ready_rows, cache.values, list(cache.states.values()),
                               cache.version, cache.checked, cache.step, cache.stamp,
                               self._tick if self.config.policy == "lru" else -1)
        cache.served(len(uniq) - len(got) - len(ready), len(uniq))
        return out

    def _pass(self, name, cache, ids):
        """A pull while the cache is idle and holds nothing (:meth:`TableCache.served
        <distemb.kvstore.caches.table.TableCache.served>`): the wrapped client's pull of
        ``ids`` as they are, with no pass over them. An idle cache's pull counts stand
        still (neither counted nor halved): it tries again with what it had learned."""
        cache.pulls += 1  # what ends the idle period
        rows = self.inner.pull(name, ids)
        # every id counts as a unique row here (not made unique: that pass is the cost)
        self._count(ids, ids, ids, [], [rows], sent=8 * len(ids))
        cache.served(0, len(ids))
        return rows

    def _count(self, ids, uniq, got, asked, arrays, sent=None):
        st = self._stats
        st["pulls"] += 1
        st["rows"] += len(ids)
        st["unique_rows"] += len(uniq)
        st["fetched_rows"] += len(got)
        st["hit_rows"] += len(uniq) - len(got)
        st["bytes_sent"] += 16 * len(asked) if sent is None else sent
        st["bytes_pulled"] += sum(a.nbytes for a in arrays) if len(got) else 0

    def push_update(self, name, ids, grads, rule, hyper):
        """Send the update to the owner; keep the cached copies equal to the owner's rows.

        In sync_exact the update names the rows held (with their versions) and the owner
        answers, for those, which copies are void and the summed gradients of those other
        trainers' gradients reached too: every held copy gets the step's own update (its
        own gradient, or the owner's sum), so rows written by several trainers at once
        stay cached. Otherwise the owner answers the rows' versions and a copy someone
        else's gradient reached is dropped (or, with staleness, kept until revalidated).
        """
        start = clock()
        try:
            self._push_update(name, ids, grads, rule, hyper)
        finally:
            self.prefetches.stepped(name)  # the pins of the copies lookups used
            cache = self._tables.get(name)
            if cache is not None:
                cache.spend(clock() - start)

    def _push_update(self, name, ids, grads, rule, hyper):
        cache = self._tables.get(name)
        impl = rule_of(rule)
        if cache is None or cache.rule != impl.name:
            self.inner.push_update(name, ids, grads, rule, hyper)
            if cache is not None:
                cache.forget(np.asarray(ids, dtype=np.int64))
            return
        if not cache.used:  # no copy to keep current (an idle cache): a plain update
            self.inner.push_update(name, ids, grads, rule, hyper)
            cache.step += 1
            return
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        slots = cache.slots(ids)
        mine = np.flatnonzero(slots >= 0)
        if not len(mine):  # no copy to keep current: a plain update
            self.inner.push_update(name, ids, grads, rule, hyper)
            cache.step += 1
            return
        at = slots[mine]
        checked = impl.check_hyper(hyper)
        if self.consistency == Consistency.SYNC_EXACT:
            have, _, _ = cachebook.held_versions(slots, cache.version, cache.checked,
                                                 cache.step, 0)
            held = push_update_held(self.inner, name, ids, grads, rule, hyper, have)
            cache.step += 1
            return self._apply_held(cache, impl, checked, slots, grads, held)
        if len(at):
            # The same rule and kernels as the owner: bit-identical per row.
            impl.apply(kernels, cache.values, cache.states, at,
                       np.ascontiguousarray(grads[mine]), checked, self.num_threads)
        versions = self.inner.push_update_versions(name, ids, grads, rule, hyper)
        cache.step += 1
        if versions is None:  # async: no answer; the next validation tells
            cache.version[at] = np.where(cache.version[at] >= 0, cache.version[at] + 1,
                                         UNKNOWN)
            return
        ok = versions[mine] == cache.version[at] + 1
        cache.version[at[ok]] = versions[mine][ok]
        self._void(cache, at[~ok])  # someone else's gradient reached these rows

    def _apply_held(self, cache, impl, hyper, slots, grads, held):
        """Apply one exact step to the held copies, ``slots >= 0`` (see push_update)."""
        self._stats["summed_rows"] += len(held.summed)
        at, step = cachebook.held_step(slots, grads, held.summed, held.sums, held.versions,
                                       held.drop, not self.config.staleness, cache.version)
        # The same rule and kernels as the owner, on the same gradient: bit-identical.
        impl.apply(kernels, cache.values, cache.states, at, step, hyper, self.num_threads)
        self._void(cache, slots[held.drop])

    def _void(self, cache, slots):
        """Copies in ``slots`` lack another writer's update: dropped, or (bounded
        staleness) used until their next validation refetches them."""
        self._stats["evicted_replicas"] += len(slots)
        if self.config.staleness:
            cache.version[slots] = UNKNOWN
        else:
            cache.evict(slots)

    def invalidate(self, name=None):
        """Forget every cached row (of table ``name``, or of all tables).

        The next pulls read the owners. In bounded-staleness mode a cached row may lack up
        to ``s - 1`` steps of other trainers' updates; call this (after a barrier) before
        reading a final model, e.g. to export or evaluate it.

        Args:
            name: a table, or None for every table.

        Raises:
            KeyError: ``name`` is not a table this cache has seen.
        """
        caches = self._tables.values() if name is None else [self._tables[name]]
        for cache in caches:
            if cache is not None:
                cache.evict(np.flatnonzero(cache.held))
