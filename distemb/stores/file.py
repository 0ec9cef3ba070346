"""FileStore: a dense store whose columns are memory-mapped files (tables beyond RAM).

Each column is one file ``<path>/<column>.bin`` of ``num_rows`` rows, mapped shared
(``MAP_SHARED``) with ``madvise(MADV_RANDOM)``: rows are touched at random, so the
kernel's read-ahead would only read pages nobody asked for. The kernel pages rows in on
first touch and writes dirty pages back on its own schedule; RAM holds only the working
set, so a table larger than memory trains at whatever the disk allows.

Files are created sparse and, by default, preallocated with ``posix_fallocate``: a full
disk is then an error when the store is made, never a SIGBUS in the middle of a step.
Reading a row never written returns zeros without touching the disk.

Durability: a completed update is in the page cache, shared with the file, so a killed
*process* loses nothing but an update in flight (tested by SIGKILL). :meth:`flush`
(``msync``) makes every completed write durable against a *machine* crash or power
loss, which loses at most the writes since the last flush. Reopening the same path
(``FileStore(path)``) maps the files again, rows and optimizer state included
(``meta.json`` records the shape and the columns). Step counts of an optimizer
(Adam's bias correction, Adagrad's lr_decay) live in the optimizer, not here.
"""
import fcntl
import hashlib
import json
import mmap
import os
import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from distemb.arrays import KEYED_INIT, check_init_func
from distemb.enums import Rounding
from distemb.errors import StoreError
from distemb.kernels.half import storage_dtype
from distemb.layouts import json_layout, layout_json, layout_policy, policy_layout
from distemb.stores.dense import DenseStore, fill_rows
from distemb.routers import PolicyRouter
from distemb.stores.init import KeyInit, ShardKeys, init_fields, init_of_fields
from distemb.stores.types import WEIGHT, check_dim, check_float_dtype

FORMAT = "distemb-file-store"
META = "meta.json"
#: What meta.json must hold besides its format (a store reopens from them).
META_FIELDS = ("num_rows", "dim", "dtype", "columns")
LOCK = ".lock"  # flock'ed by the one FileStore that has the directory open; holds its pid


def _writable_dir(path):
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)  # a new directory: this user's only
    except OSError as e:
        raise StoreError(f"path: cannot create directory {path!r} for a FileStore "
                         f"({e.strerror}); expected a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(f"path: directory {path!r} is not writable; a FileStore needs a "
                         "writable directory (read-only file system or permissions?)")


def _lock_dir(path):
    """Take the directory's exclusive lock: the open lock file (closing it, or the
    process ending, releases the lock).

    Raises:
        StoreError: another FileStore (this process or another) has the directory open.
    """
    try:
        f = open(os.path.join(path, LOCK), "a+")
    except OSError as e:
        raise StoreError(f"path: cannot open the lock file of the FileStore at {path!r} "
                         f"({e.strerror}); a FileStore needs a writable directory") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read(32).strip() or "unknown"
        f.close()
        raise StoreError(f"path: the FileStore at {path!r} is open in process {holder} "
                         "(one writer per directory: two would share the mapped rows "
                         "unknowingly); close it first") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


class FileStore(DenseStore):
    """Keys 0..N-1 on memory-mapped files under ``path``; reopened when it exists.

    Args:
        path: a directory (created when absent). If it holds a FileStore, that store is
            opened and ``num_rows``/``dim``, when given, must match it.
        num_rows: rows of a new store.
        dim: row length of a new store.
        dtype: weight dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        init: ``init(keys) -> rows`` for a new store (zeros, never written, when None).
        rounding: ``"nearest"`` (even) or ``"stochastic"`` (bfloat16 rows only).
        preallocate: reserve the files' blocks now (``posix_fallocate``), so that a full
            disk fails here and not as a SIGBUS in a later write.

    Raises:
        StoreError: ``path`` is not a writable directory, the disk is too full, the
            existing store there does not match ``num_rows``/``dim``/``dtype``, or its
            ``meta.json`` is not a FileStore's or lacks a field (named).
        ValueError: a new store without a ``num_rows`` (0 or more) and a positive ``dim``.
        TypeError: ``init`` cannot be called as ``init(keys)`` (a dense table's
            ``init(shape, dtype)``, say); refused before the directory is touched.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> s = FileStore(d, num_rows=1000, dim=4)
        >>> s.scatter(np.array([999]), np.ones((1, 4), np.float32)); s.close()
        >>> FileStore(d).gather(np.array([999, 0])).tolist()
        [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    """

    persistent = True

    @property
    def row_shape(self):
        return (self.dim,)

    def __init__(self, path, num_rows=None, dim=None, dtype="float32", init=None,
                 rounding="nearest", preallocate=True):
        check_init_func(init, KEYED_INIT, "init")
        self.path = os.fspath(path)
        self.preallocate = bool(preallocate)
        self._maps = {}
        self._lock = None
        meta_path = os.path.join(self.path, META)
        if os.path.exists(meta_path):
            self._lock = _lock_dir(self.path)
            try:
                self._reopen(meta_path, num_rows, dim, dtype)
                self._set_rounding(rounding)
            except BaseException:
                self._unlock()
                raise
            return
        _writable_dir(self.path)
        self._lock = _lock_dir(self.path)
        try:
            self._create(num_rows, dim, dtype, init, rounding)
        except BaseException:
            self._unlock()
            raise

    @property
    def closed(self):
        """True once :meth:`close` ran (the directory may be opened again)."""
        return self._lock is None

    def _unlock(self):
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _create(self, num_rows, dim, dtype, init, rounding):
        if num_rows is None or dim is None:
            raise ValueError(f"num_rows, dim: a new FileStore at {self.path!r} needs both, "
                             f"got num_rows={num_rows!r}, dim={dim!r}")
        # no rows: a shard a partition policy leaves empty (its files hold nothing)
        self.num_rows = 0 if isinstance(num_rows, (int, np.integer)) and \
            not isinstance(num_rows, bool) and num_rows == 0 else check_dim(num_rows, "num_rows")
        self.dim = check_dim(dim)
        self.dtype = check_float_dtype(dtype)
        self._set_rounding(rounding)
        self._cols, self._shapes = {}, {}
        self._set(WEIGHT, self._new_array(WEIGHT, (self.dim,), self.dtype, 0.0, False),
                  (self.dim,))
        if init is not None:
            fill_rows(self._cols[WEIGHT], init, encode=self.encode)
            self.flush()
        # last: until the metadata is there, the directory holds no store, so a creation
        # that failed (an init that raised) or was interrupted is made again, not reopened
        self._write_meta()

    def _reopen(self, meta_path, num_rows, dim, dtype):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise StoreError(f"path: {meta_path} is not a FileStore's metadata ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise StoreError(f"path: {meta_path} is not a FileStore's metadata "
                             f"(format {got!r})")
        missing = [f for f in META_FIELDS if f not in meta]
        if missing:
            raise StoreError(f"path: {meta_path} lacks the field(s) {missing} of a "
                             "FileStore's metadata")
        for what, want, got in (("num_rows", num_rows, meta["num_rows"]),
                                ("dim", dim, meta["dim"])):
            if want is not None and want != got:
                raise StoreError(f"{what}: the FileStore at {self.path!r} has {what}={got}, "
                                 f"got {want}")
        if check_float_dtype(dtype) != meta["dtype"]:
            raise StoreError(f"dtype: the FileStore at {self.path!r} has dtype "
                             f"{meta['dtype']!r}, got {dtype!r}")
        _writable_dir(self.path)
        self.num_rows, self.dim, self.dtype = meta["num_rows"], meta["dim"], meta["dtype"]
        self._cols, self._shapes = {}, {}
        for name, (row_shape, cdtype) in meta["columns"].items():
            self._set(name, self._map(name, tuple(row_shape), cdtype, create=False),
                      tuple(row_shape))

    def _file(self, name):
        return os.path.join(self.path, f"{name}.bin")

    def _map(self, name, row_shape, dtype, create):
        """Map column ``name``'s file (created, sized and preallocated when ``create``)."""
        shape = (self.num_rows,) + tuple(row_shape)
        dtype = storage_dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        try:
            fd = os.open(self._file(name), flags, 0o600)  # the rows are this user's only
        except OSError as e:
            raise StoreError(f"path: cannot open {self._file(name)!r} ({e.strerror})") from None
        try:
            if create:
                os.ftruncate(fd, nbytes)  # sparse: holes read as zeros, cost no disk
                if self.preallocate and nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise StoreError(f"path: {self._file(name)!r} has {os.fstat(fd).st_size} "
                                 f"bytes, expected {nbytes} for column {name!r}")
            if not nbytes:  # an empty file cannot be mapped: no rows to keep either
                return np.empty(shape, dtype)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            if create:
                os.close(fd)
                os.remove(self._file(name))
                fd = None
            raise StoreError(f"path: cannot make the {nbytes}-byte file of column {name!r} "
                             f"in {self.path!r} ({e.strerror}; free disk: "
                             f"{_free_bytes(self.path)} bytes)") from None
        finally:
            if fd is not None:
                os.close(fd)  # the mapping keeps the file open
        mm.madvise(mmap.MADV_RANDOM)
        self._maps[name] = mm
        return np.frombuffer(mm, dtype=dtype).reshape(shape)

    def _new_array(self, name, row_shape, dtype, fill, keep):
        arr = self._map(name, row_shape, dtype, create=True)
        if fill:
            arr[...] = fill  # writes the whole file; zeros cost nothing
        return arr

    def _write_meta(self):
        meta = {"format": FORMAT, "version": 1, "num_rows": self.num_rows, "dim": self.dim,
                "dtype": self.dtype,
                "columns": {n: [list(s), d] for n, (s, d) in self._shapes.items()}}
        tmp = os.path.join(self.path, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, META))

    def add_column(self, name, row_shape, dtype, fill=0.0, keep=False):
        super().add_column(name, row_shape, dtype, fill, keep)
        self._write_meta()

    def drop_column(self, name):
        super().drop_column(name)
        mm = self._maps.pop(name, None)
        if mm is not None:
            _close_map(mm)
            os.remove(self._file(name))
            self._write_meta()

    def flush(self):
        """``msync`` every column: completed writes survive a machine crash."""
        for mm in self._maps.values():
            mm.flush()

    def close(self):
        """Flush and unmap (arrays still held elsewhere keep their mapping alive)."""
        self.flush()
        self._cols = {}
        for mm in self._maps.values():
            _close_map(mm)
        self._maps = {}
        self._unlock()

    def nbytes(self):
        return int(sum(a.nbytes for a in self._cols.values()))

    def open_column(self, name):
        """The file of column ``name``, read-only (None for a store without rows: there is
        nothing to map)."""
        self.column(name)  # the error for an unknown column
        if not self.num_rows:
            return None
        try:
            return os.open(self._file(name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise StoreError(f"path: cannot open {self._file(name)!r} ({e.strerror})") \
                from None


def _close_map(mm):
    try:
        mm.close()
    except BufferError:  # a caller still holds a column array: the GC unmaps it later
        pass


def _free_bytes(path):
    try:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class FileTableSpec:
    """A table of keys 0..N-1 on memory-mapped files, one FileStore per shard.

    Shard ``p`` of ``S`` is the FileStore at ``path/part-<p>-of-<S>`` (made, or reopened
    with its rows and optimizer state), holding its range of the keys
    (:meth:`router`); on a server, ``path`` names a directory on the server's machine.
    With a ``partition`` (a partition policy as :func:`~distemb.layouts.policy_layout`
    describes it: ranges of its own, DGL's, or ``id % P``), partition ``q`` is on shard
    ``q % S`` and the files are ``part-<p>-of-<S>-<layout>``, so a directory never
    reopens under another layout's rows.

    Args:
        path: the table's directory (absolute in a cluster: servers resolve it).
        num_rows: keys 0..num_rows-1.
        dim: row length.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        init: a key initialiser (None: zeros; in a cluster a ``key_normal`` /
            ``key_uniform``, which servers rebuild).
        rounding: ``"nearest"`` or ``"stochastic"`` (bfloat16 rows).
        preallocate: reserve the files' blocks when made (a full disk fails then, not
            mid-training).
        partition: None (near-equal ranges, one per shard), or a partition policy's
            layout (``DistEmbedding(part_policy=...)`` sets it).

    Raises:
        ValueError: a field out of its domain (named, with the value).

    Example:
        >>> import tempfile
        >>> spec = FileTableSpec(tempfile.mkdtemp(), num_rows=10, dim=2, preallocate=False)
        >>> store = spec.make_store(1, 2)
        >>> store.num_rows, os.path.basename(store.path)
        (5, 'part-1-of-2')
        >>> store.close()
    """

    path: str
    num_rows: int
    dim: int
    dtype: str = "float32"
    init: Optional[object] = None
    rounding: str = "nearest"
    preallocate: bool = True
    partition: Optional[tuple] = None

    kind = "file"
    sink = None  # its keys are fixed: nothing is evicted
    portable = True
    fixed_keys = True
    persistent = True
    capacity = None

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise once, here
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"path: expected a directory path, got {self.path!r}")
        set_(self, "path", os.fspath(self.path))
        set_(self, "num_rows", check_dim(self.num_rows, "num_rows"))
        set_(self, "dim", check_dim(self.dim, "embedding_dim"))
        set_(self, "dtype", check_float_dtype(self.dtype))
        set_(self, "rounding", Rounding.parse(self.rounding, "rounding", ValueError).value)
        set_(self, "preallocate", bool(self.preallocate))
        if self.partition is not None:
            policy = layout_policy(self.partition, self.num_rows)  # ValueError, named
            set_(self, "partition", policy_layout(policy))
        check_init_func(self.init, KEYED_INIT)
        if isinstance(self.init, KeyInit) and self.init.dim != self.dim:
            raise ValueError(f"init_func: makes rows of dim {self.init.dim}, the table's "
                             f"dim is {self.dim}")

    def differences(self, other) -> str:
        """What differs from ``other`` apart from the initialiser ("" when none)."""
        if not isinstance(other, FileTableSpec):
            return f"kind {self.kind!r}, got kind {getattr(other, 'kind', other)!r}"
        out = []
        for field in ("path", "num_rows", "dim", "dtype", "rounding", "partition"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field} {mine!r}, got {field} {theirs!r}")
        return "; ".join(out)

    def partitioned_by(self, policy):
        """This spec with its keys routed by partition policy ``policy``.

        Raises:
            ValueError: a policy of another number of ids, of a book that cannot travel
                to servers, or other than the spec's own ``partition``.
        """
        if policy.get_size() != self.num_rows:
            raise ValueError(f"part_policy: {policy!r} covers {policy.get_size()} ids, the "
                             f"file table has {self.num_rows} rows")
        layout = policy_layout(policy)
        if self.partition is not None and self.partition != layout:
            raise ValueError(f"part_policy: the storage is partitioned as "
                             f"{self.partition!r:.60}, got {policy!r}")
        return dataclasses.replace(self, partition=layout)

    def router(self, num_parts):
        """Keys in ``num_parts`` near-equal ranges, or by the table's ``partition``
        folded onto ``num_parts`` shards (:class:`~distemb.routers.PolicyRouter`); one
        shard holds every key at its own index either way."""
        if self.partition is None or num_parts == 1:
            return PolicyRouter.ranges(self.num_rows, num_parts)
        return PolicyRouter(layout_policy(self.partition, self.num_rows), num_parts)

    def _layout_tag(self, num_parts):
        """The files' suffix naming the layout ("" for near-equal ranges, or one shard)."""
        if self.partition is None or num_parts == 1:
            return ""
        kind, arg = self.partition
        if kind == "hash":
            return f"-hash{arg}"
        digest = hashlib.sha1(json.dumps([list(v) if isinstance(v, tuple) else v
                                          for v in arg]).encode()).hexdigest()[:10]
        return ("-ranges" if kind == "range" else f"-{kind}") + digest

    @property
    def num_keys(self):
        return self.num_rows

    @property
    def row_shape(self):
        return (self.dim,)

    def make_store(self, part=0, num_parts=1, allocator=None):
        """The FileStore of shard ``part`` of ``num_parts`` (made or reopened; its rows
        are in files: it takes no allocator).

        Raises:
            StoreError: the directory is not writable, the disk is full, or it holds a
                store of another shape.
        """
        router = self.router(num_parts)
        init = None if self.init is None else ShardKeys(self.init, router, part)
        return FileStore(os.path.join(self.path, f"part-{part}-of-{num_parts}"
                                                 f"{self._layout_tag(num_parts)}"),
                         num_rows=router.part_size(part), dim=self.dim, dtype=self.dtype,
                         init=init, rounding=self.rounding, preallocate=self.preallocate)

    def fields(self):
        """The spec as JSON-able fields for a server (TypeError for a plain function)."""
        kind, params = init_fields(self.init, self.dim)
        return {"kind": self.kind, "dim": self.dim, "dtype": self.dtype, "init": kind,
                "init_args": params, "capacity": 0, "evict": "lru", "low_water": 1.0,
                "rounding": self.rounding, "num_rows": self.num_rows, "path": self.path,
                "preallocate": int(self.preallocate),
                "partition": layout_json(self.partition),
                "row_shape": [self.dim], "seed": -1, "sink": ""}

    @classmethod
    def from_fields(cls, f):
        """The spec :meth:`fields` described.

        Raises:
            ValueError: a missing or invalid field, or a relative path.
        """
        try:
            if not os.path.isabs(f["path"]):
                raise ValueError(f"path: a server needs an absolute path, got {f['path']!r}")
            return cls(f["path"], f["num_rows"], f["dim"], f["dtype"], init_of_fields(f),
                       f["rounding"], bool(f["preallocate"]), json_layout(f.get("partition")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"table spec: missing or invalid field ({e})") from None

