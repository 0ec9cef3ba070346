"""Checkpoints: whole (un-sharded) tensors plus JSON metadata in one .npz, written atomically.

Tensors are saved by global row id, so a checkpoint loads into any partitioning: that is
the resharding. A failed save leaves any earlier file at ``path`` untouched.

Example:
    >>> import numpy as np, tempfile, os
    >>> from distemb.kvstore import LocalKVClient
    >>> from distemb.partition import range_policy
    >>> kv = LocalKVClient(); kv.init_data("w", (3, 2), "float32", range_policy(3))
    >>> p = os.path.join(tempfile.mkdtemp(), "ck.npz")
    >>> save(p, kv, ["w"], {"note": "doc"}); read_meta(p)["note"]
    'doc'
"""
import json
import os
import zipfile

import numpy as np

from distemb.arrays import check_shape
from distemb.errors import DistEmbError

FORMAT = "distemb-checkpoint"
VERSION = 1
CHUNK_ROWS = 1 << 20


def all_rows(client, name: str) -> np.ndarray:
    """Every row of tensor ``name`` of ``client``, as one numpy array, pulled in chunks."""
    n = client.data_meta(name).shape[0]
    parts = [client.to_host(client.pull(
                 name, client.from_host(np.arange(s, min(s + CHUNK_ROWS, n), dtype=np.int64))))
             for s in range(0, n, CHUNK_ROWS)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def push_rows(client, name: str, array: np.ndarray) -> None:
    """Write ``array`` (every row of ``name``) into ``client``, in chunks of CHUNK_ROWS rows.

    Chunks keep each request under a transport's frame limit for remote tables.
    """
    for s in range(0, array.shape[0], CHUNK_ROWS):
        ids = np.arange(s, min(s + CHUNK_ROWS, array.shape[0]), dtype=np.int64)
        client.push(name, client.from_host(ids),
                    client.from_host(np.ascontiguousarray(array[s:s + len(ids)])))


def save(path, client, names, meta):
    """Write tensors ``names`` of ``client`` and ``meta`` to ``path`` (.npz), atomically."""
    arrays = {f"t/{name}": all_rows(client, name) for name in names}
    header = dict(meta, format=FORMAT, version=VERSION, tensors=list(names))
    arrays["meta"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_meta(path):
    """The metadata dict of checkpoint ``path``."""
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise DistEmbError(f"{path}: not a distemb checkpoint ({e})") from None
    if meta.get("format") != FORMAT:
        raise DistEmbError(f"{path}: not a distemb checkpoint (format {meta.get('format')!r})")
    return meta


def restore(path, client, names):
    """Push the saved rows of ``names`` back into ``client`` (any partitioning)."""
    meta = read_meta(path)
    with np.load(path) as z:
        for name in names:
            key = f"t/{name}"
            if key not in z.files:
                raise DistEmbError(f"{path}: has no tensor {name!r} (has {meta['tensors']})")
            arr = z[key]
            want = client.data_meta(name)
            if want is None:
                raise DistEmbError(f"{path}: tensor {name!r} is not in the live store")
            check_shape(f"{path}: tensor {name!r}", arr.shape, want.shape, DistEmbError)
            push_rows(client, name, arr)
    return meta
