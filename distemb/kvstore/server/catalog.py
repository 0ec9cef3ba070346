"""Catalog: the tables one server holds, and the requests that make, drop, checkpoint
and manage them.

Every table is made one way, by one ``Create`` carrying its spec
(:data:`~distemb.stores.spec.SPECS`: dense rows of a partition policy, a hash table, a
file table): this server makes, from the validated spec, the stores of the shards the
spec's router gives it (shard ``p`` on server ``p % num_servers``), each a
:class:`~distemb.kvstore.server.shard.ShardTable` of its
:class:`~distemb.kvstore.server.kvserver.KVServer`; a dense store's columns are
allocated in shared memory when the server has it. Requests carry the table's keys,
which each ShardTable checks against the router before the store sees them.

Every table takes optimizer state (``OptInit``: columns of its stores), is dropped
(``Drop``), checkpointed (``Save``/``Load``,
:mod:`distemb.kvstore.checkpoint.snapshot`) and has its keys managed (``Get`` without
inserting, ``Remove``, ``Info`` with eviction, ``Export``) by the same requests; what a
store cannot do (remove keys of a fixed key set) its ShardTable refuses, naming both.
Rows are read, written and updated by the row requests of
:class:`~distemb.kvstore.server.service.KVService`. Every request is decoded and checked
by :mod:`distemb.transport.messages` first; any failure becomes an error reply.

Example:
    >>> import numpy as np
    >>> from distemb.kvstore.server.kvserver import KVServer
    >>> from distemb.stores.spec import HashTableSpec
    >>> from distemb.transport.messages import Create, Get
    >>> srv = KVServer()
    >>> c = Catalog(srv, server_id=0, num_servers=1)
    >>> _ = c.create(Create.of_spec("d", HashTableSpec(2)), None)
    >>> srv.pull("d", 0, np.array([2**60])).tolist()
    [[0.0, 0.0]]
    >>> c.get(Get(name="d", mode="contains", column="weight", parts=[0], counts=[2],
    ...           ids=np.array([2**60, 5])), None).arrays[0].tolist()
    [True, False]
"""
import os
import threading

import numpy as np

from distemb.errors import KVStoreError
from distemb.kernels.half import dtype_name, storage_dtype
from distemb.kvstore.checkpoint import snapshot
from distemb.kvstore.limits import check_disk, check_fits, check_request
from distemb.rules import check_table_name, rule_of, state_owner
from distemb.stores.dense import WEIGHT_DTYPES
from distemb.stores.spec import spec_from_fields
from distemb.stores.types import WEIGHT
from distemb.transport.base import MAX_FDS, MAX_MESSAGE_BYTES
from distemb.transport.messages import Reply, Service

MAX_ELEMENTS = 1 << 40
MAX_TABLE_NAME = 256
#: Longest row a server accepts (a hostile dim must not allocate).
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
        self._specs = {}  # table -> the spec it was made from

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

    def _table(self, name):
        """The ShardTables of table ``name`` held here (optimizer state has none)."""
        return [self.server.table(name, p) for p in self.server.parts_of(name)
                if state_owner(name) is None]

    def _held(self, name, parts):
        """The ShardTables of shards ``parts`` of table ``name``, each checked to be this
        server's."""
        for part in parts:
            self.own(part)
        return [self.server.table(name, p) for p in parts]

    def create(self, m, session):
        self.check_name(m.name)
        try:
            spec = spec_from_fields(m.spec)
        except (TypeError, ValueError) as e:
            raise KVStoreError(f"table {m.name!r}: {e}") from None
        if not 1 <= spec.dim <= MAX_DIM or m.spec["capacity"] < 0:
            raise KVStoreError(f"table {m.name!r}: expected 1 <= row size <= {MAX_DIM} and "
                               f"capacity >= 0, got row size {spec.dim}, capacity "
                               f"{m.spec['capacity']}")
        # Fields the kind does not use (a hash table's path, a file's capacity) must hold
        # their neutral values: a spec is what it says, and says nothing it ignores.
        said = spec.fields()
        odd = {f: m.spec[f] for f, v in said.items()
               if f not in ("init", "init_args") and m.spec[f] != v}
        if odd:
            raise KVStoreError(f"table {m.name!r}: fields {odd} of a {spec.kind} table "
                               f"must be {({f: said[f] for f in odd})}")
        router = spec.router(self.num_servers)
        parts = [p for p in range(router.num_parts) if p % self.num_servers == self.server_id]
        with self._lock:
            have = self._spec_of(m.name)
            if have is not None:
                if have.fields() != said:
                    raise KVStoreError(f"table {m.name!r} exists with {have}, asked for "
                                       f"{spec}")
                return Reply(fields={"existed": True})
            if self.server.parts_of(m.name):
                raise KVStoreError(f"name {m.name!r} is the optimizer state of a table on "
                                   f"server {self.server_id}")
            self._check_room(m.name, spec, router, parts)
            tables = self.server.create_table(m.name, spec, router, parts, self.arena)
            if self.arena is not None:
                for table in tables:  # a store in shared memory: its segment's seqlock
                    table.set_counter(WEIGHT, self.arena.version_of(table.store.column(WEIGHT)))
            self._specs[m.name] = spec
        return Reply(fields={"existed": False})

    def _check_room(self, name, spec, router, parts):
        """Refuse, before anything is made, a table this machine cannot hold: a dense
        table's shards in memory, a preallocated file table's on disk."""
        sizes = [router.part_size(p) for p in parts] if spec.fixed_keys else []
        nbytes = sum(sizes) * spec.dim * storage_dtype(spec.dtype).itemsize
        if spec.persistent:  # rows in files on disk
            if spec.preallocate:  # its columns' blocks, reserved now
                check_disk(nbytes, f"file table {name!r}", _existing(spec.path))
            return
        for part, n in zip(parts, sizes):  # rows in memory
            if n * spec.dim > MAX_ELEMENTS:  # Python ints: no overflow
                raise KVStoreError(f"shard {part} of {name!r}: {n:,} rows of {spec.dim} "
                                   f"elements, more than {MAX_ELEMENTS:,}")
        check_fits(nbytes, f"table {name!r} ({len(parts)} shard(s))")

    def _spec_of(self, name):
        """The spec of table ``name`` made here, or None (the table is known by its spec
        even where its router gives this server no shard)."""
        return self._specs.get(name)

    def drop(self, m, session):
        self.check_name(m.name, table=False)  # a client drops each state it lists
        with self._lock:  # the table's optimizer state goes with it (its shared memory too)
            self.server.drop(m.name)
            self._specs.pop(m.name, None)
            for part in [p for (n, p) in self._counters if n == m.name]:
                self.arena.release(self._counters.pop((m.name, part)))

    def opt_init(self, m, session):
        self.check_name(m.name)  # optimizer state has no optimizer of its own
        impl = rule_of(m.rule)
        options = impl.options_from(m.options)  # known to the rule, finite
        with self._lock:
            tables = self._held(m.name, m.parts)
            for table in tables:
                store = table.store
                if store.dtype not in WEIGHT_DTYPES or len(table.columns()[WEIGHT][0]) != 1:
                    raise KVStoreError(f"optimizer of {m.name!r}: needs a 2-d table of "
                                       f"{'/'.join(WEIGHT_DTYPES)}, it has rows "
                                       f"{table.columns()[WEIGHT][0]} {store.dtype}")
            rows = sum(t.store.size() for t in tables if t.store.fixed_keys and
                       not t.store.persistent)
            check_fits(rows * sum(4 * int(np.prod(s.shape(tables[0].store.dim)))
                                  for s in impl.states) if tables else 0,
                       f"optimizer state of {m.name!r}")
            for table in tables:  # a fresh optimizer starts from fresh state
                self.server.attach_states(m.name, table.part,
                                          table.init_states(impl.name.value, options))

    def shm_info(self, m, session):
        """Read-only descriptors of the rows of shards ``m.parts`` of ``m.name``
        (``segments`` says which parts have one, in order; the rest are private): a store
        in a memory file hands its segment (a seqlock header, then the rows); a store
        whose rows are a file (``files``) hands two, a segment of the seqlock counter
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
                    table = self.server.table(m.name, part)
                    arr = self.server.shard(m.name, part)
                    fd = None
                    if state_owner(m.name) is None and self.arena is not None:
                        fd = table.store.open_column(WEIGHT)
                    in_file = fd is not None and self.arena.version_of(arr) is None
                    if in_file:
                        fds.append(self._counter(m.name, part, table))
                    if fd is not None:
                        fds.append(fd)
                    has.append(fd is not None)
                    files.append(in_file)
                    shapes.append(list(arr.shape))
                    dtypes.append(dtype_name(arr))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Reply(fields={"segments": has, "files": files, "shapes": shapes,
                             "dtypes": dtypes}, fds=fds)

    def _counter(self, name, part, table):
        """A read-only descriptor of the seqlock counter of shard ``part`` of ``name``,
        whose rows are a file: made on first ask (a segment of the header alone)."""
        if (name, part) not in self._counters:
            counter = self.arena.allocate((0,), np.int64)
            table.set_counter(WEIGHT, self.arena.version_of(counter))  # between writes: even
            self._counters[(name, part)] = counter
        return self.arena.dup_segment(self._counters[(name, part)])

    def _parts(self, m):
        """The parts a Save or Load names, each this server's shard of the table."""
        self.check_name(m.name)  # a table's state is saved and loaded with it
        self._held(m.name, m.parts)
        return list(m.parts)

    def save(self, m, session):
        return Reply(fields={"records": self.server.save(
            m.name, self._parts(m), m.directory, m.save_id, m.columns or None)})

    def load(self, m, session):
        entry = snapshot.table_entry(snapshot.read_manifest(m.directory), m.name,
                                     m.directory)
        self.server.load(m.name, self._parts(m), m.directory, entry, m.columns or None)

    def _keys(self, m):
        """(ShardTable, store keys, slice) per part of a keys request."""
        self.check_name(m.name)
        out, start = [], 0
        for table, n in zip(self._held(m.name, m.parts), m.counts):
            sl = slice(start, start + n)
            start += n
            out.append((table, table.local_keys(m.ids[sl], f"shard {table.part} of "
                                                           f"{m.name!r}"), sl))
        return out

    def get(self, m, session):
        keys = self._keys(m)
        if m.mode == "contains":
            out = np.zeros(m.ids.shape[0], bool)
            for table, local, sl in keys:
                out[sl] = table.contains(local)
            return Reply(arrays=[out])
        cols = keys[0][0].columns() if keys else {}
        if m.column in cols:
            check_request(m.ids.shape[0] * _row_bytes(cols[m.column]), self.max_request_bytes,
                          f"get of {m.ids.shape[0]} rows of {m.name!r}")
        rows = [table.get(local, m.column, m.name) for table, local, _ in keys]
        return Reply(arrays=[np.concatenate(rows) if rows else np.empty((0,), np.float32)])

    def remove(self, m, session):
        return Reply(fields={"removed": sum(table.remove(local, m.name)
                                            for table, local, _ in self._keys(m))})

    def info(self, m, session):
        self.check_name(m.name)
        tables = self._table(m.name)
        if not tables and self._spec_of(m.name) is None:
            raise KVStoreError(f"server {self.server_id} has no table {m.name!r}")
        evicted = [np.empty(0, np.int64)]
        if m.evict_to >= 0:
            share = [m.evict_to // max(1, len(tables)) + (i < m.evict_to % max(1, len(tables)))
                     for i in range(len(tables))]
            evicted += [t.router.to_global(t.part, t.evict(n, m.policy or None, m.name))
                        for t, n in zip(tables, share)]
        cols = {c: [list(s), d] for c, (s, d) in tables[0].columns().items()} if tables \
            else {}
        caps = [t.store.capacity for t in tables]
        return Reply(fields={"size": sum(t.store.size() for t in tables),
                             "capacity": None if None in caps else sum(caps),
                             "columns": cols, "parts": [t.part for t in tables]},
                     arrays=[np.concatenate(evicted)])

    def export(self, m, session):
        self.check_name(m.name)
        table, = self._held(m.name, [m.part])
        have = table.columns()
        cols = list(m.columns) or list(have)
        size = table.store.size()
        n = max(0, min(m.count, size - m.start))
        check_request(n * (8 + sum(_row_bytes(have[c]) for c in cols if c in have)),
                      self.max_request_bytes, f"export of {n} keys of {m.name!r}")
        keys, rows = table.export(m.start, m.count, cols, m.name)
        return Reply(fields={"total": size, "columns": cols},
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
