"""StreamReader: exact reads from a stream socket through one receive buffer.

A frame's head, array descriptors, name, fields and small arrays are many small reads;
through the buffer one ``recv`` serves them all instead of a system call each, and bytes
past a frame wait there for the next. Reads of at least half the buffer go straight into
their destination (an array's payload, no copy). A buffer of size 0 reads exactly: every
read is a ``recv`` of its own (a Unix-domain socket's descriptors arrive with the first
bytes of their frame, so it must not read ahead into the next one).

Example:
    >>> import socket
    >>> a, b = socket.socketpair()
    >>> a.sendall(b"headbody")
    >>> r = StreamReader(b, 64)
    >>> r.read(4), r.read(4)
    (b'head', b'body')
"""
import select
import socket


class StreamReader:
    """Reads of ``sock`` (blocking, with its timeout) through a buffer of ``size`` bytes.

    Raises (every read): ConnectionResetError when the peer closed the stream, the
    socket's OSError (a timeout) otherwise.
    """

    def __init__(self, sock: socket.socket, size: int):
        self.sock = sock
        self._buf = memoryview(bytearray(size)) if size else None
        self._lo = self._hi = 0  # the buffered bytes: _buf[_lo:_hi]
        self._poll = None  # made by the first waiting()

    def _take(self, view):
        """Copy buffered bytes into ``view``; how many."""
        k = min(len(view), self._hi - self._lo)
        if k:
            view[:k] = self._buf[self._lo:self._lo + k]
            self._lo += k
        return k

    def waiting(self) -> bool:
        """Whether a read would return at once: bytes buffered or arrived, or the peer
        closed."""
        if self._buf is not None and self._hi > self._lo:
            return True
        if self._poll is None:  # (a recv would first wait out the socket's timeout)
            self._poll = select.poll()
            self._poll.register(self.sock, select.POLLIN)
        return bool(self._poll.poll(0))  # POLLIN, POLLHUP or POLLERR: a read answers

    def first(self, view) -> int:
        """Read what is there into ``view``, waiting for one byte at least; how many
        (0: the peer closed)."""
        if self._buf is None:
            return self.sock.recv_into(view)
        if self._hi == self._lo:
            self._lo, self._hi = 0, self.sock.recv_into(self._buf)
        return self._take(view)

    def read_into(self, view):
        """Fill ``view`` exactly."""
        want = len(view)
        got = self._take(view) if self._hi > self._lo else 0
        while got < want:
            if self._buf is not None and want - got < len(self._buf) // 2:
                n = self.sock.recv_into(self._buf)  # a small rest: fill the buffer
                self._lo, self._hi = 0, n
                if n:
                    got += self._take(view[got:])
            else:
                n = self.sock.recv_into(view[got:])
                got += n
            if n == 0:
                raise ConnectionResetError("peer closed the connection")

    def read(self, n) -> bytes:
        """The next ``n`` bytes."""
        if self._buf is not None and self._hi - self._lo >= n:  # no bytearray in between
            self._lo += n
            return self._buf[self._lo - n:self._lo].tobytes()
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)
