"""The client adapters of the client suite's placements (tests/conftest.py): each makes
a client the suite's tests drive through the numpy KVClient interface.

- :class:`HostView`: a device client (a GPU table) behind the numpy interface;
- :class:`CacheLookups`: a device cache in front of a host client, pulling through its
  device lookups;
- :class:`TwoTrainers`: the two trainers of a two-server ``sync_exact`` job as one
  client.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from cpu_cuda_twin import CpuCudaTwin

from distemb.config import parse_cache_config
from distemb.kvstore import LocalKVClient
from distemb.kvstore.caches.device import DeviceCachedKVClient


class HostView:
    """A device client behind the numpy interface: arrays cross through from/to_host;
    everything else is the client's own."""

    def __init__(self, inner):
        self.inner = inner
        self.num_servers = inner.num_servers

    def init_data(self, name, shape, dtype, policy, init_func=None, rounding_seed=None):
        self.inner.init_data(name, shape, dtype, policy, init_func, rounding_seed)

    def data_meta(self, name):
        return self.inner.data_meta(name)

    def names(self):
        return self.inner.names()

    def delete_data(self, name):
        self.inner.delete_data(name)

    def pull(self, name, ids):
        return self.inner.to_host(self.inner.pull(name, self.inner.from_host(ids)))

    def push(self, name, ids, values):
        self.inner.push(name, self.inner.from_host(ids), self.inner.from_host(values))

    def init_optimizer(self, name, rule, options):
        return self.inner.init_optimizer(name, rule, options)

    def push_update(self, name, ids, grads, rule, hyper):
        self.inner.push_update(name, self.inner.from_host(ids), self.inner.from_host(grads),
                               rule, hyper)

    def __getattr__(self, attr):  # everything else (key management, checkpoints): inner's
        return getattr(self.inner, attr)

    def close(self, **kw):
        self.inner.close(**kw)


class CacheLookups(HostView):
    """A device cache in front of a host client, whose pulls are its device lookups
    (misses admitted, 4 rows: it evicts a lot) and whose updates arrive as device
    tensors, as from ``emb(ids, device=...)``. On the CPU it runs the CUDA twin; with
    ``device="cuda"`` the real kernels on a GPU."""

    def __init__(self, inner=None, device="cpu"):
        ops = CpuCudaTwin() if device == "cpu" else None
        self.device = torch.device(device)
        super().__init__(DeviceCachedKVClient(inner or LocalKVClient(),
                                              parse_cache_config({"rows": 4}), device,
                                              ops=ops))

    def pull(self, name, ids):
        return self.inner.lookup(name, ids).cpu().numpy()

    def push_update(self, name, ids, grads, rule, hyper):
        self.inner.push_update(
            name, torch.from_numpy(np.ascontiguousarray(ids)).to(self.device),
            torch.from_numpy(np.ascontiguousarray(grads)).to(self.device), rule, hyper)


class TwoTrainers:
    """The two trainers of a two-server ``sync_exact`` job as one KVClient.

    Collective calls (creation, optimizer state, barriers) run on both trainers at once;
    every pull is read by both and must agree (both trainers see one table); each update
    is split between them (the servers sum a step's contributions, so the halves equal
    the whole); other writes and key management go to each trainer in turn.
    """

    COLLECTIVE = ("init_data", "create_table", "init_optimizer", "barrier")
    EITHER = ("push", "remove", "contains", "get", "evict", "size", "export", "import_",
              "flush", "table_state", "load_table_state", "save_table", "load_table",
              "capacity")

    def __init__(self, trainers):
        self.trainers = list(trainers)
        self.num_servers, self.num_threads = self.trainers[0].num_servers, 1
        self._pool = ThreadPoolExecutor(len(self.trainers))
        self._turn = 0

    def on_all(self, method, *args):
        """``method(*args)`` of every trainer at once; the first trainer's result."""
        futures = [self._pool.submit(getattr(t, method), *args) for t in self.trainers]
        return [f.result(timeout=60) for f in futures][0]

    def _next(self):
        self._turn = (self._turn + 1) % len(self.trainers)
        return self.trainers[self._turn]

    def __getattr__(self, attr):
        if attr in self.COLLECTIVE:
            return lambda *args: self.on_all(attr, *args)
        if attr in self.EITHER:
            return getattr(self._next(), attr)
        return getattr(self.trainers[0], attr)

    def init_data(self, *args):
        self.on_all("init_data", *args)

    def init_optimizer(self, *args):
        return self.on_all("init_optimizer", *args)

    def data_meta(self, name):
        return self.trainers[0].data_meta(name)

    def names(self):
        return self.trainers[0].names()

    def delete_data(self, name):
        for t in self.trainers:
            t.delete_data(name)

    def pull(self, name, ids):
        rows = [t.pull(name, ids) for t in self.trainers]
        for other in rows[1:]:
            np.testing.assert_array_equal(other, rows[0], err_msg="the trainers disagree")
        return rows[0]

    def push(self, name, ids, values):
        self._next().push(name, ids, values)

    def push_update(self, name, ids, grads, rule, hyper):
        half = len(ids) // 2
        parts = [(ids[:half], grads[:half]), (ids[half:], grads[half:])]
        futures = [self._pool.submit(t.push_update, name, i, g, rule, hyper)
                   for t, (i, g) in zip(self.trainers, parts)]
        for f in futures:
            f.result(timeout=60)

    def close(self, **kw):
        for t in self.trainers:
            t.close(**kw)
        self._pool.shutdown()
