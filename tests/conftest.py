"""Shared fixtures.

``ctx`` gives every test its own embedded context (no shared tables); ``zipf_ids`` makes
duplicate-heavy ids. ``placement`` (and ``client``, its KVClient) runs each test of the
client suite (tests/test_kvclient_suite.py, tests/test_keyed_suite.py) on every
placement of :data:`PLACEMENTS`:

- ``embedded``: the LocalKVClient;
- ``shm1x1``: a RemoteKVClient co-located with one server (shared-memory reads and
  request slots);
- ``tcp2x2``: two trainers of a two-server ``sync_exact`` job over TCP, seen as one
  client by ``TwoTrainers`` (tests/client_views.py: collective calls on both at once,
  every pull from both and compared, updates split between them);
- ``tcp2x2+cache_exact``: the same, each trainer behind an exact LRU trainer cache of 4
  rows (it evicts a lot); ``shm1x1+cache_stale``: a bounded-staleness LFU cache;
- ``device_cache``: a device cache (4 rows) in front of a LocalKVClient, pulling through
  its device lookups, on the CPU through the CUDA kernels' stand-in
  (tests/cpu_cuda_twin.py); ``shm1x1+device_cache``: the same in front of the co-located
  client; ``device_table``: a DeviceKVClient (GPU tables) on the CPU stand-in;
- ``collective1``: a CollectiveKVClient, a collective job of one rank in this process
  (gloo, file:// rendezvous; tests/test_collective.py runs 2 to 4 ranks);
- with a GPU, the device placements again on the real kernels (``*_cuda``).

The client adapters (``HostView``, ``CacheLookups``, ``TwoTrainers``) live in
tests/client_views.py.

Model-level tests run a job on a placement with :meth:`Placement.run` (one thread per
trainer). The server clusters live for the module (spawning is the slow part); each test
gets fresh clients and drops its tables afterwards.

With ``DISTEMB_TEST_CLIENT=mpi`` (set by tests/test_mpi.py, which runs the suite as the
trainer of an ``mpirun`` job) the one placement is a RemoteKVClient over MPI to the
job's servers, read from ``$DISTEMB_CONFIG``.

``make test`` runs the suite on parallel workers (pytest-xdist, ``--dist loadgroup``;
:func:`pytest_itemcollected` groups what shares a cluster or runs many processes), then,
with ``DISTEMB_NO_EXT=1``, the tests marked ``twin`` (:data:`TWIN_MODULES`: what can
differ without the compiled kernels). Model-level oracles take ``model_impl`` (compiled
on this CPU's build, and the twin), the kernels' own oracles ``kernel_impl`` (every
build, and the twin).
"""
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch.distributed as dist

from client_views import CacheLookups, HostView, TwoTrainers
from cpu_cuda_twin import CpuCudaHalfTwin, CpuCudaTwin
from mp_helper import ProcessGroup, cluster_dict, write_json

from distemb.config import load_cluster_config, parse_cache_config, parse_cluster_config
from distemb.context import DistContext
from distemb.kvstore import LocalKVClient
from distemb.kvstore.caches.trainer import CachedKVClient
from distemb.kvstore.collective import CollectiveKVClient
from distemb.kvstore.device import DeviceKVClient
from distemb.kvstore.caches.device import DeviceCachedKVClient
from distemb.kernels import cuda
from distemb.kvstore.remote import RemoteKVClient

# DGL's (1.1.3, 2.4.0) and PyG's own files, run by tests/test_dgl_upstream.py,
# tests/test_dgl2_upstream.py and tests/test_pyg_upstream.py in their own processes.
collect_ignore = ["dgl_upstream", "dgl2_upstream", "pyg_upstream"]

MPI_SUITE = os.environ.get("DISTEMB_TEST_CLIENT") == "mpi"
#: Trainer caches of the suite's placements.
CACHES = {"cache_exact": parse_cache_config({"policy": "lru", "rows": 4}),  # evicts a lot
          "cache_stale": parse_cache_config({"policy": "lfu", "rows": 4, "staleness": 3})}
#: With a GPU, the same suite also runs on the real device placements ("_cuda" kinds).
HAS_GPU = cuda.cuda_available()
PLACEMENTS = ["mpi"] if MPI_SUITE else (
    ["embedded", "shm1x1", "tcp2x2", "tcp2x2+cache_exact", "shm1x1+cache_stale",
     "device_cache", "shm1x1+device_cache", "device_table", "collective1"]
    + (["device_cache_cuda", "shm1x1+device_cache_cuda", "device_table_cuda"]
       if HAS_GPU else []))
#: Server clusters by kind: (servers, trainers, extra config fields).
CLUSTERS = {"tcp": (2, 1, {}), "tcp_shm": (2, 1, {"shared_memory": True}),
            "shm1x1": (1, 1, {"shared_memory": True}),
            "tcp2x2": (2, 2, {"consistency": "sync_exact"}), "tcp3x1": (3, 1, {}),
            "tcp_async": (2, 1, {"consistency": "async"})}


def holds(placement, kind):
    """Whether placement ``placement`` holds tables of kind ``kind`` (tests/suite_tables.py);
    where it does not, it refuses them naming both (the capability table of
    docs/stores.md)."""
    base = placement.split("+")[-1]
    return kind.startswith(("dense", "hash")) or not base.startswith("device_table")


def routes(placement, kind):
    """Whether the suite runs fixed-key table kind ``kind`` on ``placement``: every kind
    everywhere, but for the device caches, which route nothing themselves (a miss or a
    write-back goes to the inner client by key, and ids are checked by the table's
    router as the inner client checks them), so their fixed-key tables run the range
    router only: the keys are 0..N-1 under every router, and the hash and DGL routers
    run in the inner placements' own cells (embedded, shm1x1)."""
    base = placement.split("+")[-1].replace("_cuda", "")
    return base != "device_cache" or kind.startswith("hash") or kind.endswith("-range")


#: The client type that refuses what a placement does not hold, by placement base.
REFUSERS = {"device_table": "DeviceKVClient", "device_cache": "DeviceCachedKVClient"}


class Cluster:
    """Servers of one test module and the config that names them."""

    def __init__(self, tmp_path, num_servers, num_trainers=1, **fields):
        self.raw = cluster_dict(num_servers, num_trainers, **fields)
        self.path = write_json(tmp_path / "cluster.json", self.raw)
        self.cfg = parse_cluster_config(self.raw)
        self.group = ProcessGroup()
        self.servers = self.group.spawn_servers(self.path, num_servers)

    def client(self, rank=0):
        return RemoteKVClient(self.cfg, rank)

    def stop(self, timeout=20):
        """Say goodbye as every trainer; assert every server exits 0."""
        try:
            for rank in range(self.cfg.num_trainers):
                self.client(rank).close(goodbye=True)
            self.group.wait_all(timeout)
        finally:
            self.group.__exit__(None, None, None)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            servers, trainers, fields = CLUSTERS[kind]
            made[kind] = Cluster(tmp_path_factory.mktemp(kind), servers, trainers,
                                 timeout_s=20.0, **{"shared_memory": False, **fields})
        return made[kind]

    yield get
    for cluster in made.values():
        cluster.stop()


class Placement:
    """Where the suite's tables live: ``client``, the KVClient of the tests, and
    ``trainers``, the clients of the job's trainers (one DistContext each in
    :meth:`run`); ``device``: where model tests look rows up (None: the host)."""

    def __init__(self, name, client, trainers=None, device=None):
        self.name, self.client, self.device = name, client, device
        self.trainers = trainers or [client]
        base = name.split("+")[-1].replace("_cuda", "")
        self.refuser = REFUSERS.get(base)

    def cache_stats(self):
        """The first trainer's cache counters (``stats()``), or None without a cache."""
        kv = self.trainers[0]
        return kv.stats() if isinstance(kv, (CachedKVClient, DeviceCachedKVClient)) else None

    def run(self, job):
        """``job(ctx, rank, num_trainers)`` on every trainer (one thread each); the
        results in rank order."""
        def one(rank, kv):
            role = "trainer" if isinstance(kv, (RemoteKVClient, CachedKVClient)) else \
                "embedded"
            ctx = DistContext(kv, backend="pytorch", role=role, rank=rank,
                              num_trainers=len(self.trainers), num_threads=1)
            return job(ctx, rank, len(self.trainers))
        if len(self.trainers) == 1:
            return [one(0, self.trainers[0])]
        with ThreadPoolExecutor(len(self.trainers)) as pool:
            futures = [pool.submit(one, r, kv) for r, kv in enumerate(self.trainers)]
            return [f.result(timeout=120) for f in futures]


def make_placement(name, clusters, tmp_dir=None):
    """The :class:`Placement` called ``name`` (see :data:`PLACEMENTS`); ``tmp_dir``: where
    a collective job of one rank meets (its rendezvous file)."""
    if name == "mpi":
        return Placement(name, RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]),
                                              int(os.environ["DISTEMB_RANK"])))
    base, _, wrap = name.partition("+")
    gpu = name.endswith("_cuda")
    dev = "cuda" if gpu else "cpu"
    if base in ("embedded", "device_cache", "device_cache_cuda"):
        inner = LocalKVClient()
    elif base == "collective1":  # a collective job of one rank, in this process
        dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/rdv",
                                rank=0, world_size=1)
        return Placement(name, CollectiveKVClient(timeout_s=60, own_group=True))
    elif base in ("device_table", "device_table_cuda"):
        table = DeviceKVClient("cuda") if gpu else DeviceKVClient(
            "cpu", ops=CpuCudaTwin(), half_ops=CpuCudaHalfTwin)
        return Placement(name, HostView(table), [table], device=dev)
    else:
        cluster = clusters(base)
        inner = [cluster.client(rank) for rank in range(cluster.cfg.num_trainers)]
    if base.startswith("device_cache"):
        wrap = base
    if wrap.startswith("device_cache"):
        kv = CacheLookups(inner[0] if isinstance(inner, list) else inner, device=dev)
        return Placement(name, kv, [kv.inner], device=dev)
    inner = inner if isinstance(inner, list) else [inner]
    if wrap:
        inner = [CachedKVClient(kv, CACHES[wrap]) for kv in inner]
    client = inner[0] if len(inner) == 1 else TwoTrainers(inner)
    return Placement(name, client, inner)


def pytest_generate_tests(metafunc):
    """``placement`` runs on every placement; with ``table_kind``, on every (placement,
    table kind) pair the placement holds; marked ``holding(kind, ...)``, on every
    placement that holds those kinds."""
    if "placement" not in metafunc.fixturenames:
        if "table_kind" in metafunc.fixturenames:
            from suite_tables import TABLE_KINDS
            metafunc.parametrize("table_kind", TABLE_KINDS)
        return
    holding = metafunc.definition.get_closest_marker("holding")
    if holding is not None:  # the placements that hold every kind the marker names
        where = [p for p in PLACEMENTS if all(holds(p, k) for k in holding.args)]
        metafunc.parametrize("placement", where, indirect=True)
    elif "table_kind" in metafunc.fixturenames:
        from suite_tables import TABLE_KINDS
        pairs = [(p, k) for p in PLACEMENTS for k in TABLE_KINDS
                 if holds(p, k) and routes(p, k)]
        metafunc.parametrize(["placement", "table_kind"], pairs, indirect=["placement"],
                             ids=[f"{p}-{k}" for p, k in pairs])
    else:
        metafunc.parametrize("placement", PLACEMENTS, indirect=True)


@pytest.fixture
def placement(request, clusters, tmp_path_factory):
    """A placement of each kind; remote ones talk to module-scoped server processes."""
    rendezvous = tmp_path_factory.mktemp("rdv") if request.param == "collective1" else None
    where = make_placement(request.param, clusters, rendezvous)
    yield where
    kv = where.client
    try:
        for name in kv.names():
            if "~opt~" not in name:
                kv.delete_data(name)
    finally:
        if request.param.split("+")[0] in CLUSTERS or request.param == "mpi":
            kv.close(goodbye=False)  # the module's servers serve the next test
        else:
            kv.close()


@pytest.fixture
def client(placement):
    """The KVClient of each placement (see ``placement``)."""
    return placement.client


@pytest.fixture(scope="session", autouse=True)
def mpi_goodbye():
    """Under mpirun, say goodbye once the suite is done so the servers exit."""
    yield
    if MPI_SUITE:
        RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]),
                       int(os.environ["DISTEMB_RANK"])).close(goodbye=True)


#: Test modules whose subject is code that picks the compiled or the twin implementation
#: (distemb/kernels/: ``HAS_EXT``, ``implementation()``, ``native=``, ``half._impl()``) or
#: calls it below every placement (the stores, the shard type): the twin pass
#: (``DISTEMB_NO_EXT=1 pytest -m twin``) runs them, with the client suite on the
#: embedded placement. (tests/test_no_extension.py, the import and command-line smoke
#: run without the extension, sets its processes' switch itself: it runs once.) Everything
#: else reaches the kernels only through those modules, whose dispatch validates the
#: same way for both and whose two implementations the kernel tests hold to the same
#: oracles, so it cannot behave differently on the twin.
TWIN_MODULES = {
    "test_kernels", "test_half_kernels", "test_hashtable", "test_losses", "test_ftrl",
    # the kernels, the hash index, the fused loss; the stores, the shard type
    "test_store_suite", "test_hash_store", "test_shard",
    "test_dynamic_embedding",  # its own HAS_EXT branch (an inexact twin comparison)
    "test_dynamic_embedding_storage",  # split from test_dynamic_embedding, twin as it was
    "test_cachebook",  # the caches' bookkeeping kernels
}
#: Client suite modules: their tests on the embedded placement (the stores' and rules'
#: calls into the kernels, in this process) run again on the twin.
SUITE_MODULES = {"test_kvclient_suite", "test_kvclient_jobs", "test_keyed_suite"}
#: Parameters that already run both implementations in the compiled pass.
BOTH_IMPLS = {"kernel_impl", "model_impl", "native"}


def _runs_on_the_twin(item):
    module = item.module.__name__.rsplit(".", 1)[-1]
    params = getattr(getattr(item, "callspec", None), "params", {})
    if BOTH_IMPLS & set(params) or BOTH_IMPLS & set(item.fixturenames):
        return False  # its reference case ran in the compiled pass
    if module in SUITE_MODULES:
        return params.get("placement") == "embedded"
    return module in TWIN_MODULES


#: Process-heavy tests (each starts many Python processes with torch and DGL): the
#: parallel run (pytest-xdist, ``--dist loadgroup``) keeps each lane on one worker, so
#: at most this many of them run at once on a 2-core machine, and queues them first
#: (longest first). DGL's own tests share /tmp/dist_graph, and DGL's servers name their
#: shared memory after the data alone, so every test starting DGL servers shares a lane.
HEAVY_LANES = {
    "test_dgl_upstream": "heavy-dgl", "test_dgl2_upstream": "heavy-dgl",
    "test_dgl_launcher": "heavy-dgl",
    "test_mpi": "heavy-jobs", "test_collective": "heavy-jobs",
    "test_cache_cluster": "heavy-jobs", "test_orphans": "heavy-jobs",
}


def _xdist_group(item):
    """The xdist group of ``item``: its heavy lane; else, where it shares a module-scoped
    fixture (a server cluster of one kind, a compiled emulator), its module (and cluster
    kind), so the fixture is made once; else none (any worker, one test at a time)."""
    module = item.module.__name__.rsplit(".", 1)[-1]
    if module in HEAVY_LANES:
        return HEAVY_LANES[module]
    shared = [name for name, defs in item._fixtureinfo.name2fixturedefs.items()
              if defs and defs[-1].scope in ("module", "package")]
    if not shared:
        return None
    if shared == ["clusters"]:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "clusters" in item._fixtureinfo.argnames or "placement" not in params:
            return f"{module}:clusters"  # asks for clusters itself: of any kind
        base = str(params["placement"]).split("+")[0]
        return f"{module}:{base}" if base in CLUSTERS else None  # else: spawns nothing
    return module


def pytest_itemcollected(item):
    """Remote placements of the suite spawn processes: mark them multiprocess. Mark what
    the twin pass runs (``twin``) and group tests for parallel workers (``xdist_group``,
    read by xdist's own collection hook, which must see them)."""
    if "placement" in getattr(item, "fixturenames", ()) and \
            any(k in item.nodeid for k in ("tcp", "shm1x1", "mpi")):
        item.add_marker(pytest.mark.multiprocess)
    if not isinstance(item, pytest.Function):
        return
    if _runs_on_the_twin(item):
        item.add_marker(pytest.mark.twin)
    group = _xdist_group(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(items):
    """The heavy lanes first: the parallel run queues groups in this order."""
    heavy = set(HEAVY_LANES)
    items.sort(key=lambda i: getattr(i, "module", None) is None or
               i.module.__name__.rsplit(".", 1)[-1] not in heavy)


os.environ.setdefault("DGLBACKEND", "pytorch")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


#: The compiled kernels once per CPU build (csrc/cpu_kernels.h), then their numpy twins.
KERNEL_IMPLS = ["compiled-baseline", "compiled-avx2", "compiled-avx512", "reference"]
#: The compiled kernels on the build this CPU picks, then their numpy twins.
MODEL_IMPLS = ["compiled", "reference"]


@pytest.fixture(params=KERNEL_IMPLS)
def kernel_impl(request):
    """Run the test with the compiled kernels under each CPU build (baseline, AVX2,
    AVX-512) and again with their numpy twins: for the kernels' own oracles.

    A compiled run skips where the extension is not loaded (not built, or DISTEMB_NO_EXT=1
    as in ``make test``'s twin pass), or where this CPU lacks its build.
    """
    yield from _kernels_of(request.param)


@pytest.fixture(params=MODEL_IMPLS)
def model_impl(request):
    """Run the test with the compiled kernels (the build this CPU picks) and again with
    their numpy twins: for oracles of whole models and optimizers. Every build gives the
    same bits, kernel by kernel (tests/test_cpu_isa.py, tests/test_half_isa.py), so a
    model built from those kernels needs no run per build."""
    yield from _kernels_of(request.param)


def _kernels_of(param):
    """Run the test's block on the kernels ``param`` names ('compiled', 'reference',
    'compiled-<isa>'), or skip naming why they are not here."""
    from distemb import kernels

    impl, _, isa = param.partition("-")
    if impl == "compiled" and not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT=1 or not built): "
                    "the reference run covers this case")
    if isa and isa not in kernels.available_cpu_isas():
        pytest.skip(f"this CPU lacks the {isa} build's instructions (it runs "
                    f"{kernels.available_cpu_isas()})")
    with kernels.implementation(impl), \
            (kernels.cpu_isa(isa) if isa else contextlib.nullcontext()):
        yield param


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
