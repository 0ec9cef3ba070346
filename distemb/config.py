"""Typed, validated configs. Every error names the field path that is wrong.

The partition-policy file (YAML or JSON) has this schema::

    num_partitions: 2             # int > 0
    policies:                     # one entry per node or edge type
      - kind: node                # 'node' | 'edge'
        type: user                # the node/edge type name ('_N' / '_E' when untyped)
        book: range               # 'range' | 'hash'
        bounds: [0, 600, 1000]    # range only: num_partitions+1 ascending type-wise ids
      - kind: edge
        type: follows
        book: hash
        num_ids: 5000             # hash only: number of ids; id -> partition id % P

Example:
    >>> cfg = parse_partition_config({"num_partitions": 1, "policies": [
    ...     {"kind": "node", "type": "_N", "book": "hash", "num_ids": 10}]})
    >>> cfg.policies[0].num_ids
    10
"""
import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import yaml

from distemb.enums import Book, CachePolicy, Consistency, PartitionKind, Transport
from distemb.errors import ConfigError, DistEmbError
from distemb.schema import (Schema, all_of, at_least, at_most, each, equal_to, load,
                            non_empty, option, positive)

PORT = all_of(at_least(1), at_most(65535))


@dataclass(frozen=True)
class PolicyConfig(Schema):
    """How the ids of one node or edge type are split across partitions.

    Example:
        >>> PolicyConfig(PartitionKind.NODE, "_N", Book.HASH, num_ids=10).to_dict()["book"]
        'hash'
    """

    kind: PartitionKind = option(help="'node' or 'edge'")
    type: str = option(help="node/edge type name; '_N' or '_E' when untyped",
                       validator=non_empty)
    book: Book = option(help="'range' (contiguous id ranges) or 'hash' (id % P)")
    bounds: Optional[Tuple[int, ...]] = option(
        None, help="range: num_partitions+1 ascending type-wise ids, from 0")
    num_ids: Optional[int] = option(None, help="hash: number of ids", validator=at_least(1))

    def check(self):
        # The length of bounds depends on num_partitions: PartitionConfig.check has it.
        if self.book == Book.RANGE:
            if self.bounds is None:
                raise ConfigError("bounds: missing (book 'range' needs num_partitions+1 "
                                  "ascending ids)")
            if self.num_ids is not None:
                raise ConfigError("num_ids: only for book 'hash' (range uses bounds)")
            b = self.bounds
            if b and b[0] != 0:
                raise ConfigError(f"bounds[0]: must be 0, got {b[0]}")
            for i in range(1, len(b)):
                if b[i] < b[i - 1]:
                    raise ConfigError(f"bounds[{i}]: must be >= bounds[{i - 1}] = {b[i - 1]}, "
                                      f"got {b[i]}")
        else:
            if self.num_ids is None:
                raise ConfigError("num_ids: missing (book 'hash' needs the number of ids)")
            if self.bounds is not None:
                raise ConfigError("bounds: only for book 'range' (hash uses num_ids)")


@dataclass(frozen=True)
class PartitionConfig(Schema):
    """A partition-policy file: the number of partitions and one policy per type.

    Example:
        >>> parse_partition_config({"num_partitions": 2, "policies": [{"kind": "node",
        ...     "type": "_N", "book": "range", "bounds": [0, 4, 9]}]}).policies[0].bounds
        (0, 4, 9)
    """

    num_partitions: int = option(help="number of partitions (> 0)", validator=at_least(1))
    policies: Tuple[PolicyConfig, ...] = option(help="one entry per node or edge type",
                                                validator=non_empty)

    def check(self):
        seen = set()
        for i, p in enumerate(self.policies):
            if p.bounds is not None and len(p.bounds) != self.num_partitions + 1:
                raise ConfigError(f"policies[{i}].bounds: must be a list of num_partitions+1 "
                                  f"= {self.num_partitions + 1} integers, got {list(p.bounds)}")
            if (p.kind, p.type) in seen:
                raise ConfigError(f"policies[{i}].type: duplicate {p.kind} type {p.type!r}")
            seen.add((p.kind, p.type))


def parse_partition_config(raw):
    """Validate a partition-policy mapping (already parsed from YAML/JSON).

    Raises:
        ConfigError: with the field path, e.g. ``policies[1].num_ids: must be >= 1, got 0``.
    """
    return load(PartitionConfig, raw)


def read_config_file(path):
    """Parse a YAML (.yaml/.yml) or JSON file into plain Python data.

    Raises:
        ConfigError: the file is missing or is not valid YAML/JSON.
    """
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such config file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as e:
        kind = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
        raise ConfigError(f"{path}: not valid {kind}: {e}") from e


def _load(path, parse):
    """``parse`` the data of config file ``path``; every error starts with the path."""
    try:
        return parse(read_config_file(path))
    except ConfigError as e:
        if str(e).startswith(path):
            raise
        raise ConfigError(f"{path}: {e}") from None


def load_partition_config(path):
    """Read and validate a distemb partition-policy file (YAML or JSON)."""
    return _load(path, parse_partition_config)


# --- cluster config: the one file distemb-launch hands to every process -------------
#
#     {"version": 1, "job_id": "a1b2", "transport": "tcp", "consistency": "sync",
#      "num_trainers": 2, "trainer_machines": [0, 0],
#      "servers": [{"host": "127.0.0.1", "port": 30050, "machine": 0}, ...]}
#
# The other fields and their defaults are declared once, on ClusterConfig below.


@dataclass(frozen=True)
class ServerEntry(Schema):
    """Where one KVStore server listens; its index in ``servers`` is its id.

    Example:
        >>> ServerEntry("127.0.0.1", 30050, 0).to_dict()
        {'host': '127.0.0.1', 'port': 30050, 'machine': 0}
    """

    host: str = option(help="IPv4 address the server binds and clients dial",
                       validator=non_empty)
    port: int = option(help="TCP port (1..65535)", validator=PORT)
    machine: int = option(help="machine index (line of the ip_config)", validator=at_least(0))


def _token(value, path):
    """Validator: 16..256 characters (the value itself never goes into a message)."""
    if not 16 <= len(value) <= 256:
        raise ConfigError(f"{path}: must be 16..256 characters, got {len(value)}")


def _fraction(value, path):
    if not 0 < value <= 1:
        raise ConfigError(f"{path}: must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class CacheConfig(Schema):
    """A trainer-side cache of hot rows in front of the servers (distemb.kvstore.caches.trainer).

    Give exactly one of ``rows``, ``bytes`` and ``fraction``: the capacity of each
    table's cache. Build it with :func:`parse_cache_config` (validated; errors name the
    field, ``cache.rows: must be >= 1, got 0``).

    Example:
        >>> parse_cache_config({"policy": "lfu", "fraction": 0.1}).capacity(1000, 512)
        100
    """

    policy: CachePolicy = option(CachePolicy.LRU, help="'lru' (the least recently used "
                                 "row is evicted) or 'lfu' (the least often used, with "
                                 "admission)")
    rows: Optional[int] = option(None, help="rows per table (> 0)", validator=at_least(1))
    bytes: Optional[int] = option(None, help="bytes per table, counting each row and its "
                                  "optimizer state (> 0)", validator=at_least(1))
    fraction: Optional[float] = option(None, help="rows per table as a fraction of the "
                                       "table's rows, in (0, 1]", validator=_fraction)
    staleness: int = option(0, help="0: exact (a cached row is used only while its owner "
                            "says it is current); s > 0: a cached row may be up to s steps "
                            "old (a relaxation)", validator=at_least(0))
    idle_when_slower: bool = option(True, help="time the cache's pulls and updates against "
                                    "plain ones, window by window; a cache slower than "
                                    "plain pulls empties itself and stays idle a while "
                                    "(docs/caches.md)")

    def check(self):
        given = [k for k in ("rows", "bytes", "fraction") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(f"rows: give exactly one of rows, bytes, fraction, got "
                              f"{given or 'none'}")

    def capacity(self, num_rows, row_bytes):
        """Rows of a table of ``num_rows`` rows of ``row_bytes`` bytes (state included)."""
        if self.rows is not None:
            want = self.rows
        elif self.bytes is not None:
            want = self.bytes // max(1, row_bytes)
        else:
            want = int(self.fraction * num_rows)
        return max(1, min(num_rows, want))


def parse_cache_config(raw, path="cache"):
    """Validate a cache mapping (``{"policy": "lfu", "fraction": 0.1}``).

    Raises:
        ConfigError: naming the field, e.g. ``cache.fraction: must be in (0, 1], got 1.5``.
    """
    return load(CacheConfig, raw, path)


@dataclass(frozen=True)
class ClusterConfig(Schema):
    """Everything a server or trainer needs to join one distemb job.

    Example:
        >>> cfg = parse_cluster_config({"job_id": "j", "num_trainers": 1,
        ...     "trainer_machines": [0], "servers": [{"host": "127.0.0.1", "port": 30050,
        ...     "machine": 0}]})
        >>> cfg.consistency is Consistency.SYNC, cfg.to_dict()["consistency"]
        (True, 'sync')
    """

    job_id: str = option(help="names the job (and its shared-memory files in /proc/<pid>/maps)",
                         validator=non_empty)
    servers: Tuple[ServerEntry, ...] = option(
        help="server i owns partitions p with p % len(servers) == i", validator=non_empty)
    num_trainers: int = option(help="trainer processes in the job (> 0)",
                               validator=at_least(1))
    trainer_machines: Tuple[int, ...] = option(help="machine of each trainer rank",
                                               validator=each(at_least(0)))
    transport: Transport = option(Transport.TCP, help="'tcp' or 'mpi' (under mpirun)")
    consistency: Consistency = option(
        Consistency.SYNC, help="'sync' (step waits for every server), 'sync_exact' "
        "(trainers' pushes of one step summed, applied once) or 'async' (no wait)")
    shared_memory: bool = option(
        True, help="trainers reach a server on their machine over its local socket, pull "
        "from its shards in shared memory and hand it updates and pushes there")
    timeout_s: float = option(60.0, help="seconds before a silent server is an error",
                              validator=positive)
    max_message_bytes: int = option(
        1 << 30, help="largest frame payload, and the most memory one request other than "
        "creating a table or optimizer may make a server allocate", validator=at_least(1 << 20))
    idle_timeout_s: float = option(3600.0, help="seconds a server keeps a connection that "
                                   "sends nothing", validator=positive)
    job_token: Optional[str] = option(
        None, help="secret every trainer shows at its Hello (distemb-launch makes one); "
        "None: servers accept any process that can connect", validator=_token)
    master_addr: str = option("127.0.0.1", help="torch.distributed master",
                              validator=non_empty)
    master_port: int = option(29500, help="torch.distributed port", validator=PORT)
    part_config: Optional[str] = option(None, help="partition config path",
                                        validator=non_empty)
    cache: Optional[CacheConfig] = option(None, help="trainer-side cache of hot rows "
                                          "(distemb.kvstore.caches.trainer); None: off")
    device_cache: Optional[CacheConfig] = option(
        None, help="a GPU cache of hot rows and their optimizer state in front of the "
        "tables, for emb(ids, device='cuda') (distemb.kvstore.caches.device); exact, one "
        "trainer only; None: off")
    version: int = option(1, help="schema version (1)", validator=equal_to(1))

    def check(self):
        seen = {}
        for i, s in enumerate(self.servers):
            if (s.host, s.port) in seen:
                raise ConfigError(f"servers[{i}].port: {s.host}:{s.port} is also servers"
                                  f"[{seen[(s.host, s.port)]}]")
            seen[(s.host, s.port)] = i
        if len(self.trainer_machines) != self.num_trainers:
            raise ConfigError(f"trainer_machines: must list one machine per trainer "
                              f"({self.num_trainers}), got {list(self.trainer_machines)!r:.80}")
        if self.device_cache is not None:
            check_device_cache(self.device_cache, self.num_trainers)


def check_device_cache(config, num_trainers=1, path="device_cache"):
    """ConfigError unless a GPU cache can be exact here: staleness 0, one trainer.

    Why one trainer: the GPU cache writes a row back to its owner only at eviction, so it
    must be the row's one writer (distemb.kvstore.caches.device says more).
    """
    if config.staleness:
        raise ConfigError(f"{path}.staleness: the device cache is exact only (must be 0), "
                          f"got {config.staleness}")
    if num_trainers != 1:
        raise ConfigError(f"{path}: a device cache writes rows back only at eviction, so it "
                          f"must be their one writer; this job has {num_trainers} trainers "
                          f"(expected 1). With several trainers use the trainer cache "
                          f"('cache') and emb(ids, device=...)")


def parse_cluster_config(raw):
    """Validate a cluster-config mapping.

    Raises:
        ConfigError: with the field path, e.g. ``servers[1].port: must be <= 65535``.
    """
    return load(ClusterConfig, raw)


def load_cluster_config(path):
    """Read and validate a cluster config (JSON); errors start with the path."""
    return _load(path, parse_cluster_config)


def write_cluster_config(cfg, path):
    """Write ``cfg`` as JSON to ``path`` (atomically: readers never see half a file)."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        # Owner-only: the file holds the job's token, which admits a process to the job.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
                       encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the cluster config: {e.strerror}") from None


def default_num_threads():
    """OpenMP threads of the kernels: $DISTEMB_NUM_THREADS, else the usable cores.

    Raises:
        DistEmbError: $DISTEMB_NUM_THREADS is not a positive integer.
    """
    value = os.environ.get("DISTEMB_NUM_THREADS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise DistEmbError(f"DISTEMB_NUM_THREADS: expected a positive integer, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0))
