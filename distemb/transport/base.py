"""Frames, the unit every transport moves, and the Connection interface.

A frame is a service id, a name, a small JSON object of scalar fields and up to
:data:`MAX_ARRAYS` numpy arrays. On the wire (little-endian)::

    header   24 bytes  magic b"DEMB" | version u8 | service u8 | flags u16 | name_len u16
                       | num_arrays u16 | fields_len u32 | payload_len u64
    descs    per array: dtype code u8 | ndim u8 | ndim x dim u64
    name     name_len bytes of UTF-8
    fields   fields_len bytes of JSON (an object of scalars and lists; never pickle)
    payload  the arrays' raw C-order bytes, one after another (payload_len in all)

On a Unix-domain socket a frame may also carry up to :data:`MAX_FDS` open file
descriptors (``SCM_RIGHTS`` on its first bytes): the shared-memory segments of
:mod:`distemb.transport.shm`. They are the frame's ``fds``; whoever holds a received
frame owns them and closes those it does not keep (:func:`close_fds`).

Receivers validate the header and descriptors before allocating anything
(:func:`parse_header`, :func:`parse_descriptors`) and then read each payload straight into
a preallocated numpy array, so tensor bytes are never copied through Python objects.

Example:
    >>> import numpy as np
    >>> f = Frame(3, name="w", fields={"parts": [0]}, arrays=[np.arange(3)])
    >>> head = encode_head(f)
    >>> h = parse_header(head[:HEADER.size], MAX_MESSAGE_BYTES)
    >>> h.service, h.num_arrays, h.payload_len
    (3, 1, 24)
"""
import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from distemb.errors import TransportError
from distemb.kernels.half import BFLOAT16

MAGIC = b"DEMB"
VERSION = 1
HEADER = struct.Struct("<4sBBHHHIQ")
MAX_ARRAYS = 8
MAX_NDIM = 4
MAX_NAME = 1024
MAX_FIELDS = 1 << 16
MAX_MESSAGE_BYTES = 1 << 30
MAX_DIM = 1 << 40  # any one dimension; a zero-size array may not smuggle in a huge one
FLAG_NO_REPLY = 1  # the sender will not read a reply (asynchronous update)
#: The sender of an update answered early reads its outcome in the shard's header (the
#: seqlock counter moving on) instead of a second frame, which then comes only on failure.
FLAG_OUTCOME_IN_SHARD = 2
#: Most file descriptors one frame may carry; a frame with more is malformed.
MAX_FDS = 64

DTYPE_CODES = {1: np.dtype("float32"), 2: np.dtype("float64"), 3: np.dtype("float16"),
               4: np.dtype("int64"), 5: np.dtype("int32"), 6: np.dtype("int8"),
               7: np.dtype("uint8"), 8: np.dtype("bool"),
               9: BFLOAT16}  # bfloat16 rows: 2 bytes each, as stored (no conversion)
CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


@dataclass
class Frame:
    """One message as it travels: service id, flags, name, JSON fields and arrays, and
    the file descriptors it carries (Unix-domain sockets only)."""

    service: int
    name: str = ""
    fields: dict = field(default_factory=dict)
    arrays: list = field(default_factory=list)
    flags: int = 0
    fds: list = field(default_factory=list)


def close_fds(frame):
    """Close the descriptors ``frame`` still carries (those nobody took)."""
    while frame.fds:
        try:
            os.close(frame.fds.pop())
        except OSError:
            pass  # closed already: nothing to release


@dataclass(frozen=True)
class Header:
    service: int
    flags: int
    name_len: int
    num_arrays: int
    fields_len: int
    payload_len: int


def encode_head(frame):
    """Header, descriptors, name and fields of ``frame`` as one bytes object.

    Raises:
        TransportError: too many arrays, an unsupported dtype, or an oversized name.
    """
    name = frame.name.encode("utf-8")
    fields = json.dumps(frame.fields, separators=(",", ":")).encode("utf-8")
    if len(name) > MAX_NAME or len(fields) > MAX_FIELDS or len(frame.arrays) > MAX_ARRAYS:
        raise TransportError(f"frame of service {frame.service}: name ({len(name)} B), "
                             f"fields ({len(fields)} B) or arrays ({len(frame.arrays)}) "
                             f"over the limits {MAX_NAME}/{MAX_FIELDS}/{MAX_ARRAYS}")
    descs, payload = [], 0
    for i, a in enumerate(frame.arrays):
        code = CODE_OF.get(a.dtype)
        if code is None or a.ndim > MAX_NDIM:
            raise TransportError(f"frame array {i}: dtype {a.dtype} / ndim {a.ndim} cannot "
                                 f"be sent (dtypes {sorted(d.name for d in CODE_OF)}, "
                                 f"ndim <= {MAX_NDIM})")
        descs.append(struct.pack(f"<BB{a.ndim}Q", code, a.ndim, *a.shape))
        payload += a.nbytes
    head = HEADER.pack(MAGIC, VERSION, frame.service, frame.flags, len(name),
                       len(frame.arrays), len(fields), payload)
    return b"".join([head, *descs, name, fields])


def payload_views(frame):
    """Byte views of the arrays of ``frame`` (made contiguous when needed)."""
    return [memoryview(np.ascontiguousarray(a)).cast("B") for a in frame.arrays if a.nbytes]


def parse_header(buf, max_bytes):
    """Validate the fixed header.

    Raises:
        TransportError: bad magic or version, or lengths over the limits.
    """
    magic, version, service, flags, name_len, num_arrays, fields_len, payload = \
        HEADER.unpack(buf)
    if magic != MAGIC:
        raise TransportError(f"frame: bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise TransportError(f"frame: protocol version {version}, expected {VERSION}")
    if name_len > MAX_NAME or fields_len > MAX_FIELDS or num_arrays > MAX_ARRAYS:
        raise TransportError(f"frame: name_len {name_len}, fields_len {fields_len} or "
                             f"num_arrays {num_arrays} over the limits "
                             f"{MAX_NAME}/{MAX_FIELDS}/{MAX_ARRAYS}")
    if payload > max_bytes:
        raise TransportError(f"frame: payload of {payload} bytes over the limit of "
                             f"{max_bytes}")
    return Header(service, flags, name_len, num_arrays, fields_len, payload)


def parse_descriptors(read, header):
    """Read and validate the array descriptors with ``read(n) -> bytes``.

    Returns:
        list of (dtype, shape), whose sizes add up to ``header.payload_len``.

    Raises:
        TransportError: unknown dtype code, ndim over the limit, or sizes that do not
            match the payload length.
    """
    specs, total = [], 0
    for i in range(header.num_arrays):
        code, ndim = struct.unpack("<BB", read(2))
        if code not in DTYPE_CODES:
            raise TransportError(f"frame array {i}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise TransportError(f"frame array {i}: ndim {ndim} over the limit {MAX_NDIM}")
        shape = struct.unpack(f"<{ndim}Q", read(8 * ndim)) if ndim else ()
        if any(d > MAX_DIM for d in shape):
            raise TransportError(f"frame array {i}: shape {shape} has a dimension over the "
                                 f"limit {MAX_DIM}")
        nbytes = DTYPE_CODES[code].itemsize
        for d in shape:  # Python ints: exact, and at most 4 dims of <= 2**40
            nbytes *= d
        total += nbytes
        if total > header.payload_len:
            raise TransportError(f"frame array {i}: shape {shape} needs more bytes than "
                                 f"the payload length {header.payload_len}")
        specs.append((DTYPE_CODES[code], shape))
    if total != header.payload_len:
        raise TransportError(f"frame: arrays hold {total} bytes, header says "
                             f"{header.payload_len}")
    return specs


def parse_body(name_bytes, fields_bytes):
    """Decode and check the name (UTF-8) and fields (a JSON object).

    Raises:
        TransportError: invalid UTF-8 or JSON, or fields that are not an object.
    """
    try:
        name = name_bytes.decode("utf-8")
        fields = json.loads(fields_bytes.decode("utf-8")) if fields_bytes else {}
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TransportError(f"frame: name or fields not valid UTF-8/JSON: {e}") from None
    if not isinstance(fields, dict):
        raise TransportError(f"frame: fields must be a JSON object, got "
                             f"{type(fields).__name__}")
    return name, fields


@dataclass
class Session:
    """What a server knows about one connection's peer, kept across its frames.

    ``rank`` is fixed by the peer's Hello (None before it); a handler sets ``closing``
    when the connection must be closed after the reply (a decode error, a failed
    handshake); ``trusted`` marks in-process callers, which need no Hello.
    ``passes_fds``: the connection carries file descriptors (a Unix-domain socket of
    this machine, whose peer runs as this user); ``slot`` is the peer's request slot
    once it handed one over (:class:`~distemb.transport.slots.SlotReader`), released by
    :meth:`close` when the connection ends.
    """

    peer: str = "peer"
    rank: object = None
    closing: bool = False
    trusted: bool = False
    passes_fds: bool = False
    slot: object = None
    in_slot: bool = False  # the request being handled came in the slot (InShm)

    def close(self):
        """Release what the connection held (the peer's request slot)."""
        if self.slot is not None:
            self.slot.close()
            self.slot = None


class EarlyReply:
    """A handler's answer sent before its work is done: a transport sends ``frame``, then
    calls ``finish(send)``, which does the rest (its own failures it reports, never
    raises) and sends the outcome with ``send(frame)``, if there is one to send (a Reply,
    or an Error the peer raises at its next request; none: the peer learns the outcome
    otherwise). Only ``send`` may raise (the peer gone).

    A co-located trainer's update is answered this way (:mod:`distemb.kvstore.server.early`),
    so the trainer's next step runs while the server applies it.
    """

    def __init__(self, frame, finish):
        self.frame, self.finish = frame, finish

    def whole(self):
        """For a transport that answers once: finish now; the early frame, or the
        outcome if that is an error."""
        sent = []
        self.finish(sent.append)
        errors = [f for f in sent if f.service != self.frame.service]
        return errors[0] if errors else self.frame


class Connection:
    """Interface: one ordered, reliable channel to a peer carrying frames.

    Implementations: :class:`~distemb.transport.tcp.TcpConnection` and
    :class:`~distemb.transport.mpi.MpiConnection`.
    """

    peer = ""
    #: Frames may carry file descriptors (a Unix-domain socket on this machine).
    passes_fds = False
    #: One thread may receive while another sends (a socket): replies to requests sent
    #: ahead are then read on a helper thread while the caller goes on (False: they are
    #: read by the thread that needs them, as MPI has one thread call it).
    reads_aside = False

    def send(self, frame):
        """Send ``frame``; raise :class:`~distemb.errors.TransportError` subclasses."""
        raise NotImplementedError

    def recv(self, timeout=None):
        """The next frame from the peer (blocks up to ``timeout`` s for it to begin;
        default: the connection's timeout)."""
        raise NotImplementedError

    def pending(self):
        """Whether :meth:`recv` would not wait for the next frame to begin (it has begun
        to arrive, or the peer is gone)."""
        raise NotImplementedError

    def close(self):
        """Release the channel; later calls raise."""
