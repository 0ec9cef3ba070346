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


def load_partition_config(path):
    """Read and validate a distemb partition-policy file (YAML or JSON)."""
    try:
        return parse_partition_config(read_config_file(path))
    except ConfigError as e:
        if str(e).startswith(path):
            raise
        raise ConfigError(f"{path}: {e}") from None
