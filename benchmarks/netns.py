"""A simulated cluster network for the benchmarks: hosts in network namespaces, shaped links.

``Network(n, rate)`` makes ``n`` hosts, each a network namespace with one interface
(``eth0``, address ``10.200.0.<i+1>/24``), all joined by veth pairs to a Linux bridge in a
switch namespace of their own. Every link is shaped in BOTH directions with a token
bucket (``tc qdisc ... tbf``): on the host's ``eth0`` (its upload) and on the switch's
port (its download), so each host has a full-duplex NIC of ``rate`` bits/s behind a
non-blocking switch, like machines on one rack switch. There is no added delay (``netem``
is not available on these machines): the round trip is the veth's, tens of microseconds,
so the links model bandwidth, not distance. ``rate=None`` leaves the links unshaped.

Everything lives in namespaces this process creates, named ``distemb-bench-<pid>-...``
(nothing is added to the machine's own namespace): :meth:`Network.close` (also on exit of
the ``with`` block, and at interpreter exit) deletes them, which deletes their interfaces
and queues. A namespace left by a run that was SIGKILLed is removed by the next
``Network`` once that run's PID is gone. Needs root and ``ip``/``tc`` (iproute2).

Example::

    with Network(2, parse_link("1gbit")) as net:
        server = subprocess.Popen(net.wrap(0, ["python", "-m", "http.server", "8000"]))
        ...  # net.address(0) is the server's address, reachable from host 1 only
        print(net.measure(1, 0))  # bits/s of a bulk TCP transfer from host 1 to host 0
"""
import atexit
import math
import os
import re
import shutil
import subprocess
import sys
import time

from distemb.transport import ports

PREFIX = "distemb-bench-"
SUBNET = "10.200.0"  # inside our own namespaces only; never on the machine's interfaces
MTU = 1500
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}

# The receiving and sending ends of Network.measure, run inside the hosts' namespaces.
_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; first = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    if first is None:
        first = time.perf_counter()
    n += k
print(n, time.perf_counter() - first, flush=True)
"""
_SENDER = r"""
import socket, sys
n = int(sys.argv[3]); chunk = b"\0" * (1 << 20)
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
while n > 0:
    c.sendall(chunk[:min(n, len(chunk))]); n -= len(chunk)
c.close()
"""


VETH = math.inf  # the link "veth": hosts in namespaces, links not shaped


def parse_link(text):
    """Bits/s of a link named like ``1gbit``, ``100mbit`` or ``2.5gbit``; None for
    ``loopback`` (no namespaces); :data:`VETH` (infinity) for ``veth``: hosts in
    namespaces as for a rate, their links unshaped (what the simulation itself costs).

    Raises:
        ValueError: naming the text and the expected form.
    """
    if text == "loopback":
        return None
    if text == "veth":
        return VETH
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link: expected 'loopback', 'veth' or a rate like '1gbit', "
                         f"'100mbit', got {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def link_name(rate):
    """``loopback`` for None, ``veth`` for :data:`VETH`, else the rate as ``1gbit``."""
    if rate is None:
        return "loopback"
    if rate == VETH:
        return "veth"
    for unit in ("gbit", "mbit", "kbit"):
        if rate >= UNITS[unit]:
            return f"{rate / UNITS[unit]:g}{unit}"
    return f"{rate:g}bit"


def available():
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root (not root here)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2's {' and '.join(missing)} not found on PATH"
    return None


def _run(*argv):
    """Run an ip/tc command; raise with its stderr if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def ours():
    """Names of the namespaces this module made (in any process) that still exist."""
    out = _run("ip", "netns", "list")
    return sorted(w.split()[0] for w in out.splitlines() if w.startswith(PREFIX))


def remove_stale():
    """Delete the namespaces of earlier runs whose process is gone (a SIGKILLed run)."""
    for name in ours():
        m = re.match(re.escape(PREFIX) + r"(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _tbf(ns, dev, rate):
    # burst: at least two 64 KiB GSO packets, and ~1 ms of the rate so that the timer's
    # granularity does not cap the rate; the queue: 10 ms of the rate (a shallow switch
    # buffer; TCP backs off on a full one as it would on a real link).
    burst = max(128 * 1024, int(rate / 8 * 1e-3))
    limit = max(2 * burst, int(rate / 8 * 10e-3))
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit",
         "burst", str(burst), "limit", str(limit))


class Network:
    """``num_hosts`` hosts on one switch, each link shaped to ``rate`` bits/s (or not).

    Args:
        num_hosts: hosts to make (1..250).
        rate: bits/s of every host's link, each direction; None or VETH: unshaped.

    Raises:
        RuntimeError: not root, no iproute2, or an ``ip``/``tc`` command failed (the
            namespaces made so far are removed first).
    """

    def __init__(self, num_hosts, rate=None):
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts: expected 1..250, got {num_hosts}")
        if rate is not None and rate <= 0:
            raise ValueError(f"rate: expected bits/s > 0 or None, got {rate}")
        rate = None if rate == VETH else rate
        why = available()
        if why:
            raise RuntimeError(f"Network: {why}")
        remove_stale()
        self.rate, self.num_hosts = rate, num_hosts
        tag = f"{PREFIX}{os.getpid()}-{id(self) & 0xffffff:x}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(num_hosts)]
        self._made = []
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self._made.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            # Both ends made directly inside their namespaces: nothing in the machine's own.
            _run("ip", "link", "add", "eth0", "netns", ns, "mtu", str(MTU), "type", "veth",
                 "peer", "name", f"p{i}", "netns", sw, "mtu", str(MTU))
            _run("ip", "-n", sw, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"p{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.rate is not None:
                _tbf(ns, "eth0", self.rate)       # the host's upload
                _tbf(sw, f"p{i}", self.rate)      # the host's download

    def address(self, host):
        """The IPv4 address of host ``host`` (reachable from the other hosts only)."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host: expected 0..{self.num_hosts - 1}, got {host}")
        return f"{SUBNET}.{host + 1}"

    def wrap(self, host, argv):
        """``argv`` run inside host ``host``'s namespace (``ip netns exec`` execs it: the
        process's PID is the Popen's)."""
        self.address(host)
        return ["ip", "netns", "exec", self.hosts[host]] + list(argv)

    def qdiscs(self):
        """``tc qdisc show`` of every shaped interface, one string per interface."""
        out = [_run("tc", "-n", ns, "qdisc", "show", "dev", "eth0") for ns in self.hosts]
        out += [_run("tc", "-n", self.switch, "qdisc", "show", "dev", f"p{i}")
                for i in range(self.num_hosts)]
        return [line.strip() for line in out]

    def measure(self, src, dst, nbytes=None, port=5201):
        """Bits/s of one bulk TCP transfer of ``nbytes`` from host ``src`` to host ``dst``.

        Timed at the receiver from its first byte to its last, so process start-up and
        the connection are not in it. ``nbytes`` default: half a second at the link's
        rate (64 MiB on an unshaped link).
        """
        if nbytes is None:
            nbytes = int(self.rate / 8 * 0.5) if self.rate else 64 << 20
        recv = subprocess.Popen(self.wrap(dst, [sys.executable, "-c", _RECEIVER,
                                                self.address(dst), str(port)]),
                                stdout=subprocess.PIPE, text=True)
        try:
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError("Network.measure: the receiver did not start")
            subprocess.run(self.wrap(src, [sys.executable, "-c", _SENDER, self.address(dst),
                                           str(port), str(nbytes)]), check=True, timeout=120)
            got, seconds = recv.communicate(timeout=120)[0].split()
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        if int(got) != nbytes:
            raise RuntimeError(f"Network.measure: sent {nbytes} bytes, received {got}")
        return 8 * nbytes / float(seconds)

    def close(self):
        """Delete every namespace this Network made (idempotent); their links and queues
        go with them. Processes still inside keep a namespace alive: stop them first."""
        while self._made:
            ns = self._made.pop()
            for _ in range(50):
                done = subprocess.run(["ip", "netns", "del", ns], capture_output=True,
                                      timeout=30)
                if done.returncode == 0 or ns not in ours():
                    break
                time.sleep(0.1)
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Network({self.num_hosts} hosts, {link_name(self.rate)}, "
                f"switch={self.switch!r})")


class JobHosts:
    """Where the servers and trainers of one distemb job run: every process on a host of
    its own on a shaped :class:`Network`, or (``rate=None``) all on this machine's
    loopback. Every byte between a trainer and a server then crosses one shaped link out
    and one in (no shared memory: no two processes share a host).

    Args:
        num_servers, num_trainers: processes of the job.
        rate: bits/s of every host's link (:data:`VETH`: unshaped), or None for
            loopback (127.0.0.1).

    Example::

        with JobHosts(2, 2, 1e9) as hosts:
            cfg = {"servers": hosts.servers(), "trainer_machines": hosts.trainer_machines(),
                   ...}
            subprocess.Popen(hosts.server(0, ["python", "-m", "distemb.server", ...]))
    """

    PORT = 30050

    def __init__(self, num_servers, num_trainers, rate=None):
        self.num_servers, self.num_trainers, self.rate = num_servers, num_trainers, rate
        self.net = None if rate is None else Network(num_servers + num_trainers, rate)
        self._port = ports.free_port(num_servers) if rate is None else None

    def servers(self):
        """The cluster config's ``servers`` entries (host, port, machine)."""
        if self.net is None:
            return [{"host": "127.0.0.1", "port": self._port + k, "machine": 0}
                    for k in range(self.num_servers)]
        return [{"host": self.net.address(i), "port": self.PORT, "machine": i}
                for i in range(self.num_servers)]

    def trainer_machines(self):
        """The cluster config's ``trainer_machines``."""
        if self.net is None:
            return [0] * self.num_trainers
        return [self.num_servers + r for r in range(self.num_trainers)]

    def server(self, i, argv):
        """``argv`` as run by server ``i``'s host."""
        return list(argv) if self.net is None else self.net.wrap(i, argv)

    def trainer(self, r, argv):
        """``argv`` as run by trainer ``r``'s host."""
        return list(argv) if self.net is None else self.net.wrap(self.num_servers + r, argv)

    def close(self):
        if self.net is not None:
            self.net.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def exit_on_sigterm():
    """Turn SIGTERM into SystemExit so that ``finally`` blocks and atexit remove the
    namespaces when a benchmark is stopped with ``kill`` (SIGKILL cannot be caught: the
    next run removes those, see :func:`remove_stale`)."""
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def verify(rates, nbytes=None):
    """Measure a bulk transfer across a 2-host link at each rate; print and return
    ``{rate: measured bits/s}`` (None or VETH: an unshaped veth, the machine's ceiling)."""
    out = {}
    for rate in rates:
        with Network(2, rate) as net:
            got = net.measure(0, 1, nbytes)
        out[rate] = got
        shaped = "" if rate in (None, VETH) else (f" of {link_name(rate)} configured "
                                                  f"({got / rate:.0%})")
        print(f"link check: {link_name(rate) if rate else 'veth'}: bulk TCP "
              f"{got / 1e9:.2f} Gbit/s measured{shaped}", flush=True)
    return out


if __name__ == "__main__":
    exit_on_sigterm()
    verify([None] + [parse_link(a) for a in (sys.argv[1:] or ["1gbit", "10gbit"])])


def prepare_links(parser, text, links):
    """Before a benchmark runs over ``links`` (parsed from ``--links text``): where any
    is shaped, make a kill remove the namespaces, and stop with ``parser.error`` when
    this machine cannot build them or a shaped link does not carry its rate."""
    if any(rate is not None for rate in links):
        exit_on_sigterm()  # a kill still removes the namespaces
        why = available()
        if why:
            parser.error(f"--links {text}: {why}")
        verify([rate for rate in links if rate is not None])
