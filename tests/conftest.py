"""Shared fixtures.

``ctx`` gives every test its own embedded context (no shared tables); ``zipf_ids`` makes
duplicate-heavy ids. ``client`` runs each test of tests/test_kvclient_suite.py on every
KVClient: the embedded LocalKVClient, a RemoteKVClient over TCP to two server
processes, with and without shared memory, each of the trainer caches of ``CACHES`` in
front of a RemoteKVClient, a DeviceKVClient on the CPU running the
CUDA twin (tests/cpu_cuda_twin.py), seen through numpy by ``HostView``, and a device cache
(on the CPU, with the twin) in front of a LocalKVClient and of a RemoteKVClient, pulling
through its lookups. The server clusters live for the module
(spawning is the slow part); each test gets a fresh client and drops its tables afterwards.

With ``DISTEMB_TEST_CLIENT=mpi`` (set by tests/test_mpi.py, which runs the suite as the
trainer of an ``mpirun`` job) the one client kind is a RemoteKVClient over MPI to the
job's servers, read from ``$DISTEMB_CONFIG``.
"""
import contextlib
import os

import numpy as np
import pytest
import torch

from cpu_cuda_twin import CpuCudaTwin
from mp_helper import ProcessGroup, cluster_dict, write_json

from distemb.config import load_cluster_config, parse_cache_config, parse_cluster_config
from distemb.kvstore import KVClient, LocalKVClient
from distemb.kvstore.cache import CachedKVClient
from distemb.kvstore.device import DeviceKVClient
from distemb.kvstore.device_cache import DeviceCachedKVClient
from distemb.kernels import cuda
from distemb.kvstore.remote import RemoteKVClient

# DGL's own files, run by tests/test_dgl_upstream.py in their own processes.
collect_ignore = ["dgl_upstream"]

MPI_SUITE = os.environ.get("DISTEMB_TEST_CLIENT") == "mpi"
#: Trainer caches in front of the remote clients: "<cluster kind>+<cache name>".
CACHES = {"lru_exact": parse_cache_config({"policy": "lru", "rows": 4}),  # evicts a lot
          "lfu_exact": parse_cache_config({"policy": "lfu", "fraction": 0.5}),
          "lru_stale3": parse_cache_config({"policy": "lru", "bytes": 4096, "staleness": 3})}
#: With a GPU, the same suite also runs on the real device placements ("_cuda" kinds).
HAS_GPU = cuda.cuda_available()
CLIENT_KINDS = ["mpi"] if MPI_SUITE else (
    ["local", "tcp", "tcp_shm", "device_twin", "device_cache_twin", "tcp+lru_exact",
     "tcp_shm+lfu_exact", "tcp+lru_stale3", "tcp_shm+device_cache_twin"]
    + (["device_cuda", "device_cache_cuda", "tcp_shm+device_cache_cuda"] if HAS_GPU else []))


class HostView(KVClient):
    """A device client behind the numpy interface: arrays cross through from/to_host."""

    def __init__(self, inner):
        self.inner = inner

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

    def close(self):
        self.inner.close()


class CacheLookups(HostView):
    """A device cache in front of a LocalKVClient, whose pulls are its device lookups
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

    def close(self, **kw):
        self.inner.close(**kw)


class Cluster:
    """Servers of one test module and the config that names them."""

    def __init__(self, tmp_path, num_servers, **fields):
        self.raw = cluster_dict(num_servers, **fields)
        self.path = write_json(tmp_path / "cluster.json", self.raw)
        self.cfg = parse_cluster_config(self.raw)
        self.group = ProcessGroup()
        self.servers = self.group.spawn_servers(self.path, num_servers)

    def client(self, rank=0):
        return RemoteKVClient(self.cfg, rank)

    def stop(self, timeout=20):
        """Say goodbye as the only trainer; assert every server exits 0."""
        try:
            self.client().close(goodbye=True)
            self.group.wait_all(timeout)
        finally:
            self.group.__exit__(None, None, None)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = Cluster(tmp_path_factory.mktemp(kind), 2,
                                 shared_memory=kind == "tcp_shm", timeout_s=20.0)
        return made[kind]

    yield get
    for cluster in made.values():
        cluster.stop()


@pytest.fixture(params=CLIENT_KINDS)
def client(request, clusters):
    """A KVClient of each kind; remote ones talk to two server processes."""
    if request.param in ("local", "device_twin", "device_cache_twin", "device_cuda",
                         "device_cache_cuda"):
        kv = {"local": LocalKVClient,
              "device_twin": lambda: HostView(DeviceKVClient("cpu", ops=CpuCudaTwin())),
              "device_cache_twin": CacheLookups,
              "device_cuda": lambda: HostView(DeviceKVClient("cuda")),
              "device_cache_cuda": lambda: CacheLookups(device="cuda")}[request.param]()
        yield kv
        kv.close()
        return
    if request.param == "mpi":
        kv = RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]),
                            int(os.environ["DISTEMB_RANK"]))
    else:
        kind, _, cache = request.param.partition("+")
        kv = clusters(kind).client()
        if cache == "device_cache_twin":
            kv = CacheLookups(kv)
        elif cache == "device_cache_cuda":
            kv = CacheLookups(kv, device="cuda")
        elif cache:
            kv = CachedKVClient(kv, CACHES[cache])
    yield kv
    for name in kv.names():
        kv.delete_data(name)
    kv.close(goodbye=False)


@pytest.fixture(scope="session", autouse=True)
def mpi_goodbye():
    """Under mpirun, say goodbye once the suite is done so the servers exit."""
    yield
    if MPI_SUITE:
        RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]),
                       int(os.environ["DISTEMB_RANK"])).close(goodbye=True)


def pytest_collection_modifyitems(items):
    """Remote variants of the suite spawn processes: mark them multiprocess."""
    for item in items:
        if "client" in getattr(item, "fixturenames", ()) and \
                any(k in item.nodeid for k in ("[tcp", "-tcp")):
            item.add_marker(pytest.mark.multiprocess)


os.environ.setdefault("DGLBACKEND", "pytorch")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


#: The compiled kernels once per CPU build (csrc/cpu_kernels.h), then their numpy twins.
KERNEL_IMPLS = ["compiled-baseline", "compiled-avx2", "compiled-avx512", "reference"]


@pytest.fixture(params=KERNEL_IMPLS)
def kernel_impl(request):
    """Run the test with the compiled kernels under each CPU build (baseline, AVX2,
    AVX-512) and again with their numpy twins.

    A compiled run skips where the extension is not loaded (not built, or the whole suite
    is rerun with DISTEMB_NO_EXT=1, as ``make test`` does), or where this CPU lacks its
    build.
    """
    from distemb import kernels

    impl, _, isa = request.param.partition("-")
    if impl == "compiled" and not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT=1 or not built): "
                    "the reference run covers this case")
    if isa and isa not in kernels.available_cpu_isas():
        pytest.skip(f"this CPU lacks the {isa} build's instructions (it runs "
                    f"{kernels.available_cpu_isas()})")
    with kernels.implementation(impl), \
            (kernels.cpu_isa(isa) if isa else contextlib.nullcontext()):
        yield request.param


@pytest.fixture
def ctx():
    """A fresh embedded DistContext with the pytorch backend, closed afterwards."""
    from distemb.context import DistContext

    c = DistContext.embedded(backend="pytorch", num_threads=2)
    yield c
    c.close()


def zipf_ids(rng, num_rows, size, a=1.2):
    """Duplicate-heavy ids: zipf ranks scattered over the table by a fixed permutation."""
    ranks = (rng.zipf(a, size) - 1) % num_rows
    perm = np.random.default_rng(12345).permutation(num_rows)
    return perm[ranks].astype(np.int64)
