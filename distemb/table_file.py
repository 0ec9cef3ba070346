"""A table file: what :meth:`distemb.DistEmbedding.save` writes and ``load`` reads.

One ``.npz`` archive: ``c/<column>`` per exported column (``keys``, ``weight``, the
optimizer's state columns) and ``meta``, a JSON record of the format tag, the row dim
and the column names. Written atomically: a failed write leaves an earlier file at the
path untouched.

Example:
    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "t.npz")
    >>> write(path, {"keys": np.arange(2), "weight": np.ones((2, 3), np.float32)}, dim=3)
    >>> sorted(read(path, dim=3))
    ['keys', 'weight']
"""
import json
import os
import zipfile
from typing import Dict

import numpy as np

from distemb.errors import StoreError

#: The format tag of a table file.
SAVE_FORMAT = "distemb-store-table"


def write(path, columns: Dict[str, np.ndarray], dim: int) -> None:
    """Write ``columns`` (an export: ``keys`` and column arrays) of rows of ``dim`` to
    ``path``, atomically."""
    arrays = {f"c/{k}": v for k, v in columns.items()}
    arrays["meta"] = np.frombuffer(json.dumps(
        {"format": SAVE_FORMAT, "dim": dim, "columns": sorted(columns)}).encode(), np.uint8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        # np.savez's layout, with the zip writer closed before its file, also when a
        # write fails (a full disk): np.savez leaves it to the garbage collector,
        # whose close() then fails on the closed file ("seek of closed file").
        with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", allowZip64=True) as z:
            for name, array in arrays.items():
                with z.open(f"{name}.npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, np.asanyarray(array), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read(path, dim: int) -> Dict[str, np.ndarray]:
    """The columns :func:`write` wrote to ``path``, for rows of ``dim``.

    Raises:
        StoreError: ``path`` is not a table file, or its rows are not of ``dim``.
    """
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            data = {k[2:]: z[k] for k in z.files if k.startswith("c/")}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise StoreError(f"path: {path} is not a saved table ({e})") from None
    if meta.get("format") != SAVE_FORMAT or meta.get("dim") != dim:
        raise StoreError(f"path: {path} holds format {meta.get('format')!r} with dim "
                         f"{meta.get('dim')}, expected {SAVE_FORMAT!r} with dim {dim}")
    return data
