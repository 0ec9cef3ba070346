"""Tables of every kind for the client suite (tests/test_kvclient_suite.py): a store kind
with its row dtype and a router, made on any placement, with what an oracle needs.

A *table kind* is ``"<store>[_<dtype>]-<router>"``:

- stores: ``dense`` (array tables, ``init_data``), ``hash`` (``HashTableSpec``: any int64
  key) and ``file`` (``FileTableSpec``: keys 0..N-1 on memory-mapped files); ``_bf16`` /
  ``_fp16`` keep rows in 16 bits;
- routers: the partition policies of fixed-key stores (``range``: 2 even ranges,
  ``hash``: DGL's hash book over 3 partitions, ``dgl``: a policy read from a DGL
  partition config, uneven ranges of a node type), and the key hash of hash tables
  (``key``). A file table's ``range`` is its own near-equal ranges, one per shard; its
  ``hash`` and ``dgl`` are those policies folded onto the shards (partition q on shard
  q % S).

Every table's oracle row ``i`` (0..n-1) is addressed by key :meth:`Table.key_of` (``i``
itself for fixed keys; a spread of int64 keys, negative and extreme ones included, for
hash tables), and starts from :meth:`Table.initial`: ``key_normal(dim)`` of that key,
rounded to the row dtype. So one oracle (a dense numpy copy, or ``torch.nn.Embedding``)
checks every kind, and keys, not positions, must address the rows.
"""
import json
import os
import uuid

import numpy as np
import torch

from distemb.dynamic import StoreEmbedding
from distemb.embedding import DistEmbedding
from distemb.kernels import half
from distemb.partition import HashPartitionBook, PartitionPolicy, load_dgl_partition_config, \
    range_policy
from distemb.stores import key_normal
from distemb.stores.spec import FileTableSpec, HashTableSpec

#: Every table kind of the suite (module docstring).
TABLE_KINDS = ["dense-range", "dense-hash", "dense-dgl", "dense_bf16-range", "hash-key",
               "hash_bf16-key", "file-range", "file_fp16-range", "file-hash", "file-dgl"]
#: Tolerance of a half-precision table against a float32 oracle (rows rounded on store).
HALF_RTOL = {"bfloat16": 3e-2, "float16": 4e-3}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_kind(kind):
    """("dense"|"hash"|"file", row dtype, router) of a table kind."""
    store, router = kind.split("-")
    store, _, dt = store.partition("_")
    return store, DTYPES.get(dt, "float32"), router


def dgl_policy(n, tmp):
    """The node policy of a DGL partition config (2 parts, uneven ranges) of ``n`` nodes."""
    path = os.path.join(tmp, f"dgl-{n}.json")
    cut = max(1, n // 3)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"graph_name": "g", "num_parts": 2,
                   "node_map": {"user": [[0, cut], [cut, n]], "item": [[0, 1], [1, 3]]},
                   "edge_map": {"follows": [[0, 2], [2, 5]]}}, f)
    return load_dgl_partition_config(path)[1]["node~user"]


def policy_of(router, n, tmp):
    """The partition policy a fixed-key table of ``n`` keys is routed by."""
    if router == "range":
        return range_policy(n, 2)
    if router == "hash":
        return PartitionPolicy("node", "_N", HashPartitionBook(3, node_counts={"_N": n}))
    if router == "dgl":
        return dgl_policy(n, tmp)
    raise ValueError(f"router: no partition policy {router!r}")


def hash_keys(n):
    """``n`` distinct int64 keys spread over the whole range (0, -1 and both extremes a
    hash index allows among them), in a fixed random order."""
    rng = np.random.default_rng(99)
    keys = np.unique(rng.integers(-2 ** 63 + 2, 2 ** 63 - 1, 4 * n, dtype=np.int64))
    keys = keys[rng.permutation(len(keys))]
    extremes = np.array([0, -1, 2 ** 63 - 1, -2 ** 63 + 2], np.int64)
    keys = np.concatenate([extremes, keys[~np.isin(keys, extremes)]])[:n]
    return keys


class Table:
    """One table of a kind on one client (see the module docstring).

    Attributes:
        name, kind, store, dtype, router, n, dim, keyed (made by ``create_table``),
        policy (fixed-key tables: the partition policy, or None for a file table's own
        ranges), spec (keyed tables: the table spec).
    """

    def __init__(self, kind, n, dim, tmp, name=None, seed=4):
        self.kind, self.n, self.dim, self.seed = kind, n, dim, seed
        self.store, self.dtype, self.router = parse_kind(kind)
        self.name = name or f"{self.store}-{uuid.uuid4().hex[:8]}"
        self.keyed = self.store != "dense"
        self.init = key_normal(dim, seed=seed)
        self._keys = hash_keys(n) if self.store == "hash" else np.arange(n, dtype=np.int64)
        #: the keys whose initial rows rows 0..n-1 start from (another kind's keys, for a
        #: dense oracle of that kind)
        self.init_keys = self._keys
        self.policy = policy_of(self.router, n, tmp) if self.store == "dense" or \
            (self.store == "file" and self.router != "range") else None
        if self.store == "hash":
            self.spec = HashTableSpec(dim, dtype=self.dtype, init=self.init)
        elif self.store == "file":
            self.spec = FileTableSpec(os.path.join(tmp, "files", self.name), num_rows=n,
                                      dim=dim, dtype=self.dtype, init=self.init,
                                      preallocate=False)
            if self.policy is not None:
                self.spec = self.spec.partitioned_by(self.policy)
        else:
            self.spec = None

    def key_of(self, rows):
        """The keys of oracle rows ``rows``."""
        return self._keys[np.asarray(rows, dtype=np.int64)]

    def all_keys(self):
        return self._keys.copy()

    def row_of(self, keys):
        """Oracle rows of ``keys`` (inverse of :meth:`key_of`)."""
        order = np.argsort(self._keys)
        return order[np.searchsorted(self._keys, keys, sorter=order)]

    def rounded(self, rows):
        """float32 ``rows`` as the table keeps them (rounded to its row dtype)."""
        rows = np.asarray(rows, np.float32)
        return rows if self.dtype == "float32" else half.decode(half.encode(rows, self.dtype))

    def initial(self, rows=None):
        """Initial rows of oracle rows ``rows`` (all when None), as stored."""
        rows = np.arange(self.n) if rows is None else np.asarray(rows, np.int64)
        return self.rounded(self.init(self.init_keys[rows]))

    @property
    def rtol(self):
        """Relative tolerance of this table's rows against a float32 oracle."""
        return HALF_RTOL.get(self.dtype, 1e-5)

    # -- on a client -------------------------------------------------------------------

    def make(self, client):
        """Create the table on ``client`` with its initial rows; returns self."""
        if self.keyed:
            client.create_table(self.name, self.spec)
        else:
            client.init_data(self.name, (self.n, self.dim), self.dtype, self.policy)
            client.push(self.name, self.all_keys(), self.init(self.init_keys))
        return self

    def rows(self, client):
        """Every oracle row as ``client`` reads it (a hash table inserts absent keys)."""
        return client.pull(self.name, self.all_keys())

    def state(self, client, names):
        """{state: its rows in oracle order} of the table's optimizer (``names`` as
        ``init_optimizer`` returned them); every key must be held."""
        got = client.table_state(self.name, names)
        if not self.keyed:
            return {s: got[s] for s in names}
        at = self.row_of(got["keys"])
        assert sorted(at.tolist()) == list(range(self.n)), "a key of the table is not held"
        out = {}
        for s in names:
            arr = np.empty((self.n,) + got[s].shape[1:], got[s].dtype)
            arr[at] = got[s]
            out[s] = arr
        return out

    def embedding(self, ctx, name=None):
        """A DistEmbedding of this kind in context ``ctx``, at its initial rows."""
        name = name or self.name
        if self.store == "dense":
            emb = DistEmbedding(self.n, self.dim, name=name, part_policy=self.policy,
                                context=ctx, dtype=self.dtype)
            if ctx.rank == 0:  # the others wait at the job's barrier
                emb.weight[torch.arange(self.n)] = torch.from_numpy(self.init(self.init_keys))
            return emb
        return StoreEmbedding(self.spec, name=name, context=ctx)
