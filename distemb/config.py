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
from dataclasses import dataclass, field
from typing import Optional, Tuple

import yaml

from distemb.errors import ConfigError

KINDS = ("node", "edge")
BOOKS = ("range", "hash")


@dataclass(frozen=True)
class PolicyConfig:
    """How the ids of one node or edge type are split across partitions."""

    kind: str = field(metadata={"help": "'node' or 'edge'"})
    type: str = field(metadata={"help": "node/edge type name; '_N' or '_E' when untyped"})
    book: str = field(metadata={"help": "'range' (contiguous id ranges) or 'hash' (id % P)"})
    bounds: Optional[Tuple[int, ...]] = field(
        default=None, metadata={"help": "range: num_partitions+1 ascending type-wise ids"})
    num_ids: Optional[int] = field(default=None, metadata={"help": "hash: number of ids"})


@dataclass(frozen=True)
class PartitionConfig:
    """A partition-policy file: the number of partitions and one policy per type."""

    num_partitions: int = field(metadata={"help": "number of partitions (> 0)"})
    policies: Tuple[PolicyConfig, ...] = field(metadata={"help": "one entry per type"})


def _int(value, path, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return value


def _choice(value, path, choices):
    if value not in choices:
        raise ConfigError(f"{path}: must be one of {list(choices)}, got {value!r}")
    return value


def _policy(raw, path, num_parts):
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
    allowed = {"kind", "type", "book", "bounds", "num_ids"}
    extra = sorted(set(raw) - allowed)
    if extra:
        raise ConfigError(f"{path}.{extra[0]}: unknown field (allowed: {sorted(allowed)})")
    for key in ("kind", "type", "book"):
        if key not in raw:
            raise ConfigError(f"{path}.{key}: missing")
    kind = _choice(raw["kind"], f"{path}.kind", KINDS)
    if not isinstance(raw["type"], str) or not raw["type"]:
        raise ConfigError(f"{path}.type: must be a non-empty string, got {raw['type']!r}")
    book = _choice(raw["book"], f"{path}.book", BOOKS)
    bounds = num_ids = None
    if book == "range":
        b = raw.get("bounds")
        if not isinstance(b, list) or len(b) != num_parts + 1:
            raise ConfigError(f"{path}.bounds: must be a list of num_partitions+1 = "
                              f"{num_parts + 1} integers, got {b!r}")
        bounds = tuple(_int(v, f"{path}.bounds[{i}]", 0) for i, v in enumerate(b))
        if bounds[0] != 0:
            raise ConfigError(f"{path}.bounds[0]: must be 0, got {bounds[0]}")
        for i in range(1, len(bounds)):
            if bounds[i] < bounds[i - 1]:
                raise ConfigError(f"{path}.bounds[{i}]: must be >= bounds[{i - 1}] = "
                                  f"{bounds[i - 1]}, got {bounds[i]}")
        if "num_ids" in raw:
            raise ConfigError(f"{path}.num_ids: only for book 'hash' (range uses bounds)")
    else:
        num_ids = _int(raw.get("num_ids"), f"{path}.num_ids", 1)
        if "bounds" in raw:
            raise ConfigError(f"{path}.bounds: only for book 'range' (hash uses num_ids)")
    return PolicyConfig(kind, raw["type"], book, bounds, num_ids)


def parse_partition_config(raw):
    """Validate a partition-policy mapping (already parsed from YAML/JSON).

    Raises:
        ConfigError: with the field path, e.g. ``policies[1].num_ids: must be >= 1, got 0``.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>: must be a mapping, got {type(raw).__name__}")
    if "num_partitions" not in raw:
        raise ConfigError("num_partitions: missing")
    num_parts = _int(raw["num_partitions"], "num_partitions", 1)
    pols = raw.get("policies")
    if not isinstance(pols, list) or not pols:
        raise ConfigError(f"policies: must be a non-empty list, got {pols!r}")
    parsed = tuple(_policy(p, f"policies[{i}]", num_parts) for i, p in enumerate(pols))
    seen = set()
    for i, p in enumerate(parsed):
        if (p.kind, p.type) in seen:
            raise ConfigError(f"policies[{i}].type: duplicate {p.kind} type {p.type!r}")
        seen.add((p.kind, p.type))
    return PartitionConfig(num_parts, parsed)


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
#      "shared_memory": true, "timeout_s": 60.0, "num_trainers": 2,
#      "servers": [{"host": "127.0.0.1", "port": 30050, "machine": 0}, ...],
#      "trainer_machines": [0, 0], "master_addr": "127.0.0.1", "master_port": 29500,
#      "part_config": null}

TRANSPORTS = ("tcp", "mpi")
CONSISTENCY = ("sync", "sync_exact", "async")


@dataclass(frozen=True)
class ServerEntry:
    """Where one KVStore server listens; its index in ``servers`` is its id."""

    host: str = field(metadata={"help": "IPv4 address the server binds and clients dial"})
    port: int = field(metadata={"help": "TCP port (1..65535)"})
    machine: int = field(metadata={"help": "machine index (line of the ip_config)"})


@dataclass(frozen=True)
class ClusterConfig:
    """Everything a server or trainer needs to join one distemb job."""

    job_id: str = field(metadata={"help": "names the job's shared-memory files"})
    servers: Tuple[ServerEntry, ...] = field(metadata={"help": "server i owns partitions "
                                                               "p with p % len(servers) == i"})
    num_trainers: int = field(metadata={"help": "trainer processes in the job (> 0)"})
    trainer_machines: Tuple[int, ...] = field(metadata={"help": "machine of each trainer rank"})
    transport: str = field(default="tcp", metadata={"help": "'tcp' or 'mpi' (under mpirun)"})
    consistency: str = field(default="sync", metadata={
        "help": "'sync' (step waits for every server), 'sync_exact' (trainers' pushes of "
                "one step summed, applied once) or 'async' (no wait)"})
    shared_memory: bool = field(default=True, metadata={
        "help": "trainers pull from co-located servers' shards through /dev/shm"})
    timeout_s: float = field(default=60.0, metadata={"help": "seconds before a silent "
                                                             "server is an error"})
    max_message_bytes: int = field(default=1 << 30, metadata={"help": "largest frame payload"})
    idle_timeout_s: float = field(default=3600.0, metadata={
        "help": "seconds a server keeps a connection that sends nothing"})
    job_token: Optional[str] = field(default=None, metadata={
        "help": "secret every trainer shows at its Hello (distemb-launch makes one); "
                "None: servers accept any process that can connect"})
    master_addr: str = field(default="127.0.0.1", metadata={"help": "torch.distributed master"})
    master_port: int = field(default=29500, metadata={"help": "torch.distributed port"})
    part_config: Optional[str] = field(default=None, metadata={"help": "partition config path"})
    version: int = field(default=1, metadata={"help": "schema version (1)"})

    def to_dict(self):
        """Plain data for JSON (round-trips through :func:`parse_cluster_config`)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["servers"] = [vars(s).copy() for s in self.servers]
        d["trainer_machines"] = list(self.trainer_machines)
        return d


def _str(value, path):
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: must be a non-empty string, got {value!r}")
    return value


def _port(value, path):
    _int(value, path, 1)
    if value > 65535:
        raise ConfigError(f"{path}: must be <= 65535, got {value}")
    return value


def _server(raw, path):
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
    for key in ("host", "port", "machine"):
        if key not in raw:
            raise ConfigError(f"{path}.{key}: missing")
    return ServerEntry(_str(raw["host"], f"{path}.host"), _port(raw["port"], f"{path}.port"),
                       _int(raw["machine"], f"{path}.machine", 0))


def parse_cluster_config(raw):
    """Validate a cluster-config mapping.

    Raises:
        ConfigError: with the field path, e.g. ``servers[1].port: must be <= 65535``.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>: must be a mapping, got {type(raw).__name__}")
    known = set(ClusterConfig.__dataclass_fields__)
    extra = sorted(set(raw) - known)
    if extra:
        raise ConfigError(f"{extra[0]}: unknown field (allowed: {sorted(known)})")
    for key in ("job_id", "servers", "num_trainers", "trainer_machines"):
        if key not in raw:
            raise ConfigError(f"{key}: missing")
    if _int(raw.get("version", 1), "version", 1) != 1:
        raise ConfigError(f"version: must be 1, got {raw['version']}")
    servers = raw["servers"]
    if not isinstance(servers, list) or not servers:
        raise ConfigError(f"servers: must be a non-empty list, got {servers!r:.80}")
    servers = tuple(_server(s, f"servers[{i}]") for i, s in enumerate(servers))
    seen = {}
    for i, s in enumerate(servers):
        if (s.host, s.port) in seen:
            raise ConfigError(f"servers[{i}].port: {s.host}:{s.port} is also servers"
                              f"[{seen[(s.host, s.port)]}]")
        seen[(s.host, s.port)] = i
    num_trainers = _int(raw["num_trainers"], "num_trainers", 1)
    machines = raw["trainer_machines"]
    if not isinstance(machines, list) or len(machines) != num_trainers:
        raise ConfigError(f"trainer_machines: must list one machine per trainer "
                          f"({num_trainers}), got {machines!r:.80}")
    machines = tuple(_int(m, f"trainer_machines[{i}]", 0) for i, m in enumerate(machines))
    timeout = raw.get("timeout_s", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"timeout_s: must be a number > 0, got {timeout!r}")
    shm = raw.get("shared_memory", True)
    if not isinstance(shm, bool):
        raise ConfigError(f"shared_memory: must be true or false, got {shm!r}")
    part = raw.get("part_config")
    if part is not None:
        _str(part, "part_config")
    idle = raw.get("idle_timeout_s", 3600.0)
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle <= 0:
        raise ConfigError(f"idle_timeout_s: must be a number > 0, got {idle!r}")
    token = raw.get("job_token")
    if token is not None and (not isinstance(token, str) or not 16 <= len(token) <= 256):
        got = f"{len(token)} characters" if isinstance(token, str) else repr(token)
        raise ConfigError(f"job_token: must be a string of 16..256 characters, got {got}")
    return ClusterConfig(
        job_id=_str(raw["job_id"], "job_id"), servers=servers, num_trainers=num_trainers,
        trainer_machines=machines,
        transport=_choice(raw.get("transport", "tcp"), "transport", TRANSPORTS),
        consistency=_choice(raw.get("consistency", "sync"), "consistency", CONSISTENCY),
        shared_memory=shm, timeout_s=float(timeout),
        max_message_bytes=_int(raw.get("max_message_bytes", 1 << 30), "max_message_bytes",
                               1 << 20),
        master_addr=_str(raw.get("master_addr", "127.0.0.1"), "master_addr"),
        master_port=_port(raw.get("master_port", 29500), "master_port"), part_config=part,
        idle_timeout_s=float(idle), job_token=token)


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
