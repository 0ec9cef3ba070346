"""Segments: one column of one checkpoint shard in a file, written and read in blocks.

A segment holds a shard's rows of one column in the shard's order, in blocks of at most
:data:`BLOCK_BYTES` (grown past :data:`MAX_BLOCKS` blocks) with a CRC-32 per block. It is
written to ``<file>.tmp``, fsynced and renamed; its file name carries the save's id and
a digest of its name, never user text. A reader opens only regular files (a FIFO cannot
block it), checks the size against the record, allocates no block larger than the
machine can hold, and checks every block's CRC as it reads it. Records and manifests
are :mod:`distemb.kvstore.checkpoint.snapshot`'s.

Example:
    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> a = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> rec = write_segment(d, "ab12cd34", "w", 0, 0, 1, a.shape, "float32",
    ...                     lambda lo, hi: a[lo:hi])
    >>> seg = Segment(d, rec, "float32", (2,), 3)
    >>> seg.read_all()[2].tolist()
    [4.0, 5.0]
    >>> seg.close()
"""
import hashlib
import os
import re
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels import half
from distemb.kvstore.limits import check_fits

BLOCK_BYTES = 64 << 20  # memory a save or load needs per shard, and the unit of a CRC
MAX_BLOCKS = 256  # past 256 blocks, blocks grow: manifest records and replies stay small
SAVE_ID = re.compile(r"^[0-9a-f]{8,32}$")
SEGMENT_FILE = re.compile(r"^[0-9a-f]{8,32}-[0-9a-f]{16}-p[0-9]{1,9}\.bin$")


def segment_file(save_id, name, part):
    """The file name of shard ``part`` of ``name`` in save ``save_id`` (no user text in
    file names: tensor names may hold any character)."""
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:16]
    return f"{save_id}-{digest}-p{part}.bin"


def _row_bytes(row_shape, dtype):
    return int(np.prod(row_shape, dtype=object)) * half.storage_dtype(dtype).itemsize


def max_block_rows(rows, row_bytes):
    """The most rows a save puts in one block of a segment of ``rows`` rows (a manifest
    asking for more would make a load allocate more than the save ever did)."""
    return max(1, BLOCK_BYTES // max(1, row_bytes), -(-rows // MAX_BLOCKS))


def write_segment(directory, save_id, name, part, start, step, shape, dtype, read_block):
    """Write one column of one shard as a segment file, block by block; returns its record.

    Args:
        directory: the checkpoint directory (exists).
        save_id: this save's id (hex).
        name, part: the segment's name (table and column) and partition.
        start, step: row k's key is ``start + k * step`` (for a shard of fixed keys;
            0 and 1 beside a keys segment).
        shape, dtype: the segment's shape and dtype.
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


class Segment:
    """A segment record checked, with its file open (read in CRC-checked blocks)."""

    def __init__(self, directory, seg, dtype, row_shape, count):
        if not isinstance(seg, dict) or not isinstance(seg.get("file"), str) or \
                not SEGMENT_FILE.match(seg["file"]):
            raise KVStoreError(f"checkpoint: malformed segment record {str(seg)[:80]!r}")
        self.start, self.step = _int(seg, "start", 0), _int(seg, "step", 1)
        self.n, self.br = _int(seg, "count", 0), _int(seg, "block_rows", 1)
        self.crcs, self.dtype, self.row_shape = seg.get("crc32"), dtype, tuple(row_shape)
        self.path = os.path.join(directory, seg["file"])
        self.row_bytes = _row_bytes(row_shape, dtype)
        if self.n != count:
            raise KVStoreError(f"checkpoint segment {seg['file']}: {self.n} rows, its shard "
                               f"record says {count}")
        if self.br > max_block_rows(self.n, self.row_bytes):
            raise KVStoreError(f"checkpoint segment {seg['file']}: block_rows {self.br} is "
                               f"more than a save of {self.n} rows makes "
                               f"({max_block_rows(self.n, self.row_bytes)})")
        if not isinstance(self.crcs, list) or len(self.crcs) != -(-self.n // self.br):
            raise KVStoreError(f"checkpoint segment {seg['file']}: expected "
                               f"{-(-self.n // self.br)} block checksums")
        try:  # O_NONBLOCK: a FIFO in a segment's place cannot block the server
            self.f = open(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb")
        except OSError as e:
            raise KVStoreError(f"checkpoint: segment {self.path} is missing "
                               f"({e.strerror})") from None
        info = os.fstat(self.f.fileno())
        size = info.st_size if stat.S_ISREG(info.st_mode) else -1
        if size != self.n * self.row_bytes:
            self.f.close()
            raise KVStoreError(f"checkpoint: segment {self.path} has {size} bytes, expected "
                               f"{self.n * self.row_bytes} ({self.n} rows of "
                               f"{self.row_bytes} bytes): the saved rows differ from the "
                               f"live ones, or it is truncated")
        # A block is read whole (its CRC covers it): a lying record of a sparse file must
        # not make the server allocate a block larger than it can hold.
        check_fits(min(self.br, self.n) * self.row_bytes,
                   f"checkpoint segment {self.path}: a block of {min(self.br, self.n):,} rows")

    def close(self):
        self.f.close()

    def block(self, b, lo, hi):
        """Rows lo..hi-1 (block ``b``), CRC-checked."""
        block = np.empty((hi - lo,) + self.row_shape, dtype=half.storage_dtype(self.dtype))
        self.f.seek(lo * self.row_bytes)
        view = memoryview(block).cast("B")
        if self.f.readinto(view) != len(view) or zlib.crc32(view) != self.crcs[b]:
            raise KVStoreError(f"checkpoint: block {b} of segment {self.path} is corrupt "
                               f"(CRC-32 mismatch or short read)")
        return block

    def blocks(self, keys_of, target):
        """(places, rows) of every block holding keys of ``target``; ``keys_of(lo, hi)``
        gives the keys of rows lo..hi-1 (blocks without the target's keys are not read)."""
        for b, lo in enumerate(range(0, self.n, self.br)):
            hi = min(self.n, lo + self.br)
            mask, local = target.select(keys_of(lo, hi))
            if mask.any():
                yield local, self.block(b, lo, hi)[mask]

    def read_all(self):
        """Every row (a keys segment: bounded by the caller's check)."""
        out = [self.block(b, lo, min(self.n, lo + self.br))
               for b, lo in enumerate(range(0, self.n, self.br))]
        return np.concatenate(out) if out else np.empty((0,) + self.row_shape,
                                                        half.storage_dtype(self.dtype))
