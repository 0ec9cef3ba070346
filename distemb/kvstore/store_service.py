"""StoreTables: the requests that manage the keys of tables made from a spec.

A server holds every table in its :class:`~distemb.kvstore.server.KVServer`, one
:class:`~distemb.kvstore.shard.ShardTable` per shard: array tables (``Create``: arrays
the server allocates, routed by the trainers' partition policies) and tables made from a
spec (``StoreCreate``: a store built here from the validated spec of
:data:`~distemb.stores.spec.SPECS`, a :class:`~distemb.stores.hash.HashStore` for a
dynamic table, a :class:`~distemb.stores.file.FileStore` for a file-backed one, holding
the keys the table's router (:mod:`distemb.routers`) gives this server). Both kinds are
read, written and updated by the same requests (``Pull``, ``Push``, ``OptInit``,
``Update``, ``VersionedPull``, handled by :class:`~distemb.kvstore.service.KVService`):
a spec'd table's requests carry its keys, which its ShardTable checks against the router
before the store sees them.

What only keyed tables have lives here: creation from a spec, ``contains``/``get``
without inserting, removal, size and eviction, and export (their checkpoints are every
table's ``Save``/``Load``).
Every request is decoded and checked by :mod:`distemb.transport.messages` first; any
failure becomes an error reply.

Example:
    >>> import numpy as np
    >>> from distemb.kvstore.server import KVServer
    >>> from distemb.stores.spec import HashTableSpec
    >>> from distemb.transport.messages import StoreCreate, StoreRead
    >>> srv = KVServer()
    >>> t = StoreTables(srv, server_id=0, num_servers=1)
    >>> _ = t.create(StoreCreate(name="d", **HashTableSpec(2).fields()))
    >>> srv.pull("d", 0, np.array([2**60])).tolist()
    [[0.0, 0.0]]
    >>> t.read(StoreRead(name="d", mode="contains", column="weight",
    ...                  ids=np.array([2**60, 5]))).arrays[0].tolist()
    [True, False]
"""
import os
import threading

import numpy as np

from distemb.errors import KVStoreError, StoreError
from distemb.kernels.half import storage_dtype
from distemb.kvstore.keyed import init_state_columns
from distemb.kvstore.limits import check_disk, check_request
from distemb.rules import check_table_name, state_owner
from distemb.stores.spec import spec_from_fields
from distemb.stores.types import WEIGHT
from distemb.transport.base import MAX_MESSAGE_BYTES
from distemb.transport.messages import Reply, Service


#: Longest row a server accepts for a dynamic table (a hostile dim must not allocate).
MAX_DIM = 1 << 16


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


class StoreTables:
    """The spec'd tables of one server's :class:`~distemb.kvstore.server.KVServer`; see
    the module docstring.

    Args:
        server: the KVServer holding every shard of this server.
        server_id, num_servers: this server's place; it holds the keys each table's
            router sends to ``server_id``.
        max_request_bytes: the most memory one read or export may make it allocate
            (:func:`~distemb.kvstore.limits.check_request`).
    """

    def __init__(self, server, server_id, num_servers, max_request_bytes=MAX_MESSAGE_BYTES):
        self.server, self.server_id, self.num_servers = server, server_id, num_servers
        self.max_request_bytes = max_request_bytes
        self._lock = threading.Lock()  # creation: check and add as one

    def handlers(self):
        """{service: handler(message, session=None)} of the STORE_* requests."""
        return {Service.STORE_CREATE: self.create, Service.STORE_READ: self.read,
                Service.STORE_REMOVE: self.remove, Service.STORE_INFO: self.info,
                Service.STORE_EXPORT: self.export}

    def has(self, name):
        """Whether ``name`` is a spec'd table here (the name of its optimizer state is not:
        a state is no table to remove keys from, evict, export or save alone)."""
        return state_owner(name) is None and self.server.has(name, self.server_id) and \
            self.server.table(name, self.server_id).spec is not None

    def table(self, name):
        """The ShardTable of spec'd table ``name`` on this server."""
        if not self.has(name):
            raise KVStoreError(f"server {self.server_id} has no dynamic table "
                               f"{name!r}")
        return self.server.table(name, self.server_id)

    def init_states(self, name, rule, options):
        """(Re)create ``rule``'s state columns in spec'd table ``name``'s store."""
        t = self.table(name)
        with t.write():
            states = init_state_columns(t.store, rule, options)
        self.server.attach_states(name, self.server_id, states)
        t.bump_all()  # cached copies of the state are void

    # -- handlers ---------------------------------------------------------------------

    def create(self, m, session=None):
        if not m.name or len(m.name) > 256 or not m.name.isprintable():
            raise KVStoreError(f"table name: expected 1..256 printable characters, got "
                               f"{m.name[:64]!r}")
        try:
            check_table_name(m.name)
        except ValueError as e:
            raise KVStoreError(str(e)) from None
        if not 1 <= m.dim <= MAX_DIM or m.capacity < 0:
            raise KVStoreError(f"dynamic table {m.name!r}: expected 1 <= dim <= {MAX_DIM} and "
                               f"capacity >= 0, got dim {m.dim}, capacity {m.capacity}")
        fields = {f: getattr(m, f) for f in type(m).FIELDS}
        try:
            spec = spec_from_fields(fields)
        except (TypeError, ValueError) as e:
            raise KVStoreError(f"table {m.name!r}: {e}") from None
        # Fields the kind does not use (a hash table's path, a file's capacity) must hold
        # their neutral values: a spec is what it says, and says nothing it ignores.
        said = {f: v for f, v in spec.fields().items() if f not in ("init", "init_args")}
        odd = {f: fields[f] for f, v in said.items() if fields[f] != v}
        if odd:
            raise KVStoreError(f"table {m.name!r}: fields {odd} of a {spec.kind} table "
                               f"must be {({f: said[f] for f in odd})}")
        with self._lock:
            if self.server.parts_of(m.name) and not self.has(m.name):
                raise KVStoreError(f"name {m.name!r} is an array table on server "
                                   f"{self.server_id}, not a dynamic one")
            if self.has(m.name):
                have = self.table(m.name).spec
                if have != spec:
                    raise KVStoreError(f"table {m.name!r} exists with {have}, "
                                       f"asked for {spec}")
                return Reply(fields={"existed": True})
            if spec.kind == "file" and spec.preallocate:  # its columns' blocks, reserved now
                rows = -(-spec.num_rows // self.num_servers)  # this server's shard
                check_disk(rows * spec.dim * storage_dtype(spec.dtype).itemsize,
                           f"file table {m.name!r}", _existing(spec.path))
            store = spec.make_store(self.server_id, self.num_servers)
            self.server.add_table(m.name, self.server_id, store, spec,
                                  spec.router(self.num_servers))
        return Reply(fields={"existed": False})

    def read(self, m, session=None):
        t = self.table(m.name)
        keys = t.local_keys(m.ids, repr(m.name))
        with t.read():
            if m.mode == "contains":
                return Reply(arrays=[t.store.find(keys) >= 0])
            if m.column not in t.columns():
                t.store.column(None)  # the StoreError naming the columns
            check_request(len(keys) * _row_bytes(t.columns()[m.column]), self.max_request_bytes,
                          f"get of {len(keys)} rows of {m.name!r}")
            return Reply(arrays=[t.store.gather(keys, m.column, insert=False)])

    def remove(self, m, session=None):
        t = self.table(m.name)
        if t.spec.fixed_keys:
            raise StoreError(f"remove: {m.name!r} is a {t.spec.kind} table, which holds the "
                             f"fixed keys 0..{t.router.num_keys - 1}; only hash tables "
                             "remove keys")
        with t.write():
            return Reply(fields={"removed": t.store.remove(m.ids)})

    def info(self, m, session=None):
        t = self.table(m.name)
        if m.evict_to >= 0 and t.spec.fixed_keys:
            raise StoreError(f"evict: {m.name!r} is a {t.spec.kind} table, which holds the "
                             f"fixed keys 0..{t.router.num_keys - 1}; only hash tables evict")
        with t.write():
            evicted = np.empty(0, np.int64)
            if m.evict_to >= 0:
                evicted = t.store.evict(m.evict_to, m.policy or None)
            cols = {c: [list(s), d] for c, (s, d) in t.columns().items()}
            return Reply(fields={"size": t.store.size(), "capacity": t.store.capacity,
                                 "columns": cols}, arrays=[evicted])

    def export(self, m, session=None):
        t = self.table(m.name)
        with t.read():
            have = t.columns()
            cols = list(m.columns) or list(have)
            missing = [c for c in cols if c not in have]
            if missing:
                raise StoreError(f"columns: {missing} not in {m.name!r} (has {sorted(have)})")
            n = max(0, min(m.count, t.store.size() - m.start))
            check_request(n * (8 + sum(_row_bytes(have[c]) for c in cols)),
                          self.max_request_bytes, f"export of {n} keys of {m.name!r}")
            keys = t.store.keys()
            sel = keys[m.start:m.start + m.count]
            slots = t.store.slots(sel) if len(sel) else np.empty(0, np.int64)
            rows = [t.store.decode(t.store.column(c)[slots]) if c == WEIGHT
                    else t.store.column(c)[slots] for c in cols]
            return Reply(fields={"total": int(len(keys)), "columns": cols},
                         arrays=[t.router.to_global(self.server_id, sel)] + rows)
