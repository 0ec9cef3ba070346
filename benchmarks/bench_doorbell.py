"""What waking a co-located server costs: one request and its answer between two
processes, by the socket distemb uses (a Unix stream socket, a small frame each way)
against the doorbells issue 39 proposed (an eventfd pair) and a busy-polled word in
shared memory (the floor: it keeps a core spinning, which a 2-core trainer machine
cannot spare).

The baseline is the socket, as distemb's co-located requests use it: the request's
arrays are in the shared request slot, so a frame of ~200 bytes crosses each way. Each
mechanism runs ``--trips`` round trips per round, the mechanisms in turns (a shuffled
order each round); a cell is the median over rounds of each round's median round trip.

Usage::

    python benchmarks/bench_doorbell.py [--rounds 7] [--trips 5000]
"""
import argparse
import mmap
import os
import random
import socket
import statistics
import struct
import time

import results

FRAME = 200  # bytes of a request frame whose arrays travel in the request slot


def socket_pair():
    """(ping, serve) over a Unix stream socket pair, a FRAME each way."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frame = b"x" * FRAME

    def exact(sock, n):
        got = 0
        while got < n:
            got += len(sock.recv(n - got))

    def ping():
        a.sendall(frame)
        exact(a, FRAME)

    def serve(trips):
        for _ in range(trips):
            exact(b, FRAME)
            b.sendall(frame)
    return ping, serve


def eventfd_pair():
    """(ping, serve) over two eventfds: a doorbell each way, nothing else."""
    ask, answer = os.eventfd(0), os.eventfd(0)

    def ping():
        os.eventfd_write(ask, 1)
        os.eventfd_read(answer)

    def serve(trips):
        for _ in range(trips):
            os.eventfd_read(ask)
            os.eventfd_write(answer, 1)
    return ping, serve


def spin_word():
    """(ping, serve) by a counter in shared memory that each side polls."""
    mem = mmap.mmap(-1, 64)

    def word(i):
        return struct.unpack_from("q", mem, i * 8)[0]

    def ping():
        n = word(0) + 1
        struct.pack_into("q", mem, 0, n)
        while word(1) != n:
            pass

    def serve(trips):
        for n in range(1, trips + 1):
            while word(0) != n:
                pass
            struct.pack_into("q", mem, 8, n)
    return ping, serve


#: key -> (what it is, its maker); the first is the baseline.
MECHANISMS = {"socket": ("unix socket, a frame each way (distemb; baseline)", socket_pair),
              "eventfd": ("eventfd doorbell each way", eventfd_pair),
              "spin": ("busy-polled shared word (a spinning core)", spin_word)}


def round_trips(make, trips):
    """Median seconds of ``trips`` round trips to a child process that ``make`` serves."""
    ping, serve = make()
    pid = os.fork()
    if pid == 0:
        try:
            serve(trips + 50)
        finally:
            os._exit(0)
    times = []
    for i in range(trips + 50):
        t = time.perf_counter()
        ping()
        if i >= 50:  # the first ones include the child's start
            times.append(time.perf_counter() - t)
    os.waitpid(pid, 0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--trips", type=int, default=5000)
    p.add_argument("--mechanisms", default=",".join(MECHANISMS),
                   help=f"which of {', '.join(MECHANISMS)} (default: all; the first is the "
                        "baseline; spin keeps a core busy)")
    results.add_arguments(p)
    args = p.parse_args()
    keys = args.mechanisms.split(",")
    unknown = [k for k in keys if k not in MECHANISMS]
    if unknown:
        p.error(f"--mechanisms: unknown {unknown}; known: {list(MECHANISMS)}")
    with results.Recorder("bench_doorbell", args) as rec:
        cells = {k: [] for k in keys}
        rng = random.Random(0)
        for _ in range(args.rounds):
            for k in rng.sample(keys, len(keys)):
                cells[k].append(round_trips(MECHANISMS[k][1], args.trips))
        base = statistics.median(cells[keys[0]])
        print(f"{args.rounds} rounds of {args.trips} round trips, in turns\n")
        print(f"| mechanism | round trip, median (us) | rounds' range (us) | "
              f"vs {keys[0]} |")
        print("|---|---|---|---|")
        for k in keys:
            med = statistics.median(cells[k])
            print(f"| {MECHANISMS[k][0]} | {med * 1e6:.1f} | {min(cells[k]) * 1e6:.1f}-"
                  f"{max(cells[k]) * 1e6:.1f} | {base / med:.2f}x |")
            rec.figure(f"us.{k}", round(med * 1e6, 1), "{:.1f} us",
                       f"{MECHANISMS[k][0]}: median round trip between two processes")
            if k != keys[0]:
                rec.figure(f"speedup.{k}", round(base / med, 2), "{:.2f}x",
                           f"{MECHANISMS[k][0]}: {keys[0]}'s round trip over its own")


if __name__ == "__main__":
    main()
