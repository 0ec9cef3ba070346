"""Catalog: the tables one server holds, and the requests that make, drop, checkpoint
and manage them.

Every table a server holds is a :class:`~distemb.kvstore.shard.ShardTable` per shard in
its :class:`~distemb.kvstore.server.KVServer`, made one of two ways by one ``Create``:

- array tables: shards of rows 0..N-1 the trainers route by a partition policy, their
  arrays allocated here (in shared memory when the server has it), any row shape and
  dtype;
- tables made from a spec (:data:`~distemb.stores.spec.SPECS`: a hash table for a
  dynamic table, a file table): this server's store, made here from the validated spec,
  holding the keys the spec's router gives this server; requests carry the table's
  keys, which its ShardTable checks against the router before the store sees them.

Both kinds take optimizer state (``OptInit``), are dropped (``Drop``) and checkpointed
(``Save``/``Load``, :mod:`distemb.kvstore.snapshot`) by the same requests; a table made
from a spec also has its keys managed (``Get`` without inserting, ``Remove``, ``Info``
with eviction, ``Export``). Their rows are read, written and updated by the row requests
of :class:`~distemb.kvstore.service.KVService`. Every request is decoded and checked by
:mod:`distemb.transport.messages` first; any failure becomes an error reply.

Example:
    >>> import numpy as np
    >>> from distemb.kvstore.server import KVServer
    >>> from distemb.stores.spec import HashTableSpec
    >>> from distemb.transport.messages import Create, Get
    >>> srv = KVServer()
    >>> c = Catalog(srv, server_id=0, num_servers=1)
    >>> _ = c.create(Create.of_spec("d", HashTableSpec(2)), None)
    >>> srv.pull("d", 0, np.array([2**60])).tolist()
    [[0.0, 0.0]]
    >>> c.get(Get(name="d", mode="contains", column="weight",
    ...           ids=np.array([2**60, 5])), None).arrays[0].tolist()
    [True, False]
"""
import os
import threading

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels.half import dtype_name, storage_dtype
from distemb.kvstore import snapshot
from distemb.kvstore.limits import check_disk, check_fits, check_request
from distemb.rules import check_table_name, rule_of, state_init, state_name, state_owner
from distemb.stores.spec import spec_from_fields
from distemb.stores.types import WEIGHT
from distemb.transport.base import MAX_FDS, MAX_MESSAGE_BYTES
from distemb.transport.messages import Reply, Service

DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8",
          "bool")
#: Dtypes of tables an optimizer updates (half rows: float32 state and maths).
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
MAX_ROWS = 1 << 40
MAX_TABLE_NAME = 256
#: Longest row a server accepts for a table made from a spec (a hostile dim must not
#: allocate).
MAX_DIM = 1 << 16


class Catalog:
    """The tables of one server; see the module docstring.

    Args:
        server: the :class:`~distemb.kvstore.server.KVServer` holding every shard.
        server_id, num_servers: this server's place; part p of an array table belongs to
            server ``p % num_servers``, a spec'd table's keys to the server its router
            names.
        arena: a :class:`~distemb.transport.shm.ShmArena` to allocate array shards in
            shared memory, or None for private memory.
        max_request_bytes: the most memory one get or export may make it allocate
            (:func:`~distemb.kvstore.limits.check_request`).
    """

    def __init__(self, server, server_id, num_servers, arena=None,
                 max_request_bytes=MAX_MESSAGE_BYTES):
        self.server, self.server_id, self.num_servers = server, server_id, num_servers
        self.arena, self.max_request_bytes = arena, max_request_bytes
        self._lock = threading.RLock()  # create/drop/opt-init change the shard dict
        self._counters = {}  # (table, part) -> the seqlock segment of rows in a file

    def handlers(self):
        """{service: handler(message, session)} of the requests on tables."""
        return {Service.CREATE: self.create, Service.DROP: self.drop,
                Service.OPT_INIT: self.opt_init, Service.SHM_INFO: self.shm_info,
                Service.SAVE: self.save, Service.LOAD: self.load, Service.GET: self.get,
                Service.REMOVE: self.remove, Service.INFO: self.info,
                Service.EXPORT: self.export}

    def own(self, part):
        if part % self.num_servers != self.server_id:
            raise KVStoreError(f"partition {part} belongs to server {part % self.num_servers}"
                               f", not server {self.server_id} (the partition config does "
                               f"not match the {self.num_servers} servers)")


    @staticmethod
    def check_name(name, table=True):
        """KVStoreError unless ``name`` is a name at all, and (``table``) not the name of
        optimizer state."""
        if not name or len(name) > MAX_TABLE_NAME or not name.isprintable():
            raise KVStoreError(f"table name: expected 1..{MAX_TABLE_NAME} printable "
                               f"characters, got {name[:64]!r}")
        if not table:
            return
        try:  # optimizer state is made by OptInit, never by a Create
            check_table_name(name)
        except ValueError as e:
            raise KVStoreError(str(e)) from None

    def _new_array(self, shape, dtype):
        return self.arena.allocate(shape, dtype) if self.arena else np.zeros(shape, dtype)

    def _forget(self, name, part):
        if self.server.has(name, part):
            if self.arena:
                self.arena.release(self.server.shard(name, part))
                self.arena.release(self._counters.pop((name, part), None))
            self.server.drop_shard(name, part)

    def _allocate_all(self, wanted, what):
        """Allocate ``[(name, part, shape, dtype, fill, owner)]`` after checking they all
        fit; on any failure, free what this call made (shared memory included) and re-raise."""
        nbytes = sum(int(np.prod(shape, dtype=object)) * storage_dtype(dt).itemsize
                     for _, _, shape, dt, *_ in wanted)
        check_fits(nbytes, what)  # shared or not, a shard is this machine's memory
        made = []
        try:
            for name, part, shape, dtype, fill, owner, *seed in wanted:
                arr = self._new_array(shape, storage_dtype(dtype))
                made.append((name, part, arr))
                if fill is not None:
                    arr[...] = fill
                self.server.create(name, part, arr, owner=owner,
                                   version=self.arena.version_of(arr) if self.arena else None,
                                   rounding_seed=seed[0] if seed else None)
        except BaseException:
            for name, part, arr in made:
                if self.server.has(name, part) and self.server.shard(name, part) is arr:
                    self.server.drop_shard(name, part)
                if self.arena:
                    self.arena.release(arr)
            raise

    def create(self, m, session):
        self.check_name(m.name)
        if m.spec:
            return self._create_from_spec(m)
        if self._spec_table(m.name) is not None:
            raise KVStoreError(f"name {m.name!r} is a dynamic table on server "
                               f"{self.server_id}, not an array table")
        if m.dtype not in DTYPES:
            raise KVStoreError(f"dtype: expected one of {list(DTYPES)}, got {m.dtype!r}")
        if any(d < 1 for d in m.row_shape):
            raise KVStoreError(f"row_shape: expected dimensions >= 1, got {m.row_shape}")
        seed = None if m.rounding_seed < 0 else m.rounding_seed
        if seed is not None and m.dtype != "bfloat16":
            raise KVStoreError(f"rounding_seed: stochastic rounding is for bfloat16 rows, "
                               f"got dtype {m.dtype!r}")
        existed, wanted = [], []
        with self._lock:
            others = self.server.parts_of(m.name)
            for part, rows in zip(m.parts, m.part_rows):
                self.own(part)
                shape = (rows,) + tuple(m.row_shape)
                if int(np.prod(shape, dtype=object)) > MAX_ROWS:  # Python ints: no overflow
                    raise KVStoreError(f"shard {part} of {m.name!r}: shape {shape} has more "
                                       f"than {MAX_ROWS} elements")
                if self.server.has(m.name, part):
                    have = self.server.shard(m.name, part)
                    if have.shape != shape or dtype_name(have) != m.dtype:
                        raise KVStoreError(f"shard {part} of {m.name!r} exists with shape "
                                           f"{have.shape} {have.dtype}, asked for {shape} "
                                           f"{m.dtype}")
                    existed.append(part)
                else:
                    if others:  # every shard of a table has the same row shape and dtype
                        have = self.server.shard(m.name, others[0])
                        if have.shape[1:] != shape[1:] or dtype_name(have) != m.dtype:
                            raise KVStoreError(
                                f"shard {part} of {m.name!r}: rows {shape[1:]} {m.dtype}, but "
                                f"shard {others[0]} has rows {have.shape[1:]} {have.dtype}")
                    wanted.append((m.name, part, shape, m.dtype, None, None, seed))
            self._allocate_all(wanted, f"table {m.name!r} ({len(wanted)} new shard(s))")
        return Reply(fields={"existed": existed})

    def drop(self, m, session):
        self.check_name(m.name, table=False)  # a client drops each state it lists
        with self._lock:  # the table's optimizer state goes with it (its shared memory too)
            for name, part in self.server.shards_of(m.name):
                self._forget(name, part)

    def opt_init(self, m, session):
        self.check_name(m.name)  # optimizer state has no optimizer of its own
        impl = rule_of(m.rule)
        options = impl.options_from(m.options)  # known to the rule, finite
        table = self._spec_table(m.name)
        if table is not None:  # its store makes its state columns (and may keep them)
            if list(m.parts) != [self.server_id]:  # a spec'd table's one shard is the server's
                raise KVStoreError(f"OptInit of dynamic table {m.name!r}: parts must be "
                                   f"[{self.server_id}], got {m.parts[:8]}")
            with self._lock:
                states = table.init_states(impl.name.value, options)
                self.server.attach_states(m.name, self.server_id, states)
            return
        with self._lock:
            wanted = []
            for part in m.parts:
                self.own(part)
                weight = self.server.shard(m.name, part)
                if dtype_name(weight) not in WEIGHT_DTYPES or weight.ndim != 2:
                    raise KVStoreError(f"optimizer of {m.name!r}: needs a 2-d table of "
                                       f"{'/'.join(WEIGHT_DTYPES)}, it is {weight.ndim}-d "
                                       f"{dtype_name(weight)}")
                for spec in impl.states:
                    shape = (weight.shape[0],) + spec.shape(weight.shape[1])
                    wanted.append((state_name(m.name, spec.name), part, shape, spec.dtype,
                                   state_init(spec, (1,) * len(shape), options), m.name))
            for part in m.parts:  # every part checked: cached copies of the state are void
                self.server.bump_all(m.name, part)
            for sname, part, *_ in wanted:  # a fresh optimizer starts from fresh state
                self._forget(sname, part)
            self._allocate_all(wanted, f"optimizer state of {m.name!r}")

    def shm_info(self, m, session):
        """Read-only descriptors of the memory files of shards ``m.parts`` of ``m.name``
        (``segments`` says which parts have one, in order; the rest are private). A
        table's rows in a file (``files``) come as two: a segment of the seqlock counter
        only, then the file."""
        if not (session.passes_fds or session.trusted):
            raise KVStoreError(f"ShmInfo: shared memory is handed over on a server's local "
                               f"socket only, not to {session.peer}")
        if len(m.parts) > MAX_FDS:
            raise KVStoreError(f"ShmInfo: at most {MAX_FDS} parts a request, got "
                               f"{len(m.parts)}")
        fds, has, files, shapes, dtypes = [], [], [], [], []
        try:
            with self._lock:  # a table dropped meanwhile never hands out a closed file
                for part in m.parts:
                    arr = self.server.shard(m.name, part)
                    fd = self.arena.dup_segment(arr) if self.arena else None
                    rows = None if fd is not None or not self.arena else \
                        self._rows_file(m.name, part)
                    if rows is not None:
                        fds.append(self.arena.dup_segment(self._counters[(m.name, part)]))
                        fd = rows
                    if fd is not None:
                        fds.append(fd)
                    has.append(fd is not None)
                    files.append(rows is not None)
                    shapes.append(list(arr.shape))
                    dtypes.append(dtype_name(arr))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Reply(fields={"segments": has, "files": files, "shapes": shapes,
                             "dtypes": dtypes}, fds=fds)

    def _rows_file(self, name, part):
        """A read-only descriptor of the file holding the rows of spec'd table ``name``'s
        shard ``part`` (a file store's weight), its seqlock counter made on first ask; None
        when its rows are not in a file (a hash store's move as it grows)."""
        if state_owner(name) is not None:
            return None
        table = self.server.table(name, part)
        if table.arrays:
            return None
        fd = table.store.open_column(WEIGHT)
        if fd is None or (name, part) in self._counters:
            return fd
        try:
            counter = self.arena.allocate((0,), np.int64)
        except BaseException:
            os.close(fd)
            raise
        table.set_counter(WEIGHT, self.arena.version_of(counter))  # between writes: even
        self._counters[(name, part)] = counter
        return fd

    def _shards(self, m):
        """``[(part, start, step)]`` of each part a Save or Load names: an array table's
        parts with their key progressions, or a spec'd table's one shard (its router maps
        keys: no progression)."""
        self.check_name(m.name)  # a table's state is saved and loaded with it
        out = []
        for i, part in enumerate(m.parts):
            self.own(part)
            if self.server.table(m.name, part).arrays != bool(m.starts):
                raise KVStoreError(f"{type(m).__name__} of {m.name!r}: key progressions "
                                   "name the rows of an array table's parts, and only those")
            out.append((part,) + ((m.starts[i], m.steps[i]) if m.starts else (0, 1)))
        return out

    def save(self, m, session):
        return Reply(fields={"records": self.server.save(
            m.name, self._shards(m), m.directory, m.save_id, m.columns or None)})

    def load(self, m, session):
        entry = snapshot.table_entry(snapshot.read_manifest(m.directory), m.name,
                                     m.directory)
        self.server.load(m.name, self._shards(m), m.directory, entry, m.columns or None)

    def _spec_table(self, name):
        """The ShardTable of table ``name`` made from a spec on this server, or None."""
        if state_owner(name) is None and self.server.has(name, self.server_id):
            table = self.server.table(name, self.server_id)
            return table if table.spec is not None else None
        return None

    def _keyed(self, name):
        table = self._spec_table(name)
        if table is None:
            raise KVStoreError(f"server {self.server_id} has no dynamic table {name!r}")
        return table

    def _create_from_spec(self, m):
        try:
            spec = spec_from_fields(m.spec)
        except (TypeError, ValueError) as e:
            raise KVStoreError(f"table {m.name!r}: {e}") from None
        if not 1 <= spec.dim <= MAX_DIM or m.spec["capacity"] < 0:
            raise KVStoreError(f"table {m.name!r}: expected 1 <= dim <= {MAX_DIM} and "
                               f"capacity >= 0, got dim {spec.dim}, capacity "
                               f"{m.spec['capacity']}")
        # Fields the kind does not use (a hash table's path, a file's capacity) must hold
        # their neutral values: a spec is what it says, and says nothing it ignores.
        said = {f: v for f, v in spec.fields().items() if f not in ("init", "init_args")}
        odd = {f: m.spec[f] for f, v in said.items() if m.spec[f] != v}
        if odd:
            raise KVStoreError(f"table {m.name!r}: fields {odd} of a {spec.kind} table "
                               f"must be {({f: said[f] for f in odd})}")
        with self._lock:
            have = self._spec_table(m.name)
            if have is None and self.server.parts_of(m.name):
                raise KVStoreError(f"name {m.name!r} is an array table on server "
                                   f"{self.server_id}, not a dynamic one")
            if have is not None:
                if have.spec != spec:
                    raise KVStoreError(f"table {m.name!r} exists with {have.spec}, "
                                       f"asked for {spec}")
                return Reply(fields={"existed": True})
            if spec.kind == "file" and spec.preallocate:  # its columns' blocks, reserved now
                rows = -(-spec.num_rows // self.num_servers)  # this server's shard
                check_disk(rows * spec.dim * storage_dtype(spec.dtype).itemsize,
                           f"file table {m.name!r}", _existing(spec.path))
            self.server.add_table(m.name, self.server_id,
                                  spec.make_store(self.server_id, self.num_servers), spec,
                                  spec.router(self.num_servers))
        return Reply(fields={"existed": False})

    def get(self, m, session):
        table = self._keyed(m.name)
        keys = table.local_keys(m.ids, repr(m.name))
        if m.mode == "contains":
            return Reply(arrays=[table.contains(keys)])
        cols = table.columns()
        if m.column in cols:
            check_request(len(keys) * _row_bytes(cols[m.column]), self.max_request_bytes,
                          f"get of {len(keys)} rows of {m.name!r}")
        return Reply(arrays=[table.get(keys, m.column, m.name)])

    def remove(self, m, session):
        table = self._keyed(m.name)
        return Reply(fields={"removed": table.remove(table.local_keys(m.ids, repr(m.name)),
                                                     m.name)})

    def info(self, m, session):
        table = self._keyed(m.name)
        evicted = np.empty(0, np.int64)
        if m.evict_to >= 0:
            evicted = table.evict(m.evict_to, m.policy or None, m.name)
        cols = {c: [list(s), d] for c, (s, d) in table.columns().items()}
        return Reply(fields={"size": table.store.size(), "capacity": table.store.capacity,
                             "columns": cols}, arrays=[evicted])

    def export(self, m, session):
        table = self._keyed(m.name)
        have = table.columns()
        cols = list(m.columns) or list(have)
        n = max(0, min(m.count, table.store.size() - m.start))
        check_request(n * (8 + sum(_row_bytes(have[c]) for c in cols if c in have)),
                      self.max_request_bytes, f"export of {n} keys of {m.name!r}")
        keys, rows = table.export(m.start, m.count, cols, m.name)
        return Reply(fields={"total": table.store.size(), "columns": cols},
                     arrays=[keys] + [rows[c] for c in cols])

def _row_bytes(column):
    """Bytes of one row of a column ``(row shape, dtype)`` (its rows travel as float32 or
    wider)."""
    shape, dtype = column
    return max(4, storage_dtype(dtype).itemsize) * int(np.prod(shape, dtype=object))


def _existing(path):
    """``path`` or its nearest existing ancestor (where a new directory's bytes go)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
