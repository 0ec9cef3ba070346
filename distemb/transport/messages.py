"""The KVStore protocol: service ids (one enum) and one small class per message.

Each message class lists its scalar ``FIELDS`` (name -> checker) and its ``ARRAYS``;
``encode()`` makes a :class:`~distemb.transport.base.Frame` and ``decode(frame)`` checks
every field's type and every array's dtype and rank before anything uses them, so a
hostile frame ends in :class:`~distemb.errors.TransportError`, never in a handler.

Requests that address rows carry ``parts`` (partition ids on this server) and
``counts`` (rows per part); their ``ids`` are local ids concatenated in part order.

Example:
    >>> import numpy as np
    >>> m = Pull(name="w", parts=[0], counts=[2], ids=np.array([1, 0]))
    >>> Pull.decode(m.encode()).ids.tolist()
    [1, 0]
"""
import enum

import numpy as np

from distemb.errors import TransportError
from distemb.transport.base import Frame
from distemb.transport.fields import (abs_path, choice, flag, int_list, int_value,
                                      scalar_dict, spec_fields, text, text_list)


class Service(enum.IntEnum):
    """Service ids on the wire."""

    HELLO = 1
    CREATE = 2
    DROP = 3
    PULL = 4
    PUSH = 5
    OPT_INIT = 6
    UPDATE = 7
    BARRIER = 8
    SHM_INFO = 9
    BYE = 10
    SAVE = 11
    LOAD = 12
    IN_SHM = 13
    VERSIONED_PULL = 14
    # Keys of a table made from a spec, addressed by the table's keys (any int64 for a
    # hash table); its rows are read, written, updated, saved and loaded by the requests
    # above, like every table's.
    GET = 15
    REMOVE = 16
    INFO = 17
    EXPORT = 18
    # 20..29 were the store tables' own family (STORE_CREATE .. STORE_LOAD), merged into
    # the requests above: retired, never reused.
    REPLY = 100
    ERROR = 101


ID_DTYPE = np.dtype("int64")


class Message:
    """Base: ``FIELDS`` (name -> checker), ``ARRAYS`` (names; None = any count); the last
    ``OPTIONAL`` arrays may be absent (None, and left out of the frame)."""

    SERVICE = None
    FIELDS = {}
    DEFAULTS = {}  # optional fields and their values when absent
    ARRAYS = ()
    OPTIONAL = 0

    def __init__(self, name="", flags=0, **kw):
        self.name, self.flags = name, flags
        for f in self.FIELDS:
            setattr(self, f, kw.pop(f) if f in kw or f not in self.DEFAULTS
                    else self.DEFAULTS[f])
        for i, a in enumerate(self.ARRAYS):
            optional = i >= len(self.ARRAYS) - self.OPTIONAL
            setattr(self, a, kw.pop(a, None) if optional else kw.pop(a))
        if kw:
            raise TypeError(f"{type(self).__name__}: unknown arguments {sorted(kw)}")

    def encode(self):
        """The frame of this message."""
        arrays = [getattr(self, a) for a in self.ARRAYS]
        while arrays and arrays[-1] is None and len(arrays) > len(self.ARRAYS) - self.OPTIONAL:
            arrays.pop()
        return Frame(int(self.SERVICE), self.name, {f: getattr(self, f) for f in self.FIELDS},
                     arrays, self.flags)

    @classmethod
    def decode(cls, frame):
        """Check ``frame`` against this class and build the message.

        Raises:
            TransportError: wrong service, a missing or ill-typed field, or the wrong
                number of arrays.
        """
        what = cls.__name__
        if frame.service != cls.SERVICE:
            raise TransportError(f"{what}: service {frame.service}, expected {cls.SERVICE}")
        kw = {}
        for f, check in cls.FIELDS.items():
            if f not in frame.fields and f in cls.DEFAULTS:
                continue
            if f not in frame.fields or not check(frame.fields[f]):
                raise TransportError(f"{what}.{f}: missing or invalid "
                                     f"({str(frame.fields.get(f))[:60]!r})")
            kw[f] = frame.fields[f]
        least = len(cls.ARRAYS) - cls.OPTIONAL
        if not least <= len(frame.arrays) <= len(cls.ARRAYS):
            want = len(cls.ARRAYS) if not cls.OPTIONAL else f"{least} to {len(cls.ARRAYS)}"
            raise TransportError(f"{what}: expected {want} arrays, got "
                                 f"{len(frame.arrays)}")
        kw.update(zip(cls.ARRAYS, frame.arrays))
        msg = cls(name=frame.name, flags=frame.flags, **kw)
        msg.check()
        return msg

    def check(self):
        """Cross-field checks of a decoded message (override)."""


class RowsMessage(Message):
    """A request addressing rows: ``parts``/``counts`` must describe ``ids``."""

    def check(self):
        what = type(self).__name__
        if len(self.parts) != len(self.counts) or len(set(self.parts)) != len(self.parts):
            raise TransportError(f"{what}: parts {self.parts[:8]} and counts "
                                 f"{self.counts[:8]} must be equal-length, parts unique")
        if self.ids.dtype != ID_DTYPE or self.ids.ndim != 1 or \
                self.ids.shape[0] != sum(self.counts):
            raise TransportError(f"{what}.ids: expected int64 of shape ({sum(self.counts)},), "
                                 f"got {self.ids.dtype} {self.ids.shape}")
        for a in self.ARRAYS[1:]:
            v = getattr(self, a)
            if v is None:
                continue
            if v.ndim < 1 or v.shape[0] != self.ids.shape[0]:
                raise TransportError(f"{what}.{a}: expected {self.ids.shape[0]} rows, got "
                                     f"shape {v.shape}")


class Hello(Message):
    """The handshake: fixes the connection's trainer ``rank``; ``token`` is the job's."""

    SERVICE = Service.HELLO
    FIELDS = {"rank": int_value, "token": text}


class Create(Message):
    """Make a table's shards on this server from its spec (``spec``: the fields of a
    spec of :data:`~distemb.stores.spec.SPECS`, its ``kind`` picking which): the stores
    of the shards the spec's router puts on this server (shard ``p`` on server
    ``p % num_servers``), made here. An existing table must have the same spec.
    """

    SERVICE = Service.CREATE
    FIELDS = {"spec": spec_fields}

    def check(self):
        if not self.spec:
            raise TransportError("Create: expected the fields of a table spec, got none")

    @classmethod
    def of_spec(cls, name, spec):
        """The Create of table ``name`` made from ``spec`` (its :meth:`fields`)."""
        return cls(name=name, spec=spec.fields())


class Drop(Message):
    SERVICE = Service.DROP


class Pull(RowsMessage):
    SERVICE = Service.PULL
    FIELDS = {"parts": int_list, "counts": int_list}
    ARRAYS = ("ids",)


class Push(RowsMessage):
    SERVICE = Service.PUSH
    FIELDS = {"parts": int_list, "counts": int_list}
    ARRAYS = ("ids", "values")


class OptInit(Message):
    SERVICE = Service.OPT_INIT
    FIELDS = {"rule": text, "options": scalar_dict, "parts": int_list}


class Update(RowsMessage):
    """``exact``: buffer until every trainer sent step ``seq``, sum, apply once.

    ``versions``: the reply carries the rows' versions after the update (int64, one per
    id, in request order), for a trainer cache's replica check.

    ``have`` (optional, int64, one per id; ``exact`` only): the version of each row a
    trainer cache holds (-1: not held; any other negative: held, version unknown). The
    reply then carries, instead of versions, what keeps the held copies equal to the
    owner's rows after the step (:func:`~distemb.kvstore.server.exact.held_reply`):
    the positions of held rows written
    outside the step since (drop them), and the positions, new versions and summed
    gradients of held rows other trainers' gradients reached in the step.

    ``watch`` (optional, int64 keys of this server's shards ``watch_parts``, grouped as
    ``watch_counts`` say): rows a trainer prefetched. The reply ends with three more
    arrays: the positions (in ``watch``) of the watched rows this update wrote (in an
    exact update: the step, every trainer's rows) and still held, their rows after it
    (float32), and the positions of watched keys the store no longer holds.

    ``first`` (one shard only): the first ``first`` rows are the ones the trainer looks
    up next; a server that answers the update early applies them first and says so in
    the shard's header (:mod:`~distemb.kvstore.server.early`). 0: no order asked.
    """

    SERVICE = Service.UPDATE
    FIELDS = {"rule": text, "hyper": scalar_dict, "seq": int_value, "exact": flag,
              "parts": int_list, "counts": int_list, "versions": flag,
              "watch_parts": int_list, "watch_counts": int_list, "first": int_value}
    DEFAULTS = {"versions": False, "watch_parts": [], "watch_counts": [], "first": 0}
    ARRAYS = ("ids", "grads", "have")
    OPTIONAL = 1

    def __init__(self, name="", flags=0, watch=None, **kw):
        super().__init__(name, flags, **kw)
        self.watch = watch

    def encode(self):
        """The frame; ``watch`` travels as its last array (field ``watching``)."""
        frame = super().encode()
        if self.watch is not None:
            frame.arrays.append(self.watch)
            frame.fields["watching"] = True
        return frame

    @classmethod
    def decode(cls, frame):
        watching = frame.fields.get("watching", False)
        if not isinstance(watching, bool) or (watching and not frame.arrays):
            raise TransportError(f"Update.watching: missing or invalid ({watching!r})")
        if not watching:
            return super().decode(frame)
        fields = {k: v for k, v in frame.fields.items() if k != "watching"}
        msg = super().decode(Frame(frame.service, frame.name, fields, frame.arrays[:-1],
                                   frame.flags))
        msg.watch = frame.arrays[-1]
        msg.check_watch()
        return msg

    def check(self):
        super().check()
        if not 0 <= self.first <= self.ids.shape[0] or (self.first and len(self.parts) != 1):
            raise TransportError(f"Update.first: expected 0..{self.ids.shape[0]} rows of one "
                                 f"shard, got {self.first} of {len(self.parts)} shards")
        if self.have is not None and (self.have.dtype != ID_DTYPE or self.have.ndim != 1
                                      or not self.exact):
            raise TransportError(f"Update.have: expected int64 of shape ({self.ids.shape[0]},) "
                                 f"in an exact update, got {self.have.dtype} "
                                 f"{self.have.shape} (exact={self.exact})")

    def check_watch(self):
        """``watch``, ``watch_parts`` and ``watch_counts`` describe each other (as a rows
        message's ``ids``, ``parts`` and ``counts`` do)."""
        p, c = self.watch_parts, self.watch_counts
        if len(p) != len(c) or len(set(p)) != len(p):
            raise TransportError(f"Update: watch_parts {p[:8]} and watch_counts {c[:8]} must "
                                 "be equal-length, parts unique")
        if self.watch.dtype != ID_DTYPE or self.watch.ndim != 1 or \
                self.watch.shape[0] != sum(c):
            raise TransportError(f"Update.watch: expected int64 of shape ({sum(c)},), got "
                                 f"{self.watch.dtype} {self.watch.shape}")


class VersionedPull(RowsMessage):
    """A trainer cache's pull: ``have`` is the version it holds of each row.

    ``have`` is -1 for a row the trainer will not keep (it wants the row only) and -2
    for one it does not hold but will keep. The reply has the positions (in ``ids``) of
    the rows whose version differs, their current versions, their rows, and the rows of
    each optimizer state named in ``states`` for those of them with ``have != -1``.
    """

    SERVICE = Service.VERSIONED_PULL
    FIELDS = {"parts": int_list, "counts": int_list, "states": text_list}
    ARRAYS = ("ids", "have")

    def check(self):
        super().check()
        if self.have.dtype != ID_DTYPE or self.have.ndim != 1:
            raise TransportError(f"VersionedPull.have: expected int64 of shape "
                                 f"({self.ids.shape[0]},), got {self.have.dtype} "
                                 f"{self.have.shape}")


class Barrier(Message):
    SERVICE = Service.BARRIER
    FIELDS = {"rank": int_value}


class ShmInfo(Message):
    SERVICE = Service.SHM_INFO
    FIELDS = {"parts": int_list}


class Bye(Message):
    SERVICE = Service.BYE
    FIELDS = {"rank": int_value}


class InShm(Message):
    """A request whose arrays lie in the sender's shared-memory request slot.

    ``service`` and ``fields`` are those of the wrapped request (Update or Push),
    ``size`` the slot's size in bytes and ``layout`` one ``[dtype code, shape, offset]``
    per array (:mod:`distemb.transport.shm`). The frame that first uses a slot carries
    its descriptor (a sealed memory file of exactly ``size`` bytes); later frames use the
    slot their connection handed over last. The server rebuilds the request with the
    arrays viewed in place and decodes it as if it had come with them
    (:func:`decode_request`).
    """

    SERVICE = Service.IN_SHM
    FIELDS = {"service": lambda v: v in (Service.UPDATE, Service.PUSH),
              "fields": lambda v: isinstance(v, dict),
              "size": lambda v: int_value(v) and v > 0,
              "layout": lambda v: isinstance(v, list)}

    def inner(self, arrays):
        """The wrapped request's frame, with ``arrays`` (the views of the slot)."""
        return Frame(self.service, self.name, self.fields, list(arrays), self.flags)


class _ShardsMessage(Message):
    """Names shards ``parts`` of a table and its ``columns`` (the weight and optimizer
    states; empty: every column); the table's router says which keys each holds."""

    DEFAULTS = {"columns": []}

    def check(self):
        what = type(self).__name__
        if len(set(self.parts)) != len(self.parts):
            raise TransportError(f"{what}.parts: expected distinct parts, got "
                                 f"{self.parts[:8]}")
        if len(set(self.columns)) != len(self.columns):
            raise TransportError(f"{what}.columns: expected distinct names, got "
                                 f"{self.columns}")


class Save(_ShardsMessage):
    """Write these shards into checkpoint ``directory`` as records of save ``save_id``
    (:mod:`distemb.kvstore.checkpoint.snapshot`), or, with a ``parent`` save, as a delta
    of it; the reply's ``records`` are the manifest's."""

    SERVICE = Service.SAVE
    FIELDS = {"directory": abs_path, "save_id": text, "parts": int_list, "columns": text_list,
              "parent": text}
    DEFAULTS = {"columns": [], "parent": ""}


class Load(_ShardsMessage):
    """Fill these shards from the checkpoint in ``directory`` (its manifest says where),
    all or nothing."""

    SERVICE = Service.LOAD
    FIELDS = {"directory": abs_path, "parts": int_list, "columns": text_list}


class Reply(Message):
    """Success: ``fields`` (any JSON object), any arrays, and the file descriptors it
    hands over (a ShmInfo reply on a local socket: the shards' memory files)."""

    SERVICE = Service.REPLY

    def __init__(self, name="", flags=0, fields=None, arrays=(), fds=()):
        self.name, self.flags = name, flags
        self.fields, self.arrays, self.fds = dict(fields or {}), list(arrays), list(fds)

    def encode(self):
        return Frame(int(self.SERVICE), self.name, self.fields, self.arrays, self.flags,
                     list(self.fds))

    @classmethod
    def decode(cls, frame):
        """The reply of ``frame`` (its descriptors stay the frame's)."""
        if frame.service != cls.SERVICE:
            raise TransportError(f"Reply: service {frame.service}, expected {cls.SERVICE}")
        return cls(frame.name, frame.flags, frame.fields, frame.arrays)


class Error(Message):
    """Failure: ``kind`` (an error class name) and ``message``."""

    SERVICE = Service.ERROR
    FIELDS = {"kind": text, "message": lambda v: isinstance(v, str)}


class Get(RowsMessage):
    """Rows of ``column`` for keys without inserting or counting them: ``get`` fails on
    an absent key, ``contains`` answers a bool per key (a lookup, which inserts, is a
    :class:`Pull`). ``ids`` are the table's keys, grouped by shard as a Pull's."""

    SERVICE = Service.GET
    FIELDS = {"mode": choice("get", "contains"), "column": text, "parts": int_list,
              "counts": int_list}
    ARRAYS = ("ids",)


class Remove(RowsMessage):
    """Remove keys and their state (grouped by shard as a Pull's); the reply's
    ``removed`` counts those present."""

    SERVICE = Service.REMOVE
    FIELDS = {"parts": int_list, "counts": int_list}
    ARRAYS = ("ids",)


class Info(Message):
    """Size, capacity and columns of this server's shards of table ``name``; first, with
    ``evict_to`` >= 0, evict (by ``policy``, or the table's when empty) down to it."""

    SERVICE = Service.INFO
    FIELDS = {"evict_to": int_value, "policy": text}
    DEFAULTS = {"evict_to": -1, "policy": ""}


class Export(Message):
    """Keys ``start .. start+count-1`` (in ascending store-key order) of shard ``part``,
    as the table's keys, with their rows of ``columns`` (every column when empty)."""

    SERVICE = Service.EXPORT
    FIELDS = {"part": int_value, "start": int_value, "count": int_value,
              "columns": text_list}

    def check(self):
        if self.start < 0 or self.count < 1:
            raise TransportError(f"Export: expected start >= 0 and count >= 1, got "
                                 f"{self.start}, {self.count}")


REQUESTS = {m.SERVICE: m for m in (Hello, Create, Drop, Pull, Push, OptInit, Update,
                                   Barrier, ShmInfo, Bye, Save, Load, VersionedPull, Get,
                                   Remove, Info, Export)}


def decode_request(frame):
    """The request message of ``frame``.

    Raises:
        TransportError: the service id is not a request, or the message is invalid.
    """
    cls = REQUESTS.get(frame.service)
    if cls is None:
        raise TransportError(f"frame: unknown request service id {frame.service}")
    return cls.decode(frame)
