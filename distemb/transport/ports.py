"""Free TCP ports for a job on one machine, drawn below the kernel's ephemeral range.

The usual trick (bind port 0, read the number, close) hands out an *ephemeral* port, and
any ``connect()`` on the machine may take that very port as its local end before the
server that was meant to listen on it binds: a trainer of the job connecting to server 0
can take server 1's port ("address already in use"). Ports below the ephemeral range are
only ever taken by an explicit ``bind``.
"""
import random
import socket

FIRST = 10000  # below the ephemeral range and above the well-known and common service ports

_next = {}  # (lo, hi) -> where this process's next draw from that range starts


def ephemeral_low():
    """The first port the kernel hands to ``connect()`` (``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(span=1, lo=FIRST, hi=None, host="127.0.0.1"):
    """A port ``p`` in ``[lo, hi)`` such that ``p .. p + span - 1`` all bind on ``host``
    now (distemb-launch puts server ``k`` of a machine on ``port + k``).

    Args:
        span: how many consecutive ports must be free.
        lo, hi: the range to draw from; ``hi`` defaults to the start of the ephemeral range.
        host: the address the ports are for.

    Raises:
        RuntimeError: no such run among the 200 starts after this process's last draw.
    """
    hi = ephemeral_low() if hi is None else hi
    if hi - span < lo:
        raise ValueError(f"no room for {span} ports in [{lo}, {hi})")
    start = _next.get((lo, hi))
    if start is None:
        start = random.SystemRandom().randrange(lo, hi - span + 1)
    base = start
    for _ in range(min(200, hi - lo)):
        if base + span > hi:
            base = lo
        if _binds(host, base, span):
            _next[(lo, hi)] = base + span
            return base
        base += 1
    raise RuntimeError(f"no {span} free ports in a row in [{lo}, {hi}) on {host}")


def _binds(host, base, span):
    """Whether ports ``base .. base + span - 1`` all bind on ``host`` now."""
    socks = []
    try:
        for port in range(base, base + span):
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
