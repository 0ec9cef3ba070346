"""Checkpoint segments: a shard's rows in one file, by global id, written and read in
bounded blocks. The same code runs in server processes (each writes its own shards, in
parallel with the others) and in the embedded store.

A checkpoint is a directory. Each shard of each tensor is one *segment* file, its rows in
local-id order, whose local id ``k`` is global id ``start + k * step`` (a range
partition has step 1, a hash partition step P), so a segment loads into any partitioning:
a loading shard reads, from each segment, only the blocks holding its own global ids.
Files are written to ``<file>.tmp``, fsynced and renamed; names carry the save's id, so
a new save never touches the files of the previous one. ``manifest.json`` (written last,
by :mod:`distemb.checkpoint`) lists the tensors and their segments with one CRC-32 per
block; a checkpoint without it is not a checkpoint.

Example:
    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> a = np.arange(12, dtype=np.float32).reshape(6, 2)
    >>> seg = write_segment(d, "ab12cd34", "w", 0, 0, 1, a.shape, "float32",
    ...                     lambda lo, hi: a[lo:hi])
    >>> out = np.zeros((3, 2), np.float32)   # a shard holding global ids 1, 3, 5
    >>> read_segments(d, [seg], "float32", (2,), 1, 2, 3, lambda j, rows: out.__setitem__(j, rows))
    >>> out[:, 0].tolist()
    [2.0, 6.0, 10.0]
"""
import hashlib
import json
import os
import re
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels.half import storage_dtype
from distemb.kvstore.limits import check_fits

MANIFEST = "manifest.json"
FORMAT = "distemb-checkpoint"
VERSION = 2
BLOCK_BYTES = 64 << 20  # memory a save or load needs per shard, and the unit of a CRC
MAX_BLOCKS = 256  # past 256 blocks, blocks grow: manifest records and replies stay small
SAVE_ID = re.compile(r"^[0-9a-f]{8,32}$")
SEGMENT_FILE = re.compile(r"^[0-9a-f]{8,32}-[0-9a-f]{16}-p[0-9]{1,9}\.bin$")
MAX_MANIFEST_BYTES = 256 << 20


def segment_file(save_id, name, part):
    """The file name of shard ``part`` of ``name`` in save ``save_id`` (no user text in
    file names: tensor names may hold any character)."""
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:16]
    return f"{save_id}-{digest}-p{part}.bin"


def _row_bytes(row_shape, dtype):
    return int(np.prod(row_shape, dtype=object)) * storage_dtype(dtype).itemsize


def write_segment(directory, save_id, name, part, start, step, shape, dtype, read_block):
    """Write one shard as a segment file, block by block; returns its manifest record.

    Args:
        directory: the checkpoint directory (exists).
        save_id: this save's id (hex).
        name, part: the tensor and partition.
        start, step: local id k is global id ``start + k * step``.
        shape, dtype: the shard's shape and dtype.
        read_block: ``read_block(lo, hi)`` -> rows lo..hi-1 (an array; the caller takes
            whatever lock keeps them consistent).

    Raises:
        KVStoreError: a bad save id or directory, or an I/O error (the partial file is
            removed).
    """
    if not isinstance(save_id, str) or not SAVE_ID.match(save_id):
        raise KVStoreError(f"save_id: expected 8..32 hex digits, got {save_id!r:.40}")
    if not os.path.isdir(directory):
        raise KVStoreError(f"checkpoint directory {directory!r} does not exist here")
    rows, row_bytes = int(shape[0]), _row_bytes(shape[1:], dtype)
    block_rows = max_block_rows(rows, row_bytes)
    fname = segment_file(save_id, name, part)
    final = os.path.join(directory, fname)
    tmp = final + ".tmp"
    crcs = []
    try:
        # Two stages: block k goes to disk in a thread while block k+1 is copied and
        # checksummed (both release the GIL), so the CRC costs no time; two blocks in
        # memory at most.
        with open(tmp, "wb") as f, ThreadPoolExecutor(1) as disk:
            pending = None
            for lo in range(0, rows, block_rows):
                block = np.ascontiguousarray(read_block(lo, min(rows, lo + block_rows)))
                view = memoryview(block).cast("B")
                crcs.append(zlib.crc32(view))
                if pending is not None:
                    pending.result()
                pending = disk.submit(f.write, view)
            if pending is not None:
                pending.result()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        raise KVStoreError(f"checkpoint: cannot write {final}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"file": fname, "part": int(part), "start": int(start), "step": int(step),
            "count": rows, "block_rows": block_rows, "crc32": crcs}


def _int(seg, key, minimum):
    v = seg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise KVStoreError(f"checkpoint segment {seg.get('file')!r}: {key} must be an integer "
                           f">= {minimum}, got {v!r:.40}")
    return v


def read_segments(directory, segments, dtype, row_shape, start, step, count, write_rows):
    """Load the rows of global ids ``start + step * arange(count)`` from ``segments``.

    All or nothing: every block holding some of those ids is read and checked against
    its CRC-32, and the ids must be covered exactly once, before ``write_rows`` sees the
    first row (the blocks are then read a second time to write them), so a refused load
    leaves the shard as it was.

    Args:
        directory: the checkpoint directory.
        segments: the tensor's segment records from the manifest.
        dtype, row_shape: the live tensor's (must match the saved one).
        start, step, count: the global ids of the shard being filled.
        write_rows: ``write_rows(local ids, rows)`` stores rows into the shard.

    Raises:
        KVStoreError: a missing, short or corrupt file (CRC mismatch), a malformed
            record, or ids the segments do not cover exactly once.
    """
    check_segments(directory, segments, dtype, row_shape, start, step, count)
    write_checked(directory, segments, dtype, row_shape, start, step, count, write_rows)


def check_segments(directory, segments, dtype, row_shape, start, step, count):
    """What :func:`read_segments` checks before it writes anything (every needed block's
    CRC-32, the records, exact coverage), without writing.

    Raises:
        KVStoreError: as :func:`read_segments`.
    """
    covered = sum(len(local) for local, _ in
                  _blocks(directory, segments, dtype, row_shape, start, step, count))
    if covered != count:
        raise KVStoreError(f"checkpoint: the segments hold {covered} of the {count} rows "
                           f"asked for (global ids {start}, {start + step}, ...): they do not "
                           f"cover the tensor exactly once")


def write_checked(directory, segments, dtype, row_shape, start, step, count, write_rows):
    """:func:`read_segments`'s writing pass, for segments :func:`check_segments` passed
    (each block's CRC-32 is checked again as it is read)."""
    for local, rows in _blocks(directory, segments, dtype, row_shape, start, step, count):
        write_rows(local, rows)


def max_block_rows(rows, row_bytes):
    """The most rows a save puts in one block of a segment of ``rows`` rows (a manifest
    asking for more would make a load allocate more than the save ever did)."""
    return max(1, BLOCK_BYTES // max(1, row_bytes), -(-rows // MAX_BLOCKS))


def _blocks(directory, segments, dtype, row_shape, start, step, count):
    """(local ids, rows) of every CRC-checked block holding some of the shard's ids."""
    row_bytes = _row_bytes(row_shape, dtype)
    for seg in segments:
        if not isinstance(seg, dict) or not isinstance(seg.get("file"), str) or \
                not SEGMENT_FILE.match(seg["file"]):
            raise KVStoreError(f"checkpoint: malformed segment record {str(seg)[:80]!r}")
        s0, st, n = _int(seg, "start", 0), _int(seg, "step", 1), _int(seg, "count", 0)
        br, crcs = _int(seg, "block_rows", 1), seg.get("crc32")
        if br > max_block_rows(n, row_bytes):
            raise KVStoreError(f"checkpoint segment {seg['file']}: block_rows {br} is more "
                               f"than a save of {n} rows makes "
                               f"({max_block_rows(n, row_bytes)})")
        if not isinstance(crcs, list) or len(crcs) != -(-n // br):
            raise KVStoreError(f"checkpoint segment {seg['file']}: expected {-(-n // br)} "
                               f"block checksums")
        path = os.path.join(directory, seg["file"])
        try:  # O_NONBLOCK: a FIFO in a segment's place cannot block the server
            f = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
        except OSError as e:
            raise KVStoreError(f"checkpoint: segment {path} is missing ({e.strerror})") from None
        with f:
            info = os.fstat(f.fileno())
            size = info.st_size if stat.S_ISREG(info.st_mode) else -1
            if size != n * row_bytes:
                raise KVStoreError(f"checkpoint: segment {path} has {size} bytes, expected "
                                   f"{n * row_bytes} ({n} rows of {row_bytes} bytes): the "
                                   f"saved tensor's rows differ from the live one's, or it is "
                                   f"truncated")
            if not count or not n:
                continue
            yield from _read_blocks(f, path, (s0, st, n, br, crcs), row_shape, dtype, start,
                                    step, count)


def _read_blocks(f, path, record, row_shape, dtype, start, step, count):
    """(local ids, rows) of the CRC-checked blocks of open segment ``f`` holding ids of
    the shard (global ids ``start + step * k``, k < count); ``record`` is the segment's
    checked (start, step, count, block_rows, crc32)."""
    s0, st, n, br, crcs = record
    row_bytes = _row_bytes(row_shape, dtype)
    # A block is read whole (its CRC covers it): a lying record of a sparse file must
    # not make the server allocate a block larger than it can hold.
    check_fits(min(br, n) * row_bytes, f"checkpoint segment {path}: a block of {min(br, n):,} "
               "rows")
    last = start + (count - 1) * step
    for b, lo in enumerate(range(0, n, br)):
        hi = min(n, lo + br)
        if s0 + (hi - 1) * st < start or s0 + lo * st > last:
            continue  # none of this block's ids are ours: not read
        block = np.empty((hi - lo,) + tuple(row_shape), dtype=storage_dtype(dtype))
        f.seek(lo * row_bytes)
        view = memoryview(block).cast("B")
        if f.readinto(view) != len(view) or zlib.crc32(view) != crcs[b]:
            raise KVStoreError(f"checkpoint: block {b} of segment {path} is corrupt "
                               f"(CRC-32 mismatch or short read)")
        rel = s0 + np.arange(lo, hi, dtype=np.int64) * st - start
        mine = (rel >= 0) & (rel % step == 0) & (rel // step < count)
        if mine.any():
            yield rel[mine] // step, block[mine]


def manifest_path(directory):
    return os.path.join(directory, MANIFEST)


def read_manifest(directory):
    """The manifest of checkpoint ``directory``, checked for its format.

    Raises:
        KVStoreError: no manifest (not a checkpoint, or a save that never finished), or
            one that is not a distemb checkpoint's.
    """
    path = manifest_path(directory)
    try:
        # O_NONBLOCK: a FIFO in its place cannot block the server; only a regular file is
        # read, and no more than the limit of it (a link to /dev/zero never ends).
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise KVStoreError(f"{path}: not a regular file")
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise KVStoreError(f"{path}: over {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise KVStoreError(f"{directory}: not a distemb checkpoint (no readable "
                           f"{MANIFEST}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            not isinstance(manifest.get("tensors"), dict):
        raise KVStoreError(f"{directory}: {MANIFEST} is not a distemb checkpoint's")
    return manifest


def tensor_entry(manifest, name, directory):
    """The manifest record of tensor ``name``.

    Raises:
        KVStoreError: the checkpoint has no such tensor.
    """
    entry = manifest["tensors"].get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get("segments"), list):
        raise KVStoreError(f"{directory}: has no tensor {name!r} (has "
                           f"{sorted(manifest['tensors'])[:10]})")
    return entry
